"""The ``/v1/adapters`` endpoints: a tenant's uploaded LoRA adapters, which a job starts from
with ``init_from = "adapter-..."``.

An upload is the adapter directory PEFT's ``save_pretrained`` writes, as a ``.tar.gz`` (what
``marlaas pull`` downloads). Untrusted: the body is refused past ``MAX_BODY_BYTES`` (by its
Content-Length, and counted as it arrives) and goes to a temp file; only its two files are
read out of the archive, bounded (:func:`~marlaas.platform.adapter_archives.read_adapter_archive`),
and checked against this stack's engine and base model
(:func:`~marlaas.platform.adapter_uploads.adapter_problem_on_base`), off the event loop; a
refusal is a 400 naming what is wrong. Every endpoint acts for the token's tenant only: another
tenant's adapter answers exactly like a missing one (404, same body).

Holding an adapter costs up to 256 MiB of the store, so a tenant holds at most
``MAX_ADAPTERS_PER_TENANT`` (16: 4 GiB), not ``gateway.max_files`` (64 data files of 64 MiB):
counted like files, by compare-and-set on one KV entry per tenant (its ids, in the ``files``
bucket under ``<tenant>.adapters``), so uploads on several replicas cannot pass it together.
A replica checks at most ``MAX_ADAPTER_UPLOADS`` adapters at once, one per tenant: each holds
its weights in memory while they are checked and stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from pathlib import Path

from litestar import Request, delete, get, post

from marlaas.platform.adapter_archives import MAX_ARCHIVE_BYTES, read_adapter_archive
from marlaas.platform.adapter_uploads import (
    MAX_ADAPTERS_PER_TENANT,
    AdapterRefused,
    adapter_id_of,
    adapter_problem_on_base,
    delete_adapter,
    list_adapters,
    put_adapter,
    read_adapter_record,
)
from marlaas.platform.config import Config
from marlaas.platform.http_api import AdapterDeleted, AdapterInfo
from marlaas.platform.store import make_private_dirs
from marlaas.platform.tenants import TenantRecord
from services.gateway.context import ApiError, Slots, gateway_of
from services.gateway.files import Quota, in_store

MAX_BODY_BYTES = MAX_ARCHIVE_BYTES  # an upload as sent (gzip barely shrinks float weights)
WRITE_BYTES = 1 << 20  # the body goes to its temp file in pieces of about this size, off the event loop
MAX_ADAPTER_UPLOADS = 4  # adapters one replica checks at once (each up to ~256 MiB of weights in memory)
MAX_ADAPTER_UPLOADS_PER_TENANT = 1  # of those, one tenant's
CHECKS = Slots("adapter uploads", MAX_ADAPTER_UPLOADS_PER_TENANT, "MAX_ADAPTER_UPLOADS_PER_TENANT",
               MAX_ADAPTER_UPLOADS, "MAX_ADAPTER_UPLOADS")  # per replica, like gateway.uploads


def adapter_not_found(adapter_id: str) -> ApiError:
    """The one answer for an adapter that is missing or another tenant's (the same body either way)."""
    return ApiError(404, f"no adapter {adapter_id!r}: GET /v1/adapters lists your adapters")


def too_big() -> ApiError:
    return ApiError(413, f"the upload is larger than {MAX_BODY_BYTES >> 20} MiB: upload an adapter of a lower rank "
                         "or of fewer target modules")


async def receive_body(request: Request, out) -> None:
    """Stream the request body into ``out``; a 413 as soon as it passes ``MAX_BODY_BYTES`` (by its
    Content-Length, if sent, before any of it is read)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_big()
    pending: list[bytes] = []
    size = held = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_big()
        pending.append(chunk)
        held += len(chunk)
        if held >= WRITE_BYTES:
            await asyncio.to_thread(out.writelines, pending)
            pending, held = [], 0
    await asyncio.to_thread(out.writelines, pending)


def checked_adapter(path: Path, config: Config) -> tuple[bytes, bytes]:
    """The (config JSON, weights) of the archive at ``path``, once they pass every check against
    this stack (in a worker thread: it unpacks, parses, and may build the base model on the meta device)."""
    with open(path, "rb") as body:
        config_json, weights = read_adapter_archive(body)
    problem = adapter_problem_on_base(config_json, weights, base_model_dir=config.base_model_dir,
                                      max_rank=config.rollout.max_lora_rank)
    if problem:
        raise AdapterRefused(problem)
    return config_json, weights


@post("/adapters", status_code=201, request_max_body_size=None, summary="Upload a LoRA adapter (PEFT, .tar.gz)",
      description="Body: a .tar.gz of the directory peft's save_pretrained writes (adapter_config.json and "
                  "adapter_model.safetensors; what GET /v1/jobs/{job}/adapter answers), at most 260 MiB. It must be "
                  "plain LoRA of this stack's base model, of a rank up to rollout.max_lora_rank. ?name= labels it "
                  'in listings. Answers its id (from its content); a job starts from it with init_from = '
                  '"adapter-...". 429 past 16 adapters.')
async def upload_adapter(request: Request, tenant: TenantRecord, name: str = "") -> AdapterInfo:
    gateway = gateway_of(request)
    with gateway.uploads.held(tenant.name), CHECKS.held(tenant.name):
        folder = gateway.config.home_dir / "uploads"
        await asyncio.to_thread(make_private_dirs, folder)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{tenant.name}.", suffix=".tar.gz.tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                await receive_body(request, out)
            try:
                config_json, weights = await asyncio.to_thread(checked_adapter, Path(tmp), gateway.config)
            except AdapterRefused as exc:
                raise ApiError(400, str(exc)) from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        adapter_id = adapter_id_of(config_json, weights)
        await ADAPTER_QUOTA.reserve(gateway, tenant.name, adapter_id)
        try:
            return await asyncio.to_thread(put_adapter, gateway.store, tenant.name, config_json, weights, name)
        except BaseException:
            await ADAPTER_QUOTA.release(gateway, tenant.name, adapter_id)
            raise


def holdings_key(tenant: str) -> str:
    """The tenant's adapter holdings in the ``files`` bucket (a tenant's name holds no '.': no clash
    with its files' entry, ``<tenant>``)."""
    return f"{tenant}.adapters"


ADAPTER_QUOTA = Quota(key=holdings_key, cap=lambda gateway: MAX_ADAPTERS_PER_TENANT, stored=in_store(list_adapters),
                      is_stored=in_store(read_adapter_record), kind="adapter",
                      full=("you already have {cap} adapters, the most a tenant may: delete one you no longer "
                            "need (DELETE /v1/adapters/{{id}}; GET /v1/adapters lists them), then upload again"))


@get("/adapters", summary="Your uploaded LoRA adapters, oldest first")
async def get_adapters(request: Request, tenant: TenantRecord) -> list[AdapterInfo]:
    return await asyncio.to_thread(list_adapters, gateway_of(request).store, tenant.name)


@delete("/adapters/{adapter_id:str}", status_code=200, summary="Delete one of your uploaded adapters",
        description="A job already started from it keeps its own copy (its version 0).")
async def remove_adapter(request: Request, tenant: TenantRecord, adapter_id: str) -> AdapterDeleted:
    gateway = gateway_of(request)
    if not await asyncio.to_thread(delete_adapter, gateway.store, tenant.name, adapter_id):
        raise adapter_not_found(adapter_id)
    await ADAPTER_QUOTA.release(gateway, tenant.name, adapter_id)
    return AdapterDeleted(id=adapter_id)


ADAPTER_ROUTES = [upload_adapter, get_adapters, remove_adapter]
