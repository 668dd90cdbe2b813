"""The manager's error branches, with the fault injected at exactly its point.

The manager class runs in the test against a real nats-server and a ``file://`` store; its
handlers are driven through the bus as in the service (request/reply, durable consumers).
Faults: an object store that refuses writes (version 0 cannot be stored), a JetStream stream
whose message-size limit the server enforces (the record or the event cannot be written), and
the final version's announcement delivered twice, or again to a restarted manager.
"""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest
from polling import eventually

from marlaas.platform import api, subjects
from marlaas.platform.adapters import write_adapter
from marlaas.platform.bus import JOBS_BUCKET, VERSIONS_BUCKET, Bus
from marlaas.platform.config import load_config
from marlaas.platform.events import (
    COMMITTED,
    JOB,
    JOB_RECORD,
    POLICY,
    CommittedVersion,
    JobRecord,
    JobSpec,
    JobState,
    JobStateChanged,
    PolicyCommitted,
    encode,
)
from marlaas.platform.store import FileStore
from services.manager.job_admin import cancel_job, job_status
from services.manager.service import Manager, api_responder

pytestmark = pytest.mark.timeout(120)


class RefusingStore(FileStore):
    """A file store whose disk is full (writes fail) until ``refusing`` is cleared."""

    refusing = True

    def put_bytes(self, key: str, data: bytes):
        if self.refusing:
            raise OSError(28, "No space left on device")
        return super().put_bytes(key, data)


def submission(name: str, **fields) -> bytes:
    return msgspec.json.encode({"name": name, "task": "addition", "steps": 2, "tenant": "acme", **fields})


async def manager_on(bus: Bus, store, tmp_path) -> Manager:
    config = load_config(overrides={"home": str(tmp_path / "home")}, env={})
    return await asyncio.to_thread(Manager, bus, store, config)


async def record_of(bus: Bus, job: str) -> JobRecord | None:
    entry = await bus.kv_get(JOBS_BUCKET, job)
    return JOB_RECORD.decode(entry.value) if entry else None


async def state_events(bus: Bus, job: str) -> list[JobStateChanged]:
    return [JOB.decode(d) for d in await bus.read_all("JOBS", f"marlaas.job.state.{job}")]


async def set_max_msg_size(bus: Bus, stream: str, size: int) -> None:
    """Make the server refuse messages over ``size`` bytes on ``stream`` (-1: no limit)."""
    config = (await bus.js.stream_info(stream)).config
    config.max_msg_size = size
    await bus.js.update_stream(config)


# --- admission ------------------------------------------------------------------------------


async def test_a_failing_admission_says_why_on_the_record_and_is_retried_until_it_succeeds(bus, tmp_path):
    store = RefusingStore(tmp_path / "store")
    manager = await manager_on(bus, store, tmp_path)
    stop = asyncio.Event()
    admitting = asyncio.create_task(manager.admission.keep_admitting(stop, every_s=0.5))
    try:
        first = await manager.submissions.submit(submission("first"))
        second = await manager.submissions.submit(submission("second"))
        assert first.id and second.id and not first.error  # accepted: queued, not refused

        record = await record_of(bus, first.id)
        assert record.state is JobState.QUEUED
        assert record.reason == ("not admitted yet: admission failed (OSError: [Errno 28] No space left on "
                                 "device); retrying")
        (view,) = (await job_status(manager.jobs, msgspec.json.encode({"job": first.id}))).jobs
        assert view.state == "queued" and "No space left on device" in view.reason  # users see it
        (event,) = await state_events(bus, first.id)  # watchers hear it once, not at every retry
        assert event.state is JobState.QUEUED and event.reason == record.reason
        assert (await record_of(bus, second.id)).state is JobState.QUEUED  # FIFO: it waits behind
        assert await bus.kv_get(VERSIONS_BUCKET, first.id) is None

        store.refusing = False  # the disk has room again: the next pass admits both
        for job in (first.id, second.id):
            record = await eventually(lambda job=job: _running(bus, job), what=f"{job} admitted")
            assert record.reason == ""  # cleared on admission
            assert COMMITTED.decode((await bus.kv_get(VERSIONS_BUCKET, job)).value).version == 0
            announced = [POLICY.decode(d).version for d in await bus.read_all("POLICY", subjects.policy_committed(job))]
            assert announced == [0]
        assert [(e.state, e.reason) for e in await state_events(bus, first.id)][-1] == (JobState.RUNNING, "")
    finally:
        stop.set()
        await admitting


