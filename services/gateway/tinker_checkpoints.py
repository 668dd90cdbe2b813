"""The Tinker API's checkpoint management: publishing, TTLs, deleting, copying, listing a tenant's
checkpoints, a checkpoint's weights info, and signed download URLs.

A checkpoint is its owner's to publish, unpublish, give a TTL and delete; another tenant's
attempt is answered as for a missing checkpoint. Published, any tenant may read it: sample it,
load it, copy it, download it (``tinker_records.can_read``). A TTL is an expiry on the record;
the manager's sweep deletes expired checkpoints (``tinker_records.sweep_checkpoints``).

``get_external_weights_urls`` answers one URL per file of the PEFT adapter, served by this gateway
under ``/tinker/weights/`` (outside the API-key router: a plain GET downloads it) and signed for
the asking tenant until an hour on (``tinker_auth``). The file is served only while the URL's
tenant may still read the checkpoint: deleting or unpublishing it voids the URLs given out.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import time
import urllib.parse
import uuid

import msgspec
from litestar import Request, Response, Router, delete, get, post, put
from litestar.di import Provide

from marlaas.platform import tinker_records as wire
from marlaas.platform.adapters import CONFIG_FILE, WEIGHTS_FILE, read_adapter
from marlaas.platform.bus import StaleRevision
from marlaas.platform.store import ObjectNotFound, ObjectStore
from marlaas.platform.tenants import TenantRecord, get_tenant
from services.gateway import tinker_auth
from services.gateway.context import ApiError, gateway_of
from services.gateway.files import Quota
from services.gateway.tinker_api import (
    body_json,
    checkpoint_entry,
    field,
    model_checkpoints,
    owned,
    readable,
    served_names,
    signing_key,
    tinker_tenant,
)

CHECKPOINT_BY_ID = "/training_runs/{model_id:str}/checkpoints/{checkpoint_id:path}"
MAX_LISTED = 1000  # list_user_checkpoints' page
MAX_COPIES = 64  # copied runs a tenant keeps at once (each a checkpoint's objects again): delete one to copy more


def checkpoint_target(model_id: str, checkpoint_id: str, action: str) -> str:
    """The tinker:// path ``<model>/<segment>/<name>/<action>`` names ("" action: none); 404 for a
    URL of another shape (a name never holds a '/')."""
    parts = checkpoint_id.strip("/").split("/")
    if len(parts) != 2 + bool(action) or action and parts[-1] != action:
        raise ApiError(404, f"no endpoint for checkpoint {checkpoint_id!r}: the SDK's paths are "
                            "training_runs/<model>/checkpoints/<segment>/<name>[/publish|/ttl|/external_weights_urls]")
    return f"tinker://{model_id}/{parts[0]}/{parts[1]}"


async def set_record(request: Request, tenant: TenantRecord, path: str, **changes) -> dict:
    """Change the owner's checkpoint at ``path`` (404 for anyone else's), compare-and-set: a
    checkpoint deleted meanwhile stays deleted, and two changes at once both hold."""
    gateway, key = gateway_of(request), wire.key("checkpoint", path)
    while True:
        entry = await gateway.bus.kv_get(wire.TINKER_BUCKET, key)
        checkpoint = msgspec.json.decode(entry.value, type=wire.TinkerCheckpoint) if entry else None
        if checkpoint is None or checkpoint.tenant != tenant.name:
            raise ApiError(404, f"no checkpoint {path!r}")
        with contextlib.suppress(StaleRevision):
            await gateway.bus.kv_update(wire.TINKER_BUCKET, key, msgspec.json.encode(
                msgspec.structs.replace(checkpoint, **changes)), entry.revision)
            return {}


@delete(CHECKPOINT_BY_ID, status_code=200)
async def delete_or_unpublish(request: Request, tenant: TenantRecord, model_id: str, checkpoint_id: str) -> dict:
    """``DELETE .../<segment>/<name>``: delete the checkpoint (its record and objects; samplers
    made from it stop working). ``DELETE .../<segment>/<name>/publish``: unpublish it."""
    if checkpoint_id.strip("/").count("/") == 2:  # <segment>/<name>/<action>
        return await set_record(request, tenant, checkpoint_target(model_id, checkpoint_id, "publish"), public=False)
    gateway = gateway_of(request)
    path = checkpoint_target(model_id, checkpoint_id, "")
    checkpoint = await owned(gateway, tenant, "checkpoint", path, wire.TinkerCheckpoint)
    await wire.delete_checkpoint(gateway.bus, gateway.store, checkpoint)
    if checkpoint.model_id.startswith("copy-"):
        await COPY_QUOTA.release(gateway, tenant.name, checkpoint.model_id)  # unless the run holds another
    return {}


@post(CHECKPOINT_BY_ID, status_code=200)
async def publish(request: Request, tenant: TenantRecord, model_id: str, checkpoint_id: str) -> dict:
    """``POST .../<segment>/<name>/publish``: any tenant may read the checkpoint from now on."""
    return await set_record(request, tenant, checkpoint_target(model_id, checkpoint_id, "publish"), public=True)


@put(CHECKPOINT_BY_ID, status_code=200)
async def set_ttl(request: Request, tenant: TenantRecord, model_id: str, checkpoint_id: str) -> dict:
    """``PUT .../<segment>/<name>/ttl`` ``{"ttl_seconds": N | null}``: the checkpoint expires N
    seconds from now (1 hour to 10 years), or never."""
    path = checkpoint_target(model_id, checkpoint_id, "ttl")
    try:
        expires_at = wire.expiry((await body_json(request)).get("ttl_seconds"), time.time())
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    return await set_record(request, tenant, path, expires_at=expires_at)


@get(CHECKPOINT_BY_ID)
async def external_weights_urls(request: Request, tenant: TenantRecord, model_id: str, checkpoint_id: str) -> dict:
    """``GET .../<segment>/<name>/external_weights_urls``: a signed URL per file of the adapter,
    valid for an hour (``types.ExternalWeightsUrlsResponse``)."""
    gateway = gateway_of(request)
    path = checkpoint_target(model_id, checkpoint_id, "external_weights_urls")
    await readable(gateway, tenant, path)
    key = signing_key(gateway, tinker_auth.URL_LABEL)
    expires = str(int(time.time()) + tinker_auth.URL_TTL_S)
    base = str(request.base_url).rstrip("/")
    urls = {}
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        query = {"path": path, "reader": tenant.name, "expires": expires,
                 "signature": tinker_auth.url_signature(key, tenant.name, path, file, expires)}
        urls[file] = f"{base}/tinker/weights/{file}?{urllib.parse.urlencode(query)}"
    return {"urls": urls, "expires": datetime.datetime.fromtimestamp(int(expires), datetime.UTC).isoformat()}


@get("/tinker/weights/{file:str}", include_in_schema=False)
async def signed_weights_file(request: Request, file: str, path: str = "", reader: str = "", expires: str = "",
                              signature: str = "") -> Response:
    """One file of a checkpoint, to whoever holds a URL ``external_weights_urls`` signed: no API
    key; 403 for a changed or expired URL, 404 once its tenant may no longer read the checkpoint."""
    gateway = gateway_of(request)
    problem = tinker_auth.url_problem(signing_key(gateway, tinker_auth.URL_LABEL), reader, path, file, expires,
                                      signature, time.time())
    if problem:
        raise ApiError(403, problem)
    tenant = await get_tenant(gateway.bus, reader)
    if tenant is None or not tenant.active:
        raise ApiError(403, f"the URL was signed for tenant {reader!r}, whose access was revoked")
    checkpoint = await wire.read(gateway.bus, "checkpoint", path, wire.TinkerCheckpoint)
    if checkpoint is None or not wire.can_read(checkpoint, reader):
        raise ApiError(404, f"no checkpoint {path!r} (deleted, or unpublished, since the URL was signed)")
    try:
        config_json, weights = await asyncio.to_thread(read_adapter, gateway.store, checkpoint.adapter)
    except ObjectNotFound:
        raise ApiError(404, f"the weights of {path} are no longer stored") from None
    return Response(config_json if file == CONFIG_FILE else weights, media_type="application/octet-stream",
                    headers={"Content-Disposition": f'attachment; filename="{file}"'})


@post("/weights_info", status_code=200)
async def weights_info(request: Request, tenant: TenantRecord) -> dict:
    """What loading a checkpoint takes (``types.WeightsInfoResponse``): its base and LoRA shape."""
    gateway = gateway_of(request)
    checkpoint = await readable(gateway, tenant, field(await body_json(request), "tinker_path", str))
    model = await wire.read(gateway.bus, "model", checkpoint.model_id, wire.TinkerModel, checkpoint.tenant)
    return {"base_model": model.base_model if model else sorted(served_names(gateway))[0], "is_lora": True,
            "lora_rank": checkpoint.rank, "train_mlp": model.train_mlp if model else True,
            "train_attn": model.train_attn if model else True,
            "train_unembed": model.train_unembed if model else True}


def check_page(limit: int, offset: int) -> None:
    """A listing's page: a 400 past ``MAX_LISTED`` (the work per request is bounded by it)."""
    if not 1 <= limit <= MAX_LISTED or offset < 0:
        raise ApiError(400, f"limit must be 1 to {MAX_LISTED} and offset 0 or more, not {limit} and {offset}")


