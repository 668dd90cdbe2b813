"""Admission by KV-cache budget on the real stack: a job that does not fit waits in the queue."""

from __future__ import annotations

import asyncio

import pytest

from marlaas.platform.bus import Bus
from marlaas.platform.config import load_config
from marlaas.platform.nats_client import BusClient
from marlaas.platform.telemetry import read_spans
from marlaas.stack.launcher import Stack

pytestmark = pytest.mark.stack  # starts a vLLM engine: not in `make test-fast`


@pytest.mark.timeout(400)
def test_a_job_beyond_the_kv_budget_queues_until_room_frees_up(tmp_path):
    # tiny model, float32: repeat needs ~3.1 MiB of KV cache, addition ~1.3 MiB; 4 MiB fits one
    config = load_config(overrides={"home": str(tmp_path), "gateway.port": 0, "manager.kv_budget_gib": 4 / 1024},
                         env={})

    async def go(url: str):
        client = await BusClient.connect(url)
        first = await client.submit({"name": "first", "task": "repeat", "steps": 3, "seed": 1})
        second = await client.submit({"name": "second", "task": "addition", "steps": 2, "seed": 2})
        states = {v.id: v.state for v in await client.status()}
        views = await client.wait([first, second], timeout_s=300)
        bus = await Bus.connect(url)
        spans = await read_spans(bus)
        await bus.close()
        await client.close()
        return first, second, states, views, spans

    with Stack(config) as stack:
        first, second, states, views, spans = asyncio.run(go(stack.nats_url))

    assert states == {first: "running", second: "queued"}
    assert all(v.state == "completed" for v in views)
    first_done = max(s.end for s in spans if s.job == first and s.phase == "commit")
    second_starts = min(s.start for s in spans if s.job == second)
    assert second_starts >= first_done  # admitted only once the first job had finished
