"""What the engine core really runs, asked from outside: a vLLM worker extension.

Rollout starts its engine with ``worker_extension_cls`` set to :class:`EngineProbe`, whose
methods vLLM adds to the worker in the engine core; ``AsyncLLM.collective_rpc`` calls them
by name. Rollout checks at start that the LoRA kernels configured are the ones installed
there, since a plugin that vLLM did not load (an install without the project's entry
points) would otherwise only show as a slower engine.
"""

from __future__ import annotations


def installed_kernels() -> str:
    """"fused", "grouped" or "vllm": the CPU LoRA kernels installed in this process."""
    from vllm.lora.punica_wrapper import punica_cpu

    from marlaas.vllm_plugin import fused_linear, lora_ops

    if punica_cpu.PunicaWrapperCPU.add_lora_linear is fused_linear.add_lora_linear:
        return "fused"
    if punica_cpu.bgmv_shrink is lora_ops.bgmv_shrink:
        return "grouped"
    return "vllm"


class EngineProbe:
    """Mixed into vLLM's worker class (``worker_extension_cls``)."""

    def marlaas_lora_kernels(self) -> str:
        return installed_kernels()