@get("/checkpoints")
async def list_user_checkpoints(request: Request, tenant: TenantRecord, limit: int = 100, offset: int = 0) -> dict:
    """All the tenant's checkpoints, newest first, a page at a time (``types.CheckpointsListResponse``)."""
    check_page(limit, offset)
    gateway = gateway_of(request)
    found = []
    for model in await wire.tenant_models(gateway.bus, tenant.name):
        found += await model_checkpoints(gateway, model.id)
    found.sort(key=lambda checkpoint: checkpoint.created_at, reverse=True)
    return {"checkpoints": [checkpoint_entry(c) for c in found[offset:offset + limit]],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(found)}}


async def training_run(gateway, model: wire.TinkerModel) -> dict:
    """A model as the SDK's ``types.TrainingRun``: its base, rank, last request, last checkpoints."""
    live = await wire.read(gateway.bus, "live", model.id, wire.TinkerLive)
    checkpoints = await model_checkpoints(gateway, model.id)
    last = {kind: max((c for c in checkpoints if c.kind == kind), key=lambda c: c.created_at, default=None)
            for kind in ("state", "sampler")}
    at = max(model.created_at, live.done_at if live else 0.0)
    return {"training_run_id": model.id, "base_model": model.base_model, "model_owner": model.tenant,
            "is_lora": True, "lora_rank": model.rank,
            "last_request_time": datetime.datetime.fromtimestamp(at, datetime.UTC).isoformat(),
            "last_checkpoint": checkpoint_entry(last["state"]) if last["state"] else None,
            "last_sampler_checkpoint": checkpoint_entry(last["sampler"]) if last["sampler"] else None}


