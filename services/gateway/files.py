"""The ``/v1/files`` endpoints: a tenant's data files (JSONL datasets and corpora).

A job names its data by file id (``dataset = "file-..."``), never by a path on the server.
Every endpoint acts for the token's tenant only: another tenant's file answers exactly like a
missing one (404, same body) and never shows up in a list.

An upload never sits whole in memory: it streams to a temp file while :class:`JsonlCheck`
checks each line as it completes (holding at most ``gateway.max_line_bytes`` of one) and
hashes it, then goes to the store from that file. A tenant sends at most
``gateway.max_uploads_per_tenant`` at once to one replica. Its file quota is one KV entry
(:class:`FileHoldings`) taken by compare-and-set before the file is stored, so concurrent
uploads on any replicas cannot pass ``gateway.max_files`` between a check and a write.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from litestar import Request, delete, get, post

from marlaas.platform.bus import StaleRevision
from marlaas.platform.files import (
    FILES_BUCKET,
    FileHoldings,
    FileRefused,
    FileTooBig,
    JsonlCheck,
    delete_file,
    list_files,
    plan_reservation,
    put_local_file,
    read_file_record,
    too_big,
)
from marlaas.platform.http_api import FileDeleted, FileInfo
from marlaas.platform.store import make_private_dirs
from marlaas.platform.tenants import TenantRecord
from services.gateway.context import ApiError, Gateway, gateway_of

CHECK_BYTES = 256 * 1024  # the body is checked and written in pieces of about this size, off the event loop
CAS_TRIES = 100  # compare-and-set rounds on a tenant's holdings: each round one of its racing uploads wins


def file_not_found(file_id: str) -> ApiError:
    """The one answer for a file that is missing or another tenant's (the same body either way)."""
    return ApiError(404, f"no file {file_id!r}: GET /v1/files lists your files")


def _take(check: JsonlCheck, out, pieces: list[bytes]) -> None:
    """Check and write a few chunks of the body (in a worker thread: both block)."""
    for piece in pieces:
        check.feed(piece)
        out.write(piece)


async def receive_upload(request: Request, check: JsonlCheck, out) -> None:
    """Stream the request body into ``out`` through ``check``, never more than ``CHECK_BYTES`` of
    it in memory; a 413 as soon as it passes the size limit (by its Content-Length, if sent)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > check.limit_bytes:
        raise too_big(check.limit_bytes)
    pending: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        pending.append(chunk)
        size += len(chunk)
        if size >= CHECK_BYTES:
            await asyncio.to_thread(_take, check, out, pending)
            pending, size = [], 0
    await asyncio.to_thread(_take, check, out, pending)


@post("/files", status_code=201, request_max_body_size=None, summary="Upload a data file (JSONL)",
      description="Body: the file's bytes, one JSON object per line (a dataset or a corpus), at most "
                  "gateway.max_file_bytes, each line at most gateway.max_line_bytes. ?name= labels it in listings. "
                  "Answers its id (from its content: the same bytes again are the same file), size and sha256; "
                  'a job names it as dataset = "file-..." (or corpus, eval_dataset). 429 past gateway.max_files '
                  "files, or gateway.max_uploads_per_tenant uploads at once.")
async def upload_file(request: Request, tenant: TenantRecord, name: str = "") -> FileInfo:
    gateway = gateway_of(request)
    cfg = gateway.config.gateway
    with gateway.uploads.held(tenant.name):
        folder = gateway.config.home_dir / "uploads"
        await asyncio.to_thread(make_private_dirs, folder)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{tenant.name}.", suffix=".tmp")
        try:
            check = JsonlCheck(cfg.max_file_bytes, cfg.max_line_bytes)
            try:
                with os.fdopen(fd, "wb") as out:
                    await receive_upload(request, check, out)
                sha256, records = check.finish()
            except FileRefused as exc:
                raise ApiError(413 if isinstance(exc, FileTooBig) else 400, str(exc)) from None
            return await store_upload(gateway, tenant.name, Path(tmp), sha256, records, name)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


async def store_upload(gateway: Gateway, tenant: str, path: Path, sha256: str, records: int, name: str) -> FileInfo:
    """Take the file's place in the tenant's quota, then store it; the place is given back if
    storing fails."""
    file_id = f"file-{sha256[:32]}"
    await FILE_QUOTA.reserve(gateway, tenant, file_id)
    try:
        return await asyncio.to_thread(put_local_file, gateway.store, tenant, path, sha256, records, name)
    except BaseException:
        await FILE_QUOTA.release(gateway, tenant, file_id)
        raise


def in_store(read: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    """``read(store, *args)`` as a :class:`Quota` lookup: on the gateway's object store, off the event loop."""
    async def lookup(gateway: Gateway, *args):
        return await asyncio.to_thread(read, gateway.store, *args)

    return lookup