async def _running(bus: Bus, job: str) -> JobRecord | None:
    record = await record_of(bus, job)
    return record if record is not None and record.state is JobState.RUNNING else None


async def test_a_job_whose_version_0_cannot_be_built_fails_alone_and_the_pass_admits_the_jobs_behind_it(
        bus, file_store, tmp_path):
    manager = await manager_on(bus, file_store, tmp_path)
    # queued by a manager that did not range-check seeds yet: torch's generator cannot take this one
    bad = JobSpec(id="acme.huge-seed", tenant="acme", name="huge-seed", task="addition", steps=2, seed=2**64,
                  submitted_at=time.time() - 1)
    await bus.kv_create(JOBS_BUCKET, bad.id, encode(JobRecord(spec=bad, kv_cache_bytes=1)))
    fine = await manager.submissions.submit(submission("fine"))  # behind it in the queue
    assert fine.id and not fine.error

    await asyncio.wait_for(manager.admission.admit_queued(), 60)
    failed = await record_of(bus, bad.id)
    assert failed.state is JobState.FAILED
    assert failed.reason.startswith("not admitted: version 0 cannot be built from the job's settings "
                                    "(ValueError: Overflow")
    assert failed.reason.endswith("fix them and submit the job again")
    assert [(e.state, e.reason) for e in await state_events(bus, bad.id)] == [(JobState.FAILED, failed.reason)]
    assert await bus.kv_get(VERSIONS_BUCKET, bad.id) is None
    assert (await record_of(bus, fine.id)).state is JobState.RUNNING  # the same pass went on
    assert COMMITTED.decode((await bus.kv_get(VERSIONS_BUCKET, fine.id)).value).version == 0


# --- submission -----------------------------------------------------------------------------


async def test_a_submit_whose_record_cannot_be_written_gets_a_clear_error_and_creates_nothing(
        bus, file_store, tmp_path):
    manager = await manager_on(bus, file_store, tmp_path)
    await bus.serve(subjects.API_SUBMIT, "manager", api_responder(manager.submissions.submit))

    async def submit(name: str) -> api.SubmitReply:  # as a client does: request/reply over the bus
        data = await bus.request(subjects.API_SUBMIT, submission(name), timeout_s=10)
        return msgspec.json.decode(data, type=api.SubmitReply)

    await set_max_msg_size(bus, "KV_jobs", 64)  # the server refuses the record itself
    refused = await submit("no-record")
    assert refused.code == api.UNAVAILABLE and not refused.id
    assert refused.error.startswith("the job could not be recorded (")
    assert refused.error.endswith("nothing was created: submit it again")
    assert "message size exceeds maximum allowed" in refused.error  # the broker's own words

    await set_max_msg_size(bus, "KV_jobs", -1)
    await set_max_msg_size(bus, "JOBS", 64)  # the record is written, its announcement refused
    unannounced = await submit("no-event")
    assert unannounced.code == api.UNAVAILABLE and "nothing was created" in unannounced.error

    assert await bus.kv_keys(JOBS_BUCKET) == []  # neither left a record...
    assert await manager.jobs.unfinished_records() == []  # ... nor a job the manager would admit
    assert await bus.read_all("JOBS", "marlaas.job.>") == []

    await set_max_msg_size(bus, "JOBS", -1)  # healthy again: the same submission goes through
    accepted = await submit("no-record")
    assert accepted.id and not accepted.error
    assert await bus.kv_keys(JOBS_BUCKET) == [accepted.id]


# --- the final version's announcement, repeated ---------------------------------------------


