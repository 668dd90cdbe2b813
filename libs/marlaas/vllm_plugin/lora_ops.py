"""vLLM's CPU LoRA ops (``vllm.lora.ops.torch_ops``), computed one adapter at a time.

vLLM's own versions gather a copy of the adapter matrix for every token
(``weights[indices]``: tokens x out x rank) and multiply with a batched einsum, which on
CPU costs more than the base model's own matmuls for a small model
(``benchmarks/engine_lora.py --kernels vllm,grouped``). Here the tokens of each adapter
in the batch are multiplied with that adapter's matrix in one matmul; a batch of one
adapter (one job decoding) is one matmul with no gather at all.

Same signatures and the same results as vLLM's ops (up to float summation order;
``tests/unit/test_vllm_plugin.py`` compares them): an index selects ``weights[index]``
exactly as Python indexing does, so the -1 vLLM gives tokens without an adapter picks the
same slot it would there.

Shapes: ``x_B_I`` inputs (tokens x in), ``weights_L_O_I`` one matrix per adapter slot
(optionally ``L x 1 x O x I``), ``indices_B`` the slot of each token.
"""

from __future__ import annotations

import torch


def lora_matmul(x_B_I: torch.Tensor, weights_L_O_I: torch.Tensor, indices_B: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """``out[b] = weights[indices[b]] @ x[b]`` for every token b, one matmul per adapter in use."""
    if weights_L_O_I.dim() == 4:
        weights_L_O_I = weights_L_O_I.squeeze(1)
    x_B_I = x_B_I.to(dtype)
    slots = torch.unique(indices_B)
    if slots.numel() > 1 and x_B_I.shape[0] == 1:  # one input row for many tokens: einsum's broadcast
        x_B_I = x_B_I.expand(indices_B.shape[0], -1)
    if slots.numel() == 1:
        return x_B_I @ weights_L_O_I[slots[0]].to(dtype).T
    out_B_O = torch.empty(x_B_I.shape[0], weights_L_O_I.shape[1], dtype=dtype, device=x_B_I.device)
    for slot in slots.tolist():
        rows = (indices_B == slot).nonzero().squeeze(1)
        out_B_O[rows] = x_B_I[rows] @ weights_L_O_I[slot].to(dtype).T
    return out_B_O


def bgmv_shrink(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, scaling: float = 1.0) -> None:
    outputs = lora_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, add_inputs: bool = True) -> None:
    outputs = lora_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    common = min(outputs.shape[1], output_tensor.shape[1])  # adapter and model may pad differently
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                      lora_indices_tensor: torch.Tensor, slice_offset: int, slice_size: int,
                      add_inputs: bool = True) -> None:
    outputs = lora_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset: slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset: slice_offset + slice_size] = outputs


def _per_token(lora_indices_tensor: torch.Tensor, seq_len_tensor: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)


def sgmv_shrink(inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches, max_seq_length, token_nums, scaling) -> None:
    bgmv_shrink(inputs, lora_a_weights, output_tensor, _per_token(lora_indices_tensor, seq_len_tensor), scaling)


def sgmv_expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches, max_seq_length, token_nums, add_inputs=False) -> None:
    bgmv_expand(inputs, lora_b_weights, output_tensor, _per_token(lora_indices_tensor, seq_len_tensor), add_inputs)


def sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                      batches, max_seq_length, token_nums, slice_offset, slice_size, add_inputs=False) -> None:
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor, _per_token(lora_indices_tensor, seq_len_tensor),
                      slice_offset, slice_size, add_inputs)
