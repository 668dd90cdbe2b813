"""marlaas's vLLM plugin: faster LoRA for the CPU engine.

vLLM loads general plugins (entry point group ``vllm.general_plugins``, declared in
pyproject.toml) in every process that runs its model, the engine core included, so this is
the one place where the engine's code can be changed. :func:`register` does nothing unless
the platform is CPU. There it makes prompt logprobs under LoRA take each request's own adapter
(:mod:`marlaas.vllm_plugin.prompt_logprobs`: vLLM 0.32 maps a prompt's logits rows with the
sampled rows' mapping and its engine core dies when a batch mixes prompt logprobs with other
requests), and installs the kernels ``MARLAAS_CPU_LORA_KERNELS`` (what rollout sets from
``rollout.cpu_lora_kernels``) asks for:

- ``grouped``: the six LoRA ops of vLLM's CPU punica wrapper become those of
  :mod:`marlaas.vllm_plugin.lora_ops` (one matmul per adapter in the batch);
- ``fused`` (the default): ``grouped``, and the wrapper's ``add_lora_linear`` (every LoRA
  linear layer of the model) becomes :func:`marlaas.vllm_plugin.fused_linear.add_lora_linear`
  (all slices and all adapters of a step in two matmuls);
- ``vllm``: vLLM's own kernels.
"""

from __future__ import annotations

import os

KERNELS_ENV = "MARLAAS_CPU_LORA_KERNELS"
OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")


def register() -> None:
    """On CPU: the prompt logprobs fix and the LoRA kernels asked for (idempotent: vLLM may call it repeatedly)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.lora.punica_wrapper import punica_cpu
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from marlaas.vllm_plugin import fused_linear, lora_ops, prompt_logprobs

    prompt_logprobs.install(CPUModelRunner, punica_cpu.PunicaWrapperCPU)
    kernels = os.environ.get(KERNELS_ENV, "vllm")
    if kernels not in ("fused", "grouped"):
        return
    for name in OPS:
        setattr(punica_cpu, name, getattr(lora_ops, name))
    if kernels == "fused":
        fused_linear.install(punica_cpu.PunicaWrapperCPU)
