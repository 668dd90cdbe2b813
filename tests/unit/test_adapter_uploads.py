"""Uploaded LoRA adapters (issue 38): the checks that an untrusted PEFT directory is one a job can
start from (its config field by field, issue 48), and its round trip through a tenant's part of
the store. Reading its .tar.gz: test_adapter_archives.py."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from safetensors.torch import load, save

from marlaas.basemodel import builtin_model_dir
from marlaas.platform import adapter_uploads
from marlaas.platform.adapter_uploads import (
    NOTES,
    SHAPE_FIELDS,
    UNSUPPORTED,
    AdapterRefused,
    adapter_id_of,
    adapter_problem,
    adapter_problem_on_base,
    base_lora_targets,
    delete_adapter,
    fresh_adapter_shapes,
    is_adapter_id,
    list_adapters,
    put_adapter,
    read_uploaded_adapter,
    tensor_shapes,
)
from marlaas.platform.adapters import init_adapter
from marlaas.platform.events import LoraSettings
from marlaas.platform.store import open_store

TARGETS = ("q_proj", "v_proj")
MAX_RANK = 32


@pytest.fixture(scope="module")
def good() -> tuple[bytes, bytes]:
    """A rank-4 adapter of q_proj and v_proj on the built-in base, as PEFT would save it."""
    return init_adapter(builtin_model_dir(), LoraSettings(rank=4, target_modules=TARGETS), seed=0)


@pytest.fixture(scope="module")
def facts() -> dict:
    """What adapter_problem is given: the engine's rank bound, the base's linear layers, a fresh adapter's shapes."""
    base = str(builtin_model_dir())
    return {"max_rank": MAX_RANK, "lora_targets": base_lora_targets(base),
            "expected_shapes": fresh_adapter_shapes(base, 4, TARGETS)}


def config_with(good_config: bytes, **changes) -> bytes:
    config = json.loads(good_config)
    config.update(changes)
    return json.dumps(config).encode()


def reweighed(weights: bytes, change) -> bytes:
    """``weights`` with their tensors passed through ``change`` (a dict of name -> tensor, edited in place)."""
    tensors = load(weights)
    change(tensors)
    return save(tensors)


def test_a_peft_adapter_of_the_base_model_passes_and_its_id_comes_from_both_files(good, facts):
    config, weights = good
    assert adapter_problem(config, weights, **facts) == ""
    assert adapter_problem_on_base(config, weights, base_model_dir=builtin_model_dir(), max_rank=MAX_RANK) == ""
    assert adapter_problem(config_with(config, lora_dropout=0.3), weights, **facts) == ""  # training-only
    adapter_id = adapter_id_of(config, weights)
    assert is_adapter_id(adapter_id) and len(adapter_id) == len("adapter-") + 32
    assert adapter_id_of(config_with(config, lora_alpha=32), weights) != adapter_id
    assert not is_adapter_id("adapter-../x") and not is_adapter_id("file-" + "0" * 32) and not is_adapter_id(None)


