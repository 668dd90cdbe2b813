"""Tenants' uploaded LoRA adapters: a PEFT directory a job starts from (``init_from = "adapter-..."``).

A tenant uploads the directory ``peft``'s ``save_pretrained`` writes (``adapter_config.json`` and
``adapter_model.safetensors``) as a ``.tar.gz`` (``POST /v1/adapters``, the format ``marlaas
pull`` downloads), and a job names it by id as the source of its version 0. Both files are
untrusted: :func:`marlaas.platform.adapter_archives.read_adapter_archive` reads only the two
files out of the archive, in bounded memory and work; :func:`adapter_problem` says why the engine
could not serve or the trainer not train the adapter (not plain LoRA, a config field this stack
does not accept, a rank or targets this stack does not serve, weights that are not a safetensors
file of exactly the LoRA tensors the config describes, or tensors shaped for another base model).
Weights are read by parsing the safetensors header: nothing in an upload is ever executed or
unpickled. The config is checked field by field against an allow-list (:func:`lora_shape`): a
peft setting that would run code of its own in the trainer (``init_lora_weights = "pissa"``
rewrites the shared base weights) is refused by name, and the trainer builds its own LoRA config
from the shape alone (:func:`marlaas.platform.adapters.trained_lora_config`).

An adapter's id comes from its content (``adapter-`` and 32 hex digits of a sha256 over both
files): one tenant's same adapter uploaded twice is one. It lives in the tenant's own prefix of
the object store, ``uploaded-adapters/<tenant>/<id>/`` (the two files) and
``uploaded-adapters/<tenant>/<id>.json`` (its :class:`~marlaas.platform.http_api.AdapterInfo`,
written after the files, so a listed adapter always has them); another tenant's id names
nothing, exactly like a missing one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import reprlib
import struct
import time
from pathlib import Path

import msgspec

from marlaas.platform import limits
from marlaas.platform.adapters import CONFIG_FILE, WEIGHTS_FILE
from marlaas.platform.http_api import AdapterInfo
from marlaas.platform.store import ImmutableKeyError, ObjectStore

ADAPTER_ID = re.compile(r"adapter-[0-9a-f]{32}")
RECORD = re.compile(r"adapter-[0-9a-f]{32}\.json")
PREFIX = "uploaded-adapters"
# adapter_model.safetensors: rank 16 on every linear layer of an 8B model is ~160 MiB in float32
MAX_ADAPTER_BYTES = 256 << 20
MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json is ~1 KiB
MAX_HEADER_BYTES = 16 << 20  # the safetensors header (JSON): ~150 bytes a tensor
MAX_ADAPTERS_PER_TENANT = 16  # up to 4 GiB of a tenant's in the store
FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}  # the dtypes a LoRA weight may have
LORA_HALVES = ("lora_A", "lora_B")  # a LoRA tensor's name: <module path>.<half>.weight
# adapter_config.json, field by field (issue 48): a job trains, and the engine serves, plain LoRA of
# (r, lora_alpha, target_modules), so an uploaded config is held to that. Every field peft's
# LoraConfig writes (0.21; test_adapter_uploads checks the installed peft's) is named here or in
# config_field_problem (init_lora_weights, bias); a field named nowhere is a peft feature nobody
# here has looked at, and is refused by name.
SHAPE_FIELDS = ("peft_type", "r", "lora_alpha", "target_modules", "lora_dropout")  # lora_shape checks these
OFF = (None, False, [], {})  # what a peft field that turns nothing on holds
UNSUPPORTED = {  # LoRA variants the engine and the trainer do not run: each must be off (one of OFF)
    "use_dora": "DoRA", "use_rslora": "rank-stabilized scaling", "use_qalora": "QA-LoRA",
    "modules_to_save": "fully trained extra modules", "lora_bias": "LoRA biases",
    "rank_pattern": "per-module ranks", "alpha_pattern": "per-module alphas",
    "target_parameters": "parameter targets", "trainable_token_indices": "trained token embeddings",
    "layer_replication": "replicated layers", "exclude_modules": "modules left out by pattern",
    "layers_to_transform": "LoRA on some layers only", "layers_pattern": "LoRA on some layers only",
    "fan_in_fan_out": "weights stored transposed, as for GPT-2's Conv1D", "use_bdlora": "block-diagonal LoRA",
    "megatron_config": "Megatron parallel layers", "alora_invocation_tokens": "activated LoRA",
    "arrow_config": "Arrow routing", "ensure_weight_tying": "adapted tied embeddings",
    "loftq_config": "LoftQ initialization", "eva_config": "EVA initialization", "corda_config": "CorDA initialization",
    "lora_ga_config": "LoRA-GA initialization", "velora_config": "VeLoRA", "monteclora_config": "MonteCLoRA",
    "kasa_config": "KaSA",
}
# fields that change nothing this stack computes (notes on where the adapter came from, or a
# setting read only with a feature above turned on): (values accepted, how the error says them)
NOTES: dict[str, tuple[tuple[object, ...] | type, str]] = {
    "task_type": ((None, "CAUSAL_LM"), "'CAUSAL_LM' or null"),
    "base_model_name_or_path": (str, "a string or null"), "revision": (str, "a string or null"),
    "peft_version": (str, "a string or null"), "auto_mapping": (dict, "an object or null"),
    "inference_mode": ((True, False), "true or false"),
    "megatron_core": ((None, "megatron.core"), "'megatron.core' or null"),
    "qalora_group_size": (int, "a whole number or null"),
}
MAX_SHOWN_CHARS = 80  # of a refused value, in the error
HOW = ("upload the directory peft's save_pretrained writes for a plain LoRA adapter "
       "(LoraConfig(r=..., target_modules=[...]))")


class AdapterRefused(ValueError):
    """An upload no job could start from; the message says what is wrong and how to fix it."""


def adapter_id_of(config_json: bytes, weights: bytes) -> str:
    """The id of the adapter of these two files (each hashed on its own: no two pairs collide)."""
    both = hashlib.sha256(hashlib.sha256(config_json).digest() + hashlib.sha256(weights).digest())
    return f"adapter-{both.hexdigest()[:32]}"


def is_adapter_id(value: object) -> bool:
    """Whether ``value`` names an uploaded adapter (``adapter-`` and 32 hex digits)."""
    return isinstance(value, str) and ADAPTER_ID.fullmatch(value) is not None


def files_key(tenant: str, adapter_id: str) -> str:
    return f"{PREFIX}/{tenant}/{adapter_id}"


def record_key(tenant: str, adapter_id: str) -> str:
    return f"{files_key(tenant, adapter_id)}.json"


# --- the checks ------------------------------------------------------------------------------


class LoraShape(msgspec.Struct, kw_only=True, frozen=True):
    """What an adapter's config says of its shape: the job it starts has these LoRA settings."""

    rank: int
    alpha: int
    target_modules: tuple[str, ...]  # sorted


