"""marlaas's vLLM plugin: grouped LoRA kernels for the CPU engine.

vLLM loads general plugins (entry point group ``vllm.general_plugins``, declared in
pyproject.toml) in every process that runs its model, the engine core included, so this is
the one place where the engine's code can be changed. :func:`register` does nothing unless
the platform is CPU and ``MARLAAS_CPU_LORA_KERNELS`` is ``grouped`` (what rollout sets for
``rollout.cpu_lora_kernels = "grouped"``, the default); it then swaps the six LoRA ops of
vLLM's CPU punica wrapper for those of :mod:`marlaas.vllm_plugin.lora_ops`.
"""

from __future__ import annotations

import os

KERNELS_ENV = "MARLAAS_CPU_LORA_KERNELS"
OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")


def register() -> None:
    """Install the grouped CPU LoRA ops when asked to (idempotent: vLLM may call it repeatedly)."""
    if os.environ.get(KERNELS_ENV, "vllm") != "grouped":
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.lora.punica_wrapper import punica_cpu

    from marlaas.vllm_plugin import lora_ops

    for name in OPS:
        setattr(punica_cpu, name, getattr(lora_ops, name))
