"""Prompt logprobs under LoRA (issue 48, H4): each prompt row's logits take its own request's adapter,
scored one request at a time, with vLLM's ops and with marlaas's."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.lora.ops import torch_ops as vllm_ops
from vllm.lora.punica_wrapper import punica_cpu

from marlaas.vllm_plugin import lora_ops, prompt_logprobs
from marlaas.vllm_plugin.prompt_logprobs import add_lora_logits, logits_row_slots, prompt_rows, scoring_prompt_at

SLOTS, RANK, HIDDEN, VOCAB = 4, 8, 32, 40
SEQ_LENS, SEQ_SLOTS = (5, 3, 6), (0, -1, 2)  # a step's three requests: prompt tokens and adapter slots
STARTS = (0, 5, 8)  # each request's first row in the batch (vLLM's query_start_loc)


def step_wrapper() -> SimpleNamespace:
    """What ``add_lora_logits`` reads of vLLM's punica wrapper in this step: one sampled row per
    request, and every scheduled token's slot."""
    return SimpleNamespace(sampler_indices=torch.tensor(SEQ_SLOTS),
                           token_lora_indices=torch.repeat_interleave(torch.tensor(SEQ_SLOTS), torch.tensor(SEQ_LENS)))


def lm_head_lora() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(SLOTS, 1, RANK, HIDDEN), torch.randn(SLOTS, 1, VOCAB, RANK)  # vLLM's stacked layout


def expected(y: torch.Tensor, x: torch.Tensor, slot: int, a, b, scale: float) -> torch.Tensor:
    return y + scale * x @ a[slot, 0].T @ b[slot, 0].T  # Python indexing, as vLLM's CPU ops (-1: the last slot)


@pytest.fixture(params=["vllm", "marlaas"])
def kernels(request, monkeypatch):
    ops = vllm_ops if request.param == "vllm" else lora_ops
    monkeypatch.setattr(punica_cpu, "bgmv_shrink", ops.bgmv_shrink)
    monkeypatch.setattr(punica_cpu, "bgmv_expand", ops.bgmv_expand)
    return request.param


def test_sampled_rows_keep_vllms_mapping_and_prompt_rows_take_their_tokens():
    wrapper = step_wrapper()
    assert logits_row_slots(3, wrapper.sampler_indices, wrapper.token_lora_indices, None) is wrapper.sampler_indices
    assert logits_row_slots(6, wrapper.sampler_indices, wrapper.token_lora_indices, 8).tolist() == [2] * 6
    assert logits_row_slots(2, wrapper.sampler_indices, wrapper.token_lora_indices, 4).tolist() == [0, -1]
    with pytest.raises(ValueError, match="prompt logprobs of 7 rows from batch row 8, but the step has 14 tokens"):
        logits_row_slots(7, wrapper.sampler_indices, wrapper.token_lora_indices, 8)


@pytest.mark.parametrize("request_index", [0, 2])
def test_a_prompts_logits_take_its_own_adapter_beside_other_requests(kernels, request_index):
    """The crash of H4: five or six prompt rows beside three sampled ones (vLLM's einsum failed,
    marlaas's lora_matmul indexed past the rows or left rows unset)."""
    a, b = lm_head_lora()
    start, rows, slot = STARTS[request_index], SEQ_LENS[request_index] - 1, SEQ_SLOTS[request_index]
    x, y = torch.randn(rows, HIDDEN), torch.randn(rows, VOCAB)
    out = y.clone()
    with scoring_prompt_at(start):
        add_lora_logits(step_wrapper(), out, x, a, b, 0.5)
    torch.testing.assert_close(out, expected(y, x, slot, a, b, 0.5), rtol=1e-5, atol=1e-4)
    assert prompt_rows.at is None


def test_sampled_logits_keep_one_adapter_per_request(kernels):
    a, b = lm_head_lora()
    x, y = torch.randn(len(SEQ_SLOTS), HIDDEN), torch.randn(len(SEQ_SLOTS), VOCAB)
    out = y.clone()
    add_lora_logits(step_wrapper(), out, x, a, b, 1.0)
    for row, slot in enumerate(SEQ_SLOTS):
        torch.testing.assert_close(out[row], expected(y[row], x[row], slot, a, b, 1.0), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [2, 5])
