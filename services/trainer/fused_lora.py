"""A LoRA linear layer whose adapter term is one fused GEMM, for the trainer's forward/backward.

peft's ``lora.Linear`` computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling``: on top of
the three matmuls, a multiply and an add over the whole ``tokens x out_features`` output, and
their two passes again in backward. On a CPU those element-wise passes are memory-bound and
cost about as much as the small LoRA matmuls themselves. Here the adapter term is added by
``torch.addmm(base(x), dropout(x) @ A^T, B^T, alpha=scaling)``: the scale and the sum happen
inside the second GEMM, and autograd's ``addmm`` backward gives the same gradients
(``test_the_fused_lora_layers_match_peft``). One ``multiply`` GRPO step on one core: ~10 % less time.

Only the plain case is fused (one active adapter, not merged, not disabled, no per-row adapter
names, no DoRA or other variant); every other case is peft's own forward. The parameters, their
names and what peft saves are untouched: only the layer's class changes (``fuse_lora_layers``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from peft.tuners.lora.layer import Linear as LoraLinear


class FusedLoraLinear(LoraLinear):
    """peft's LoRA ``Linear`` with the adapter's scale-and-add folded into one ``addmm``."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        active = self.active_adapters
        if (args or kwargs or self.disable_adapters or self.merged or len(active) != 1
                or active[0] not in self.lora_A or active[0] in self.lora_variant):
            return super().forward(x, *args, **kwargs)
        name = active[0]
        lora_A, lora_B = self.lora_A[name].weight, self.lora_B[name].weight
        x_N_I = x.reshape(-1, x.shape[-1])
        base_N_O = self.base_layer(x_N_I)
        xa_N_R = self.lora_dropout[name](x_N_I).to(lora_A.dtype) @ lora_A.t()
        out_N_O = torch.addmm(base_N_O, xa_N_R.to(base_N_O.dtype), lora_B.t().to(base_N_O.dtype),
                              alpha=self.scaling[name])
        return out_N_O.view(*x.shape[:-1], out_N_O.shape[-1])


def fuse_lora_layers(layers: Iterable[torch.nn.Module]) -> None:
    """Give every plain peft LoRA ``Linear`` among ``layers`` the fused forward.

    Subclasses of peft's layer (quantized bases and the like) keep their own forward."""
    for layer in layers:
        if type(layer) is LoraLinear:
            layer.__class__ = FusedLoraLinear
