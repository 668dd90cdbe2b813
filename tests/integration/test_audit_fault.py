"""The on-policy audit can fail: an engine serving stale weights under each new version's name
(the failure of vllm#47724 / #42125, injected here) is caught by the logprob gap, and only by it."""

from __future__ import annotations

import asyncio

import pytest

from marlaas.platform.audit import audit_training, gaps_by_version
from marlaas.platform.bus import Bus
from marlaas.platform.config import load_config
from marlaas.platform.nats_client import BusClient
from marlaas.platform.telemetry import read_spans
from marlaas.stack.launcher import Stack

pytestmark = [pytest.mark.stack,  # starts a vLLM engine: not in `make test-fast`
              pytest.mark.own_stack("an injected fault: the trainer is made to serve a stale adapter")]

STEPS = 4


@pytest.mark.timeout(600)
def test_an_engine_serving_a_wrong_adapter_fails_the_audit(tmp_path):
    config = load_config(overrides={"home": str(tmp_path), "gateway.port": 0}, env={})
    with Stack(config, child_env={"MARLAAS_FAULT_STALE_ADAPTER": "1"}) as stack:

        async def go():
            client = await BusClient.connect(stack.nats_url)
            job = await client.submit({"task": "addition", "steps": STEPS, "seed": 1})
            (view,) = await client.wait([job], timeout_s=400)
            await client.close()
            bus = await Bus.connect(stack.nats_url)
            spans = await read_spans(bus, job)
            await bus.close()
            return view, spans

        view, spans = asyncio.run(go())
    assert view.state == "completed"
    gaps = gaps_by_version(spans, view.id)
    problems = audit_training(spans)
    print(f"logprob gap per version with a stale adapter in the engine: {gaps}")
    # v0 is served right (the first adapter *is* v0); every later version is served v0's weights
    assert not any(f"{view.id} v0:" in p for p in problems)
    for version in range(1, STEPS):
        assert any(p.startswith(f"{view.id} v{version}: engine-vs-trainer logprob gap") for p in problems), problems
    # the version labels all look right: only the gap sees the wrong weights
    assert not any("trained from other versions" in p for p in problems)
