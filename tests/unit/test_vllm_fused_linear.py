"""The fused LoRA linear gives what vLLM's CPU wrapper gives, in each of its layouts."""

from __future__ import annotations

import pytest
import torch
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

from marlaas.vllm_plugin import fused_linear

SLOTS, RANK, HIDDEN = 6, 8, 32
SLICES = (32, 16, 16)  # a fused q, k, v projection


def vllm_add_lora_linear():
    """vLLM's own ``add_lora_linear``, also when the plugin replaced it in this process."""
    method = PunicaWrapperCPU.add_lora_linear
    return fused_linear._vllm_add_lora_linear if method is fused_linear.add_lora_linear else method


def wrapper(indices: torch.Tensor) -> PunicaWrapperCPU:
    """A CPU punica wrapper set up for one decode step whose tokens use ``indices``."""
    w = PunicaWrapperCPU(256, 32, "cpu")
    w._token_lora_indices[: len(indices)].copy_(indices)
    w.indices_len[:] = [len(indices)] * 4
    w.is_prefill = False
    return w


def layer(seed: int = 0):
    torch.manual_seed(seed)
    lora_a = tuple(torch.randn(SLOTS, 1, RANK, HIDDEN) for _ in SLICES)
    lora_b = tuple(torch.randn(SLOTS, 1, width, RANK) for width in SLICES)
    return lora_a, lora_b


def reference(y, x, lora_a, lora_b, indices, scale):
    """Token by token: y[b] += scale * x[b] A_s^T B_s^T per slice s, nothing for index -1."""
    y = y.clone()
    for b, slot in enumerate(indices.tolist()):
        if slot < 0:
            continue
        offset = 0
        for a, bw, width in zip(lora_a, lora_b, SLICES):
            y[b, offset:offset + width] += scale * (x[b] @ a[slot, 0].T) @ bw[slot, 0].T
            offset += width
    return y


CASES = {
    "one adapter": torch.full((10,), 3),
    "balanced mix (padded bmm)": torch.tensor([0, 1, 2, 0, 1, 2, 5, 5, 0, 1, 2, 5]),
    "one long prefill among decodes (per adapter)": torch.tensor([4] * 40 + [0, 1, 2, 3, 5]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_vllm(case):
    indices = CASES[case]
    lora_a, lora_b = layer()
    x = torch.randn(len(indices), HIDDEN)
    start = torch.randn(len(indices), sum(SLICES))
    ours, theirs = start.clone(), start.clone()
    fused_linear.add_lora_linear(wrapper(indices), ours, x, lora_a, lora_b, 0.5, SLICES)
    vllm_add_lora_linear()(wrapper(indices), theirs, x, lora_a, lora_b, 0.5, SLICES)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-4)


def test_each_layout_is_the_one_its_case_names():
    assert fused_linear.plan_step(CASES["one adapter"], SLOTS).slots == (3,)
    padded = fused_linear.plan_step(CASES["balanced mix (padded bmm)"], SLOTS)
    assert padded.gather_P is not None and padded.rows == 3 and not padded.groups
    grouped = fused_linear.plan_step(CASES["one long prefill among decodes (per adapter)"], SLOTS)
    assert grouped.gather_P is None and len(grouped.groups) == 6


@pytest.mark.parametrize("indices", [torch.tensor([-1, 0, 0, -1, 2, 2, 2, -1]),
                                     torch.tensor([-1] * 30 + [1, 2])], ids=["padded", "per adapter"])
def test_a_token_without_adapter_gets_no_lora_term(indices):
    lora_a, lora_b = layer(1)
    x = torch.randn(len(indices), HIDDEN)
    start = torch.randn(len(indices), sum(SLICES))
    ours = start.clone()
    fused_linear.add_lora_linear(wrapper(indices), ours, x, lora_a, lora_b, 1.0, SLICES)
    torch.testing.assert_close(ours, reference(start, x, lora_a, lora_b, indices, 1.0), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ours[indices < 0], start[indices < 0], rtol=0, atol=0)


def test_a_step_without_any_adapter_leaves_the_output_alone():
    lora_a, lora_b = layer(2)
    start = torch.randn(4, sum(SLICES))
    ours = start.clone()
    fused_linear.add_lora_linear(wrapper(torch.full((4,), -1)), ours, torch.randn(4, HIDDEN), lora_a, lora_b,
                                 1.0, SLICES)
    assert torch.equal(ours, start)


def test_a_slot_reloaded_in_place_is_used_at_once():
    """vLLM loads an adapter by copying into its slot: the cached stacked weights must follow."""
    lora_a, lora_b = layer(3)
    indices = torch.tensor([0, 1, 0, 1])
    x = torch.randn(4, HIDDEN)
    first = torch.zeros(4, sum(SLICES))
    fused_linear.add_lora_linear(wrapper(indices), first, x, lora_a, lora_b, 1.0, SLICES)
    lora_a[1][1, 0].copy_(torch.randn(RANK, HIDDEN))  # a new adapter in slot 1
    lora_b[0][1].zero_()
    second = torch.zeros(4, sum(SLICES))
    fused_linear.add_lora_linear(wrapper(indices), second, x, lora_a, lora_b, 1.0, SLICES)
    torch.testing.assert_close(second, reference(torch.zeros(4, sum(SLICES)), x, lora_a, lora_b, indices, 1.0),
                               rtol=1e-5, atol=1e-4)
    assert torch.equal(second[indices == 0], first[indices == 0])
    assert not torch.allclose(second[indices == 1], first[indices == 1])


def test_a_step_with_other_adapters_picks_their_weights():
    lora_a, lora_b = layer(4)
    x = torch.randn(6, HIDDEN)
    for indices in (torch.tensor([0, 0, 1, 1, 2, 2]), torch.tensor([3, 3, 4, 4, 5, 5]), torch.tensor([5] * 6)):
        ours = torch.zeros(6, sum(SLICES))
        fused_linear.add_lora_linear(wrapper(indices), ours, x, lora_a, lora_b, 1.0, SLICES)
        torch.testing.assert_close(ours, reference(torch.zeros(6, sum(SLICES)), x, lora_a, lora_b, indices, 1.0),
                                   rtol=1e-5, atol=1e-4)


def test_bf16_activations_match_vllm():
    indices = CASES["balanced mix (padded bmm)"]
    lora_a, lora_b = (tuple(t.bfloat16() for t in part) for part in layer(5))
    x = torch.randn(len(indices), HIDDEN, dtype=torch.bfloat16)
    start = torch.randn(len(indices), sum(SLICES), dtype=torch.bfloat16)
    ours, theirs = start.clone(), start.clone()
    fused_linear.add_lora_linear(wrapper(indices), ours, x, lora_a, lora_b, 1.0, SLICES)
    vllm_add_lora_linear()(wrapper(indices), theirs, x, lora_a, lora_b, 1.0, SLICES)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=2e-2, atol=2e-1)


def test_rows_the_indices_do_not_cover_go_to_vllms_own_method(monkeypatch):
    """A mismatch between the step's indices and the rows given is left to vLLM, not guessed at."""
    calls = []
    monkeypatch.setattr(fused_linear, "_vllm_add_lora_linear", lambda *args, **kwargs: calls.append(args))
    lora_a, lora_b = layer(6)
    y = torch.zeros(5, sum(SLICES))
    fused_linear.add_lora_linear(wrapper(torch.tensor([0, 1, 2])), y, torch.randn(5, HIDDEN), lora_a, lora_b,
                                 1.0, SLICES)
    assert len(calls) == 1 and calls[0][1] is y
