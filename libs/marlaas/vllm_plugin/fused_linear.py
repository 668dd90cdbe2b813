"""A LoRA linear layer's whole adapter path in two matmuls: every slice, every adapter of the step.

vLLM's CPU punica wrapper applies a layer's LoRA one slice at a time (q, k and v of a
fused qkv projection are three slices), a shrink then an expand per slice, and each op
handles the adapters of the batch one by one. With ten jobs in a batch that is a few
hundred small torch calls per layer, and the Python around them cost more than the base
model's own matmuls (a py-spy profile of the engine core under ``agentic-10``).
:func:`add_lora_linear` replaces the wrapper's method of that name:

    h_B_R = scale * x_B_I @ A[slot(b)]        # R = slices x rank: the slices' A stacked
    y_B_O += h_B_R @ Bd[slot(b)]              # Bd: the slices' B on a block diagonal

The tokens of the step are laid out by adapter in a padded ``adapters x M`` block
(M = the most tokens of any adapter), so both products are one ``bmm``; when padding would
more than double the rows (one long prefill among short decodes) each adapter's rows are
multiplied on their own instead. A batch of one adapter is two plain matmuls. Both
layouts are worked out once per step (:class:`StepPlan`), and the stacked weights once
per adapter load (:class:`FusedWeights`, keyed on the weight tensors' version counters,
which every in-place write bumps: that is how vLLM loads and clears a slot).

A token whose index is -1 (a request without an adapter) gets no LoRA term, as vLLM's
GPU kernels do; vLLM's CPU ops index ``weights[-1]`` there, the last slot's adapter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from marlaas.vllm_plugin.lora_ops import GroupingCache

PAD_LIMIT = 2  # use the padded layout while it has at most this many rows per token (+ PAD_SLACK)
PAD_SLACK = 64


@dataclass(frozen=True)
class StepPlan:
    """How this step's tokens map onto the adapters in use.

    ``slots``: the slots in use, ascending, the no-adapter slot (the number of slots) last.
    ``gather_P`` / ``back_B``: the padded layout (P = adapters x ``rows``), the token of each
    padded row (padding repeats token 0) and the padded row of each token; None when each
    adapter's ``groups`` rows are multiplied on their own (or there is one adapter).
    """

    slots: tuple[int, ...]
    rows: int = 0
    gather_P: torch.Tensor | None = None
    back_B: torch.Tensor | None = None
    groups: tuple[torch.Tensor, ...] = ()


def plan_step(indices_B: torch.Tensor, num_slots: int) -> StepPlan:
    """Group the step's tokens by adapter (``indices_B``: each token's slot, -1 for none)."""
    slots_B = torch.where(indices_B < 0, num_slots, indices_B)
    slots, local_B, counts = torch.unique(slots_B, sorted=True, return_inverse=True, return_counts=True)
    used = tuple(slots.tolist())
    if len(used) == 1:
        return StepPlan(used)
    tokens, most = indices_B.shape[0], int(counts.max())
    if len(used) * most > PAD_LIMIT * tokens + PAD_SLACK:
        return StepPlan(used, groups=tuple((local_B == i).nonzero().squeeze(1) for i in range(len(used))))
    order_B = torch.argsort(local_B, stable=True)  # tokens grouped by adapter, in batch order within one
    starts = torch.cumsum(counts, 0) - counts
    place_B = local_B[order_B] * most + torch.arange(tokens) - torch.repeat_interleave(starts, counts)
    back_B = torch.empty_like(place_B)
    back_B[order_B] = place_B
    gather_P = torch.zeros(len(used) * most, dtype=torch.long)
    gather_P[place_B] = order_B
    return StepPlan(used, most, gather_P, back_B)


class FusedWeights:
    """One layer's LoRA weights stacked per slot: ``a_S_I_R`` (A^T, slices side by side) and
    ``b_S_R_O`` (each slice's B^T on the block diagonal), slot S = the number of slots all zeros.

    Rebuilt when any of the layer's weight tensors was written in place (its version counter
    moved); :meth:`pick` narrows them to a step's slots, kept until those change.
    """

    def __init__(self) -> None:
        self._key: tuple = ()
        self._kept: tuple[torch.Tensor, ...] = ()
        self.a_S_I_R = self.b_S_R_O = torch.empty(0)
        self._picked: tuple = ((), None, None)

    def update(self, lora_a: tuple[torch.Tensor, ...], lora_b: tuple[torch.Tensor, ...],
               output_slices: tuple[int, ...]) -> None:
        key = tuple((t.data_ptr(), t._version, tuple(t.shape)) for t in lora_a + lora_b) + (output_slices,)
        if key == self._key:
            return
        slots, rank, hidden = lora_a[0].shape[0], lora_a[0].shape[-2], lora_a[0].shape[-1]
        a_S_I_R = torch.zeros(slots + 1, hidden, rank * len(lora_a), dtype=torch.float32)
        b_S_R_O = torch.zeros(slots + 1, rank * len(lora_b), sum(output_slices), dtype=torch.float32)
        offset = 0
        for i, (a, b, width) in enumerate(zip(lora_a, lora_b, output_slices)):
            a_L_R_I = a.reshape(slots, rank, hidden)
            b_L_O_R = b.reshape(slots, b.shape[-2], rank)[:, :width]
            a_S_I_R[:slots, :, i * rank:(i + 1) * rank] = a_L_R_I.transpose(1, 2)
            b_S_R_O[:slots, i * rank:(i + 1) * rank, offset:offset + width] = b_L_O_R.transpose(1, 2)
            offset += width
        self.a_S_I_R, self.b_S_R_O = a_S_I_R, b_S_R_O
        self._key, self._kept, self._picked = key, lora_a + lora_b, ((), None, None)

    def pick(self, slots: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The stacked weights of ``slots`` only (adapters x in x R, adapters x R x out)."""
        if self._picked[0] != slots:
            index = torch.tensor(slots)
            self._picked = (slots, self.a_S_I_R.index_select(0, index), self.b_S_R_O.index_select(0, index))
        return self._picked[1], self._picked[2]


