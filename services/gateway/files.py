"""The ``/v1/files`` endpoints: a tenant's data files (JSONL datasets and corpora).

A job names its data by file id (``dataset = "file-..."``), never by a path on the server.
Every endpoint acts for the token's tenant only: another tenant's file answers exactly like a
missing one (404, same body) and never shows up in a list.
"""

from __future__ import annotations

import asyncio

from litestar import Request, delete, get, post

from marlaas.platform.files import FileRefused, delete_file, file_id_of, list_files, put_file, too_big
from marlaas.platform.http_api import FileDeleted, FileInfo
from marlaas.platform.tenants import TenantRecord
from services.gateway.app import ApiError, gateway_of


def file_not_found(file_id: str) -> ApiError:
    """The one answer for a file that is missing or another tenant's (the same body either way)."""
    return ApiError(404, f"no file {file_id!r}: GET /v1/files lists your files")


async def read_upload(request: Request, limit_bytes: int) -> bytes:
    """The request body, read no further than ``limit_bytes`` (413 beyond, naming the setting)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit_bytes:
        raise ApiError(413, str(too_big(limit_bytes)))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit_bytes:
            raise ApiError(413, str(too_big(limit_bytes)))
        chunks.append(chunk)
    return b"".join(chunks)


@post("/files", status_code=201, request_max_body_size=None, summary="Upload a data file (JSONL)",
      description="Body: the file's bytes, one JSON object per line (a dataset or a corpus), at most "
                  "gateway.max_file_bytes. ?name= labels it in listings. Answers its id (from its content: "
                  "the same bytes again are the same file), size and sha256; a job names it as "
                  'dataset = "file-..." (or corpus, eval_dataset).')
async def upload_file(request: Request, tenant: TenantRecord, name: str = "") -> FileInfo:
    gateway = gateway_of(request)
    limit = gateway.config.gateway.max_file_bytes
    data = await read_upload(request, limit)
    files = await asyncio.to_thread(list_files, gateway.store, tenant.name)
    cap = gateway.config.gateway.max_files
    if len(files) >= cap and file_id_of(data) not in {f.id for f in files}:
        raise ApiError(429, f"you already have {cap} files (gateway.max_files): delete one you no longer "
                            "need (DELETE /v1/files/{id}; GET /v1/files lists them), then upload again")
    try:
        return await asyncio.to_thread(put_file, gateway.store, tenant.name, data, name, limit)
    except FileRefused as exc:
        raise ApiError(413 if len(data) > limit else 400, str(exc)) from None


@get("/files", summary="Your data files, oldest first")
async def get_files(request: Request, tenant: TenantRecord) -> list[FileInfo]:
    return await asyncio.to_thread(list_files, gateway_of(request).store, tenant.name)


@delete("/files/{file_id:str}", status_code=200, summary="Delete one of your data files",
        description="Jobs already running keep the copy their services fetched; a replica that has none "
                    "fails the job.")
async def remove_file(request: Request, tenant: TenantRecord, file_id: str) -> FileDeleted:
    if not await asyncio.to_thread(delete_file, gateway_of(request).store, tenant.name, file_id):
        raise file_not_found(file_id)
    return FileDeleted(id=file_id)


FILE_ROUTES = [upload_file, get_files, remove_file]
