"""marlaas's grouped CPU LoRA ops give what vLLM's own torch ops give, on every path."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from vllm.lora.ops import torch_ops as vllm_ops

from marlaas.vllm_plugin import lora_ops

TOKENS, SLOTS, RANK, HIDDEN, OUT = 12, 4, 8, 32, 48


def assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Equal up to float summation order (a matmul and an einsum add in different orders)."""
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-4)


def indices_cases():
    return {
        "one adapter": torch.full((TOKENS,), 2),
        "mixed adapters": torch.tensor([0, 0, 1, 3, 3, 3, 1, 0, 2, 2, 1, 3]),
        "with -1 (no adapter)": torch.tensor([-1, -1, 0, 0, 1, -1, 1, 1, 2, 2, -1, 0]),
    }


@pytest.fixture(params=list(indices_cases()))
def indices(request):
    return indices_cases()[request.param]


def test_shrink_matches_vllm(indices):
    torch.manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN)
    weights = torch.randn(SLOTS, 1, RANK, HIDDEN)  # vLLM's lora_a_stacked layout
    ours, theirs = torch.zeros(TOKENS, RANK + 2), torch.zeros(TOKENS, RANK + 2)
    lora_ops.bgmv_shrink(x, weights, ours, indices, 0.5)
    vllm_ops.bgmv_shrink(x, weights, theirs, indices, 0.5)
    assert_close(ours, theirs)


@pytest.mark.parametrize("add_inputs", [True, False])
def test_expand_matches_vllm(indices, add_inputs):
    torch.manual_seed(1)
    x = torch.randn(TOKENS, RANK)
    weights = torch.randn(SLOTS, OUT, RANK)
    start = torch.randn(TOKENS, OUT - 4)  # the model's output narrower than the adapter's (padding)
    ours, theirs = start.clone(), start.clone()
    lora_ops.bgmv_expand(x, weights, ours, indices, add_inputs)
    vllm_ops.bgmv_expand(x, weights, theirs, indices, add_inputs)
    assert_close(ours, theirs)


@pytest.mark.parametrize("add_inputs", [True, False])
def test_expand_slice_matches_vllm(indices, add_inputs):
    torch.manual_seed(2)
    x = torch.randn(TOKENS, RANK)
    weights = torch.randn(SLOTS, 1, OUT, RANK)
    start = torch.randn(TOKENS, 3 * OUT)
    ours, theirs = start.clone(), start.clone()
    lora_ops.bgmv_expand_slice(x, weights, ours, indices, OUT, OUT, add_inputs)
    vllm_ops.bgmv_expand_slice(x, weights, theirs, indices, OUT, OUT, add_inputs)
    assert_close(ours, theirs)


def test_prefill_ops_expand_per_sequence_indices():
    torch.manual_seed(3)
    seq_lens, seq_slots = torch.tensor([5, 3, 4]), torch.tensor([1, -1, 1])
    starts = torch.tensor([0, 5, 8])
    x = torch.randn(TOKENS, HIDDEN)
    a = torch.randn(SLOTS, RANK, HIDDEN)
    b = torch.randn(SLOTS, OUT, RANK)
    meta = (starts, seq_lens, seq_slots, 3, 5, TOKENS)
    shrunk = {name: torch.zeros(TOKENS, RANK) for name in ("ours", "theirs")}
    lora_ops.sgmv_shrink(x, a, shrunk["ours"], *meta, 2.0)
    vllm_ops.sgmv_shrink(x, a, shrunk["theirs"], *meta, 2.0)
    assert_close(shrunk["ours"], shrunk["theirs"])
    out = {name: torch.ones(TOKENS, OUT) for name in ("ours", "theirs")}
    lora_ops.sgmv_expand(shrunk["ours"], b, out["ours"], *meta, True)
    vllm_ops.sgmv_expand(shrunk["theirs"], b, out["theirs"], *meta, True)
    assert_close(out["ours"], out["theirs"])
    sliced = {name: torch.zeros(TOKENS, 2 * OUT) for name in ("ours", "theirs")}
    lora_ops.sgmv_expand_slice(shrunk["ours"], b, sliced["ours"], *meta, OUT, OUT, False)
    vllm_ops.sgmv_expand_slice(shrunk["theirs"], b, sliced["theirs"], *meta, OUT, OUT, False)
    assert_close(sliced["ours"], sliced["theirs"])