async def committed_job(bus: Bus, store, name: str, steps: int, record_version: int,
                        state: JobState = JobState.RUNNING) -> PolicyCommitted:
    """A job whose trainer committed version ``steps`` (the last) while its record says
    ``record_version``; returns the last version's announcement."""
    spec = JobSpec(id=f"acme.{name}", tenant="acme", name=name, task="addition", steps=steps,
                   submitted_at=time.time())
    await bus.kv_create(JOBS_BUCKET, spec.id, encode(JobRecord(
        spec=spec, state=state, version=record_version, rewards=[0.5] * max(record_version, 0))))
    adapter = await asyncio.to_thread(write_adapter, store, spec.id, steps, b"{}", b"weights")
    await bus.kv_create(VERSIONS_BUCKET, spec.id, encode(CommittedVersion(
        job=spec.id, version=steps, adapter=adapter, batch_id=f"{spec.id}:v{steps - 1}", committed_at=time.time())))
    return PolicyCommitted(job=spec.id, version=steps, adapter=adapter, batch_id=f"{spec.id}:v{steps - 1}",
                           metrics={"reward/mean": 0.75}, committed_at=time.time())


async def consume_policy(bus: Bus, manager: Manager, stop: asyncio.Event) -> asyncio.Task:
    return asyncio.create_task(bus.consume("POLICY", "manager", "marlaas.policy.committed.>", manager.events.on_policy,
                                           stop=stop))


async def stop_manager(manager: Manager, stop: asyncio.Event, consuming: asyncio.Task) -> None:
    """Stop consuming, then let the manager's background work (garbage collection) finish."""
    stop.set()
    await consuming
    await asyncio.gather(*list(manager.jobs.background))


async def test_the_final_announcement_twice_or_after_a_restart_completes_the_job_once(bus, file_store, tmp_path):
    twice = await committed_job(bus, file_store, "twice", steps=2, record_version=1)
    # a manager that died after recording the last version but before marking the job completed
    crashed = await committed_job(bus, file_store, "crashed", steps=2, record_version=2)

    manager, stop = await manager_on(bus, file_store, tmp_path), asyncio.Event()
    consuming = await consume_policy(bus, manager, stop)
    for _ in range(2):  # without Nats-Msg-Id: a repeat the duplicate window would not catch
        await bus.publish(subjects.policy_committed(twice.job), encode(twice))
    await eventually(lambda: _completed(bus, twice.job), what="completed")
    await asyncio.sleep(1.0)  # the repeat is handled too
    await stop_manager(manager, stop, consuming)

    # a restarted manager: the announcement is delivered again (a trainer re-announces on its
    # restart), and the crashed manager's unacknowledged one reaches it for the first time
    manager, stop = await manager_on(bus, file_store, tmp_path), asyncio.Event()
    consuming = await consume_policy(bus, manager, stop)
    await bus.publish(subjects.policy_committed(twice.job), encode(twice))
    await bus.publish(subjects.policy_committed(crashed.job), encode(crashed))
    await eventually(lambda: _completed(bus, crashed.job), what="the crashed manager's job completed")
    await asyncio.sleep(1.0)
    await stop_manager(manager, stop, consuming)

    for event, rewards in ((twice, [0.5, 0.75]), (crashed, [0.5, 0.5])):
        record = await record_of(bus, event.job)
        assert record.state is JobState.COMPLETED and record.version == 2
        assert record.rewards == rewards  # the last version's reward recorded once
        states = [e.state for e in await state_events(bus, event.job)]
        assert states == [JobState.COMPLETED], states  # completed exactly once
    info = await bus.js.consumer_info("POLICY", "manager")
    assert info.num_pending == 0 and info.num_ack_pending == 0


async def _completed(bus: Bus, job: str) -> bool:
    record = await record_of(bus, job)
    return record is not None and record.state is JobState.COMPLETED


class ListingFailsOnce(FileStore):
    """A file store whose first listing for garbage collection fails (the store briefly unreachable)."""

    listings = 0

    def collectable(self, prefix: str = "") -> list[str]:
        self.listings += 1
        if self.listings == 1:
            raise ConnectionError("object store unreachable")
        return super().collectable(prefix)


