"""Load: 32 jobs submitted at once to one stack all run to the end, each version committed and
announced once, every batch trained on-policy, with the engine serving many jobs in one batch.

Each job is small (two versions of 2 prompts x 2 samples): the point is the number of jobs the
services juggle at once, not their length. ``python benchmarks/load.py`` runs longer waves and
follows every service's memory from wave to wave.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from marlaas.platform.audit import audit_training
from marlaas.platform.bus import Bus
from marlaas.platform.config import load_config
from marlaas.platform.events import POLICY
from marlaas.platform.nats_client import BusClient
from marlaas.platform.telemetry import read_spans
from marlaas.stack.launcher import Stack

pytestmark = pytest.mark.own_stack("32 jobs submitted at once: a load the shared stack's other users would wait on")

JOBS, STEPS = 32, 2
TASKS = ("addition", "reverse", "repeat")
SMALL = {"prompts_per_step": 2, "group_size": 2}


def most_at_once(spans) -> int:
    """The most jobs whose generation spans overlap one moment."""
    edges = sorted(itertools.chain(((s.start, 1) for s in spans), ((s.end, -1) for s in spans)))
    return max(itertools.accumulate(delta for _, delta in edges))


@pytest.mark.slow
@pytest.mark.stack
@pytest.mark.timeout(900)
def test_32_jobs_at_once_all_finish_with_every_version_once(tmp_path):
    config = load_config(overrides={"home": str(tmp_path), "gateway.port": 0}, env={})

    async def go(url: str):
        client = await BusClient.connect(url)
        ids = await asyncio.gather(*(client.submit({"name": f"load-{i}", "task": TASKS[i % len(TASKS)], "seed": i,
                                                    "steps": STEPS, "grpo": SMALL}) for i in range(JOBS)))
        views = await client.wait(list(ids), timeout_s=800)
        await client.close()
        bus = await Bus.connect(url)
        try:
            announced = [POLICY.decode(data) for data in await bus.read_all("POLICY", "marlaas.policy.committed.>")]
            spans = [s for s in await read_spans(bus) if s.job in ids]
        finally:
            await bus.close()
        return views, announced, spans

    with Stack(config) as stack:
        views, announced, spans = asyncio.run(go(stack.nats_url))
        stack.check_alive()  # no service died of the load

    assert len(views) == JOBS
    for view in views:
        assert view.state == "completed" and view.version == STEPS, view
        assert sorted(a.version for a in announced if a.job == view.id) == list(range(STEPS + 1)), view.id
    trained = sorted((s.job, s.version) for s in spans if s.phase == "train")
    assert trained == sorted((v.id, version) for v in views for version in range(STEPS))  # each batch once
    assert audit_training(spans) == []
    generating = [s for s in spans if s.phase == "generate"]
    print(f"at most {most_at_once(generating)} jobs generating at once")
    assert most_at_once(generating) >= 4  # one engine, many adapters in its batches
