"""LoRA adapters in the object store: keys, the seeded version-0 init, and materializing for vLLM.

An adapter version lives under an attempt-unique prefix
``adapters/<job>/v<version>/<attempt>/`` holding PEFT's two files
(``adapter_config.json``, ``adapter_model.safetensors``). Keys are never reused;
which attempt *is* version v is decided by the compare-and-set on the
``versions`` KV entry, so a crashed attempt leaves only an unreferenced orphan.
"""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path

from marlaas.platform.events import Blob, LoraSettings
from marlaas.platform.store import ObjectStore

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def attempt_prefix(kind: str, job: str, version: int) -> str:
    """A fresh, never-reused key prefix for one attempt at writing ``version``."""
    return f"{kind}/{job}/v{version:06d}/{uuid.uuid4().hex[:12]}"


def write_adapter(store: ObjectStore, job: str, version: int, config_json: bytes, weights: bytes) -> Blob:
    """Write config then weights; the returned Blob (of the weights) is what gets announced."""
    prefix = attempt_prefix("adapters", job, version)
    store.put_bytes(f"{prefix}/{CONFIG_FILE}", config_json)
    return store.put_bytes(f"{prefix}/{WEIGHTS_FILE}", weights)


def _config_key(store: ObjectStore, blob: Blob) -> str:
    """The adapter config sits next to the weights the Blob points at."""
    return store.key_of(blob.uri).rsplit("/", 1)[0] + "/" + CONFIG_FILE


def read_adapter(store: ObjectStore, blob: Blob) -> tuple[bytes, bytes]:
    """An adapter's (config JSON, verified safetensors weights)."""
    return store.get_bytes(_config_key(store, blob)), store.fetch(blob)


def materialize(store: ObjectStore, blob: Blob, dest: Path) -> Path:
    """Copy an adapter to a local directory (for vLLM / peft), verifying the weights' sha256.

    A working copy: each file appears whole (renamed into place) but is not fsynced, which
    took ~1 ms of every version's handoff to the engine; a process that dies leaves its copy
    behind unread (rollout's cache directory is its own, ``adapters-<pid>``).
    """
    dest.mkdir(parents=True, exist_ok=True)
    if not (dest / WEIGHTS_FILE).exists():
        store.get_file(_config_key(store, blob), dest / CONFIG_FILE, durable=False)
        store.get_file(store.key_of(blob.uri), dest / WEIGHTS_FILE, sha256=blob.sha256, durable=False)
    return dest


def lora_config(settings: LoraSettings):
    """The peft ``LoraConfig`` for a job's settings: plain LoRA, nothing else turned on."""
    from peft import LoraConfig

    return LoraConfig(
        r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules), bias="none", task_type="CAUSAL_LM",
        # peft's default, said out loud: any other (PiSSA, OLoRA, LoftQ, ...) rewrites the base weights
        # that every job on the trainer shares
        init_lora_weights=True,
    )


def lora_of(config_json: bytes) -> LoraSettings:
    """The LoRA shape a stored PEFT ``adapter_config.json`` describes: its rank, alpha and target
    modules, nothing else. Its dropout is not one of them: every job trains without (an RL job's
    dropout would train a policy other than the one that sampled; the manager refuses lora.dropout)."""
    config = json.loads(config_json)
    return LoraSettings(rank=int(config["r"]), alpha=int(config.get("lora_alpha", 8)),  # peft's default alpha
                        target_modules=tuple(sorted(config["target_modules"])))


def trained_lora_config(config_json: bytes):
    """The peft ``LoraConfig`` the trainer builds for a stored adapter: :func:`lora_config` of its
    shape (:func:`lora_of`) and its base model's name, whatever else the file says.

    A tenant's uploaded config is checked field by field at upload
    (:func:`marlaas.platform.adapter_uploads.lora_shape`), and here it is still never passed
    through to peft: ``init_lora_weights = "pissa"`` would make peft rewrite the base weights
    that every job shares (and ``"pissa_niter_<N>"`` run N iterations of SVD first), a
    ``lora_dropout`` train an RL job off-policy, ``layers_to_transform`` or ``exclude_modules``
    train another adapter than the one the engine serves."""
    config = lora_config(lora_of(config_json))
    base = json.loads(config_json).get("base_model_name_or_path")
    config.base_model_name_or_path = base if isinstance(base, str) else None  # a note, read by nothing
    return config


def linear_module_names(model_dir) -> set[str]:
    """Names LoRA can target: the base model's linear layers (built on the meta device: no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name != "lm_head"}


def init_adapter(base_model_dir: Path, settings: LoraSettings, seed: int) -> tuple[bytes, bytes]:
    """Version 0 of a job: PEFT's default LoRA init (A ~ Kaiming-uniform, B = 0), seeded.

    The base model is built on the meta device, so no base weights are read: this
    costs the same for a 0.6B model as for the tiny one. Returns (config JSON, safetensors).
    """
    import tempfile

    import torch
    from peft import get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save
    from transformers import AutoConfig, AutoModelForCausalLM

    model_config = AutoConfig.from_pretrained(base_model_dir)
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(model_config)
    config = lora_config(settings)
    try:
        shapes = get_peft_model_state_dict(get_peft_model(base, config))
    except ValueError as exc:  # peft: "Target modules ... not found in the base model"
        raise ValueError(f"lora.target_modules do not fit the base model: {exc}") from exc
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name in sorted(shapes):
        tensor = torch.zeros(shapes[name].shape, dtype=torch.float32)
        if "lora_A" in name:
            torch.nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)
        weights[name] = tensor
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        config_json = json.loads((Path(tmp) / CONFIG_FILE).read_text())
    config_json["base_model_name_or_path"] = str(base_model_dir)
    return json.dumps(config_json, indent=1).encode(), save(weights)
