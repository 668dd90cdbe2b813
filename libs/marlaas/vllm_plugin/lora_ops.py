"""vLLM's CPU LoRA ops (``vllm.lora.ops.torch_ops``), computed one adapter at a time.

vLLM's own versions gather a copy of the adapter matrix for every token
(``weights[indices]``: tokens x out x rank) and multiply with a batched einsum, which on
CPU costs more than the base model's own matmuls for a small model
(``benchmarks/engine_lora.py --kernels vllm,grouped``). Here the tokens of each adapter
in the batch are multiplied with that adapter's matrix in one matmul; a batch of one
adapter (one job decoding) is one matmul with no gather at all. Which tokens belong to
which adapter is worked out once per step, not once per op (:class:`GroupingCache`).

Same signatures and the same results as vLLM's ops (up to float summation order;
``tests/unit/test_vllm_plugin.py`` compares them): an index selects ``weights[index]``
exactly as Python indexing does, so the -1 vLLM gives tokens without an adapter picks the
same slot it would there.

Shapes: ``x_B_I`` inputs (tokens x in), ``weights_L_O_I`` one matrix per adapter slot
(optionally ``L x 1 x O x I``), ``indices_B`` the slot of each token.
"""

from __future__ import annotations

import torch

Groups = list[tuple[int, "torch.Tensor | None"]]  # (adapter slot, its token rows; None = every token)


class GroupingCache:
    """The last grouping of tokens by adapter (here :data:`Groups`, in fused_linear a ``StepPlan``),
    reused while its index tensors are unchanged.

    Every LoRA op of a forward pass (a few per layer) gets the same index tensors, so the
    grouping is computed once per step. The key is each tensor's address, shape and version
    counter (bumped by every in-place write, which is how vLLM refills its index buffers); the
    tensors are kept referenced, so their memory cannot be reused by another tensor meanwhile.
    """

    def __init__(self) -> None:
        self._key: tuple = ()
        self._kept: tuple[torch.Tensor, ...] = ()
        self._groups = []

    def get(self, tensors: tuple[torch.Tensor, ...], build):
        key = tuple((t.data_ptr(), t._version, tuple(t.shape)) for t in tensors)
        if key != self._key:
            self._groups, self._key, self._kept = build(), key, tensors
        return self._groups


_token_groups = GroupingCache()
_sequence_groups = GroupingCache()


def group_tokens(indices_B: torch.Tensor) -> Groups:
    """Each adapter slot in use with the rows of its tokens (None: one slot for every token)."""
    slots = torch.unique(indices_B)
    if slots.numel() == 1:
        return [(int(slots[0]), None)]
    return [(slot, (indices_B == slot).nonzero().squeeze(1)) for slot in slots.tolist()]


def group_sequences(lora_indices_S: torch.Tensor, seq_lens_S: torch.Tensor) -> Groups:
    """:func:`group_tokens` for prefill, where each sequence's tokens share its adapter."""
    slots = torch.unique(lora_indices_S)
    if slots.numel() == 1:
        return [(int(slots[0]), None)]
    return group_tokens(torch.repeat_interleave(lora_indices_S, seq_lens_S))


def lora_matmul(x_B_I: torch.Tensor, weights_L_O_I: torch.Tensor, groups: Groups,
                dtype: torch.dtype) -> torch.Tensor:
    """``out[b] = weights[slot of b] @ x[b]`` for every token b, one matmul per adapter in use."""
    if weights_L_O_I.dim() == 4:
        weights_L_O_I = weights_L_O_I.squeeze(1)
    x_B_I = x_B_I.to(dtype)
    if len(groups) == 1 and groups[0][1] is None:
        return x_B_I @ weights_L_O_I[groups[0][0]].to(dtype).T
    tokens = sum(rows.numel() for _, rows in groups)
    if x_B_I.shape[0] == 1 and tokens > 1:  # one input row for many tokens: einsum's broadcast
        x_B_I = x_B_I.expand(tokens, -1)
    if x_B_I.shape[0] != tokens:  # vLLM's einsum fails here too; rows left out would be garbage
        raise ValueError(f"LoRA inputs of {x_B_I.shape[0]} rows with a mapping of {tokens} tokens")
    out_B_O = torch.empty(x_B_I.shape[0], weights_L_O_I.shape[1], dtype=dtype, device=x_B_I.device)
    for slot, rows in groups:
        out_B_O[rows] = x_B_I[rows] @ weights_L_O_I[slot].to(dtype).T
    return out_B_O


def _bgmv_groups(indices_B: torch.Tensor) -> Groups:
    return _token_groups.get((indices_B,), lambda: group_tokens(indices_B))


def _sgmv_groups(lora_indices_S: torch.Tensor, seq_lens_S: torch.Tensor) -> Groups:
    return _sequence_groups.get((lora_indices_S, seq_lens_S), lambda: group_sequences(lora_indices_S, seq_lens_S))


def bgmv_shrink(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor | None, scaling: float = 1.0, groups: Groups | None = None) -> None:
    """Decode: ``output[:, :rank] = scaling * (A x)`` per token (the adapter's down-projection)."""
    outputs = lora_matmul(inputs, lora_b_weights, _bgmv_groups(lora_indices_tensor) if groups is None else groups,
                          output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor | None, add_inputs: bool = True,
                groups: Groups | None = None) -> None:
    """Decode: ``output (+)= B x`` per token (the up-projection), cut to the narrower of the two widths."""
    outputs = lora_matmul(inputs, lora_b_weights, _bgmv_groups(lora_indices_tensor) if groups is None else groups,
                          output_tensor.dtype)
    limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    common = min(outputs.shape[1], output_tensor.shape[1])  # adapter and model may pad differently
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                      lora_indices_tensor: torch.Tensor | None, slice_offset: int, slice_size: int,
                      add_inputs: bool = True, groups: Groups | None = None) -> None:
    """Decode: :func:`bgmv_expand` into ``output[:, slice_offset:slice_offset + slice_size]``."""
    outputs = lora_matmul(inputs, lora_b_weights, _bgmv_groups(lora_indices_tensor) if groups is None else groups,
                          output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset: slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset: slice_offset + slice_size] = outputs


def sgmv_shrink(inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches, max_seq_length, token_nums, scaling) -> None:
    """Prefill: :func:`bgmv_shrink` where each sequence's tokens share its adapter."""
    bgmv_shrink(inputs, lora_a_weights, output_tensor, None, scaling,
                groups=_sgmv_groups(lora_indices_tensor, seq_len_tensor))


def sgmv_expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches, max_seq_length, token_nums, add_inputs=False) -> None:
    """Prefill: :func:`bgmv_expand` where each sequence's tokens share its adapter."""
    bgmv_expand(inputs, lora_b_weights, output_tensor, None, add_inputs,
                groups=_sgmv_groups(lora_indices_tensor, seq_len_tensor))


def sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                      batches, max_seq_length, token_nums, slice_offset, slice_size, add_inputs=False) -> None:
    """Prefill: :func:`bgmv_expand_slice` where each sequence's tokens share its adapter."""
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor, None, slice_offset, slice_size, add_inputs,
                      groups=_sgmv_groups(lora_indices_tensor, seq_len_tensor))