def test_lora_inputs_that_the_mapping_does_not_cover_fail_by_name(rows):
    """Fewer rows than mapped tokens indexed past them (IndexError); more were left as torch.empty's garbage."""
    with pytest.raises(ValueError, match=f"LoRA inputs of {rows} rows with a mapping of 3 tokens"):
        lora_ops.bgmv_shrink(torch.randn(rows, HIDDEN), torch.randn(SLOTS, RANK, HIDDEN), torch.zeros(rows, RANK),
                             torch.tensor([0, 1, 2]), 1.0)


class FakeRunner:
    """vLLM's ``_get_prompt_logprobs_dict`` as it treats ``num_prompt_logprobs``: scores the requests
    in it, returns those whose prompt is complete, and deletes them from it."""

    lora_config = True

    def __init__(self, complete: set[str]) -> None:
        self.num_prompt_logprobs = {"r0": 1, "r1": 0, "r2": 5}
        self.input_batch = SimpleNamespace(req_id_to_index={"r0": 0, "r2": 2})  # r1 is not in this step
        self.query_start_loc = SimpleNamespace(np=np.array([*STARTS, 14]))
        self.complete, self.calls = complete, []

    def _get_prompt_logprobs_dict(self, hidden_states, num_scheduled_tokens):
        asked = self.num_prompt_logprobs
        self.calls.append((dict(asked), prompt_rows.at))
        done = {req_id: f"scores of {req_id}" for req_id in asked if req_id in self.complete}
        for req_id in done:
            del asked[req_id]
        return done


def test_prompt_logprobs_are_scored_one_request_at_a_time_from_its_first_row(monkeypatch):
    monkeypatch.setattr(FakeRunner, "_get_prompt_logprobs_dict",
                        prompt_logprobs.score_prompts_per_request(FakeRunner._get_prompt_logprobs_dict))
    runner = FakeRunner(complete={"r0", "r1"})
    everyone = runner.num_prompt_logprobs
    assert runner._get_prompt_logprobs_dict(None, {}) == {"r0": "scores of r0", "r1": "scores of r1"}
    assert runner.calls == [({"r0": 1}, 0), ({"r1": 0}, None), ({"r2": 5}, 8)]
    assert runner.num_prompt_logprobs is everyone and everyone == {"r2": 5}  # the completed ones are gone
    assert prompt_rows.at is None

    without_lora = FakeRunner(complete={"r2"})
    without_lora.lora_config = None
    assert without_lora._get_prompt_logprobs_dict(None, {}) == {"r2": "scores of r2"}
    assert without_lora.calls == [({"r0": 1, "r1": 0, "r2": 5}, None)]  # vLLM's own loop, as it was


def test_register_installs_the_fix_whichever_kernels_are_configured(monkeypatch):
    """On "vllm" kernels too: vLLM's own ops fail on a prompt's rows the same way. (vLLM's runner module
    is stood in for: importing it runs a subprocess, which tests/unit refuses.)"""
    from marlaas import vllm_plugin

    class CPUModelRunner(FakeRunner):
        pass

    monkeypatch.setitem(sys.modules, "vllm.v1.worker.cpu_model_runner", SimpleNamespace(CPUModelRunner=CPUModelRunner))
    monkeypatch.setattr(punica_cpu.PunicaWrapperCPU, "add_lora_logits", punica_cpu.PunicaWrapperCPU.add_lora_logits)
    for name in (*vllm_plugin.OPS, "add_lora_linear"):  # "fused" swaps these: vLLM's again after the test
        owner = punica_cpu.PunicaWrapperCPU if name == "add_lora_linear" else punica_cpu
        monkeypatch.setattr(owner, name, getattr(owner, name))
    for kernels in ("vllm", "fused"):
        monkeypatch.setenv(vllm_plugin.KERNELS_ENV, kernels)
        vllm_plugin.register()
        vllm_plugin.register()  # twice: still one layer of wrapping
        assert punica_cpu.PunicaWrapperCPU.add_lora_logits is add_lora_logits
        scored = CPUModelRunner._get_prompt_logprobs_dict
        assert scored.marlaas_per_request and scored.__wrapped__ is FakeRunner._get_prompt_logprobs_dict
