"""The Tinker API's state and work on the bus: sessions, models, samplers, checkpoints, futures.

The gateway serves Tinker's HTTP API (``services/gateway/tinker_api.py``); the work is done by the
same services as a job's: the trainer takes a model's training requests from the work queue
``marlaas.tinker.train.<tenant>`` in order, rollout takes sampling requests from
``marlaas.tinker.sample.<tenant>`` and runs them on the shared engine. Whoever finishes a request
writes its future to the ``tinker`` bucket, where the gateway's ``retrieve_future`` reads it.

Every record names its tenant; the gateway answers another tenant's id as a missing one. Ids are
the SDK's own shapes (``<session>:train:<n>``, ``<session>:sample:<n>``, ``<model>:<seq>``);
bucket keys are their hashes, so any id is a valid key. A model is a "job driven by its client":
its live adapter and optimizer state are written to the object store after every ``optim_step``
(``TinkerLive``), and its checkpoints are adapters in the store like any job's versions.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

import msgspec

from marlaas.platform.bus import TINKER_BUCKET, TINKER_FUTURES_BUCKET, Bus
from marlaas.platform.events import Blob
from marlaas.platform.limits import cut

INLINE_RESULT_BYTES = 512 * 1024  # a future's body above this goes to the object store
MAX_SAMPLES = 64  # num_samples of one asample
LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro",
          "stable_reinforce", "gspo")  # served (services/trainer/tinker_losses.py)
SESSION_LIVE_S = 120.0  # a session not heard from for this long no longer counts (the SDK beats every 10 s)
SESSION_EXPIRE_S = 600.0  # ... and is ended after this long, its ephemeral weights deleted
SWEEP_EVERY_S = 60.0
MIN_TTL_S, MAX_TTL_S = 3600, 10 * 365 * 86400  # a checkpoint's TTL (Tinker's range): 1 hour to 10 years
SAMPLE_DURABLE = "rollout-tinker"  # rollout's consumers of the sampling queue: rollout-tinker-<tenant>


class Wire(msgspec.Struct, frozen=True, kw_only=True):
    """Base of the Tinker records: wire types accept fields they do not know."""


class TinkerSession(Wire):
    """A client's session (``ServiceClient``): its tenant, and when it last sent a heartbeat."""

    id: str
    tenant: str
    created_at: float
    heartbeat_at: float = 0.0
    finished: bool = False


class TinkerModel(Wire):
    """A LoRA a Tinker client trains: what ``create_model`` (or ``load_weights``) asked for."""

    id: str
    tenant: str
    session: str
    base_model: str
    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    created_at: float = 0.0
    from_checkpoint: str = ""  # a tinker:// path when created from saved state


class TinkerCheckpoint(Wire):
    """Saved weights: ``kind`` "sampler" or "external" (adapter only) or "state" (adapter and
    optimizer). Its tenant alone may change or delete it; any tenant may read it once ``public``."""

    path: str  # tinker://<model id>/<sampler_weights|weights|external_weights>/<name>
    tenant: str
    model_id: str
    kind: str
    adapter: Blob
    optimizer: Blob | None = None
    rank: int = 0
    created_at: float = 0.0
    public: bool = False  # published: other tenants may sample, load, copy and download it
    expires_at: float = 0.0  # the manager's sweep deletes it after this (0 = never)


class TinkerSampler(Wire):
    """A sampling session: the adapter it samples (None: the base model)."""

    id: str
    tenant: str
    base_model: str
    model_path: str = ""
    adapter: Blob | None = None
    shared: bool = False  # of another tenant's published checkpoint: it samples while that stays published


class TinkerLive(Wire):
    """The trainer's record of a model: its state as of the last optimizer step, and its progress."""

    model_id: str
    steps: int = 0  # the weights' version: optimizer steps, and loads into the model
    adapter: Blob | None = None
    optimizer: Blob | None = None
    last_seq: int = 0  # the last of the model's requests done (they are done in seq_id order)
    holder: str = ""  # the trainer replica holding gradients not yet stepped ("" = none)
    pending_from: int = 0  # the first request whose gradients the holder keeps (0 = none)
    lost_from: int = 0  # gradients since this request went with a replica that went away: the step fails
    working: str = ""  # the replica doing one of the model's requests now ("" = none)
    done_at: float = 0.0  # when the last request was done: a request's wait for its turn counts from it


