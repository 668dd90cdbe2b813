"""The Tinker API (``/tinker/api/v1/...``), so that scripts written for Tinker's SDK run here unchanged.

Point a script at it with ``TINKER_BASE_URL=http://<gateway>/tinker`` and
``TINKER_API_KEY=tml-<tenant token>`` (``marlaas tenant add NAME --json`` prints the key). The
gateway keeps no state: it checks the key's tenant and the ids' owner, records sessions, models
and samplers in the ``tinker`` bucket, and puts the work on the bus (``marlaas.platform.tinker_records``),
where the trainer and rollout do it and write each request's future. Another tenant's session,
model, sampler, checkpoint or future answers like a missing one.

Errors: a request the gateway can refuse at once gets a 4xx ``{"error": ...}``; one that fails in
the doing fails its future (HTTP 200 ``{"error", "category"}``), which the SDK raises as
``RequestFailedError``. A future still pending after ``POLL_S`` answers ``try_again``.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import json
import re
import time
import uuid
from pathlib import Path

import msgspec
from litestar import Request, Response, Router, delete, get, post
from litestar.di import Provide
from tinker.proto import tinker_public_pb2 as pb

from marlaas.platform import api, limits, subjects
from marlaas.platform import tinker_records as wire
from marlaas.platform.adapter_uploads import adapter_archive
from marlaas.platform.adapters import read_adapter
from marlaas.platform.store import ObjectNotFound
from marlaas.platform.tenants import TenantRecord, authenticate, tinker_api_key
from services.gateway.app import ApiError, Gateway, gateway_of, json_object

KEY_PREFIX = tinker_api_key("")  # "tml-"
POLL_S = 10.0  # a retrieve_future waits this long for a pending future (the SDK's read timeout is 45 s)
MAX_CHUNK_BYTES = 512 * 1024  # forward_backward chunks the SDK sends: each must fit one NATS message
MAX_REQUEST_BYTES = 640 * 1024  # any one request: base64 in the queued JSON, it must fit a 1 MiB NATS message
MAX_CHUNK_DATUMS = 64  # ... and hold at most this many datums
PROTO = "application/x-protobuf"
CHECKPOINT_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


async def tinker_tenant(request: Request) -> TenantRecord:
    """The tenant of the ``X-API-Key`` header: ``tml-`` and the tenant's token."""
    key = request.headers.get("x-api-key", "")
    if not key.startswith(KEY_PREFIX):
        raise ApiError(401, "send X-API-Key: tml-<your tenant token> (TINKER_API_KEY; `marlaas tenant add NAME "
                            "--json` prints it as tinker_api_key)")
    tenant = await authenticate(gateway_of(request).bus, key[len(KEY_PREFIX):])
    if tenant is None:
        raise ApiError(401, "API key not accepted (malformed, unknown or revoked): use tml-<a current token of "
                            "your tenant>")
    return tenant


async def body_json(request: Request) -> dict:
    """The request's JSON object: a 400 for anything else, deep nesting included."""
    return json_object(await request.body())


def seq_of(body: dict) -> int | None:
    """The request's ``seq_id`` (the SDK numbers a client's requests from 1; None: unnumbered)."""
    seq = body.get("seq_id")
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < 2**53):
        raise ApiError(400, f"seq_id must be a whole number >= 0, not {seq!r}")
    return seq


def field(body: dict, name: str, typ: type):
    value = body.get(name)
    if not isinstance(value, typ) or isinstance(value, bool) and typ is int:
        raise ApiError(400, f"{name!r} must be a {typ.__name__}, not {value!r}")
    return value


def served_names(gateway: Gateway) -> set[str]:
    """The names ``base_model`` may take: the configured one, and the model's directory."""
    config = gateway.config
    return {config.base_model or "builtin:chat", str(config.base_model_dir)}


