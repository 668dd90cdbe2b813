# over 500 lines: the Tinker SDK's one router (sessions, models, training, sampling, futures); auth, checkpoints apart
"""The Tinker API (``/tinker/api/v1/...``), so that scripts written for Tinker's SDK run here unchanged.

Point a script at it with ``TINKER_BASE_URL=http://<gateway>/tinker`` and
``TINKER_API_KEY=tml-<tenant token>`` (``marlaas tenant add NAME --json`` prints the key). The
gateway keeps no state: it checks the key's tenant and the ids' owner, records sessions, models
and samplers in the ``tinker`` bucket, and puts the work on the bus (``marlaas.platform.tinker_records``),
where the trainer and rollout do it and write each request's future. Another tenant's session,
model, sampler, checkpoint (unless published: ``tinker_checkpoints.py``) or future answers like a
missing one.

Errors: a request the gateway can refuse at once gets a 4xx ``{"error": ...}``; one that fails in
the doing fails its future (HTTP 200 ``{"error", "category"}``), which the SDK raises as
``RequestFailedError``. A future still pending after ``POLL_S`` answers ``try_again``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import io
import json
import re
import time
import uuid
from pathlib import Path

import msgspec
import zstandard
from litestar import Request, Response, Router, get, post
from litestar.di import Provide

from marlaas.platform import api, limits, subjects
from marlaas.platform import tinker_records as wire
from marlaas.platform.adapter_archives import adapter_archive
from marlaas.platform.adapters import read_adapter
from marlaas.platform.store import ObjectNotFound
from marlaas.platform.tenants import TenantRecord, authenticate, get_tenant, tinker_api_key
from services.gateway import tinker_auth
from services.gateway.context import ApiError, Gateway, gateway_of, json_object

KEY_PREFIX = tinker_api_key("")  # "tml-"
POLL_S = 10.0  # a retrieve_future waits this long for a pending future (the SDK's read timeout is 45 s)
MAX_CHUNK_BYTES = 512 * 1024  # forward_backward chunks the SDK sends: each must fit one NATS message
MAX_REQUEST_BYTES = limits.MAX_TINKER_REQUEST_BYTES  # any one request: base64 in the queued JSON, one NATS message
MAX_CHUNK_DATUMS = 64  # ... and hold at most this many datums
PROTO = "application/x-protobuf"
CHECKPOINT_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


async def tinker_tenant(request: Request) -> TenantRecord:
    """The tenant of the ``X-API-Key`` header: ``tml-`` and the tenant's token, or the JWT the SDK
    exchanged it for (``auth_token``)."""
    key = request.headers.get("x-api-key", "")
    if key.startswith("eyJ"):  # a JWT: base64 of '{"'
        return await jwt_tenant(gateway_of(request), key)
    if not key.startswith(KEY_PREFIX):
        raise ApiError(401, "send X-API-Key: tml-<your tenant token> (TINKER_API_KEY; `marlaas tenant add NAME "
                            "--json` prints it as tinker_api_key)")
    tenant = await authenticate(gateway_of(request).bus, key[len(KEY_PREFIX):])
    if tenant is None:
        raise ApiError(401, "API key not accepted (malformed, unknown or revoked): use tml-<a current token of "
                            "your tenant>")
    return tenant


def signing_key(gateway: Gateway, label: bytes) -> bytes:
    """The key the gateway signs JWTs or download URLs with (``tinker_auth``): derived from the
    operator's token; a 503 without one (a gateway made in a test without it)."""
    if not gateway.operator_token:
        raise ApiError(503, "this gateway has no operator token to sign with (gateway.operator_token): JWTs and "
                            "download URLs are not served")
    return tinker_auth.derived_key(gateway.operator_token, label)