class SequenceRecord(Wire):
    """A sampled sequence recorded for ``stable_reinforce`` (``record_stability_info``): its prompt,
    its tokens and the engine's logprob of each, which a training request's provenance names by
    ``sequence_id`` (``<request id>:<j>``). Kept as long as futures are (an hour)."""

    id: str
    tenant: str
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]


class ReplicaBeat(Wire):
    """A trainer replica's heartbeat: a model's requests wait for a live replica that holds its gradients."""

    id: str
    at: float


class TinkerFuture(Wire):
    """A finished request: a JSON or protobuf body (inline, or in the store), or an error."""

    request_id: str
    tenant: str
    media: str = "json"  # "json" | "proto" | "error"
    body: bytes = b""
    blob: Blob | None = None
    error: str = ""
    category: str = "user"  # "user" | "server" | "unknown" (the SDK's RequestErrorCategory)
    done_at: float = 0.0


class TrainRequest(Wire):
    """One training request of a model, as the gateway took it: ``kind`` is the endpoint
    (create_model, forward_backward, optim_step, save_weights, save_weights_for_sampler,
    load_weights, unload), ``body`` its JSON (or protobuf for forward_backward)."""

    request_id: str
    tenant: str
    model_id: str
    kind: str
    body: bytes
    seq_id: int = 0
    submitted_at: float = 0.0


class SampleRequest(Wire):
    """One ``asample``: the sampler's record and the request's JSON body."""

    request_id: str
    tenant: str
    sampler: TinkerSampler
    body: bytes
    submitted_at: float = 0.0


def prompt_tokens(model_input) -> list[int]:
    """An ``asample`` prompt's token ids, from its encoded-text chunks; ValueError saying what is wrong."""
    chunks = model_input.get("chunks") if isinstance(model_input, dict) else None
    if not isinstance(chunks, list) or not all(isinstance(chunk, dict) for chunk in chunks):
        raise ValueError('prompt must be {"chunks": [{"type": "encoded_text", "tokens": [...]}]}')
    tokens: list[int] = []
    for chunk in chunks:
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise ValueError(f"prompt chunks of type {chunk.get('type')!r} are not served: this is a text model")
        ids = chunk.get("tokens") or []
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("a prompt chunk's tokens must be a list of token ids")
        tokens.extend(ids)
    if not tokens:
        raise ValueError("the prompt has no tokens")
    return tokens


def key(kind: str, ident: str, tenant: str = "") -> str:
    """The bucket key of ``ident`` (any string) of ``kind`` (session, model, sampler, ...); a model's
    key starts with its tenant's name, so that a tenant's models are counted without reading others'."""
    digest = hashlib.sha256(ident.encode()).hexdigest()[:40]
    return f"{kind}.{tenant}.{digest}" if kind == "model" else f"{kind}.{digest}"


def model_prefix(model: TinkerModel, *parts: str) -> str:
    """Where a model's objects go in the store: its live state (only the last step's is kept) and
    its checkpoints."""
    return "/".join(("tinker", model.tenant, "models", hashlib.sha256(model.id.encode()).hexdigest()[:24], *parts))


def session_prefix(tenant: str, session: str, *parts: str) -> str:
    """Where a session's ephemeral sampler weights go: deleted when the session finishes."""
    return "/".join(("tinker", tenant, "sessions", session, *parts))


def span_job(tenant: str) -> str:
    """The "job" a tenant's Tinker work is recorded under in spans (job ids never end in ``.tinker``:
    their slugs carry a random suffix)."""
    return f"{tenant}.tinker"


def bucket_of(kind: str) -> str:
    return TINKER_FUTURES_BUCKET if kind in ("future", "sequence", "replica") else TINKER_BUCKET  # kept an hour


def request_id(scope: str, seq_id: int | None) -> str:
    """A request's id: its model's or sampler's id and its sequence number. The same request
    retried gets the same id, so the work queue drops the duplicate and the client is answered
    with the first one's future."""
    return f"{scope}:{seq_id}" if seq_id is not None else f"{scope}:{time.time_ns()}"