@functools.cache
def architecture(model_dir: str) -> str | None:
    """The base model's ``model_type`` (its config.json), for get_info."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


async def owned(gateway: Gateway, tenant: TenantRecord, kind: str, ident: str, typ: type):
    record = await wire.read(gateway.bus, kind, ident, typ, tenant.name)
    if record is None or record.tenant != tenant.name:
        raise ApiError(404, f"no {kind} {ident!r}")
    return record


async def check_quota(gateway: Gateway, subject: str, request: msgspec.Struct) -> str:
    """Have the manager record a session or model: it counts the tenant's quota and writes the
    record in one step (``services/manager/tinker_sessions.py``), so that concurrent creates, on any
    gateway replica, cannot race past it. Its id; 429 past the quota."""
    reply = await gateway.call(subject, request, api.TinkerReply)
    if reply.error:
        raise ApiError(429 if reply.code == api.QUOTA else 400, reply.error)
    return reply.id


async def submit_training(gateway: Gateway, tenant: TenantRecord, model_id: str, kind: str, body: bytes,
                          seq_id: int | None) -> dict:
    """Queue a model's request; a retried submission (same model and seq_id) gets the first's id."""
    if len(body) > MAX_REQUEST_BYTES:
        raise ApiError(413, f"a request of {len(body)} bytes is over {MAX_REQUEST_BYTES} (one NATS message): send "
                            "fewer datums at a time (the SDK splits forward_backward into chunks itself)")
    request_id = wire.request_id(model_id, seq_id)
    await gateway.bus.publish(subjects.tinker_train(tenant.name), msgspec.json.encode(wire.TrainRequest(
        request_id=request_id, tenant=tenant.name, model_id=model_id, kind=kind, body=body,
        seq_id=seq_id or 0, submitted_at=time.time())), msg_id=request_id)
    return {"request_id": request_id, "model_id": model_id}


# --- client, sessions --------------------------------------------------------------------------

@post("/client/config", status_code=200)
async def client_config(tenant: TenantRecord) -> dict:
    """The SDK's feature flags: forward_backward chunks one at a time (each in its turn, so a
    model's requests reach the queue in order) and small enough for one NATS message."""
    return {"parallel_fwdbwd_chunks": False, "fwdbwd_max_chunk_bytes_count": MAX_CHUNK_BYTES,
            "fwdbwd_max_chunk_len": MAX_CHUNK_DATUMS,
            "sample_use_retrieve_futures": False, "pjwt_auth_enabled": False}


@post("/create_session", status_code=200)
async def create_session(request: Request, tenant: TenantRecord) -> dict:
    session = wire.TinkerSession(id=uuid.uuid4().hex, tenant=tenant.name, created_at=time.time())
    await check_quota(gateway_of(request), subjects.API_TINKER_SESSION, api.TinkerSessionRequest(session=session))
    return {"type": "create_session", "session_id": session.id}


@post("/session_heartbeat", status_code=200)
async def session_heartbeat(request: Request, tenant: TenantRecord) -> dict:
    gateway, body = gateway_of(request), await body_json(request)
    session = await owned(gateway, tenant, "session", field(body, "session_id", str), wire.TinkerSession)
    await wire.write(gateway.bus, "session", session.id, msgspec.structs.replace(session, heartbeat_at=time.time()))
    return {"type": "session_heartbeat"}


@post("/sessions/{session_id:str}/finish", status_code=200)
async def finish_session(request: Request, tenant: TenantRecord, session_id: str) -> dict:
    gateway = gateway_of(request)
    session = await owned(gateway, tenant, "session", session_id, wire.TinkerSession)
    await wire.end_session(gateway.bus, gateway.store, session)
    return {"type": "finish_session"}


@get("/get_server_capabilities")
async def capabilities(request: Request, tenant: TenantRecord) -> dict:
    gateway = gateway_of(request)
    return {"supported_models": [{"model_name": name, "max_context_length": gateway.config.rollout.max_model_len,
                                  "trainable": True, "sampleable": True}
                                 for name in sorted(served_names(gateway))]}


