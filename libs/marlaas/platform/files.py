"""Tenants' data files: JSONL uploaded through the gateway, named in a job by id.

A tenant uploads a dataset or corpus (``POST /v1/files``) and names it in a job as
``dataset = "file-..."`` (likewise ``corpus``, ``eval_dataset``); a job never names a path on
the server (the gateway refuses one), so no tenant can read another's data, or any other file
of the server, through its own reward function.

A file's id comes from its content (``file-`` and the first 32 hex digits of its sha256): one
tenant's same bytes uploaded twice are one file. Ids live in each tenant's own prefix of the
object store, ``files/<tenant>/<id>`` (the bytes) and ``files/<tenant>/<id>.json`` (its
:class:`~marlaas.platform.http_api.FileInfo`, written after the bytes, so a listed file always has them): another
tenant's id names nothing, exactly like a missing one. The services read a job's file through
:class:`DataFiles`, which fetches it once into a local cache named by its sha256.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import msgspec

from marlaas.platform.http_api import FileInfo, is_file_id
from marlaas.platform.store import ImmutableKeyError, ObjectStore, sha256_hex
from marlaas.tasks import Task, TaskError, get_task

FILE_ID = re.compile(r"file-[0-9a-f]{32}")
PREFIX = "files"
EXAMPLE_LINE = '{"question": "What is 2 plus 3?", "answer": "#### 5"}'


class FileRefused(ValueError):
    """An upload that no job could read (not JSONL, empty, too big); the message says what to fix."""


class FileMissing(TaskError):
    """A job names a file id its tenant does not have (never uploaded, deleted, or another's)."""


def file_id_of(data: bytes) -> str:
    return f"file-{sha256_hex(data)[:32]}"


def data_key(tenant: str, file_id: str) -> str:
    return f"{PREFIX}/{tenant}/{file_id}"


def record_key(tenant: str, file_id: str) -> str:
    return f"{data_key(tenant, file_id)}.json"


def missing(file_id: str) -> FileMissing:
    """The one answer for a file id that is not the tenant's (missing, deleted or another's)."""
    return FileMissing(f"no file {file_id!r} among your uploaded files: GET /v1/files lists them; upload the "
                       "JSONL with POST /v1/files (`marlaas submit` uploads a job file's local paths for you)")


def count_records(data: bytes, limit_bytes: int) -> int:
    """The JSON objects of a JSONL upload, one per non-blank line; :class:`FileRefused` names the
    first line that is not one, or says the file is empty or over ``limit_bytes``."""
    if len(data) > limit_bytes:
        raise too_big(limit_bytes)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileRefused(f"the file is not UTF-8 text (byte {exc.start}): save it as UTF-8 JSONL") from None
    count = 0
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = msgspec.json.decode(line)
        except msgspec.DecodeError as exc:
            raise FileRefused(f"line {lineno} is not JSON ({exc}): write one JSON object per line, "
                              f"e.g. {EXAMPLE_LINE}") from None
        if not isinstance(record, dict):
            raise FileRefused(f"line {lineno} is a JSON {type(record).__name__}, not an object: write one "
                              f"JSON object per line, e.g. {EXAMPLE_LINE}")
        count += 1
    if not count:
        raise FileRefused(f"the file is empty (no JSON object on any line): upload a JSONL file with one "
                          f"record per line, e.g. {EXAMPLE_LINE}")
    return count


def too_big(limit_bytes: int) -> FileRefused:
    return FileRefused(f"the file is larger than {limit_bytes} bytes (gateway.max_file_bytes): upload a "
                       "smaller file (fewer records), or ask the operator to raise the limit")


def put_file(store: ObjectStore, tenant: str, data: bytes, name: str = "", limit_bytes: int = 1 << 62) -> FileInfo:
    """Check ``data`` as JSONL and store it as one of ``tenant``'s files; the same bytes again
    return the file already stored (with its first name)."""
    records = count_records(data, limit_bytes)
    file_id = file_id_of(data)
    blob = store.put_bytes(data_key(tenant, file_id), data)  # immutable: the same bytes are a no-op
    record = FileInfo(id=file_id, size=blob.size, sha256=blob.sha256, records=records, name=name[:256],
                        created_at=time.time())
    try:
        store.put_bytes(record_key(tenant, file_id), msgspec.json.encode(record))
    except ImmutableKeyError:  # uploaded before (perhaps under another name): that record stays
        return read_file_record(store, tenant, file_id) or record
    return record


def read_file_record(store: ObjectStore, tenant: str, file_id: str) -> FileInfo | None:
    """``tenant``'s file ``file_id``, or None (a malformed id names no file)."""
    if not FILE_ID.fullmatch(file_id):
        return None
    key = record_key(tenant, file_id)
    if not store.exists(key):
        return None
    return msgspec.json.decode(store.get_bytes(key), type=FileInfo)


def list_files(store: ObjectStore, tenant: str) -> list[FileInfo]:
    """``tenant``'s files, oldest first."""
    keys = [k for k in store.list(f"{PREFIX}/{tenant}/") if k.endswith(".json")]
    records = [msgspec.json.decode(store.get_bytes(k), type=FileInfo) for k in keys]
    return sorted(records, key=lambda r: (r.created_at, r.id))


def delete_file(store: ObjectStore, tenant: str, file_id: str) -> bool:
    """Delete ``tenant``'s file (the record first: a listed file always has its bytes); False
    when it has none of that id."""
    if read_file_record(store, tenant, file_id) is None:
        return False
    store.delete(record_key(tenant, file_id))
    store.delete(data_key(tenant, file_id))
    return True


class DataFiles:
    """Where the services read a job's data: a tenant's uploaded file, fetched once from the
    object store into ``cache_dir`` (named by its sha256, verified), or a path as given (only
    the platform's own jobs, submitted over NATS, or the gateway's operator-allowed directory)."""

    def __init__(self, store: ObjectStore, cache_dir: str | Path) -> None:
        self.store = store
        self.cache_dir = Path(cache_dir)

    def local_path(self, tenant: str, ref: str | None) -> str | None:
        """The local file a job's data field names; :class:`FileMissing` for a file id ``tenant``
        does not have."""
        if not is_file_id(ref):
            return ref
        record = read_file_record(self.store, tenant, ref)
        if record is None:
            raise missing(ref)
        path = self.cache_dir / f"{record.sha256}.jsonl"
        if not path.is_file():  # written whole or not at all: readers never see half of it
            self.store.get_file(data_key(tenant, ref), path, record.sha256, durable=False)
        return str(path)

    def task(self, tenant: str, name: str, dataset: str | None, corpus: str | None = None) -> Task:
        """The task ``name`` over the job's data; an error names the file as the job did (its id),
        never the cache path it was read from."""
        local = {ref: self.local_path(tenant, ref) for ref in (dataset, corpus) if is_file_id(ref)}
        try:
            return get_task(name, local.get(dataset, dataset), local.get(corpus, corpus))
        except TaskError as exc:
            message = str(exc)
            for ref, path in local.items():
                message = message.replace(path, ref)
            raise TaskError(message) from None