async def test_a_finished_jobs_failed_last_garbage_collection_is_retried_before_the_announcement_is_acked(
        bus, tmp_path):
    # no later commit would retry a finished job's collection: its last announcement must be
    # redelivered until a pass succeeds (a manager killed during that pass is the same case)
    store = ListingFailsOnce(tmp_path / "store")
    last = await committed_job(bus, store, "gc", steps=2, record_version=1)
    loser = await asyncio.to_thread(write_adapter, store, last.job, 2, b"{}", b"a losing attempt")

    manager, stop = await manager_on(bus, store, tmp_path), asyncio.Event()
    consuming = await consume_policy(bus, manager, stop)
    await bus.publish(subjects.policy_committed(last.job), encode(last))
    await eventually(lambda: _completed(bus, last.job), what="completed")
    await eventually(lambda: _all_acknowledged(bus), what="the last announcement acknowledged")
    await stop_manager(manager, stop, consuming)
    assert store.listings > 1  # the failed pass was followed by one that ran
    keys = await asyncio.to_thread(store.list, f"adapters/{last.job}/")
    assert store.key_of(loser.uri) not in keys  # the losing attempt was collected
    assert store.key_of(last.adapter.uri) in keys


async def _all_acknowledged(bus: Bus) -> bool:
    info = await bus.js.consumer_info("POLICY", "manager")
    return info.num_pending == 0 and info.num_ack_pending == 0


class SlowListing(FileStore):
    """A file store whose listings for garbage collection of one job's folders wait until
    ``released`` is set: the listing of a large bucket."""

    def __init__(self, root, slow_job: str) -> None:
        super().__init__(root)
        self.slow_job = slow_job
        self.listing, self.released = threading.Event(), threading.Event()

    def collectable(self, prefix: str = "") -> list[str]:
        if f"/{self.slow_job}/" in prefix:
            self.listing.set()
            self.released.wait(60)
        return super().collectable(prefix)


async def test_a_finished_jobs_last_garbage_collection_does_not_hold_up_other_jobs_announcements(bus, tmp_path):
    store = SlowListing(tmp_path / "store", "acme.slow")
    last = await committed_job(bus, store, "slow", steps=2, record_version=1)
    other = await committed_job(bus, store, "busy", steps=2, record_version=0)
    manager, stop = await manager_on(bus, store, tmp_path), asyncio.Event()
    consuming = await consume_policy(bus, manager, stop)
    try:
        await bus.publish(subjects.policy_committed(last.job), encode(last))
        assert await asyncio.to_thread(store.listing.wait, 30), "the finished job's last pass never listed"
        # while that pass lists, another job's trainer commits its version 1
        await bus.publish(subjects.policy_committed(other.job), encode(msgspec.structs.replace(other, version=1)))

        async def recorded() -> bool:
            record = await record_of(bus, other.job)
            return record.version == 1 and record.rewards == [0.75]

        await eventually(recorded, what="the other job's version 1 recorded during the pass")
        info = await bus.js.consumer_info("POLICY", "manager")
        assert info.num_ack_pending == 1  # the finished job's announcement waits for its pass
        store.released.set()
        await eventually(lambda: _all_acknowledged(bus), what="acknowledged once the pass ended")
    finally:
        store.released.set()
        await stop_manager(manager, stop, consuming)
    assert (await record_of(bus, last.job)).state is JobState.COMPLETED


# --- bounds (issue 35) ------------------------------------------------------------------------


async def test_a_tenants_finished_jobs_beyond_the_bound_are_deleted_oldest_first(bus, file_store, tmp_path):
    """``manager.max_finished_jobs``: a tenant's finished jobs past the newest N are deleted whole
    (record and data) as each job finishes; its other jobs and other tenants' are untouched."""
    config = load_config(overrides={"home": str(tmp_path / "home"), "manager.max_finished_jobs": 2}, env={})
    manager = await asyncio.to_thread(Manager, bus, file_store, config)
    jobs = [(await manager.submissions.submit(submission(f"job{k}"))).id for k in range(4)]
    other = (await manager.submissions.submit(submission("theirs", tenant="zeta"))).id
    running = (await manager.submissions.submit(submission("still-queued"))).id
    assert all(jobs) and other and running
    for job in (*jobs, other):
        assert (await cancel_job(manager.jobs, msgspec.json.encode({"job": job}))).state == "cancelled"
        await asyncio.sleep(0.05)  # distinct finished_at, in this order

    async def kept() -> list[str] | None:
        present = [job for job in (*jobs, other, running) if await record_of(bus, job) is not None]
        return present if len(present) == 4 else None

    assert await eventually(kept, what="acme's two oldest finished jobs deleted") == [jobs[2], jobs[3], other,
                                                                                      running]