async def read(bus: Bus, kind: str, ident: str, typ: type, tenant: str = ""):
    """The record of ``ident`` (None when there is none); a model is read with its tenant's name."""
    entry = await bus.kv_get(bucket_of(kind), key(kind, ident, tenant))
    return None if entry is None else msgspec.json.decode(entry.value, type=typ)


async def write(bus: Bus, kind: str, ident: str, record: msgspec.Struct) -> None:
    tenant = record.tenant if kind == "model" else ""
    await bus.kv_put(bucket_of(kind), key(kind, ident, tenant), msgspec.json.encode(record))


async def end_session(bus: Bus, store, session: TinkerSession) -> None:
    """Finish ``session``: its models stop counting against the quota, its ephemeral samplers'
    weights are deleted (named checkpoints stay)."""
    await write(bus, "session", session.id, msgspec.structs.replace(session, finished=True))
    await asyncio.to_thread(store.delete_prefix, session_prefix(session.tenant, session.id) + "/")


async def sweep_sessions(bus: Bus, store, now: float | None = None) -> list[str]:
    """End every session not heard from for ``SESSION_EXPIRE_S`` (its client died without finishing
    it); return their ids. The manager runs this every ``SWEEP_EVERY_S``."""
    now = time.time() if now is None else now
    ended = []
    for session_key in await bus.kv_keys(TINKER_BUCKET, under="session"):
        entry = await bus.kv_get(TINKER_BUCKET, session_key)
        if entry is None:
            continue
        session = msgspec.json.decode(entry.value, type=TinkerSession)
        if not session.finished and now - max(session.heartbeat_at, session.created_at) > SESSION_EXPIRE_S:
            await end_session(bus, store, session)
            ended.append(session.id)
    return ended


def is_live(session: TinkerSession, now: float) -> bool:
    """Whether ``session`` counts against its tenant's quotas: not finished, and heard from (or
    created) in the last ``SESSION_LIVE_S``."""
    return not session.finished and now - max(session.heartbeat_at, session.created_at) < SESSION_LIVE_S


async def tenant_models(bus: Bus, tenant: str) -> list[TinkerModel]:
    """Every model of ``tenant`` (read under its name's key prefix: no other tenant's is read)."""
    found = []
    for model_key in await bus.kv_keys(TINKER_BUCKET, under=f"model.{tenant}"):
        entry = await bus.kv_get(TINKER_BUCKET, model_key)
        if entry is not None:
            found.append(msgspec.json.decode(entry.value, type=TinkerModel))
    return found


async def active_models(bus: Bus, tenant: str, now: float | None = None) -> int:
    """How many of ``tenant``'s models belong to a live session (not finished, heard from in the
    last ``SESSION_LIVE_S``): they count against the tenant's ``max_jobs`` as jobs do."""
    now = time.time() if now is None else now
    live: dict[str, bool] = {}
    count = 0
    for model in await tenant_models(bus, tenant):
        if model.session not in live:
            session = await read(bus, "session", model.session, TinkerSession)
            live[model.session] = session is not None and is_live(session, now)
        count += live[model.session]
    return count


class CheckpointIndex(Wire):
    """The checkpoints a model has saved (its tinker:// paths), for the listing endpoints."""

    model_id: str
    tenant: str
    paths: list[str] = []


async def index(bus: Bus, tenant: str, model_id: str, path: str) -> None:
    """Add ``path`` to its model's checkpoint list (one trainer writes a model's requests at a time)."""
    found = await read(bus, "checkpoints", model_id, CheckpointIndex)
    paths = [p for p in (found.paths if found else []) if p != path] + [path]
    await write(bus, "checkpoints", model_id, CheckpointIndex(model_id=model_id, tenant=tenant, paths=paths))


async def unindex(bus: Bus, tenant: str, model_id: str, path: str) -> None:
    """Take ``path`` off its model's checkpoint list."""
    found = await read(bus, "checkpoints", model_id, CheckpointIndex)
    if found is not None:
        await write(bus, "checkpoints", model_id, CheckpointIndex(
            model_id=model_id, tenant=tenant, paths=[p for p in found.paths if p != path]))


def can_read(checkpoint: TinkerCheckpoint, tenant: str) -> bool:
    """Whether ``tenant`` may sample, load, copy or download ``checkpoint``: its own, or published.
    Publishing, TTLs and deleting stay its owner's."""
    return checkpoint.tenant == tenant or checkpoint.public


