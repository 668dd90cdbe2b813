"""Agentic jobs on the embedded stack: the built-in tool-using task learns next to a single-turn
job, multi-turn re-entry hits vLLM's prefix cache, and a tenant's own tool process serves a job.

This module runs the **bare** rendering (``rollout.prompt_format = "bare"``) on the
character-level base (``base_model = "builtin:char"``), the setting kept for models without a
chat template: that base calls the calculator in about a third of its episodes, so
``multiply`` has something to learn (the default chat base solves it already). The chat
template path learns a tool of its own in ``test_agent_learns_new_tool.py``.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from marlaas.platform.audit import audit_training
from marlaas.platform.bus import Bus
from marlaas.platform.config import load_config
from marlaas.platform.events import TRAJECTORY
from marlaas.platform.nats_client import ApiError, BusClient
from marlaas.platform.telemetry import read_spans
from marlaas.stack.launcher import Stack
from marlaas.tools.protocol import RESPONSE_CLOSE, RESPONSE_OPEN

pytestmark = [pytest.mark.stack,  # starts a vLLM engine: not in `make test-fast`
              pytest.mark.own_stack("the char base with bare prompts and a 1.5 s tool timeout: a config of its own")]

STEPS = 40
TOOL_SCRIPT = Path(__file__).parent / "tools" / "acme_calculator.py"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # 32-token KV blocks: only full blocks are prefix-cached, and these episodes are ~100 tokens
    config = load_config(overrides={"home": str(tmp_path_factory.mktemp("agentic-home")), "gateway.port": 0,
                                    "rollout.block_size": 32, "rollout.tool_timeout_s": 1.5,
                                    "base_model": "builtin:char", "rollout.prompt_format": "bare"}, env={})
    with Stack(config) as running:
        yield running


def run(coro):
    return asyncio.run(coro)


def mean(values: list[float]) -> float:
    return statistics.mean(values) if values else 0.0


async def catch_batches(url: str, job: str, into: list, stop: asyncio.Event) -> None:
    """Copies of the job's trajectory batches as they are published (a plain subscription: the
    work queue itself is the trainer's)."""
    bus = await Bus.connect(url)

    async def keep(msg) -> None:
        into.append(TRAJECTORY.decode(msg.data))

    sub = await bus.nc.subscribe(f"marlaas.trajectory.ready.{job}", cb=keep)
    await stop.wait()
    await sub.unsubscribe()
    await bus.close()


@pytest.mark.timeout(1800)
def test_the_agentic_task_learns_to_use_its_tool_next_to_a_single_turn_job(stack):
    async def go():
        client = await BusClient.connect(stack.nats_url)
        agent = await client.submit({"name": "agent", "task": "multiply", "steps": STEPS, "seed": 1})
        plain = await client.submit({"name": "plain", "task": "reverse", "steps": STEPS, "seed": 2})
        batches, stop = [], asyncio.Event()
        catcher = asyncio.create_task(catch_batches(stack.nats_url, agent, batches, stop))
        views = await client.wait([agent, plain], timeout_s=1700)
        stop.set()
        await catcher
        await client.close()
        bus = await Bus.connect(stack.nats_url)
        spans = await read_spans(bus)
        await bus.close()
        return views, batches, spans

    started = time.time()
    (agent, plain), batches, spans = run(go())
    print(f"{2 * STEPS} steps in {time.time() - started:.0f}s")
    assert agent.state == plain.state == "completed", (agent, plain)
    assert agent.tools == ["calculator"]

    # the agent learns: reward, and the share of episodes with a successful tool call, rise
    first, last = mean(agent.rewards[:5]), mean(agent.rewards[-5:])
    success = agent.metrics["tool/success_rate"]
    print(f"multiply: reward first5={first:.3f} last5={last:.3f}; successful-call share "
          f"first5={mean(success[:5]):.2f} last5={mean(success[-5:]):.2f}; "
          f"tool wait per episode {mean(agent.metrics['tool/wait_s']) * 1000:.1f} ms; "
          f"turns {mean(agent.metrics['episode/turns']):.2f}")
    print(f"reverse (beside it): first5={mean(plain.rewards[:5]):.3f} last5={mean(plain.rewards[-5:]):.3f}")
    assert last >= first + 0.1
    assert mean(success[-5:]) > mean(success[:5])
    assert len(success) == STEPS

    # trajectories hold tool turns, and observation tokens are masked out of the loss
    with_tools = [s for b in batches if b.batch for s in b.batch.samples if 0 in s.loss_mask]  # inline ones
    assert with_tools, "no trajectory contained a tool observation"
    from tests.models import tokenizer as tokenizer_of

    tokenizer = tokenizer_of(stack.resolved.base_model_dir)
    sample = with_tools[0]
    masked = [t for t, m in zip(sample.completion_ids, sample.loss_mask) if m == 0]
    assert tokenizer.decode(masked).startswith(RESPONSE_OPEN) and RESPONSE_CLOSE in tokenizer.decode(masked)
    assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.loss_mask) if m == 0)
    assert any(lp < 0.0 for lp, m in zip(sample.logprobs, sample.loss_mask) if m == 1)  # the engine's

    # the second turn re-enters the engine through the prefix cache
    cached = agent.metrics["episode/cached_tokens"]
    print(f"prefix-cache hits per re-entering turn (tokens): mean {mean([c for c in cached if c]):.0f}")
    assert max(cached) >= 32

    # strictly on-policy across turns: the trainer reproduces the engine's logprobs of every turn
    assert audit_training([s for s in spans if s.job in (agent.id, plain.id)]) == []