_plans = GroupingCache()  # this step's StepPlan, kept while the token index tensor is unchanged


def lora_delta(x_B_I: torch.Tensor, a_N_I_R: torch.Tensor, b_N_R_O: torch.Tensor, plan: StepPlan,
               scale: float) -> torch.Tensor:
    """``scale * x[b] @ A[slot b] @ B[slot b]`` for every token b (fp32), with ``plan.slots`` = N."""
    x_B_I = x_B_I.float()
    if len(plan.slots) == 1:
        return (x_B_I @ a_N_I_R[0]).mul_(scale) @ b_N_R_O[0]
    if plan.gather_P is not None:
        x_N_M_I = x_B_I.index_select(0, plan.gather_P).view(len(plan.slots), plan.rows, -1)
        y_N_M_O = torch.bmm(torch.bmm(x_N_M_I, a_N_I_R).mul_(scale), b_N_R_O)
        return y_N_M_O.view(-1, y_N_M_O.shape[-1]).index_select(0, plan.back_B)
    y_B_O = x_B_I.new_zeros(x_B_I.shape[0], b_N_R_O.shape[-1])
    for n, rows in enumerate(plan.groups):
        y_B_O.index_copy_(0, rows, (x_B_I.index_select(0, rows) @ a_N_I_R[n]).mul_(scale) @ b_N_R_O[n])
    return y_B_O


def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: tuple[torch.Tensor, ...],
                    lora_b_stacked: tuple[torch.Tensor, ...], scale: float, output_slices: tuple[int, ...],
                    *, buffer=None, **kwargs) -> None:
    """``PunicaWrapperCPU.add_lora_linear``: ``y += scale * x @ A @ B`` per token, every slice at once."""
    x_B_I = x.view(-1, x.shape[-1])
    y_B_O = y.view(-1, y.shape[-1])
    indices_B = self.token_lora_indices
    if indices_B.shape[0] != x_B_I.shape[0] or y_B_O.shape[-1] != sum(output_slices):
        return (_vllm_add_lora_linear or type(self).add_lora_linear)(self, y, x, lora_a_stacked, lora_b_stacked, scale,
                                                                     output_slices, buffer=buffer, **kwargs)
    weights = _weights_of(lora_a_stacked[0])
    weights.update(tuple(lora_a_stacked), tuple(lora_b_stacked), tuple(output_slices))
    num_slots = lora_a_stacked[0].shape[0]  # the same for every layer of the engine
    plan = _plans.get((indices_B,), lambda: plan_step(indices_B, num_slots))
    if plan.slots == (num_slots,):  # no token has an adapter
        return None
    a_N_I_R, b_N_R_O = weights.pick(plan.slots)
    if len(plan.slots) == 1 and y_B_O.dtype == torch.float32:  # one adapter: add in place
        y_B_O.addmm_((x_B_I.float() @ a_N_I_R[0]).mul_(scale), b_N_R_O[0])
    else:
        y_B_O += lora_delta(x_B_I, a_N_I_R, b_N_R_O, plan, scale).to(y_B_O.dtype)
    return None


_weights: dict[int, FusedWeights] = {}
_vllm_add_lora_linear = None  # set by install()


def _weights_of(anchor: torch.Tensor) -> FusedWeights:
    """The layer's :class:`FusedWeights`, found by its first A tensor (kept alive by the layer)."""
    found = _weights.get(id(anchor))
    if found is None or (found._kept and found._kept[0] is not anchor):
        found = _weights[id(anchor)] = FusedWeights()
    return found


def install(wrapper_class) -> None:
    """Make ``wrapper_class.add_lora_linear`` this module's (idempotent)."""
    global _vllm_add_lora_linear
    if wrapper_class.add_lora_linear is add_lora_linear:
        return
    _vllm_add_lora_linear = wrapper_class.add_lora_linear
    wrapper_class.add_lora_linear = add_lora_linear