@post("/telemetry", status_code=200)
async def telemetry(tenant: TenantRecord) -> dict:
    """The SDK's telemetry is accepted and dropped (TINKER_TELEMETRY=0 stops it being sent)."""
    return {"status": "accepted"}


# --- models -------------------------------------------------------------------------------------

@post("/create_model", status_code=200)
async def create_model(request: Request, tenant: TenantRecord) -> dict:
    gateway, body = gateway_of(request), await body_json(request)
    session = await owned(gateway, tenant, "session", field(body, "session_id", str), wire.TinkerSession)
    seq = field(body, "model_seq_id", int)
    base = field(body, "base_model", str)
    if base not in served_names(gateway):
        raise ApiError(400, f"base_model {base!r} is not served here: use one of {sorted(served_names(gateway))}")
    lora = body.get("lora_config") or {}
    if not isinstance(lora, dict):
        raise ApiError(400, "lora_config must be an object: {\"rank\": 8, ...}")
    rank = lora.get("rank", 32)
    max_rank = gateway.config.rollout.max_lora_rank
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        wanted = rank if isinstance(rank, int) and rank > max_rank else 32
        raise ApiError(400, f"lora_config.rank must be 1 to {max_rank}, not {rank!r}: ask for a lower rank, or "
                            f"have the operator raise rollout.max_lora_rank to {wanted} (the config file's "
                            "[rollout] section; docs/configuration.md)")
    seed = lora.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, f"lora_config.seed must be a whole number, not {seed!r}")
    model = wire.TinkerModel(
        id=f"{session.id}:train:{seq}", tenant=tenant.name, session=session.id, base_model=base, rank=rank,
        seed=seed, train_mlp=bool(lora.get("train_mlp", True)),
        train_attn=bool(lora.get("train_attn", True)), train_unembed=bool(lora.get("train_unembed", True)),
        created_at=time.time())
    await check_quota(gateway, subjects.API_TINKER_MODEL, api.TinkerModelRequest(model=model))
    return await submit_training(gateway, tenant, model.id, "create_model", b"{}", 0)


@post("/get_info", status_code=200)
async def get_info(request: Request, tenant: TenantRecord) -> dict:
    gateway, body = gateway_of(request), await body_json(request)
    model = await owned(gateway, tenant, "model", field(body, "model_id", str), wire.TinkerModel)
    return {"type": "get_info", "model_id": model.id, "is_lora": True, "lora_rank": model.rank,
            "model_name": model.base_model,
            "model_data": {"arch": architecture(str(gateway.config.base_model_dir)), "model_name": model.base_model,
                           "tokenizer_id": str(gateway.config.base_model_dir)}}


@post("/forward_backward", status_code=200)
async def forward_backward(request: Request, tenant: TenantRecord) -> dict:
    gateway, raw = gateway_of(request), await request.body()
    if PROTO not in request.headers.get("content-type", ""):
        raise ApiError(400, f"send forward_backward as protobuf ({PROTO}): the tinker SDK does since 0.25")
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(raw)
    except Exception as exc:  # protobuf's DecodeError, or worse on hostile bytes
        raise ApiError(400, f"the body is not a ForwardBackwardRequest ({exc})") from None
    await owned(gateway, tenant, "model", message.model_id, wire.TinkerModel)
    if message.loss_fn not in wire.LOSSES:  # the trainer is told, so that the next request need not wait for it
        await submit_training(gateway, tenant, message.model_id, "refused", b"", message.seq_id)
        raise ApiError(400, f"loss_fn {message.loss_fn!r} is not served here: use one of {', '.join(wire.LOSSES)} "
                            "(custom losses: forward_backward_custom, which sends cross_entropy weights)")
    return await submit_training(gateway, tenant, message.model_id, "forward_backward", raw, message.seq_id)