def versions_metric(view, key: str) -> list[float]:
    return view.metrics.get(key, [])


@pytest.mark.timeout(900)
def test_a_tenants_own_tool_process_serves_a_job_and_its_loss_is_survived(stack, tmp_path):
    calls_log = tmp_path / "calls.log"
    env_url = {"MARLAAS_NATS_URL": stack.nats_url, "PATH": "/usr/bin:/bin"}

    def start_tool() -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, str(TOOL_SCRIPT), str(calls_log)], env=env_url)
        return proc

    async def registered(client: BusClient) -> None:
        from marlaas.tools.registry import read_tool

        deadline = time.monotonic() + 60
        while await read_tool(client.bus, "acme.calculator") is None:
            assert time.monotonic() < deadline, "the tool never announced itself"
            await asyncio.sleep(0.2)

    async def version_reached(client: BusClient, job: str, version: int) -> None:
        deadline = time.monotonic() + 300
        while (await client.status(job))[0].version < version:
            assert time.monotonic() < deadline, f"{job} never reached v{version}"
            await asyncio.sleep(0.2)

    tool = start_tool()
    try:
        async def go():
            client = await BusClient.connect(stack.nats_url)
            await registered(client)
            with pytest.raises(ApiError, match="belongs to tenant 'acme'"):
                await client.submit({"task": "multiply", "steps": 2, "tenant": "other",
                                     "tools": ["acme.calculator"]})
            with pytest.raises(ApiError, match="is not served right now"):
                await client.submit({"task": "multiply", "steps": 2, "tenant": "acme", "tools": ["acme.nope"]})
            job = await client.submit({"task": "multiply", "steps": 14, "seed": 3, "tenant": "acme",
                                       "tools": ["acme.calculator"]})
            await version_reached(client, job, 3)
            served_before = len(calls_log.read_text().splitlines())
            tool.kill()  # the tenant's process dies mid-job
            tool.wait()
            killed_at = (await client.status(job))[0].version
            await version_reached(client, job, killed_at + 3)
            restarted = start_tool()
            await registered(client)
            (view,) = await client.wait([job], timeout_s=600)
            await client.close()
            return view, served_before, killed_at, restarted

        view, served_before, killed_at, restarted = run(go())
    finally:
        for proc in [tool] + ([restarted] if "restarted" in dir() else []):
            proc.terminate()
            proc.wait(timeout=30)
    assert view.state == "completed" and view.version == 14, view
    assert served_before > 0  # the job's rollouts called the tenant's process
    success, errors = versions_metric(view, "tool/success_rate"), versions_metric(view, "tool/errors")
    dead = range(killed_at + 1, killed_at + 3)  # batches sampled while it was gone (one may straddle)
    print(f"successful-call share per version: {[round(x, 2) for x in success]} (killed after v{killed_at})")
    assert any(success[v] == 0 and errors[v] > 0 for v in dead), "no version saw the tool's timeouts"
    assert success[-1] > 0  # restarted: served again
    assert len(calls_log.read_text().splitlines()) > served_before

    # metering: the job's usage is what its versions report, episode by episode (tool calls included,
    # to the tenant's own tool: those that timed out while it was gone too)
    samples = 8 * 8  # the default grpo.prompts_per_step x grpo.group_size
    used = run(settled_usage(stack, view.id, lambda u: u.train_samples >= 14 * samples))
    assert used.episodes == used.train_samples == 14 * samples
    assert used.tool_calls == sum(round(c * samples) for c in versions_metric(view, "tool/calls")) > 0
    assert used.tool_s == pytest.approx(sum(w * samples for w in versions_metric(view, "tool/wait_s")), rel=1e-6)
    assert used.generated_tokens >= used.train_tokens > 0  # observations are generated by tools, not trained


async def settled_usage(stack: Stack, job: str, settled, timeout_s: float = 60.0):
    """``job``'s usage from the ledger, read again until ``settled(counters)`` (the manager folds
    the services' events a moment after they happen)."""
    from marlaas.platform.usage import UsageCounters, add, read_usage

    bus = await Bus.connect(stack.nats_url)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            used = UsageCounters()
            for record in await read_usage(bus, job.partition(".")[0]):
                if record.job == job:
                    used = add(used, record.counters)
            if settled(used) or time.monotonic() > deadline:
                return used
            await asyncio.sleep(0.5)
    finally:
        await bus.close()