@get("/training_runs/{model_id:str}")
async def get_training_run(request: Request, tenant: TenantRecord, model_id: str) -> dict:
    """One of the tenant's training runs (a model, or a copy_weights run)."""
    gateway = gateway_of(request)
    return await training_run(gateway, await owned(gateway, tenant, "model", model_id, wire.TinkerModel))


@get("/training_runs")
async def list_training_runs(request: Request, tenant: TenantRecord, limit: int = 100, offset: int = 0) -> dict:
    """The tenant's training runs, newest first, a page at a time (``types.TrainingRunsResponse``)."""
    check_page(limit, offset)
    gateway = gateway_of(request)
    models = await wire.tenant_models(gateway.bus, tenant.name)
    models.sort(key=lambda model: model.created_at, reverse=True)
    return {"training_runs": [await training_run(gateway, m) for m in models[offset:offset + limit]],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(models)}}


@post("/copy_weights", status_code=200)
async def copy_weights(request: Request, tenant: TenantRecord) -> dict:
    """Copy a checkpoint the tenant may read (its own, or a published one) into a new training run
    of the tenant's, of the same kind (``types.CopyWeightsResponse``). The copy has objects of its
    own, so deleting either leaves the other; it is never trained (the run has no session). The
    SDK's project is accepted and ignored (a tenant has none); a retry with the same
    ``X-Idempotency-Key`` is answered with the same copy."""
    gateway, body = gateway_of(request), await body_json(request)
    source = await readable(gateway, tenant, field(body, "source_path", str))
    now = time.time()
    try:
        expires_at = wire.expiry(body.get("ttl_seconds"), now)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    retry_key = request.headers.get("x-idempotency-key")
    seed = msgspec.json.encode([tenant.name, retry_key, source.path]) if retry_key else uuid.uuid4().bytes
    run_id = f"copy-{hashlib.sha256(seed).hexdigest()[:24]}"
    await COPY_QUOTA.reserve(gateway, tenant.name, run_id)  # a 429 at MAX_COPIES, however many race for it
    try:
        return {"tinker_path": await make_copy(gateway, tenant, source, run_id, now, expires_at)}
    except BaseException:
        await COPY_QUOTA.release(gateway, tenant.name, run_id)  # not made: its place is given back
        raise