async def jwt_tenant(gateway: Gateway, jwt: str) -> TenantRecord:
    """The tenant of a JWT this gateway minted: unexpired, its tenant active and still holding the
    token it was minted for. Any other is a 401 ``invalid_token``, on which the SDK exchanges its API
    key for a new JWT (and raises the exchange's 401 for a revoked key)."""
    claims = tinker_auth.jwt_claims(signing_key(gateway, tinker_auth.JWT_LABEL), jwt, time.time())
    tenant = await get_tenant(gateway.bus, str(claims.get("org_id"))) if claims else None
    if tenant is None or not tenant.active or not tinker_auth.token_matches(claims, tenant.token_sha256):
        raise ApiError(401, "JWT not accepted (expired, not this gateway's, or its tenant's token was revoked or "
                            "replaced): exchange your API key for a new one (POST /auth/token; the SDK does)",
                       {"WWW-Authenticate": 'Bearer error="invalid_token"'})
    return tenant


async def body_json(request: Request) -> dict:
    """The request's JSON object: a 400 for anything else, deep nesting included."""
    if request.headers.get("content-encoding", "identity") != "identity":
        raise ApiError(415, f"Content-Encoding {request.headers['content-encoding']!r}: send JSON bodies "
                            "uncompressed (only forward_backward's protobuf may be zstd)")
    return json_object(await request.body())


def unzstd(body: bytes, limit: int) -> bytes:
    """A zstd-compressed body, decompressed to at most ``limit`` bytes (read in a stream: a bomb
    stops at the limit); a 400 or 413 saying what is wrong."""
    try:
        data = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)).read(limit + 1)
    except zstandard.ZstdError as exc:
        raise ApiError(400, f"the body is not zstd ({exc}): send it as is, or compressed whole") from None
    if len(data) > limit:
        raise ApiError(413, f"the body decompresses to over {limit} bytes (one NATS message): send fewer datums "
                            "at a time")
    return data


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


async def readable(gateway: Gateway, tenant: TenantRecord, path: str) -> wire.TinkerCheckpoint:
    """The checkpoint at ``path`` if the tenant may read it (its own, or published); 404 otherwise,
    the same for another tenant's unpublished one as for a missing one."""
    checkpoint = await wire.read(gateway.bus, "checkpoint", path, wire.TinkerCheckpoint)
    if checkpoint is None or not wire.can_read(checkpoint, tenant.name):
        raise ApiError(404, f"no checkpoint {path!r}")
    return checkpoint


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
async def client_config(request: Request, tenant: TenantRecord) -> dict:
    """The SDK's feature flags: forward_backward chunks one at a time (each in its turn, so a
    model's requests reach the queue in order) and small enough for one NATS message; the API key
    exchanged for a JWT (which ``whoami`` reads) where the gateway can sign one."""
    return {"parallel_fwdbwd_chunks": False, "fwdbwd_max_chunk_bytes_count": MAX_CHUNK_BYTES,
            "fwdbwd_max_chunk_len": MAX_CHUNK_DATUMS, "sample_use_retrieve_futures": False,
            "pjwt_auth_enabled": bool(gateway_of(request).operator_token), "proto_compress_fwdbwd": True}


@post("/auth/token", status_code=200)
async def auth_token(request: Request, tenant: TenantRecord) -> dict:
    """The API key exchanged for a JWT of ``tinker_auth.JWT_TTL_S`` (the SDK renews it): its claims
    name the tenant (``RestClient.whoami``)."""
    key = signing_key(gateway_of(request), tinker_auth.JWT_LABEL)
    return {"jwt": tinker_auth.mint_jwt(key, tenant.name, tenant.token_sha256, time.time())}


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


@functools.cache
def tinker_messages():
    """The tinker SDK's protobuf messages, imported on the first ``forward_backward`` (in a thread:
    ``tinker.proto`` runs the SDK's ``__init__``, which imports torch, 2 s of CPU a gateway start
    would otherwise pay whether or not anyone uses Tinker)."""
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