async def model_request(request: Request, tenant: TenantRecord, kind: str) -> dict:
    gateway, raw = gateway_of(request), await request.body()
    body = await body_json(request)
    model = await owned(gateway, tenant, "model", field(body, "model_id", str), wire.TinkerModel)
    name = body.get("path")
    if kind == "save_weights" and name is None:
        raise ApiError(400, "save_weights needs a name for the checkpoint: 'path'")
    if kind.startswith("save") and name is not None and not (isinstance(name, str) and CHECKPOINT_NAME.fullmatch(name)):
        raise ApiError(400, f"a checkpoint's name is 1-128 letters, digits, '.', '_' or '-', not {name!r}")
    return await submit_training(gateway, tenant, model.id, kind, raw, seq_of(body))


def model_endpoint(kind: str):
    """``POST /<kind>``: a request of an existing model, queued for the trainer as it is."""
    async def handler(request: Request, tenant: TenantRecord) -> dict:
        return await model_request(request, tenant, kind)

    handler.__name__ = handler.__qualname__ = kind
    return post(f"/{kind}", status_code=200)(handler)


MODEL_ENDPOINTS = [model_endpoint(kind) for kind in ("optim_step", "save_weights", "save_weights_for_sampler",
                                                     "unload_model")]


@post("/load_weights", status_code=200)
async def load_weights(request: Request, tenant: TenantRecord) -> dict:
    """Load a checkpoint into an existing model, or (``session_id`` + ``model_seq_id``) into a new one."""
    gateway, raw = gateway_of(request), await request.body()
    body = await body_json(request)
    checkpoint = await owned(gateway, tenant, "checkpoint", field(body, "path", str), wire.TinkerCheckpoint)
    if body.get("model_id") is not None:
        model = await owned(gateway, tenant, "model", field(body, "model_id", str), wire.TinkerModel)
        return await submit_training(gateway, tenant, model.id, "load_weights", raw, seq_of(body))
    session = await owned(gateway, tenant, "session", field(body, "session_id", str), wire.TinkerSession)
    source = await wire.read(gateway.bus, "model", checkpoint.model_id, wire.TinkerModel, tenant.name)
    model = wire.TinkerModel(
        id=f"{session.id}:train:{field(body, 'model_seq_id', int)}", tenant=tenant.name, session=session.id,
        base_model=source.base_model if source else sorted(served_names(gateway))[0], rank=checkpoint.rank,
        train_mlp=source.train_mlp if source else True, train_attn=source.train_attn if source else True,
        created_at=time.time(), from_checkpoint=checkpoint.path)
    await check_quota(gateway, subjects.API_TINKER_MODEL, api.TinkerModelRequest(model=model))
    return await submit_training(gateway, tenant, model.id, "load_weights", raw, 0)


@get("/training_runs/{model_id:str}/checkpoints")
async def list_checkpoints(request: Request, tenant: TenantRecord, model_id: str) -> dict:
    gateway = gateway_of(request)
    await owned(gateway, tenant, "model", model_id, wire.TinkerModel)
    index = await wire.read(gateway.bus, "checkpoints", model_id, wire.CheckpointIndex)
    listed = []
    for path in index.paths if index else []:
        checkpoint = await wire.read(gateway.bus, "checkpoint", path, wire.TinkerCheckpoint)
        if checkpoint is not None:
            listed.append({"checkpoint_id": path.rsplit("/", 2)[-2] + "/" + path.rsplit("/", 1)[-1],
                           "checkpoint_type": "sampler" if checkpoint.kind == "sampler" else "training",
                           "time": datetime.datetime.fromtimestamp(checkpoint.created_at, datetime.UTC).isoformat(),
                           "tinker_path": path})
    return {"checkpoints": listed, "cursor": None}