@dataclass(frozen=True)
class Quota:
    """What a tenant may hold of one kind (its files, its adapters, its copied Tinker checkpoints),
    counted in one entry of the ``files`` bucket per tenant and taken by compare-and-set before a
    thing is stored, so that requests racing on any replicas cannot pass ``cap`` between a check
    and a write."""

    key: Callable[[str], str]  # the tenant's entry
    cap: Callable[[Gateway], int]
    stored: Callable[[Gateway, str], Awaitable[list]]  # the tenant's stored records (``id``, ``created_at``)
    is_stored: Callable[[Gateway, str, str], Awaitable[object]]  # one of them by id (falsy: not stored)
    full: str  # the 429's text, ``{cap}`` filled in
    kind: str  # "file", "adapter", "copied checkpoint"

    async def holdings(self, gateway: Gateway, tenant: str) -> tuple[dict[str, float], int]:
        """The tenant's holdings and their KV revision (0: none yet; then what it has stored,
        which uploads made before the holdings existed left)."""
        entry = await gateway.bus.kv_get(FILES_BUCKET, self.key(tenant))
        if entry is None:
            return {r.id: r.created_at for r in await self.stored(gateway, tenant)}, 0
        return msgspec.json.decode(entry.value, type=FileHoldings).files, entry.revision

    async def write(self, gateway: Gateway, tenant: str, held: dict[str, float], revision: int) -> bool:
        """Compare-and-set the holdings; False when another upload or deletion wrote first."""
        value = msgspec.json.encode(FileHoldings(files=held))
        try:
            if revision:
                await gateway.bus.kv_update(FILES_BUCKET, self.key(tenant), value, revision)
            else:
                await gateway.bus.kv_create(FILES_BUCKET, self.key(tenant), value)
        except StaleRevision:
            await asyncio.sleep(random.uniform(0.0, 0.02))  # racing uploads spread out their next round
            return False
        return True

    async def reserve(self, gateway: Gateway, tenant: str, ident: str) -> None:
        """Count ``ident`` in the tenant's holdings (a no-op if it is already); a 429 at the cap."""
        cap = self.cap(gateway)
        for _ in range(CAS_TRIES):
            held, revision = await self.holdings(gateway, tenant)
            now = time.time()
            plan = plan_reservation(held, ident, cap, now)
            if plan is None:  # full: look whether some places are held by uploads that never finished
                stored = {r.id for r in await self.stored(gateway, tenant)}
                plan = plan_reservation(held, ident, cap, now, stored)
            if plan is None:
                raise ApiError(429, self.full.format(cap=cap))
            if ident in held or await self.write(gateway, tenant, plan, revision):
                return
        raise ApiError(503, f"too many of your requests changed your {self.kind} list at once: retry in a moment")

    async def release(self, gateway: Gateway, tenant: str, ident: str) -> None:
        """Stop counting ``ident``, unless it is stored (the same bytes, by another upload)."""
        for _ in range(CAS_TRIES):
            entry = await gateway.bus.kv_get(FILES_BUCKET, self.key(tenant))
            if entry is None:
                return
            held = msgspec.json.decode(entry.value, type=FileHoldings).files
            if ident not in held or await self.is_stored(gateway, tenant, ident):
                return
            rest = {i: at for i, at in held.items() if i != ident}
            if await self.write(gateway, tenant, rest, entry.revision):
                return
        # left counted: the next upload at the cap drops it once RESERVATION_GRACE_S has passed


FILE_QUOTA = Quota(key=lambda tenant: tenant, cap=lambda gateway: gateway.config.gateway.max_files,
                   stored=in_store(list_files), is_stored=in_store(read_file_record), kind="file",
                   full=("you already have {cap} files (gateway.max_files): delete one you no longer need "
                         "(DELETE /v1/files/{{id}}; GET /v1/files lists them), then upload again"))


@get("/files", summary="Your data files, oldest first")
async def get_files(request: Request, tenant: TenantRecord) -> list[FileInfo]:
    return await asyncio.to_thread(list_files, gateway_of(request).store, tenant.name)


@delete("/files/{file_id:str}", status_code=200, summary="Delete one of your data files",
        description="Jobs already running keep the copy their services fetched; a replica that has none "
                    "fails the job.")
async def remove_file(request: Request, tenant: TenantRecord, file_id: str) -> FileDeleted:
    gateway = gateway_of(request)
    if not await asyncio.to_thread(delete_file, gateway.store, tenant.name, file_id):
        raise file_not_found(file_id)
    await FILE_QUOTA.release(gateway, tenant.name, file_id)
    return FileDeleted(id=file_id)


FILE_ROUTES = [upload_file, get_files, remove_file]