def lora_shape(config_json: bytes, max_rank: int = 1 << 30) -> LoraShape:
    """The LoRA shape an ``adapter_config.json`` describes; :class:`AdapterRefused` unless it is a
    plain LoRA config of a rank up to ``max_rank`` with its target modules listed, every other
    field one this stack accepts (:func:`config_field_problem`)."""
    if len(config_json) > MAX_CONFIG_BYTES:
        raise AdapterRefused(f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes: {HOW}")
    try:
        config = json.loads(config_json)
    except (ValueError, RecursionError) as exc:
        raise AdapterRefused(f"{CONFIG_FILE} is not JSON ({exc}): {HOW}") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        found = config.get("peft_type") if isinstance(config, dict) else type(config).__name__
        raise AdapterRefused(f"{CONFIG_FILE} is not a LoRA config (its peft_type is {shown(found)}, not 'LORA'): {HOW}")
    rank, alpha, targets = config.get("r"), config.get("lora_alpha", 8), config.get("target_modules")
    dropout = config.get("lora_dropout", 0.0)
    if type(rank) is not int or not 1 <= rank <= max_rank:
        raise AdapterRefused(f"{CONFIG_FILE}: r is {shown(rank)}, and this stack serves LoRA ranks 1..{max_rank} "
                             "(rollout.max_lora_rank): train the adapter with a rank in that range")
    # the range first: float() of a whole number past 1e308 overflows
    if type(alpha) not in (int, float) or not (1 <= alpha <= limits.MAX_LORA_ALPHA and float(alpha).is_integer()):
        raise AdapterRefused(f"{CONFIG_FILE}: lora_alpha is {shown(alpha)}: a job's LoRA alpha is a whole number "
                             f"from 1 to {limits.MAX_LORA_ALPHA}; train the adapter with one")
    if type(dropout) not in (int, float) or not 0 <= dropout < 1:
        raise AdapterRefused(f"{CONFIG_FILE}: lora_dropout is {shown(dropout)}: a dropout probability is a number "
                             "from 0 up to (not including) 1 (a job trains without dropout whatever it says)")
    if isinstance(targets, str):
        raise AdapterRefused(f"{CONFIG_FILE}: target_modules is the pattern {shown(targets)}: list the modules "
                             'instead, e.g. target_modules=["q_proj", "v_proj"]')
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterRefused(f"{CONFIG_FILE}: target_modules must list the adapted modules by name, "
                             f'e.g. ["q_proj", "v_proj"]; it is {shown(targets)}')
    for field, value in config.items():
        if field not in SHAPE_FIELDS and (problem := config_field_problem(field, value)):
            raise AdapterRefused(problem)
    return LoraShape(rank=rank, alpha=int(alpha), target_modules=tuple(sorted(set(targets))))


def config_field_problem(field: str, value: object) -> str:
    """Why this stack refuses ``field = value`` in an ``adapter_config.json`` ("" = it accepts it);
    the fields of :data:`SHAPE_FIELDS` are :func:`lora_shape`'s own."""
    if field == "init_lora_weights":  # the weights come with the adapter: no initialization runs, ever
        return "" if value is True else (
            f"{CONFIG_FILE}: init_lora_weights is {shown(value)}: an uploaded adapter brings its weights, and a job "
            "never runs another initialization (PiSSA, OLoRA, CorDA and the like rewrite the base model's weights): "
            "save the adapter with init_lora_weights=True, a PiSSA or OLoRA adapter converted to plain LoRA first "
            "(peft's save_pretrained(..., path_initial_model_for_weight_conversion=...))")
    if field == "bias":
        return "" if value == "none" else (
            f"{CONFIG_FILE}: bias is {shown(value)}, and this stack serves plain LoRA only (bias = 'none'): train "
            "the adapter with bias='none'")
    if field in UNSUPPORTED:
        return "" if is_one_of(value, OFF) else (
            f"{CONFIG_FILE}: {field} is set ({UNSUPPORTED[field]}), and this stack serves plain LoRA only: train "
            f"the adapter without {field}")
    if field in NOTES:
        accepted, says = NOTES[field]
        ok = is_one_of(value, accepted) if isinstance(accepted, tuple) else value is None or type(value) is accepted
        return "" if ok else f"{CONFIG_FILE}: {field} is {shown(value)}; it must be {says}: {HOW}"
    return (f"{CONFIG_FILE} has the field {shown(field)}, which this stack does not accept (it serves plain LoRA: r, "
            f"lora_alpha, target_modules and what peft notes beside them): remove it from {CONFIG_FILE}")


def is_one_of(value: object, values: tuple[object, ...]) -> bool:
    """Whether ``value`` is one of ``values``, type and all (JSON's 1 is not true, nor 0 false)."""
    return any(type(value) is type(v) and value == v for v in values)


_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxlong = _SHOWN.maxother = MAX_SHOWN_CHARS
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict = 2, 4, 4


def shown(value: object) -> str:
    """``value`` as an error quotes it: cut short, however long or deep."""
    return _SHOWN.repr(value)


def tensor_shapes(weights: bytes) -> dict[str, tuple[int, ...]]:
    """The tensors of a safetensors file, by name, as its header describes them; :class:`AdapterRefused`
    unless the header is well formed, its tensors are floats and they cover the data exactly.
    Parses the header only (JSON): nothing is executed, no tensor is built."""
    if len(weights) > MAX_ADAPTER_BYTES:
        raise AdapterRefused(f"{WEIGHTS_FILE} is larger than {MAX_ADAPTER_BYTES >> 20} MiB: upload an adapter "
                             "of a lower rank or of fewer target modules")
    not_safetensors = f"{WEIGHTS_FILE} is not a safetensors file"
    if len(weights) < 8:
        raise AdapterRefused(f"{not_safetensors} (only {len(weights)} bytes): {HOW}")
    (header_len,) = struct.unpack("<Q", weights[:8])
    if header_len > min(MAX_HEADER_BYTES, len(weights) - 8):
        raise AdapterRefused(f"{not_safetensors} (its header would be {header_len} bytes): {HOW}")
    try:
        header = json.loads(weights[8:8 + header_len])
    except (ValueError, RecursionError) as exc:
        raise AdapterRefused(f"{not_safetensors} (its header is not JSON: {exc}): {HOW}") from None
    if not isinstance(header, dict):
        raise AdapterRefused(f"{not_safetensors} (its header is not a JSON object): {HOW}")
    header.pop("__metadata__", None)
    shapes, spans = {}, []
    for name, entry in header.items():
        shape, span = _tensor_entry(name, entry)
        shapes[name] = shape
        spans.append(span)
    end = 0
    for begin, stop in sorted(spans):  # safetensors' own rule: the tensors tile the data, no gaps or overlaps
        if begin != end:
            raise AdapterRefused(f"{not_safetensors} (its tensors overlap or leave gaps in the data): {HOW}")
        end = stop
    if end != len(weights) - 8 - header_len:
        raise AdapterRefused(f"{not_safetensors} (its data is {len(weights) - 8 - header_len} bytes, its "
                             f"tensors {end}: truncated?): {HOW}")
    return shapes


def _tensor_entry(name: str, entry: object) -> tuple[tuple[int, ...], tuple[int, int]]:
    """One header entry's shape and byte span, checked against its dtype."""
    bad = AdapterRefused(f"{WEIGHTS_FILE} is not a safetensors file (its entry {name[:120]!r} is malformed): {HOW}")
    if not isinstance(entry, dict):
        raise bad
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in FLOAT_BYTES:
        raise AdapterRefused(f"{WEIGHTS_FILE}: tensor {name[:120]!r} is {str(dtype)[:16]}, not one of "
                             f"{sorted(FLOAT_BYTES)}: save the adapter's weights as floats")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise bad
    begin, end = offsets
    if not 0 <= begin <= end or end - begin != math.prod(shape) * FLOAT_BYTES[dtype]:
        raise bad
    return tuple(shape), (begin, end)


def adapter_problem(config_json: bytes, weights: bytes, *, max_rank: int, lora_targets: frozenset[str] | set[str],
                    expected_shapes: dict[str, tuple[int, ...]] | None = None) -> str:
    """Why no job could start from this adapter ("" = one can): its config must be plain LoRA of a
    rank up to ``max_rank`` over some of ``lora_targets`` (the base model's linear layers), its
    weights a safetensors file of exactly a lora_A (r x in) and a lora_B (out x r) per adapted
    module. Given ``expected_shapes`` (:func:`fresh_adapter_shapes` of the config's rank and
    targets on the base model), its tensors must be named and shaped as those: an adapter
    trained on another base model is refused."""
    try:
        shape = lora_shape(config_json, max_rank)
        if strange := sorted(set(shape.target_modules) - set(lora_targets)):
            return (f"{CONFIG_FILE}: target_modules {strange} are not linear layers of this stack's base model "
                    f"(choose from {sorted(lora_targets)}): the adapter was trained on another base model")
        tensors = tensor_shapes(weights)
        if problem := lora_tensors_problem(tensors, shape):
            return problem
        if expected_shapes is not None:
            return base_model_problem(tensors, expected_shapes)
    except AdapterRefused as exc:
        return str(exc)
    return ""


def lora_tensor_name(name: str) -> tuple[str, str]:
    """(module path, "lora_A" | "lora_B") of a LoRA tensor's name, ("", "") for any other name
    (string splits, no pattern: a hostile header's names cost a linear scan)."""
    rest, dot, last = name.rpartition(".")
    module, dot2, half = rest.rpartition(".")
    if last != "weight" or not dot or not dot2 or not module or half not in LORA_HALVES:
        return "", ""
    return module, half


def lora_tensors_problem(tensors: dict[str, tuple[int, ...]], shape: LoraShape) -> str:
    """Why ``tensors`` are not the LoRA weights of ``shape`` ("" = they are)."""
    if not tensors:
        return f"{WEIGHTS_FILE} holds no tensor: {HOW}"
    halves: dict[str, set[str]] = {}
    for name, dims in sorted(tensors.items()):
        module, half = lora_tensor_name(name)
        if not module or module.rsplit(".", 1)[-1] not in shape.target_modules:
            return (f"{WEIGHTS_FILE}: tensor {name[:120]!r} is not the lora_A or lora_B weight of one of the "
                    f"target_modules {list(shape.target_modules)}: {HOW}")
        rank_dim = 0 if half == "lora_A" else 1
        if len(dims) != 2 or dims[rank_dim] != shape.rank:
            expected = "(r, in_features)" if half == "lora_A" else "(out_features, r)"
            return (f"{WEIGHTS_FILE}: tensor {name[:120]!r} is shaped {dims}, not {expected} with r = {shape.rank} "
                    f"as {CONFIG_FILE} says: upload the config saved with these weights")
        halves.setdefault(module, set()).add(half)
    if lonely := sorted(m for m, h in halves.items() if len(h) != 2):
        return f"{WEIGHTS_FILE}: module {lonely[0][:120]!r} has a lora_A or a lora_B weight but not both: {HOW}"
    return ""


def base_model_problem(tensors: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> str:
    """Why ``tensors`` do not fit the base model a fresh adapter of the same config has ``expected``
    tensors for ("" = they fit)."""
    another = "the adapter was trained on another base model: train it on this stack's base model"
    if missing := sorted(set(expected) - set(tensors)):
        return (f"{WEIGHTS_FILE} lacks {len(missing)} of the {len(expected)} tensors an adapter of this config "
                f"has on this stack's base model (e.g. {missing[0][:120]!r}): {another}")
    if extra := sorted(set(tensors) - set(expected)):
        return (f"{WEIGHTS_FILE} has {len(extra)} tensors that no layer of this stack's base model has "
                f"(e.g. {extra[0][:120]!r}): {another}")
    for name in sorted(tensors):
        if tuple(tensors[name]) != tuple(expected[name]):
            return (f"{WEIGHTS_FILE}: tensor {name[:120]!r} is shaped {tuple(tensors[name])}, and this stack's "
                    f"base model needs {tuple(expected[name])}: {another}")
    return ""


@functools.lru_cache(maxsize=4)
def base_lora_targets(base_model_dir: str) -> frozenset[str]:
    """The base model's linear layers, LoRA's possible targets (torch imported on the first call)."""
    from marlaas.platform.adapters import linear_module_names

    return frozenset(linear_module_names(base_model_dir))


@functools.lru_cache(maxsize=64)
def fresh_adapter_shapes(base_model_dir: str, rank: int, target_modules: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """The tensors, by name and shape, of a fresh adapter of this rank and these targets on the base
    model (built on the meta device; cached: the caller must not change the dict)."""
    from marlaas.platform.adapters import init_adapter
    from marlaas.platform.events import LoraSettings

    settings = LoraSettings(rank=rank, target_modules=target_modules)
    return tensor_shapes(init_adapter(Path(base_model_dir), settings, seed=0)[1])


def adapter_problem_on_base(config_json: bytes, weights: bytes, *, base_model_dir: str | Path, max_rank: int) -> str:
    """:func:`adapter_problem` against the base model at ``base_model_dir``: its linear layers are
    the possible targets and a fresh adapter's tensors the expected shapes (both cached per process)."""
    targets = base_lora_targets(str(base_model_dir))
    if problem := adapter_problem(config_json, weights, max_rank=max_rank, lora_targets=targets):
        return problem
    shape = lora_shape(config_json)
    expected = fresh_adapter_shapes(str(base_model_dir), shape.rank, shape.target_modules)
    return adapter_problem(config_json, weights, max_rank=max_rank, lora_targets=targets, expected_shapes=expected)


# --- the store ---------------------------------------------------------------------------------


def put_adapter(store: ObjectStore, tenant: str, config_json: bytes, weights: bytes, name: str = "") -> AdapterInfo:
    """Store a checked adapter (:func:`adapter_problem`) as one of ``tenant``'s; the same two files
    again return the adapter already stored (with its first name)."""
    shape = lora_shape(config_json)
    adapter_id = adapter_id_of(config_json, weights)
    prefix = files_key(tenant, adapter_id)
    store.put_bytes(f"{prefix}/{CONFIG_FILE}", config_json)  # immutable: the same bytes again are a no-op
    blob = store.put_bytes(f"{prefix}/{WEIGHTS_FILE}", weights)
    record = AdapterInfo(id=adapter_id, rank=shape.rank, alpha=shape.alpha, target_modules=list(shape.target_modules),
                         size=len(config_json) + blob.size, sha256=blob.sha256, name=name[:256], created_at=time.time())
    try:
        store.put_bytes(record_key(tenant, adapter_id), msgspec.json.encode(record))
    except ImmutableKeyError:
        return read_adapter_record(store, tenant, adapter_id) or record
    return record


def read_adapter_record(store: ObjectStore, tenant: str, adapter_id: str) -> AdapterInfo | None:
    """``tenant``'s adapter ``adapter_id``, or None (a malformed id names none)."""
    if not is_adapter_id(adapter_id):
        return None
    key = record_key(tenant, adapter_id)
    if not store.exists(key):
        return None
    return msgspec.json.decode(store.get_bytes(key), type=AdapterInfo)


def read_uploaded_adapter(store: ObjectStore, tenant: str, adapter_id: str) -> tuple[bytes, bytes] | None:
    """The (config JSON, verified weights) of ``tenant``'s adapter, or None when it has none of that
    id (never uploaded, deleted, or another tenant's: the same answer)."""
    record = read_adapter_record(store, tenant, adapter_id)
    if record is None:
        return None
    prefix = files_key(tenant, adapter_id)
    return store.get_bytes(f"{prefix}/{CONFIG_FILE}"), store.get_bytes(f"{prefix}/{WEIGHTS_FILE}", record.sha256)


def list_adapters(store: ObjectStore, tenant: str) -> list[AdapterInfo]:
    """``tenant``'s adapters, oldest first."""
    prefix = f"{PREFIX}/{tenant}/"
    keys = [k for k in store.list(prefix) if RECORD.fullmatch(k.removeprefix(prefix))]  # not the configs
    records = [msgspec.json.decode(store.get_bytes(k), type=AdapterInfo) for k in keys]
    return sorted(records, key=lambda r: (r.created_at, r.id))


def delete_adapter(store: ObjectStore, tenant: str, adapter_id: str) -> bool:
    """Delete ``tenant``'s adapter (the record first: a listed adapter always has its files); False
    when it has none of that id."""
    if read_adapter_record(store, tenant, adapter_id) is None:
        return False
    store.delete(record_key(tenant, adapter_id))
    store.delete_prefix(files_key(tenant, adapter_id) + "/")
    return True

