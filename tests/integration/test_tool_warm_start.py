"""The tool a base cannot call: SFT on 24 demonstrations, then RL from its last version (issue 38).

``examples/tool_warm_start`` is a tenant's project: two tools with made-up names
(``zorbleck_capital``, ``qelvin_moons``) served from the tenant's own process, 24 demonstrations,
40 RL questions about other countries and planets. Measured here, on the embedded chat base:
the base's right-call share at version 0 (an ``agent`` job with no warm start) is under 5 %; an
``sft`` job on the demonstrations, then an ``agent`` job that starts from its last version
(``init_from``) and learns by RL, end above 60 %, and the RL job's reward rises on top of
where the sft job left it. The calls are counted from the tool's own log (the right tool with
an argument it knows), beside the jobs' ``tool/success_rate``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from marlaas.basemodel import builtin_model_dir
from marlaas.basemodel.synthetic import split_of
from marlaas.platform.config import load_config
from marlaas.platform.events import POLICY
from marlaas.platform.files import put_file
from marlaas.platform.nats_client import BusClient
from marlaas.platform.store import open_store
from marlaas.stack.launcher import Stack
from marlaas.tools.registry import read_tool

pytestmark = pytest.mark.stack  # starts a vLLM engine: not in `make test-fast`

PROJECT = Path(__file__).resolve().parents[2] / "examples" / "tool_warm_start"
_spec = importlib.util.spec_from_file_location("tool_warm_start", PROJECT / "tools.py")
project = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(project)

TOOLS = ["acme.zorbleck_capital", "acme.qelvin_moons"]
GRPO = {"max_new_tokens": 40, "prompts_per_step": 8, "group_size": 8}
RL_STEPS = 20


def mean(values) -> float:
    return statistics.mean(values) if values else 0.0


def test_the_projects_data_is_what_its_tools_file_writes(tmp_path):
    project.write_data(tmp_path)
    for name in ("demos.jsonl", "prompts.jsonl"):
        assert (tmp_path / name).read_text() == (PROJECT / name).read_text(), f"regenerate {name}"
    assert all(split_of(w) == "heldout" for w in project.COUNTRIES + project.PLANETS)


@pytest.mark.timeout(1200)
def test_sft_then_rl_teaches_a_tool_the_base_cannot_call(tmp_path):
    config = load_config(overrides={"home": str(tmp_path / "home"), "gateway.port": 0,
                                    "base_model": str(builtin_model_dir()), "rollout.prompt_format": "chat"}, env={})
    calls_log = tmp_path / "calls.log"
    calls_log.touch()

    async def go(stack: Stack):
        client = await BusClient.connect(stack.nats_url)
        deadline = time.monotonic() + 60
        while any([await read_tool(client.bus, name) is None for name in TOOLS]):
            assert time.monotonic() < deadline, "the tools never announced themselves"
            await asyncio.sleep(0.2)
        store = open_store(stack.resolved.store_url)
        prompts = put_file(store, "acme", (PROJECT / "prompts.jsonl").read_bytes(), "prompts.jsonl").id
        demos = put_file(store, "acme", (PROJECT / "demos.jsonl").read_bytes(), "demos.jsonl").id
        agent = {"task": "agent", "tenant": "acme", "dataset": prompts, "tools": TOOLS, "reward": "contains",
                 "system": project.SYSTEM, "grpo": GRPO, "seed": 3}
        base = await client.submit({**agent, "name": "base", "steps": 1})
        # the chain as one submission: the sft job, then (``then``) the RL job from its last version
        rl_job = {k: v for k, v in agent.items() if k != "tenant"} | {"name": "rl", "steps": RL_STEPS}
        sft = await client.submit({"name": "sft", "task": "sft", "tenant": "acme", "dataset": demos, "tools": TOOLS,
                                   "steps": 1, "sft": {"batch_size": 8, "epochs": 6}, "seed": 3,
                                   "grpo": {"learning_rate": 5e-3}, "then": rl_job})
        base_view, sft_view = await client.wait([base, sft], timeout_s=600)
        base_calls = calls_log.read_text().splitlines()
        while not sft_view.followed_by:  # noted in its record right after it completed
            assert not sft_view.reason, sft_view
            await asyncio.sleep(0.5)
            (sft_view,) = await client.status(sft)
        (rl_view,) = await client.wait([sft_view.followed_by], timeout_s=600)
        firsts = {}
        for name in (sft, rl_view.id):
            firsts[name] = [POLICY.decode(d) for d in await client.bus.read_all(
                "POLICY", f"marlaas.policy.committed.{name}")]
        assert firsts[rl_view.id][0].adapter.sha256 == firsts[sft][-1].adapter.sha256  # v0 = the sft job's last
        await client.close()
        return base_view, sft_view, rl_view, base_calls

    with Stack(config) as stack:
        tools = subprocess.Popen([sys.executable, str(PROJECT / "tools.py"), str(calls_log)],
                                 env={"MARLAAS_NATS_URL": stack.nats_url, "PATH": "/usr/bin:/bin"})
        try:
            base, sft, rl, base_calls = asyncio.run(go(stack))
        finally:
            tools.terminate()
            tools.wait(timeout=30)
    assert base.state == sft.state == rl.state == "completed", (base, sft, rl)
    base_share, rl_share = base.metrics["tool/success_rate"], rl.metrics["tool/success_rate"]
    rl_calls = Counter(line.rpartition(" ")[2] for line in calls_log.read_text().splitlines()[len(base_calls):])
    print(f"\nbase: right-call share {base_share}, reward {base.rewards}; its calls {base_calls[:20]}")
    print(f"rl calls: {dict(rl_calls)}")
    print(f"sft loss per version: {[round(x, 3) for x in sft.metrics['loss']]}")
    print(f"rl right-call share per version: {[round(x, 2) for x in rl_share]}")
    print(f"rl reward per version: {[round(x, 2) for x in rl.rewards]}")
    assert mean(base_share) < 0.05
    assert mean(rl_share[-3:]) > 0.6
    assert mean(rl.rewards[-3:]) >= mean(rl.rewards[:3]) + 0.05
