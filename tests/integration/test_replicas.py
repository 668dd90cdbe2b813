"""Scale-out on one machine: two rollout replicas (two vLLM engines), two trainers on the one work
queue, two env replicas. Each shares the work; a job moves between trainers (cold load from the
store) and never trains twice at once; a killed rollout replica's jobs carry on on the other."""

from __future__ import annotations

import asyncio
import time

import pytest

from marlaas.platform.audit import audit_training
from marlaas.platform.bus import Bus
from marlaas.platform.config import load_config
from marlaas.platform.nats_client import BusClient
from marlaas.platform.telemetry import read_spans
from marlaas.stack.launcher import Stack

pytestmark = [pytest.mark.stack,  # starts a vLLM engine: not in `make test-fast`
              pytest.mark.own_stack("two replicas of rollout, trainer and env, one of them killed")]

JOBS = [("addition", 0), ("reverse", 1), ("repeat", 2), ("addition", 3)]
STEPS = 6


def pids(spans, phase: str) -> set[int]:
    return {int(s.attrs["pid"]) for s in spans if s.phase == phase}


@pytest.mark.timeout(900)
def test_replicas_share_the_work_and_survive_a_killed_rollout(tmp_path):
    config = load_config(overrides={"home": str(tmp_path), "gateway.port": 0}, env={})
    stack = Stack(config, replicas={"rollout": 2, "trainer": 2, "env": 2})
    assert sorted(stack.services) == sorted(["manager", "gateway", "env", "env-2", "sandbox", "trainer", "trainer-2",
                                            "rollout", "rollout-2"])

    async def submit_and_wait_for_progress(url: str) -> list[str]:
        client = await BusClient.connect(url)
        ids = [await client.submit({"name": f"{task}-{seed}", "task": task, "steps": STEPS, "seed": seed})
               for task, seed in JOBS]
        deadline = time.monotonic() + 300
        while min(v.version for v in await client.status() if v.id in ids) < 2:
            assert time.monotonic() < deadline, "jobs made no progress with two replicas of everything"
            await asyncio.sleep(0.5)
        await client.close()
        return ids

    async def finish(url: str, ids: list[str]):
        client = await BusClient.connect(url)
        views = await client.wait(ids, timeout_s=500)
        bus = await Bus.connect(url)
        spans = [s for s in await read_spans(bus) if s.job in ids]
        await bus.close()
        await client.close()
        return views, spans

    with stack:
        ids = asyncio.run(submit_and_wait_for_progress(stack.nats_url))
        killed_pid = stack.procs["rollout-2"].pid
        killed_at = time.time()  # a span it started before this may still be published; none after
        stack.kill("rollout-2")  # SIGKILL, engine core included
        views, spans = asyncio.run(finish(stack.nats_url, ids))

    assert all(v.state == "completed" and v.version == STEPS for v in views), [(v.name, v.state) for v in views]
    assert audit_training(spans) == []  # each version trained once, on-policy, from the right adapter
    assert len(pids(spans, "generate")) == 2 and killed_pid in pids(spans, "generate")  # both engines sampled
    # every job still had versions to sample at the kill: the survivor sampled them, the killed one nothing
    assert pids([s for s in spans if s.start > killed_at], "generate") == pids(spans, "generate") - {killed_pid}
    assert len(pids(spans, "train")) == 2  # both trainers trained
    assert len(pids(spans, "score")) == 2  # both env replicas scored rewards
    moved = [job for job in ids if len(pids([s for s in spans if s.job == job], "train")) == 2]
    assert moved, "no job moved between the two trainers"
    for job in ids:  # never two updates of one job at once
        trains = sorted((s.start, s.end) for s in spans if s.job == job and s.phase == "train")
        assert all(a[1] <= b[0] for a, b in zip(trains, trains[1:]))