def test_a_grouping_is_reused_only_while_its_indices_are_unchanged():
    """vLLM refills one index buffer in place every step: the next op must see the new adapters."""
    torch.manual_seed(4)
    buffer = torch.zeros(TOKENS + 4, dtype=torch.long)
    x = torch.randn(TOKENS, HIDDEN)
    weights = torch.randn(SLOTS, RANK, HIDDEN)
    for step_indices in indices_cases().values():
        buffer[:TOKENS].copy_(step_indices)
        for _ in range(2):  # the second op of the step reuses the grouping
            ours, theirs = torch.zeros(TOKENS, RANK), torch.zeros(TOKENS, RANK)
            lora_ops.bgmv_shrink(x, weights, ours, buffer[:TOKENS], 1.0)
            vllm_ops.bgmv_shrink(x, weights, theirs, buffer[:TOKENS], 1.0)
            assert_close(ours, theirs)
    seq_lens, seq_slots = torch.tensor([6, 6]), torch.tensor([0, 0])
    for slots in ([0, 0], [2, 1], [3, 3]):
        seq_slots.copy_(torch.tensor(slots))
        ours, theirs = torch.zeros(TOKENS, RANK), torch.zeros(TOKENS, RANK)
        lora_ops.sgmv_shrink(x, weights, ours, torch.tensor([0, 6]), seq_lens, seq_slots, 2, 6, TOKENS, 1.0)
        vllm_ops.sgmv_shrink(x, weights, theirs, torch.tensor([0, 6]), seq_lens, seq_slots, 2, 6, TOKENS, 1.0)
        assert_close(ours, theirs)


def test_register_swaps_the_cpu_wrapper_ops_only_when_asked(monkeypatch):
    from vllm.lora.punica_wrapper import punica_cpu

    from marlaas import vllm_plugin
    from marlaas.vllm_plugin import fused_linear

    # register() also wraps vLLM's CPU model runner (tests/unit/test_vllm_prompt_logprobs.py), whose module's
    # import runs a subprocess: a stand-in here
    runner = type("CPUModelRunner", (), {"_get_prompt_logprobs_dict": lambda self, *args: {}})
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.cpu_model_runner", SimpleNamespace(CPUModelRunner=runner))
    monkeypatch.setattr(punica_cpu.PunicaWrapperCPU, "add_lora_logits", punica_cpu.PunicaWrapperCPU.add_lora_logits)
    # vLLM's own ops and method, even when an earlier test in this process loaded the plugin
    originals = {name: getattr(vllm_ops, name) for name in vllm_plugin.OPS}
    installed = punica_cpu.PunicaWrapperCPU.add_lora_linear
    original_linear = fused_linear._vllm_add_lora_linear if installed is fused_linear.add_lora_linear else installed
    try:
        for name, op in originals.items():  # start from vLLM's state
            setattr(punica_cpu, name, op)
        punica_cpu.PunicaWrapperCPU.add_lora_linear = original_linear
        monkeypatch.setenv(vllm_plugin.KERNELS_ENV, "vllm")
        vllm_plugin.register()
        assert all(getattr(punica_cpu, name) is originals[name] for name in vllm_plugin.OPS)
        assert punica_cpu.PunicaWrapperCPU.add_lora_linear is original_linear
        monkeypatch.setenv(vllm_plugin.KERNELS_ENV, "grouped")
        vllm_plugin.register()
        assert all(getattr(punica_cpu, name) is getattr(lora_ops, name) for name in vllm_plugin.OPS)
        assert punica_cpu.PunicaWrapperCPU.add_lora_linear is original_linear
        monkeypatch.setenv(vllm_plugin.KERNELS_ENV, "fused")
        vllm_plugin.register()
        vllm_plugin.register()  # twice: still one layer of wrapping
        assert all(getattr(punica_cpu, name) is getattr(lora_ops, name) for name in vllm_plugin.OPS)
        assert punica_cpu.PunicaWrapperCPU.add_lora_linear is fused_linear.add_lora_linear
        assert fused_linear._vllm_add_lora_linear is original_linear
    finally:
        for name, op in originals.items():
            setattr(punica_cpu, name, op)
        punica_cpu.PunicaWrapperCPU.add_lora_linear = original_linear


def test_the_plugin_is_declared_to_vllm():
    from importlib.metadata import entry_points

    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("marlaas_cpu_lora") == "marlaas.vllm_plugin:register"