@pytest.mark.parametrize("changes, says", [
    ({"peft_type": "IA3"}, "not a LoRA config (its peft_type is 'IA3'"),
    ({"r": 0}, "r is 0, and this stack serves LoRA ranks 1..32"),
    ({"r": 64}, "r is 64, and this stack serves LoRA ranks 1..32 (rollout.max_lora_rank)"),
    ({"r": "4"}, "r is '4'"),
    ({"lora_alpha": 0.5}, "lora_alpha is 0.5: a job's LoRA alpha is a whole number from 1 to 4096"),
    ({"target_modules": ".*proj"}, "target_modules is the pattern '.*proj': list the modules instead"),
    ({"target_modules": []}, "target_modules must list the adapted modules"),
    ({"target_modules": ["q_proj", "c_attn"]}, "target_modules ['c_attn'] are not linear layers of this stack's"),
    ({"use_dora": True}, "use_dora is set (DoRA), and this stack serves plain LoRA only"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save is set"),
    ({"use_rslora": True}, "use_rslora is set"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern is set (per-module ranks)"),
    ({"bias": "lora_only"}, "bias is 'lora_only', and this stack serves plain LoRA only"),
])
def test_a_config_the_stack_cannot_train_or_serve_is_refused_saying_why(good, facts, changes, says):
    config, weights = good
    assert says in adapter_problem(config_with(config, **changes), weights, **facts)


@pytest.mark.parametrize("init", ["pissa", "olora", "pissa_niter_1000000000", "pissa_niter_4", "corda", "eva",
                                  "loftq", "gaussian", "orthogonal", False, 1, None])
def test_an_initialization_other_than_peft_s_default_is_refused_naming_the_field(good, facts, init):
    """A job never initializes an uploaded adapter: PiSSA and its kin would rewrite the shared base
    weights in the trainer (and pissa_niter_<N> run N SVD iterations first)."""
    config, weights = good
    problem = adapter_problem(config_with(config, init_lora_weights=init), weights, **facts)
    assert problem.startswith(f"adapter_config.json: init_lora_weights is {init!r}: an uploaded adapter brings its "
                              "weights")
    assert "save the adapter with init_lora_weights=True" in problem
    assert adapter_problem(config_with(config, init_lora_weights=True), weights, **facts) == ""


@pytest.mark.parametrize("alpha", [1e308, float("inf"), float("nan"), 4097, 10**30, 0, -16, True, "16"])
def test_an_alpha_out_of_range_is_refused(good, facts, alpha):
    config, weights = good
    assert "lora_alpha is" in (problem := adapter_problem(config_with(config, lora_alpha=alpha), weights, **facts))
    assert "a whole number from 1 to 4096" in problem
    for fine in (1, 4096, 32.0):
        assert adapter_problem(config_with(config, lora_alpha=fine), weights, **facts) == ""


@pytest.mark.parametrize("changes, says", [
    ({"exclude_modules": ".*"}, "exclude_modules is set (modules left out by pattern)"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out is set (weights stored transposed"),
    ({"layers_to_transform": [0]}, "layers_to_transform is set (LoRA on some layers only)"),
    ({"layers_pattern": "layers"}, "layers_pattern is set"),
    ({"loftq_config": {"loftq_bits": 4}}, "loftq_config is set (LoftQ initialization)"),
    ({"eva_config": {"rho": 2.0}}, "eva_config is set"),
    ({"corda_config": {"cache_file": "/etc/passwd"}}, "corda_config is set"),
    ({"use_qalora": True}, "use_qalora is set"),
    ({"use_dora": 1}, "use_dora is set (DoRA)"),  # JSON's 1 is not false
    ({"alora_invocation_tokens": [1, 2]}, "alora_invocation_tokens is set"),
    ({"megatron_config": {"tensor_model_parallel_size": 2}}, "megatron_config is set"),
    ({"megatron_core": "os"}, "megatron_core is 'os'; it must be 'megatron.core' or null"),
    ({"task_type": "SEQ_CLS"}, "task_type is 'SEQ_CLS'; it must be 'CAUSAL_LM' or null"),
    ({"inference_mode": "yes"}, "inference_mode is 'yes'; it must be true or false"),
    ({"auto_mapping": "transformers"}, "auto_mapping is 'transformers'; it must be an object or null"),
    ({"qalora_group_size": 1.5}, "qalora_group_size is 1.5; it must be a whole number or null"),
    ({"lora_dropout": 1.0}, "lora_dropout is 1.0: a dropout probability is a number from 0 up to (not including) 1"),
    ({"lora_dropout": -0.1}, "lora_dropout is -0.1"),
    ({"lora_dropout": "0.1"}, "lora_dropout is '0.1'"),
    ({"lora_dropout": float("nan")}, "lora_dropout is nan"),
    ({"custom_init": "pissa"}, "adapter_config.json has the field 'custom_init', which this stack does not accept"),
    ({"runtime_config": {}}, "has the field 'runtime_config', which this stack does not accept"),
])
def test_a_field_this_stack_does_not_accept_is_refused_by_name(good, facts, changes, says):
    config, weights = good
    assert says in adapter_problem(config_with(config, **changes), weights, **facts)


def test_peft_s_notes_and_off_settings_are_accepted_and_a_refusal_quotes_a_value_cut_short(good, facts):
    config, weights = good
    noted = config_with(config, task_type=None, inference_mode=True, revision="main", peft_version="0.13.2",
                        auto_mapping={"base_model_class": "Qwen3ForCausalLM", "parent_library": "transformers"},
                        lora_dropout=0.05, lora_alpha=16.0, modules_to_save=[], exclude_modules=None,
                        use_dora=False, megatron_core=None, qalora_group_size=None)
    assert adapter_problem(noted, weights, **facts) == ""
    bare = json.loads(config)
    for field in set(bare) - {"peft_type", "r", "target_modules"}:
        del bare[field]
    assert adapter_problem(json.dumps(bare).encode(), weights, **facts) == ""  # peft's defaults, all left out
    problem = adapter_problem(config_with(config, task_type="x" * 100_000, **{"y" * 100_000: 1}), weights, **facts)
    assert "task_type is 'xxx" in problem and len(problem) < 400


def test_every_field_the_installed_peft_writes_is_one_this_stack_decided_on():
    """A peft upgrade that adds a LoRA field fails here until the field is reviewed (and listed)."""
    from peft import LoraConfig

    decided = set(SHAPE_FIELDS) | set(UNSUPPORTED) | set(NOTES) | {"init_lora_weights", "bias"}
    assert set(LoraConfig(r=4, target_modules=["q_proj"]).to_dict()) - decided == set()


@pytest.mark.parametrize("config, says", [
    (b"{not json", "adapter_config.json is not JSON"),
    (b"[1, 2]", "not a LoRA config"),
    (b"[" * 100_000, "adapter_config.json is not JSON"),  # nesting deeper than the parser's recursion
    (b" " * (adapter_uploads.MAX_CONFIG_BYTES + 1), "adapter_config.json is larger than"),
])
def test_a_config_that_is_not_a_json_object_is_refused(good, facts, config, says):
    assert says in adapter_problem(config, good[1], **facts)


def test_weights_that_are_not_a_safetensors_file_are_refused_without_running_them(good, facts):
    config, weights = good
    pickled = pickle.dumps({"base_model.model.lora_A.weight": [0.0]})  # what torch.save writes: never loaded
    for data, says in [(pickled, "is not a safetensors file"), (b"", "only 0 bytes"),
                       (weights[:-4], "truncated?"), (b"\xff" * 8 + weights[8:], "its header would be"),
                       (len(b"[1]").to_bytes(8, "little") + b"[1]", "not a JSON object")]:
        assert says in adapter_problem(config, data, **facts), says


def test_weights_over_the_size_limit_are_refused_before_they_are_parsed(good, facts, monkeypatch):
    monkeypatch.setattr(adapter_uploads, "MAX_ADAPTER_BYTES", len(good[1]) - 1)
    assert "is larger than" in adapter_problem(good[0], good[1], **facts)


def test_a_header_that_lies_about_its_data_is_refused(good, facts):
    config, weights = good
    header_len = int.from_bytes(weights[:8], "little")
    header = json.loads(weights[8:8 + header_len])
    name = next(n for n in header if n != "__metadata__")
    header[name]["data_offsets"][1] += 4  # claims more bytes than its shape
    forged = json.dumps(header).encode()
    assert "is malformed" in adapter_problem(config, len(forged).to_bytes(8, "little") + forged
                                             + weights[8 + header_len:], **facts)


def test_tensors_that_are_not_the_lora_weights_of_the_config_are_refused(good, facts):
    config, weights = good
    a_name = sorted(tensor_shapes(weights))[0]
    cases = [
        (lambda t: t.update({"base_model.model.lm_head.weight": torch.zeros(2, 2)}),
         "'base_model.model.lm_head.weight' is not the lora_A or lora_B weight"),
        (lambda t: t.update({k: torch.zeros(8, v.shape[1]) for k, v in t.items() if "lora_A" in k}),
         "is shaped (8, 128), not (r, in_features) with r = 4"),
        (lambda t: t.pop(a_name.replace("lora_A", "lora_B")), "has a lora_A or a lora_B weight but not both"),
        (lambda t: t.update({a_name: t[a_name].to(torch.int32)}), "is I32, not one of"),
        (lambda t: t.clear(), "holds no tensor"),
    ]
    for change, says in cases:
        assert says in adapter_problem(config, reweighed(weights, change), **facts), says


def test_an_adapter_trained_on_another_base_model_is_refused(good, facts):
    config, weights = good
    wider = reweighed(weights, lambda t: t.update({k: torch.zeros(4, 256) for k in t if "lora_A" in k}))
    assert adapter_problem(config, wider, **{**facts, "expected_shapes": None}) == ""  # fits its own config
    assert "this stack's base model needs (4, 128): the adapter was trained on another base model" in \
        adapter_problem(config, wider, **facts)
    fewer = reweighed(weights, lambda t: [t.pop(k) for k in list(t) if ".layers.3." in k])
    assert "lacks 4 of the 16 tensors" in adapter_problem(config, fewer, **facts)
    deeper = reweighed(weights, lambda t: t.update({k.replace(".layers.3.", ".layers.9."): v.clone()
                                                    for k, v in t.items()}))
    assert "tensors that no layer of this stack's base model has" in adapter_problem(config, deeper, **facts)
    assert "trained on another base model" in adapter_problem_on_base(config, wider, base_model_dir=builtin_model_dir(),
                                                                      max_rank=MAX_RANK)


def test_a_tenants_adapters_round_trip_through_its_part_of_the_store_only(good, tmp_path):
    store = open_store(f"file://{tmp_path}/store")
    config, weights = good
    info = put_adapter(store, "alice", config, weights, name="warm")
    assert (info.id, info.rank, info.alpha) == (adapter_id_of(config, weights), 4, 16)
    assert info.target_modules == list(TARGETS)
    assert info.size == len(config) + len(weights) and info.name == "warm"
    assert put_adapter(store, "alice", config, weights, name="again") == info  # the same files: the first record
    other = put_adapter(store, "alice", config_with(config, lora_alpha=8), weights)
    assert read_uploaded_adapter(store, "alice", info.id) == good
    assert [a.id for a in list_adapters(store, "alice")] == [info.id, other.id]
    assert read_uploaded_adapter(store, "bob", info.id) is None  # another tenant's reads as missing
    assert list_adapters(store, "bob") == [] and not delete_adapter(store, "bob", info.id)
    assert read_uploaded_adapter(store, "alice", "adapter-../../files") is None
    assert delete_adapter(store, "alice", info.id)
    assert read_uploaded_adapter(store, "alice", info.id) is None and not delete_adapter(store, "alice", info.id)
    assert [a.id for a in list_adapters(store, "alice")] == [other.id]
    assert not [k for k in store.list(f"uploaded-adapters/alice/{info.id}")]  # its files went with it


def test_put_adapter_refuses_a_config_that_is_not_lora(good, tmp_path):
    with pytest.raises(AdapterRefused, match="not a LoRA config"):
        put_adapter(open_store(f"file://{tmp_path}/store"), "alice", b"{}", good[1])