@delete("/training_runs/{model_id:str}/checkpoints/{checkpoint_id:path}", status_code=200)
async def delete_checkpoint(request: Request, tenant: TenantRecord, model_id: str, checkpoint_id: str) -> dict:
    """Delete a checkpoint (``weights/NAME`` or ``sampler_weights/NAME``): its record and its objects;
    samplers made from it stop working."""
    gateway = gateway_of(request)
    path = f"tinker://{model_id}/{checkpoint_id.lstrip('/')}"
    checkpoint = await owned(gateway, tenant, "checkpoint", path, wire.TinkerCheckpoint)
    await wire.unindex(gateway.bus, tenant.name, model_id, path)
    await gateway.bus.kv_delete(wire.TINKER_BUCKET, wire.key("checkpoint", path))
    folder = gateway.store.key_of(checkpoint.adapter.uri).rsplit("/", 1)[0] + "/"
    await asyncio.to_thread(gateway.store.delete_prefix, folder)
    return {}


# --- sampling -----------------------------------------------------------------------------------

@post("/create_sampling_session", status_code=200)
async def create_sampling_session(request: Request, tenant: TenantRecord) -> dict:
    gateway, body = gateway_of(request), await body_json(request)
    session = await owned(gateway, tenant, "session", field(body, "session_id", str), wire.TinkerSession)
    sampler = await sampler_for(gateway, tenant, body,
                                f"{session.id}:sample:{field(body, 'sampling_session_seq_id', int)}")
    await wire.write(gateway.bus, "sampler", sampler.id, sampler)
    return {"type": "create_sampling_session", "sampling_session_id": sampler.id}


async def sampler_for(gateway: Gateway, tenant: TenantRecord, body: dict, sampler_id: str) -> wire.TinkerSampler:
    """A sampler of ``body``'s ``model_path`` (a checkpoint of the tenant's) or ``base_model``."""
    if body.get("model_path"):
        path = field(body, "model_path", str)
        checkpoint = await owned(gateway, tenant, "checkpoint", path, wire.TinkerCheckpoint)
        return wire.TinkerSampler(id=sampler_id, tenant=tenant.name, base_model=sorted(served_names(gateway))[0],
                                  model_path=path, adapter=checkpoint.adapter)
    base = body.get("base_model")
    if base not in served_names(gateway):
        raise ApiError(400, f"give model_path (a tinker:// checkpoint) or base_model, one of "
                            f"{sorted(served_names(gateway))}; got base_model {base!r}")
    return wire.TinkerSampler(id=sampler_id, tenant=tenant.name, base_model=base)


@get("/samplers/{sampler_id:str}")
async def get_sampler(request: Request, tenant: TenantRecord, sampler_id: str) -> dict:
    sampler = await owned(gateway_of(request), tenant, "sampler", sampler_id, wire.TinkerSampler)
    return {"sampler_id": sampler.id, "base_model": sampler.base_model, "model_path": sampler.model_path or None}


@post("/asample", status_code=200)
async def asample(request: Request, tenant: TenantRecord) -> dict:
    gateway, raw = gateway_of(request), await request.body()
    body = await body_json(request)
    if body.get("sampling_session_id"):
        sampler = await owned(gateway, tenant, "sampler", field(body, "sampling_session_id", str), wire.TinkerSampler)
        request_id = wire.request_id(sampler.id, seq_of(body))
    else:  # a one-off sampler of a checkpoint or the base: the request is its own scope
        request_id = f"once-{tenant.name}-{uuid.uuid4().hex}"
        sampler = await sampler_for(gateway, tenant, body, request_id)
    if len(raw) > MAX_REQUEST_BYTES:
        raise ApiError(413, f"a sampling request of {len(raw)} bytes is over {MAX_REQUEST_BYTES}: shorten the prompt")
    n = body.get("num_samples", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= wire.MAX_SAMPLES:
        raise ApiError(400, f"num_samples must be a whole number from 1 to {wire.MAX_SAMPLES}, not {n!r}")
    try:
        wire.prompt_tokens(body.get("prompt"))
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    params = body.get("sampling_params") or {}
    seed = params.get("seed") if isinstance(params, dict) else None
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not 0 <= seed < limits.MAX_SAMPLING_SEED):
        raise ApiError(400, f"sampling_params.seed must be a whole number from 0 to {limits.MAX_SAMPLING_SEED - 1}, "
                            f"not {seed!r}")
    await gateway.bus.publish(subjects.tinker_sample(tenant.name), msgspec.json.encode(wire.SampleRequest(
        request_id=request_id, tenant=tenant.name, sampler=sampler, body=raw, submitted_at=time.time())),
        msg_id=request_id)
    return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{j}" for j in range(n)]}


