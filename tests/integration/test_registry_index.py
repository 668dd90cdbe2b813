"""The manager's index of unfinished jobs: a registry full of finished jobs costs a submission
nothing, while quotas and admission still see every queued and running job."""

from __future__ import annotations

import asyncio

import msgspec

from marlaas.platform import api
from marlaas.platform.bus import JOBS_BUCKET
from marlaas.platform.config import load_config
from marlaas.platform.events import JobRecord, JobSpec, JobState, encode
from marlaas.platform.tenants import add_tenant
from services.manager.service import Manager

FINISHED = 2000


class CountingGets:
    """Counts the KV reads of the ``jobs`` bucket made through a bus."""

    def __init__(self, bus) -> None:
        self.count, self._get = 0, bus.kv_get
        bus.kv_get = self

    async def __call__(self, bucket, key):
        self.count += bucket == JOBS_BUCKET
        return await self._get(bucket, key)


def submission(name: str, tenant: str = "default") -> bytes:
    return msgspec.json.encode({"name": name, "task": "addition", "steps": 2, "tenant": tenant})


async def test_finished_jobs_do_not_slow_submission(bus, file_store, tmp_path):
    for i in range(FINISHED):  # a long-lived registry: thousands of finished jobs
        spec = JobSpec(id=f"old.job-{i}", tenant="old", name="old", task="addition", steps=1)
        await bus.kv_create(JOBS_BUCKET, spec.id, encode(JobRecord(spec=spec, state=JobState.COMPLETED)))
    config = load_config(overrides={"home": str(tmp_path)}, env={})
    manager = await asyncio.to_thread(Manager, bus, file_store, config)
    gets = CountingGets(bus)

    first = await manager.submissions.submit(submission("first"))  # builds the index: one scan of the registry
    assert first.id and gets.count >= FINISHED
    gets.count = 0
    second = await manager.submissions.submit(submission("second"))
    assert second.id
    assert gets.count < 10, gets.count  # only the unfinished jobs' records, not the registry

    queued = {r.spec.id for r in await manager.jobs.unfinished_records()}
    assert queued == {first.id, second.id}  # both admitted and running: the index holds them
    await manager.jobs.transition(first.id, JobState.CANCELLED, "test")
    assert {r.spec.id for r in await manager.jobs.unfinished_records()} == {second.id}

    await add_tenant(bus, "acme", max_jobs=1)  # the quota counts from the index too
    assert (await manager.submissions.submit(submission("a1", "acme"))).id
    refused = await manager.submissions.submit(submission("a2", "acme"))
    assert refused.code == api.QUOTA and "max_jobs = 1" in refused.error


async def test_a_staleness_job_counts_its_extra_lora_slots_against_the_quota(bus, file_store, tmp_path):
    """At max_staleness = k the engine serves up to 1 + k versions of the job at once: it holds
    1 + k of its tenant's max_jobs, and a job that needs more than is left is refused, saying why."""
    config = load_config(overrides={"home": str(tmp_path)}, env={})
    manager = await asyncio.to_thread(Manager, bus, file_store, config)
    await add_tenant(bus, "acme", max_jobs=3)

    def stale(name: str, k: int) -> bytes:
        return msgspec.json.encode({"name": name, "task": "addition", "steps": 2, "tenant": "acme",
                                    "grpo": {"max_staleness": k}})

    too_big = await manager.submissions.submit(stale("k3", 3))  # 4 slots against 3
    assert too_big.code == api.QUOTA and "this one needs 4 (1 + grpo.max_staleness)" in too_big.error
    assert (await manager.submissions.submit(stale("k1", 1))).id  # 2 slots of 3
    refused = await manager.submissions.submit(stale("k1-again", 1))  # 2 more: 4 against 3
    assert refused.code == api.QUOTA
    assert "1 jobs queued or running, holding 2 LoRA slots (a job at max_staleness = k holds 1 + k)" in refused.error
    assert (await manager.submissions.submit(submission("plain", "acme"))).id  # 1 slot: exactly 3
    assert (await manager.submissions.submit(submission("one-more", "acme"))).code == api.QUOTA
