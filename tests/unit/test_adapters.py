"""The LoRA config the trainer builds from a stored adapter_config.json (issue 48): its shape only,
whatever else a tenant's uploaded file says (peft's config objects only: no model is built)."""

from __future__ import annotations

import json

from marlaas.platform.adapters import lora_config, lora_of, trained_lora_config
from marlaas.platform.events import LoraSettings

HOSTILE = {  # what an uploaded config could say, were the upload's checks ever bypassed
    "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 32, "target_modules": ["v_proj", "q_proj"],
    "base_model_name_or_path": "Qwen/Qwen3-0.6B",
    "init_lora_weights": "pissa_niter_1000000000",  # rewrites the shared base weights, after 1e9 SVD iterations
    "lora_dropout": 0.5, "layers_to_transform": [0], "exclude_modules": ".*", "fan_in_fan_out": True,
    "use_dora": True, "use_rslora": True, "rank_pattern": {"q_proj": 64}, "alpha_pattern": {"q_proj": 1e308},
    "modules_to_save": ["lm_head"], "bias": "all", "loftq_config": {"loftq_bits": 4},
    "corda_config": {"cache_file": "/etc/passwd"}, "megatron_config": {"tensor_model_parallel_size": 2},
    "megatron_core": "os", "auto_mapping": {"base_model_class": "X", "parent_library": "os"},
}


def test_the_lora_shape_is_read_from_the_adapter_config():
    config = json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["v_proj", "q_proj"]}).encode()
    shape = lora_of(config)
    assert (shape.rank, shape.alpha, shape.target_modules, shape.dropout) == (4, 8, ("q_proj", "v_proj"), 0.0)
    assert lora_of(json.dumps({"r": 4, "target_modules": ["q_proj"]}).encode()).alpha == 8  # peft's default


def test_the_trainer_s_config_is_the_shape_alone_never_a_custom_init_or_dropout():
    for init in ("pissa", "olora", "pissa_niter_1000000000", False):
        pissa = {"r": 4, "target_modules": ["q_proj"], "init_lora_weights": init, "lora_dropout": 0.5}
        config = trained_lora_config(json.dumps(pissa).encode())
        assert (config.init_lora_weights, config.lora_dropout) == (True, 0.0)
    config = trained_lora_config(json.dumps(HOSTILE).encode())
    assert config.init_lora_weights is True and config.lora_dropout == 0.0
    assert (config.r, config.lora_alpha, config.target_modules) == (4, 32, {"q_proj", "v_proj"})
    assert config.base_model_name_or_path == "Qwen/Qwen3-0.6B"  # a note: read by nothing
    plain = lora_config(LoraSettings(rank=4, alpha=32, target_modules=("q_proj", "v_proj")))
    plain.base_model_name_or_path = "Qwen/Qwen3-0.6B"
    assert config.to_dict() == plain.to_dict()  # every other field at peft's default, whatever the file said
