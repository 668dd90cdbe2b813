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
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from marlaas.basemodel import builtin_model_dir
from marlaas.basemodel.synthetic import split_of
from marlaas.platform.api import follow_up, parse_submission
from marlaas.platform.events import POLICY, GrpoSettings
from marlaas.platform.nats_client import BusClient
from marlaas.sdk.http import read_job_file
from marlaas.stack.launcher import Stack
from marlaas.tools.registry import read_tool

pytestmark = [pytest.mark.stack, pytest.mark.shared_stack]  # the session's stack: not in `make test-fast`

PROJECT = Path(__file__).resolve().parents[2] / "examples" / "tool_warm_start"
_spec = importlib.util.spec_from_file_location("tool_warm_start", PROJECT / "tools.py")
project = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(project)

TOOLS = ["default.zorbleck_capital", "default.qelvin_moons"]  # the job files' (the embedded stack's tenant)
GRPO = {"max_new_tokens": 40, "prompts_per_step": 8, "group_size": 8}
RL_STEPS = 20
SFT_SETTINGS = (8, 6, 5e-3)  # batch size, epochs, learning rate


def mean(values) -> float:
    return statistics.mean(values) if values else 0.0


def test_the_projects_data_and_job_files_are_what_this_test_runs(tmp_path):
    project.write_data(tmp_path)
    for name in ("demos.jsonl", "prompts.jsonl"):
        assert (tmp_path / name).read_text() == (PROJECT / name).read_text(), f"regenerate {name}"
    assert all(split_of(w) == "heldout" for w in project.COUNTRIES + project.PLANETS)
    # `marlaas submit --then rl.toml sft.toml` submits the chain this test runs (tenant default's tools)
    sft, rl = (read_job_file(PROJECT / name) for name in ("sft.toml", "rl.toml"))
    job = parse_submission({**sft, "then": rl})
    assert (job.task, job.sft.batch_size, job.sft.epochs, job.grpo.learning_rate) == ("sft", *SFT_SETTINGS)
    then = follow_up(job)
    assert (then.task, then.steps, then.reward, then.system, then.seed) == ("agent", RL_STEPS, "contains",
                                                                          project.SYSTEM, 3)
    assert msgspec.structs.asdict(then.grpo) == {**msgspec.structs.asdict(GrpoSettings()), **GRPO}
    assert list(job.tools) == list(then.tools) == TOOLS
    assert Path(job.dataset) == PROJECT / "demos.jsonl" and Path(then.dataset) == PROJECT / "prompts.jsonl"


def submit_chain(stack: Stack) -> str:
    """``marlaas submit --then rl.toml sft.toml`` from the project's folder, as the README says:
    the real CLI, through the gateway as tenant ``default`` (it uploads both jobs' data)."""
    env = {**os.environ, "MARLAAS_NATS_URL": "", "MARLAAS_URL": "", "MARLAAS_TOKEN": "",
           "MARLAAS_HOME": str(stack.home)}
    proc = subprocess.run([sys.executable, "-m", "marlaas.cli", "--home", str(stack.home), "submit", "--then",
                           "rl.toml", "sft.toml", "--json"], capture_output=True, text=True, timeout=120, env=env,
                          cwd=PROJECT)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["id"]


@pytest.mark.timeout(1200)
def test_sft_then_rl_teaches_a_tool_the_base_cannot_call(shared_stack, tmp_path):
    stack = shared_stack  # the default base (the chat model) and prompt format: the stack's own defaults
    assert (stack.resolved.base_model_dir, stack.resolved.rollout.prompt_format) == (builtin_model_dir(), "chat")
    calls_log = tmp_path / "calls.log"
    calls_log.touch()

    async def go(stack: Stack):
        client = await BusClient.connect(stack.nats_url)
        deadline = time.monotonic() + 60
        while any([await read_tool(client.bus, name) is None for name in TOOLS]):
            assert time.monotonic() < deadline, "the tools never announced themselves"
            await asyncio.sleep(0.2)
        # the plain base, one version on the RL job's questions: where the chain starts from
        rl_job = read_job_file(PROJECT / "rl.toml")
        base = await client.submit({**rl_job, "name": "base", "steps": 1})
        sft = await asyncio.to_thread(submit_chain, stack)
        base_view, sft_view = await client.wait([base, sft], timeout_s=600)
        while not sft_view.followed_by:  # noted in its record right after it completed
            assert sft_view.state == "completed" and not sft_view.reason, sft_view
            await asyncio.sleep(0.5)
            (sft_view,) = await client.status(sft)
        (rl_view,) = await client.wait([sft_view.followed_by], timeout_s=600)
        firsts = {}
        for name in (sft, rl_view.id):
            firsts[name] = [POLICY.decode(d) for d in await client.bus.read_all(
                "POLICY", f"marlaas.policy.committed.{name}")]
        assert firsts[rl_view.id][0].adapter.sha256 == firsts[sft][-1].adapter.sha256  # v0 = the sft job's last
        await client.close()
        return base_view, sft_view, rl_view

    tools = subprocess.Popen([sys.executable, str(PROJECT / "tools.py"), str(calls_log), "default"],
                             env={"MARLAAS_NATS_URL": stack.nats_url, "PATH": "/usr/bin:/bin"})
    try:
        base, sft, rl = asyncio.run(go(stack))
    finally:
        tools.terminate()
        tools.wait(timeout=30)
    assert base.state == sft.state == rl.state == "completed", (base, sft, rl)
    assert (sft.task, sft.version, rl.task, rl.version) == ("sft", 18, "agent", RL_STEPS)
    base_share, rl_share = base.metrics["tool/success_rate"], rl.metrics["tool/success_rate"]
    calls = Counter(" ".join(line.split()[::2]) for line in calls_log.read_text().splitlines())
    print(f"\nbase: right-call share {base_share}, reward {base.rewards}; all calls (tool, outcome): {dict(calls)}")
    print(f"sft loss per version: {[round(x, 3) for x in sft.metrics['loss']]}")
    print(f"rl right-call share per version: {[round(x, 2) for x in rl_share]}")
    print(f"rl reward per version: {[round(x, 2) for x in rl.rewards]}")
    assert mean(base_share) < 0.05
    assert sft.metrics["loss"][-1] < 0.5 * sft.metrics["loss"][0]
    assert mean(rl_share[-3:]) > 0.6
    assert mean(rl.rewards[-3:]) >= mean(rl.rewards[:3]) + 0.05
