"""Adaptive admission on the real stack: jobs that fit the KV budget are still admitted one at a
time, each once the last has taken its first steps and while the engine has idle time."""

from __future__ import annotations

import asyncio

import pytest

from marlaas.platform.bus import Bus
from marlaas.platform.config import load_config
from marlaas.platform.nats_client import BusClient
from marlaas.platform.telemetry import read_spans
from marlaas.stack.launcher import Stack
from services.manager.adaptive import SETTLE_STEPS

pytestmark = [pytest.mark.stack,  # starts a vLLM engine: not in `make test-fast`
              pytest.mark.own_stack("manager.admission = adaptive: a config of its own")]


@pytest.mark.timeout(500)
def test_adaptive_admission_admits_one_settled_job_at_a_time(tmp_path):
    config = load_config(overrides={"home": str(tmp_path), "gateway.port": 0, "manager.admission": "adaptive",
                                    "manager.target_engine_busy": 0.99,
                                    "manager.target_trainer_busy": 0.99}, env={})

    async def go(url: str):
        client = await BusClient.connect(url)
        ids = [await client.submit({"name": f"j{i}", "task": "addition", "steps": 4, "seed": i}) for i in range(3)]
        states = [v.state for v in sorted(await client.status(), key=lambda v: v.name)]
        views = await client.wait(ids, timeout_s=400)
        bus = await Bus.connect(url)
        spans = await read_spans(bus)
        await bus.close()
        await client.close()
        return ids, states, views, spans

    with Stack(config) as stack:
        ids, states, views, spans = asyncio.run(go(stack.nats_url))

    assert states[0] == "running" and "queued" in states[1:]  # all three fit the budget, yet they wait
    assert all(v.state == "completed" for v in views)
    first_generate = {job: min(s.start for s in spans if s.job == job and s.phase == "generate") for job in ids}
    for earlier, later in zip(ids, ids[1:]):  # each admitted only after the one before had settled
        # v1 is the first
        settled = sorted(s.end for s in spans if s.job == earlier and s.phase == "commit")[SETTLE_STEPS - 1]
        assert first_generate[later] >= settled
