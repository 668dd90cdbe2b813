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

import collections
import hashlib
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from marlaas.platform.errors import TaskError
from marlaas.platform.http_api import FileInfo, is_file_id
from marlaas.platform.store import ImmutableKeyError, ObjectStore, sha256_hex

FILE_ID = re.compile(r"file-[0-9a-f]{32}")
PREFIX = "files"
EXAMPLE_LINE = '{"question": "What is 2 plus 3?", "answer": "#### 5"}'
CHECK_PIECE_BYTES = 64 * 1024  # lines are checked this many bytes' worth at a time (~15x that in objects)
DEFAULT_MAX_LINE_BYTES = 1 << 20  # gateway.max_line_bytes: what an upload's check holds of one line


class FileRefused(ValueError):
    """An upload that no job could read (not JSONL, empty, too big); the message says what to fix."""


class FileTooBig(FileRefused):
    """An upload over ``gateway.max_file_bytes`` (a 413, where other refusals are 400s)."""


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


class JsonlCheck:
    """An upload's JSONL checked as its bytes arrive, in bounded memory: each complete line is
    decoded (one JSON object) and dropped; only the unfinished last line is held, and never
    more than ``max_line_bytes`` of it. Hashes and counts as it goes. Sans-IO: :meth:`feed`
    the chunks, then :meth:`finish`; each raises :class:`FileRefused` naming what to fix."""

    def __init__(self, limit_bytes: int, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> None:
        self.limit_bytes, self.max_line_bytes = limit_bytes, max_line_bytes
        self.size = self.records = 0
        self.lines = 0  # complete lines checked so far (blank ones too: line numbers are the editor's)
        self._offset = 0  # byte offset in the file of the first byte of ``_partial``
        self._partial: list[bytes] = []
        self._partial_len = 0
        self._hash = hashlib.sha256()

    def feed(self, chunk: bytes) -> None:
        """Check the lines ``chunk`` completes; keep its unfinished tail for the next chunk."""
        self.size += len(chunk)
        if self.size > self.limit_bytes:
            raise too_big(self.limit_bytes)
        self._hash.update(chunk)
        for start in range(0, len(chunk), CHECK_PIECE_BYTES):  # a piece's lines are split out at once
            self._feed(chunk[start:start + CHECK_PIECE_BYTES])

    def _feed(self, chunk: bytes) -> None:
        cut = chunk.rfind(b"\n")
        if cut < 0:
            self._hold(chunk)
            return
        block = b"".join([*self._partial, chunk[:cut]])
        self._partial, self._partial_len = [], 0
        self._check_block(block)
        self._offset += len(block) + 1
        self._hold(chunk[cut + 1:])

    def finish(self) -> tuple[str, int]:
        """The upload's sha256 and record count, once its last line is checked."""
        if self._partial_len:
            self._check_block(b"".join(self._partial))
        if not self.records:
            raise FileRefused(f"the file is empty (no JSON object on any line): upload a JSONL file with one "
                              f"record per line, e.g. {EXAMPLE_LINE}")
        return self._hash.hexdigest(), self.records

    def _hold(self, tail: bytes) -> None:
        self._partial_len += len(tail)
        if self._partial_len > self.max_line_bytes:
            raise self._too_long(self.lines + 1)
        if tail:
            self._partial.append(tail)

    def _too_long(self, lineno: int) -> FileRefused:
        return FileRefused(f"line {lineno} is longer than {self.max_line_bytes} bytes (gateway.max_line_bytes): "
                           "split the record, or ask the operator to raise the limit")

    def _check_block(self, block: bytes) -> None:
        """Check the complete lines of ``block``: all at once (fast), or one by one to name the
        first bad one."""
        lines = block.split(b"\n")
        if max(map(len, lines)) > self.max_line_bytes:
            longest = next(i for i, line in enumerate(lines) if len(line) > self.max_line_bytes)
            raise self._too_long(self.lines + longest + 1)
        try:
            nonblank = list(filter(None, lines))
            collections.deque(map(_OBJECT.decode, nonblank), maxlen=0)  # decoded and dropped
            records = len(nonblank)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            records = self._check_each(lines)  # a bad line, or one of blanks only ("  ", "\r")
        self.records += records
        self.lines += len(lines)

    def _check_each(self, lines: list[bytes]) -> int:
        """The records of ``lines`` checked one by one: raises for the first that is not a JSON
        object (blank ones pass)."""
        offset, records = self._offset, 0
        for i, line in enumerate(lines):
            if line.strip():
                _check_line(line, self.lines + i + 1, offset)
                records += 1
            offset += len(line) + 1
        return records


_OBJECT = msgspec.json.Decoder(dict)


def _check_line(line: bytes, lineno: int, offset: int) -> None:
    """:class:`FileRefused` unless ``line`` (at byte ``offset`` of the file) is one JSON object."""
    try:
        record = msgspec.json.decode(line)
    except (msgspec.DecodeError, RecursionError) as exc:
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise FileRefused(f"the file is not UTF-8 text (byte {offset + bad.start}): save it as UTF-8 JSONL "
                              f"(line {lineno} is the first such)") from None
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise FileRefused(f"line {lineno} is not JSON ({reason}): write one JSON object per line, "
                          f"e.g. {EXAMPLE_LINE}") from None
    if not isinstance(record, dict):
        raise FileRefused(f"line {lineno} is a JSON {type(record).__name__}, not an object: write one "
                          f"JSON object per line, e.g. {EXAMPLE_LINE}")


def count_records(data: bytes, limit_bytes: int, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> int:
    """The JSON objects of a JSONL upload, one per non-blank line; :class:`FileRefused` names the
    first line that is not one, or says the file is empty or over ``limit_bytes``."""
    if len(data) > limit_bytes:
        raise too_big(limit_bytes)
    check = JsonlCheck(limit_bytes, max_line_bytes)
    check.feed(data)
    return check.finish()[1]


def too_big(limit_bytes: int) -> FileTooBig:
    return FileTooBig(f"the file is larger than {limit_bytes} bytes (gateway.max_file_bytes): upload a "
                       "smaller file (fewer records), or ask the operator to raise the limit")


def put_file(store: ObjectStore, tenant: str, data: bytes, name: str = "", limit_bytes: int = 1 << 62) -> FileInfo:
    """Check ``data`` as JSONL and store it as one of ``tenant``'s files; the same bytes again
    return the file already stored (with its first name)."""
    records = count_records(data, limit_bytes)
    file_id = file_id_of(data)
    blob = store.put_bytes(data_key(tenant, file_id), data)  # immutable: the same bytes are a no-op
    return _put_record(store, tenant, FileInfo(id=file_id, size=blob.size, sha256=blob.sha256, records=records,
                                               name=name[:256], created_at=time.time()))


def put_local_file(store: ObjectStore, tenant: str, path: str | os.PathLike, sha256: str, records: int,
                   name: str = "") -> FileInfo:
    """Store the checked upload at ``path`` (its ``sha256`` and ``records`` from a
    :class:`JsonlCheck`) as one of ``tenant``'s files, without reading it whole into memory."""
    file_id = f"file-{sha256[:32]}"
    size = os.path.getsize(path)
    store_local_file(store, data_key(tenant, file_id), path)
    return _put_record(store, tenant, FileInfo(id=file_id, size=size, sha256=sha256, records=records,
                                               name=name[:256], created_at=time.time()))


def _put_record(store: ObjectStore, tenant: str, record: FileInfo) -> FileInfo:
    """Write a file's record after its bytes; one already there (the same bytes uploaded before,
    perhaps under another name) stays, and is returned."""
    try:
        store.put_bytes(record_key(tenant, record.id), msgspec.json.encode(record))
    except ImmutableKeyError:
        return read_file_record(store, tenant, record.id) or record
    return record




def store_local_file(store: ObjectStore, key: str, path: str | os.PathLike) -> None:
    """Copy the file at ``path`` to ``key``, streamed (:meth:`ObjectStore.put_path`). A key already
    there is left alone: file keys are named by their content's sha256, so it holds these bytes."""
    if not store.exists(key):
        store.put_path(key, path)


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


def count_lines(path: Path, chunk_bytes: int = 1 << 20) -> int:
    """The lines of the file at ``path`` (a last one without its newline too), read a chunk at a time."""
    lines, last = 0, b"\n"
    with open(path, "rb") as data:
        while chunk := data.read(chunk_bytes):
            lines, last = lines + chunk.count(b"\n"), chunk[-1:]
    return lines + (last != b"\n")


FILES_BUCKET = "files"  # KV: per tenant, the ids its file quota counts (FileHoldings)
RESERVATION_GRACE_S = 300.0  # an id reserved this long ago whose file is not stored was a crashed upload


class FileHoldings(msgspec.Struct, kw_only=True, frozen=True):
    """The file ids a tenant's quota counts, each with when it was reserved: stored files and
    uploads being stored. Updated only by compare-and-set, so gateway replicas uploading for one
    tenant at once cannot both take its last free place (a check of the listing, then a write,
    could: 72 files were held against a quota of 64)."""

    files: dict[str, float] = {}


def plan_reservation(held: dict[str, float], file_id: str, cap: int, now: float,
                     stored: set[str] | None = None) -> dict[str, float] | None:
    """The holdings with ``file_id`` reserved, or None when the tenant has ``cap`` already. An id
    already held costs nothing (the same bytes again). Given the ids ``stored`` now, reservations
    of files never stored (an upload that crashed, a deletion cut short) older than
    ``RESERVATION_GRACE_S`` are dropped first."""
    if file_id in held:
        return held
    if len(held) >= cap and stored is not None:
        held = {f: at for f, at in held.items() if f in stored or now - at < RESERVATION_GRACE_S}
    if len(held) >= cap:
        return None
    return {**held, file_id: now}


TaskLookup = Callable[[str, str | None, str | None], Any]  # (task name, dataset, corpus) -> a task


class DataFiles:
    """Where the services read a job's data: a tenant's uploaded file, fetched once from the
    object store into ``cache_dir`` (named by its sha256, verified), or a path as given (only
    the platform's own jobs, submitted over NATS, or the gateway's operator-allowed directory)."""

    def __init__(self, store: ObjectStore, cache_dir: str | Path, get_task: TaskLookup) -> None:
        self.store = store
        self.cache_dir = Path(cache_dir)
        self.get_task = get_task  # marlaas.tasks.get_task: the platform's data layer names no task

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

    def size(self, tenant: str, ref: str, count_within: int) -> tuple[int, int] | None:
        """The records and bytes of a job's data field, known without reading its data: an uploaded
        file's from its record (counted at upload); a path's bytes from the file system, and its
        records counted as lines (an upper bound) only when it is within ``count_within`` bytes
        (past them, its bytes say enough). None: no such file (reading the job's data says so)."""
        if is_file_id(ref):
            record = read_file_record(self.store, tenant, ref)
            return None if record is None else (record.records, record.size)
        path = Path(ref).expanduser()
        if not path.is_file():
            return None
        size = path.stat().st_size
        return (count_lines(path) if size <= count_within else 0), size

    def task(self, tenant: str, name: str, dataset: str | None, corpus: str | None = None):
        """The task ``name`` over the job's data; an error names the file as the job did (its id),
        never the cache path it was read from."""
        local = {ref: self.local_path(tenant, ref) for ref in (dataset, corpus) if is_file_id(ref)}
        try:
            return self.get_task(name, local.get(dataset, dataset), local.get(corpus, corpus))
        except TaskError as exc:
            message = str(exc)
            for ref, path in local.items():
                message = message.replace(path, ref)
            raise TaskError(message) from None
