"""The shared base model's weights, fingerprinted: the trainer checks that no job changed them.

Every job trains a LoRA over one base held in the trainer's memory, and every tenant's on-policy
check (the engine scores with the base as vLLM loaded it from disk) depends on that base staying
exactly as loaded. peft can rewrite a base in place (an adapter config asking for PiSSA or OLoRA
init did, issue 48 H2: every tenant then trained off-policy, silently). Configs are reduced to
their shape now (``marlaas.platform.adapters.trained_lora_config``); this is the check that would
see any other way in: a digest of every base tensor, taken at load and compared after each job's
first step and on a schedule (services/trainer/service.py), the trainer reloading the base when
it differs.

The digest covers the base's own tensors only: LoRA's (``lora_*``) are left out and peft's
wrapping (``.base_layer``) is undone in the names, so the digest of a base with adapters attached
equals the digest of the base as loaded. BLAKE2b over the bytes: ~1 GB/s, a few seconds for a
0.6B fp32 base, milliseconds for the built-in one.
"""

from __future__ import annotations

import hashlib

import torch

LORA_PARTS = (".lora_", "lora_magnitude_vector")  # peft's names for an adapter's own tensors


def base_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base's tensors of a (possibly peft-wrapped) model's state dict, by their base names."""
    return {name.replace(".base_layer.", "."): tensor for name, tensor in state.items()
            if not any(part in name for part in LORA_PARTS)}


def base_digest(model: torch.nn.Module) -> str:
    """A digest of ``model``'s base weights (and buffers) as they are now: names, dtypes, shapes, bytes."""
    digest = hashlib.blake2b(digest_size=16)
    with torch.no_grad():
        for name, tensor in sorted(base_names(model.state_dict()).items()):
            data = tensor.detach().to("cpu").contiguous()
            digest.update(f"{name}|{data.dtype}|{tuple(data.shape)}\n".encode())
            if data.numel():
                digest.update(data.reshape(-1).view(torch.uint8).numpy())  # the bytes, not copied again
    return digest.hexdigest()