async def make_copy(gateway, tenant: TenantRecord, source: wire.TinkerCheckpoint, run_id: str, now: float,
                    expires_at: float) -> str:
    """Copy ``source`` into run ``run_id`` of the tenant's (objects, then records); its tinker:// path."""
    origin = await wire.read(gateway.bus, "model", source.model_id, wire.TinkerModel, source.tenant)
    run = wire.TinkerModel(
        id=run_id, tenant=tenant.name, session="", rank=source.rank,
        base_model=origin.base_model if origin else sorted(served_names(gateway))[0],
        train_mlp=origin.train_mlp if origin else True, train_attn=origin.train_attn if origin else True,
        created_at=now, from_checkpoint=source.path)
    adapter, optimizer = await asyncio.to_thread(copy_objects, gateway.store, source,
                                                 wire.model_prefix(run, "checkpoints", "copy"))
    path = f"tinker://{run.id}/{'/'.join(source.path.rsplit('/', 2)[-2:])}"
    copy = wire.TinkerCheckpoint(path=path, tenant=tenant.name, model_id=run.id, kind=source.kind, adapter=adapter,
                                 optimizer=optimizer, rank=source.rank, created_at=now, expires_at=expires_at)
    await wire.write(gateway.bus, "checkpoint", path, copy)
    await wire.write(gateway.bus, "model", run.id, run)
    await wire.index(gateway.bus, tenant.name, run.id, path)
    return path


async def copied_runs(gateway, tenant: str) -> list[wire.TinkerModel]:
    """The tenant's runs made by copy_weights that still hold a checkpoint."""
    return [model for model in await wire.tenant_models(gateway.bus, tenant)
            if model.id.startswith("copy-") and await model_checkpoints(gateway, model.id)]


async def holds_copy(gateway, tenant: str, run_id: str) -> bool:
    """Whether the tenant's copied run ``run_id`` still holds a checkpoint."""
    run = await wire.read(gateway.bus, "model", run_id, wire.TinkerModel, tenant)
    return run is not None and bool(await model_checkpoints(gateway, run_id))


# copied runs, counted in the tenant's entry <tenant>.copies of the files bucket (a name holds no '.':
# no clash with its files' or adapters' entries) and taken by compare-and-set: 120 concurrent copies
# once made 84 against this cap, each counting the runs before any was written (issue 48, L1)
COPY_QUOTA = Quota(key=lambda tenant: f"{tenant}.copies", cap=lambda gateway: MAX_COPIES, stored=copied_runs,
                   is_stored=holds_copy, kind="copied checkpoint",
                   full=("you keep {cap} copied checkpoints, the most a tenant may (each stores the weights "
                         "again): delete_checkpoint one of them (tinker://copy-.../...) to copy more"))


def copy_objects(store: ObjectStore, source: wire.TinkerCheckpoint, prefix: str):
    """The checkpoint's files (adapter, and optimizer state if any) written again under ``prefix``:
    the (adapter, optimizer) Blobs; 404 if they are no longer stored."""
    try:
        config_json, weights = read_adapter(store, source.adapter)
        state = store.fetch(source.optimizer) if source.optimizer is not None else None
    except ObjectNotFound:
        raise ApiError(404, f"the weights of {source.path} are no longer stored") from None
    store.put_bytes(f"{prefix}/{CONFIG_FILE}", config_json)
    adapter = store.put_bytes(f"{prefix}/{WEIGHTS_FILE}", weights)
    return adapter, store.put_bytes(f"{prefix}/adamw.pt", state) if state is not None else None


SIGNED_ROUTES = [signed_weights_file]  # outside the API-key router: the URL's signature is the credential

TINKER_CHECKPOINT_ROUTER = Router(
    path="/tinker/api/v1",
    route_handlers=[delete_or_unpublish, publish, set_ttl, external_weights_urls, weights_info, list_user_checkpoints,
                    copy_weights, get_training_run, list_training_runs],
    dependencies={"tenant": Provide(tinker_tenant)}, include_in_schema=False,
)