@post("/forward_backward", status_code=200)
async def forward_backward(request: Request, tenant: TenantRecord) -> dict:
    gateway, raw = gateway_of(request), await request.body()
    if PROTO not in request.headers.get("content-type", ""):
        raise ApiError(400, f"send forward_backward as protobuf ({PROTO}): the tinker SDK does since 0.25")
    encoding = request.headers.get("content-encoding", "identity")
    if encoding not in ("identity", "zstd"):
        raise ApiError(415, f"Content-Encoding {encoding!r}: send the protobuf as is, or zstd-compressed")
    if encoding == "zstd":
        raw = await asyncio.to_thread(unzstd, raw, MAX_REQUEST_BYTES)
    message = (await asyncio.to_thread(tinker_messages)).ForwardBackwardRequest()
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
    if kind in ("save_weights", "save_weights_external") and name is None:
        raise ApiError(400, f"{kind} needs a name for the checkpoint: 'path'")
    if kind.startswith("save") and name is not None and not (isinstance(name, str) and CHECKPOINT_NAME.fullmatch(name)):
        raise ApiError(400, f"a checkpoint's name is 1-128 letters, digits, '.', '_' or '-', not {name!r}")
    if kind.startswith("save"):
        try:
            wire.expiry(body.get("ttl_seconds"), 0.0)  # the trainer records the expiry from the time it saves
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
    if kind == "save_weights_external":
        if body.get("age_encryption_recipients"):
            raise ApiError(400, "age_encryption_recipients is not served here: save unencrypted (the weights stay "
                                "in this stack's store; download them over its signed URLs)")
        # the same PEFT files as sampler weights: the trainer saves it as one, under external_weights/
        # (its _save tells them apart by the body's type)
        kind, raw = "save_weights_for_sampler", msgspec.json.encode({**body, "type": "save_weights_external"})
    return await submit_training(gateway, tenant, model.id, kind, raw, seq_of(body))


def model_endpoint(kind: str):
    """``POST /<kind>``: a request of an existing model, queued for the trainer as it is."""
    async def handler(request: Request, tenant: TenantRecord) -> dict:
        return await model_request(request, tenant, kind)

    handler.__name__ = handler.__qualname__ = kind
    return post(f"/{kind}", status_code=200)(handler)


MODEL_ENDPOINTS = [model_endpoint(kind) for kind in ("optim_step", "save_weights", "save_weights_for_sampler",
                                                     "save_weights_external",
                                                     "unload_model")]


@post("/load_weights", status_code=200)
async def load_weights(request: Request, tenant: TenantRecord) -> dict:
    """Load a checkpoint into an existing model, or (``session_id`` + ``model_seq_id``) into a new one."""
    gateway, raw = gateway_of(request), await request.body()
    body = await body_json(request)
    checkpoint = await readable(gateway, tenant, field(body, "path", str))
    if body.get("model_id") is not None:
        model = await owned(gateway, tenant, "model", field(body, "model_id", str), wire.TinkerModel)
        return await submit_training(gateway, tenant, model.id, "load_weights", raw, seq_of(body))
    session = await owned(gateway, tenant, "session", field(body, "session_id", str), wire.TinkerSession)
    source = await wire.read(gateway.bus, "model", checkpoint.model_id, wire.TinkerModel, checkpoint.tenant)
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
    return {"checkpoints": [checkpoint_entry(c) for c in await model_checkpoints(gateway, model_id)], "cursor": None}


async def model_checkpoints(gateway: Gateway, model_id: str) -> list[wire.TinkerCheckpoint]:
    """The checkpoints a model has saved (its index's, those still recorded), oldest first."""
    index = await wire.read(gateway.bus, "checkpoints", model_id, wire.CheckpointIndex)
    found = [await wire.read(gateway.bus, "checkpoint", path, wire.TinkerCheckpoint) for path in index.paths] \
        if index else []
    return [checkpoint for checkpoint in found if checkpoint is not None]