def expiry(ttl_seconds, now: float) -> float:
    """When a checkpoint given ``ttl_seconds`` (None: none) expires (0.0 = never); ValueError saying
    the range, Tinker's: 1 hour to 10 years."""
    if ttl_seconds is None:
        return 0.0
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) or not MIN_TTL_S <= ttl_seconds <= MAX_TTL_S:
        raise ValueError(f"ttl_seconds must be a whole number from {MIN_TTL_S} (1 hour) to {MAX_TTL_S} (10 years), "
                         f"or null for no expiry; got {ttl_seconds!r}")
    return now + ttl_seconds


def expired(checkpoints: list[TinkerCheckpoint], now: float) -> list[TinkerCheckpoint]:
    """The checkpoints whose TTL has run out by ``now``."""
    return [c for c in checkpoints if 0 < c.expires_at <= now]


async def delete_checkpoint(bus: Bus, store, checkpoint: TinkerCheckpoint) -> None:
    """Delete ``checkpoint``: its index entry, its record and its objects (samplers made from it
    stop working). The owner's ``delete_checkpoint`` and the manager's TTL sweep both call this."""
    await unindex(bus, checkpoint.tenant, checkpoint.model_id, checkpoint.path)
    await bus.kv_delete(TINKER_BUCKET, key("checkpoint", checkpoint.path))
    folder = store.key_of(checkpoint.adapter.uri).rsplit("/", 1)[0] + "/"
    await asyncio.to_thread(store.delete_prefix, folder)


async def sweep_checkpoints(bus: Bus, store, now: float | None = None) -> list[str]:
    """Delete every checkpoint whose TTL has run out; return their paths. The manager runs this
    with :func:`sweep_sessions`, every ``SWEEP_EVERY_S``."""
    now = time.time() if now is None else now
    found = []
    for checkpoint_key in await bus.kv_keys(TINKER_BUCKET, under="checkpoint"):
        entry = await bus.kv_get(TINKER_BUCKET, checkpoint_key)
        if entry is not None:
            found.append(msgspec.json.decode(entry.value, type=TinkerCheckpoint))
    doomed = expired(found, now)
    for checkpoint in doomed:
        await delete_checkpoint(bus, store, checkpoint)
    return [c.path for c in doomed]


async def finish(bus: Bus, store, future: TinkerFuture) -> None:
    """Record a finished request; a body too large for the bucket goes to the object store."""
    if len(future.body) > INLINE_RESULT_BYTES:
        blob = store.put_bytes(f"tinker/{future.tenant}/futures/"
                               f"{hashlib.sha256(future.request_id.encode()).hexdigest()}", future.body)
        future = msgspec.structs.replace(future, body=b"", blob=blob)
    await write(bus, "future", future.request_id, msgspec.structs.replace(future, done_at=time.time()))


async def fail(bus: Bus, store, request_id: str, tenant: str, error: str, category: str = "user") -> None:
    """Record a request that failed: the client raises ``RequestFailedError`` with ``error`` (cut to
    ``limits.MAX_ERROR_CHARS``: the text may quote a tenant's input)."""
    await finish(bus, store, TinkerFuture(request_id=request_id, tenant=tenant, media="error",
                                          error=cut(error), category=category))


def queue_state(request_id: str, in_hand: int, waiting: int, per_tenant: int) -> tuple[str, str]:
    """What a pending request's ``try_again`` tells the SDK (its ``queue_state`` and reason): a
    sampling request waiting while its tenant has ``per_tenant`` in the engine is held by the
    tenant's own limit ("paused_rate_limit"); one waiting while its tenant is under it waits for the
    engine's Tinker slots ("paused_capacity"); anything else is "active" (in the queue, or being done)."""
    if not (":sample:" in request_id or request_id.startswith("once-")) or waiting == 0:
        return "active", ""
    if in_hand >= per_tenant:
        return "paused_rate_limit", (f"{in_hand} of your sampling requests are in the engine, your limit "
                                     f"(rollout.tinker_sample_per_tenant = {per_tenant}): the rest wait their turn")
    return "paused_capacity", ("the engine's Tinker sampling slots (rollout.tinker_sample_concurrency) are busy "
                               "with other tenants' requests: yours waits its turn")
