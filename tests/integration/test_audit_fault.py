"""The on-policy audit can fail: an engine serving stale weights under each new version's name
(the failure of vllm#47724 / #42125, injected here) is caught by the logprob gap, and only by it,
and the trainer acts on it (services/trainer/gap_watch.py): the batch is not trained."""

from __future__ import annotations

import asyncio

import pytest

from marlaas.platform.audit import MAX_LOGPROB_GAP, audit_training, gaps_by_version
from marlaas.platform.bus import Bus
from marlaas.platform.config import load_config
from marlaas.platform.nats_client import BusClient
from marlaas.platform.telemetry import read_spans
from marlaas.stack.launcher import Stack

pytestmark = [pytest.mark.stack,  # starts a vLLM engine: not in `make test-fast`
              pytest.mark.own_stack("an injected fault: the trainer is made to serve a stale adapter")]

STEPS = 4


@pytest.mark.timeout(600)
def test_an_engine_serving_a_wrong_adapter_is_caught_by_the_gap_and_the_trainer_acts(tmp_path):
    """v0 is served right (the first adapter *is* v0); v1 is served v0's weights under v1's name.
    The trainer, acting at its default bound, does not train that batch: the job fails
    saying why, an operator alert is raised, and the audit of the spans names v1 by its gap alone
    (every version label looks right)."""
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
    gaps = gaps_by_version(spans, view.id)
    problems = audit_training(spans)
    print(f"logprob gap per version with a stale adapter in the engine: {gaps}")
    assert view.state == "failed" and view.version == 1, view
    assert "engine-vs-trainer logprob gap " in view.reason, view.reason
    alerts = [s.attrs for s in spans if s.phase == "alert"]
    assert [(a["alert"], a["verdict"]) for a in alerts] == [("logprob_gap", "fail_job")]
    assert gaps[0] <= MAX_LOGPROB_GAP < gaps[1]
    assert not any(f"{view.id} v0:" in p for p in problems)
    assert any(p.startswith(f"{view.id} v1: engine-vs-trainer logprob gap") for p in problems), problems
    # the version labels all look right: only the gap sees the wrong weights
    assert not any("trained from other versions" in p for p in problems)