def checkpoint_entry(checkpoint: wire.TinkerCheckpoint) -> dict:
    """A checkpoint as the SDK's listings give it (``types.Checkpoint``)."""
    def moment(at: float) -> str:
        return datetime.datetime.fromtimestamp(at, datetime.UTC).isoformat()

    segment, name = checkpoint.path.rsplit("/", 2)[-2:]
    return {"checkpoint_id": f"{segment}/{name}", "tinker_path": checkpoint.path, "time": moment(checkpoint.created_at),
            "checkpoint_type": {"state": "training", "external": "external"}.get(checkpoint.kind, "sampler"),
            "size_bytes": checkpoint.adapter.size + (checkpoint.optimizer.size if checkpoint.optimizer else 0),
            "public": checkpoint.public, "expires_at": moment(checkpoint.expires_at) if checkpoint.expires_at else None}


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
    """A sampler of ``body``'s ``model_path`` (a checkpoint of the tenant's, or a published one) or
    ``base_model``."""
    if body.get("model_path"):
        path = field(body, "model_path", str)
        checkpoint = await readable(gateway, tenant, path)
        return wire.TinkerSampler(id=sampler_id, tenant=tenant.name, base_model=sorted(served_names(gateway))[0],
                                  model_path=path, adapter=checkpoint.adapter, shared=checkpoint.tenant != tenant.name)
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
        if sampler.shared:  # unpublished (or deleted) since: no longer the tenant's to sample
            await readable(gateway, tenant, sampler.model_path)
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
            return Response({"type": "try_again", "request_id": request_id,
                             **await queue_state(gateway, tenant, request_id)})
        await asyncio.sleep(wait)
        wait = min(wait * 1.5, 0.5)
    if future.tenant != tenant.name:
        raise ApiError(404, f"no request {request_id!r}")
    if future.media == "error":
        return Response({"error": future.error, "category": future.category})
    data = future.body if future.blob is None else await asyncio.to_thread(gateway.store.fetch, future.blob)
    return Response(data, media_type=PROTO if future.media == "proto" else "application/json")


async def queue_state(gateway: Gateway, tenant: TenantRecord, request_id: str) -> dict:
    """The SDK's ``queue_state`` (and its reason) for a pending request: from the tenant's sampling
    consumer, how many of its requests the engine has in hand and how many wait."""
    state, reason = "active", ""
    with contextlib.suppress(Exception):  # no consumer yet (never sampled, or idle): nothing waits
        info = await gateway.bus.js.consumer_info("TINKER", f"{wire.SAMPLE_DURABLE}-{tenant.name}")
        state, reason = wire.queue_state(request_id, info.num_ack_pending, info.num_pending,
                                         gateway.config.rollout.tinker_sample_per_tenant)
    return {"queue_state": state, **({"queue_state_reason": reason} if reason else {})}


async def owner_check(gateway: Gateway, tenant: TenantRecord, request_id: str) -> None:
    """404 unless the request is of a session (or a one-off sample) of the tenant's."""
    if request_id.startswith(f"once-{tenant.name}-"):
        return
    session = await wire.read(gateway.bus, "session", request_id.split(":", 1)[0], wire.TinkerSession)
    if session is None or session.tenant != tenant.name:
        raise ApiError(404, f"no request {request_id!r}")


@get("/tinker/checkpoint", summary="A Tinker checkpoint's weights as a .tar.gz of the PEFT directory",
     description="?path=tinker://<model>/<weights|sampler_weights>/<name>: one of the tenant's Tinker checkpoints, "
                 "or a published one (`marlaas pull tinker://...`).", response_description="application/gzip")
async def download_checkpoint(request: Request, tenant: TenantRecord, path: str | None = None) -> Response:
    gateway = gateway_of(request)
    if not path:
        raise ApiError(400, "name the checkpoint: ?path=tinker://<model>/<weights|sampler_weights>/<name>")
    checkpoint = await readable(gateway, tenant, path)
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
                    auth_token, create_model, get_info, forward_backward, *MODEL_ENDPOINTS, load_weights,
                    list_checkpoints, create_sampling_session, get_sampler, asample, retrieve_future],
    dependencies={"tenant": Provide(tinker_tenant)}, include_in_schema=False,
)