# --- futures ------------------------------------------------------------------------------------

@post("/retrieve_future", status_code=200)
async def retrieve_future(request: Request, tenant: TenantRecord) -> Response:
    gateway, body = gateway_of(request), await body_json(request)
    request_id = field(body, "request_id", str)
    await owner_check(gateway, tenant, request_id)
    deadline, wait = time.monotonic() + POLL_S, 0.02
    while (future := await wire.read(gateway.bus, "future", request_id, wire.TinkerFuture)) is None:
        if time.monotonic() > deadline:
            return Response({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        await asyncio.sleep(wait)
        wait = min(wait * 1.5, 0.5)
    if future.tenant != tenant.name:
        raise ApiError(404, f"no request {request_id!r}")
    if future.media == "error":
        return Response({"error": future.error, "category": future.category})
    data = future.body if future.blob is None else await asyncio.to_thread(gateway.store.fetch, future.blob)
    return Response(data, media_type=PROTO if future.media == "proto" else "application/json")


async def owner_check(gateway: Gateway, tenant: TenantRecord, request_id: str) -> None:
    """404 unless the request is of a session (or a one-off sample) of the tenant's."""
    if request_id.startswith(f"once-{tenant.name}-"):
        return
    session = await wire.read(gateway.bus, "session", request_id.split(":", 1)[0], wire.TinkerSession)
    if session is None or session.tenant != tenant.name:
        raise ApiError(404, f"no request {request_id!r}")


@get("/tinker/checkpoint", summary="A Tinker checkpoint's weights as a .tar.gz of the PEFT directory",
     description="?path=tinker://<model>/<weights|sampler_weights>/<name>: one of the tenant's Tinker checkpoints "
                 "(`marlaas pull tinker://...`).", response_description="application/gzip")
async def download_checkpoint(request: Request, tenant: TenantRecord, path: str | None = None) -> Response:
    gateway = gateway_of(request)
    if not path:
        raise ApiError(400, "name the checkpoint: ?path=tinker://<model>/<weights|sampler_weights>/<name>")
    checkpoint = await owned(gateway, tenant, "checkpoint", path, wire.TinkerCheckpoint)
    try:
        config_json, weights = await asyncio.to_thread(read_adapter, gateway.store, checkpoint.adapter)
    except ObjectNotFound:
        raise ApiError(404, f"the weights of {path} are no longer stored") from None
    data = await asyncio.to_thread(adapter_archive, config_json, weights, checkpoint.created_at)
    name = path.removeprefix("tinker://").replace("/", "-").replace(":", "-")
    return Response(data, media_type="application/gzip", headers={
        "Content-Disposition": f'attachment; filename="{name}.tar.gz"', "X-Adapter-Sha256": checkpoint.adapter.sha256})


CHECKPOINT_ROUTES = [download_checkpoint]  # under /v1, with the tenant's bearer token

TINKER_ROUTER = Router(
    path="/tinker/api/v1",
    route_handlers=[client_config, create_session, session_heartbeat, finish_session, capabilities, telemetry,
                    create_model, get_info, forward_backward, *MODEL_ENDPOINTS, load_weights, list_checkpoints,
                    delete_checkpoint, create_sampling_session, get_sampler, asample, retrieve_future],
    dependencies={"tenant": Provide(tinker_tenant)}, include_in_schema=False,
)
