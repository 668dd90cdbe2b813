"""Object store for adapters, optimizer state and big trajectory batches.

Two backends chosen by URL: ``file://DIR`` (the embedded default; atomic write by
temp file + rename, so a crash never leaves a partial object) and
``s3://bucket/prefix`` through the ``minio`` SDK (MinIO or any S3-compatible
server; endpoint and credentials from the arguments or ``MARLAAS_S3_*`` env vars).

Every write is immutable: writing the same bytes to an existing key is a no-op,
writing different bytes is an :class:`ImmutableKeyError`.

A file store holds every tenant's adapters, so it is private to its owner: the folders it
creates are 0700 (the root, and any missing parents such as ``<home>``) and its files 0600.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import io
import os
import shutil
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

from marlaas.platform.events import Blob


class ImmutableKeyError(Exception):
    """A write tried to replace an existing object with different bytes."""


class ObjectNotFound(KeyError):
    """No object under that key."""


class ChecksumMismatch(Exception):
    """The bytes read do not match the sha256 they were announced with."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ObjectStore(abc.ABC):
    """put/get/exists/list/delete of bytes and files, addressed by key, with sha256."""

    url: str

    @abc.abstractmethod
    def _read(self, key: str) -> bytes: ...

    @abc.abstractmethod
    def _write_new(self, key: str, data: bytes) -> None:
        """Write ``data`` under ``key`` atomically (whole or not at all).

        Immutability is checked before this write, not by it: two writers racing on one
        key could both pass the check. The services never do that: every attempt at a
        version writes under its own attempt-unique prefix (``marlaas.platform.adapters``).
        """

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]: ...

    def interrupted_writes(self, prefix: str = "") -> list[str]:
        """Keys of writes a killed writer left unfinished under ``prefix``, which :meth:`list`
        never shows; garbage collection deletes them with their attempt. The default finds
        none, which is right for S3, whose PUTs are atomic; :class:`FileStore` overrides it."""
        return []

    def collectable(self, prefix: str = "") -> list[str]:
        """Every key garbage collection may delete under ``prefix``: :meth:`list`'s and
        :meth:`interrupted_writes`'s (a store that can tell both in one listing does)."""
        return self.list(prefix) + self.interrupted_writes(prefix)

    @abc.abstractmethod
    def delete(self, key: str) -> None: ...

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object whose key starts with ``prefix``; return how many there were.

        End the prefix with ``/`` to mean a folder (``adapters/<job>/`` must not also take
        ``adapters/<job>x/``). An empty prefix is refused: it would empty the whole store.
        """
        keys = self.list(_checked_prefix(prefix))
        for key in keys:
            self.delete(key)
        return len(keys)

    def uri(self, key: str) -> str:
        return f"{self.url.rstrip('/')}/{key}"

    def key_of(self, uri: str) -> str:
        base = self.url.rstrip("/") + "/"
        if not uri.startswith(base):
            raise ValueError(f"{uri!r} is not in this store ({self.url})")
        return uri[len(base):]

    def put_bytes(self, key: str, data: bytes) -> Blob:
        """Store ``data`` under ``key`` (immutable) and return its reference."""
        digest = sha256_hex(data)
        if self.exists(key):
            if sha256_hex(self._read(key)) != digest:
                raise ImmutableKeyError(
                    f"{self.uri(key)} already holds different bytes; versioned keys are "
                    "immutable: write the new payload under a new version"
                )
        else:
            self._write_new(key, data)
        return Blob(uri=self.uri(key), sha256=digest, size=len(data))

    def get_bytes(self, key: str, sha256: str | None = None) -> bytes:
        """Read ``key``; when ``sha256`` is given, verify it."""
        data = self._read(key)
        if sha256 is not None and sha256_hex(data) != sha256:
            raise ChecksumMismatch(f"{self.uri(key)}: sha256 {sha256_hex(data)} != expected {sha256}")
        return data

    def fetch(self, blob: Blob) -> bytes:
        """Read the bytes a :class:`Blob` points at, verified."""
        return self.get_bytes(self.key_of(blob.uri), blob.sha256)

    def put_file(self, key: str, path: str | os.PathLike) -> Blob:
        return self.put_bytes(key, Path(path).read_bytes())

    def put_path(self, key: str, path: str | os.PathLike) -> None:
        """Copy the file at ``path`` to ``key`` streamed, in bounded memory (``put_file`` reads it
        whole), and whole or not at all. The caller checks the key is new (no sha256 is kept)."""
        self.put_file(key, path)

    def get_file(self, key: str, path: str | os.PathLike, sha256: str | None = None, *, durable: bool = True) -> Path:
        """Copy ``key`` to ``path`` (atomically) and return the path. ``durable=False``: no fsync,
        for a scratch copy that no later process reads (a crash loses nothing the store lacks)."""
        path = Path(path)
        _atomic_write(path, self.get_bytes(key, sha256), durable=durable)
        return path


def _checked_prefix(prefix: str) -> str:
    if not prefix.strip("/"):
        raise ValueError("delete_prefix needs a non-empty prefix (e.g. 'adapters/<job>/'); "
                         "refusing to delete the whole store")
    return prefix


def make_private_dirs(path: Path) -> None:
    """Create ``path`` and its missing parents, each readable by its owner only (0700); folders
    that exist keep their mode (``mkdir -p`` would give the new parents the umask's 0755)."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another writer made it just now
            folder.mkdir(mode=0o700)


S3_PART_BYTES = 8 << 20  # what a streamed S3 upload holds in memory at once (S3's minimum part is 5 MiB)


def _atomic_write(path: Path, data: bytes | Path, durable: bool = True) -> None:
    """Write ``data`` (bytes, or the file at that path, copied streamed) to ``path`` through a
    temp file renamed into place: readers never see half of it."""
    make_private_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # created 0600
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(data, Path):
                with data.open("rb") as src:
                    shutil.copyfileobj(src, f)
            else:
                f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class FileStore(ObjectStore):
    """Objects as plain files under a directory; temp files (``.*.tmp``) are never listed."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).resolve()
        make_private_dirs(self.root)
        self.url = f"file://{self.root}"

    def path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root not in path.parents:
            raise ValueError(f"key {key!r} escapes the store root")
        return path

    def _read(self, key: str) -> bytes:
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError as exc:
            raise ObjectNotFound(self.uri(key)) from exc

    def _write_new(self, key: str, data: bytes) -> None:
        _atomic_write(self.path(key), data)

    def put_path(self, key: str, path: str | os.PathLike) -> None:
        _atomic_write(self.path(key), Path(path))

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def list(self, prefix: str = "") -> list[str]:
        """Keys starting with ``prefix``, from a walk of the prefix's folder only. A folder
        deleted during the walk (another job's garbage collection) is skipped, not an error."""
        return self._walk(prefix, temporary=False)

    def interrupted_writes(self, prefix: str = "") -> list[str]:
        """The temp files (``.*.tmp``) under ``prefix``: a writer killed between creating one and
        renaming it into place leaves it behind."""
        return self._walk(prefix, temporary=True)

    def collectable(self, prefix: str = "") -> list[str]:
        """The objects and temp files under ``prefix``, from one walk."""
        return self._walk(prefix, temporary=None)

    def _walk(self, prefix: str, temporary: bool | None) -> list[str]:
        """Keys under ``prefix`` of temp files (True), of objects (False) or of both (None)."""
        folder = prefix.rpartition("/")[0]
        keys = []
        for parent, _, names in os.walk(self.path(folder) if folder else self.root):  # errors skip the folder
            for name in names:
                key = Path(parent, name).relative_to(self.root).as_posix()
                if key.startswith(prefix) and temporary in (None, name.endswith(".tmp")):
                    keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(key).unlink()

    def delete_prefix(self, prefix: str) -> int:
        """Delete the objects under ``prefix``, then the folders that left empty (temp files too)."""
        count = super().delete_prefix(prefix)
        folder = self.root / prefix.rstrip("/") if prefix.endswith("/") else None
        if folder is not None and folder.is_dir() and self.root in folder.resolve().parents:
            shutil.rmtree(folder, ignore_errors=True)  # leftovers: a crashed writer's .tmp files
            folder = folder.parent
        else:
            folder = self.path(prefix).parent
        # prune the now-empty parents, short of the top-level folders (a writer may be creating
        # a sibling in one: mkdir then write, with no lock between them)
        while folder.parent != self.root and self.root in folder.parents:
            try:
                folder.rmdir()
            except OSError:  # not empty (or gone): stop here
                break
            folder = folder.parent
        return count


CONNECT_WAIT_S = 120.0  # a service's first connect to S3: how long it waits for the server


class S3Store(ObjectStore):
    """Objects in an S3 bucket through the minio SDK; S3 PUTs are atomic by nature."""

    def __init__(
        self, bucket: str, prefix: str = "", *, endpoint: str | None = None,
        access_key: str | None = None, secret_key: str | None = None, secure: bool | None = None,
        connect_wait_s: float = CONNECT_WAIT_S,
    ) -> None:
        from minio import Minio

        endpoint = endpoint or os.environ.get("MARLAAS_S3_ENDPOINT", "127.0.0.1:9000")
        parsed = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
        if secure is None:
            secure = parsed.scheme == "https"
        self.client = Minio(
            parsed.netloc,
            access_key=access_key or os.environ.get("MARLAAS_S3_ACCESS_KEY", "minioadmin"),
            secret_key=secret_key or os.environ.get("MARLAAS_S3_SECRET_KEY", "minioadmin"),
            secure=secure,
        )
        self.endpoint = parsed.netloc
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        if not self._bucket_exists_once_reachable(connect_wait_s):
            from minio.error import S3Error

            try:  # every service makes it if missing; two may race to
                self.client.make_bucket(bucket)
            except S3Error as exc:
                if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

    def _bucket_exists_once_reachable(self, wait_s: float) -> bool:
        """``bucket_exists``, waiting up to ``wait_s`` for the server to answer: in a deployment
        the services may start before the object store does (found by `make deploy-test`, where a
        replica that gave up at once was never restarted)."""
        import structlog
        from urllib3.exceptions import HTTPError

        deadline, told = time.monotonic() + wait_s, False
        while True:
            try:
                return self.client.bucket_exists(self.bucket)
            except (HTTPError, OSError) as exc:
                if not told:  # once: a misconfigured endpoint shows in the log at once, not in 120 s
                    structlog.get_logger("store").warning("object store not answering yet; waiting",
                                                          endpoint=self.endpoint, wait_s=wait_s, error=str(exc))
                    told = True
                if time.monotonic() >= deadline:
                    raise ConnectionError(f"the object store at {self.endpoint} did not answer "
                                          f"within {wait_s:.0f} s: {exc}") from exc
                time.sleep(1.0)

    def _name(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _read(self, key: str) -> bytes:
        from minio.error import S3Error

        try:
            resp = self.client.get_object(self.bucket, self._name(key))
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject"):
                raise ObjectNotFound(self.uri(key)) from exc
            raise
        try:
            return resp.read()
        finally:
            resp.close()
            resp.release_conn()

    def _write_new(self, key: str, data: bytes) -> None:
        # part_size=len: one PUT, never multipart, so the object appears whole or not at all
        self.client.put_object(
            self.bucket, self._name(key), io.BytesIO(data), length=len(data),
            part_size=max(len(data), 5 * 1024 * 1024),
        )

    def put_path(self, key: str, path: str | os.PathLike) -> None:
        # a multipart upload appears only once completed, so it too is whole or nothing
        with open(path, "rb") as src:
            self.client.put_object(self.bucket, self._name(key), src, length=os.path.getsize(path),
                                   part_size=S3_PART_BYTES, num_parallel_uploads=1)

    def exists(self, key: str) -> bool:
        from minio.error import S3Error

        try:
            self.client.stat_object(self.bucket, self._name(key))
            return True
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject", "NotFound"):
                return False
            raise

    def list(self, prefix: str = "") -> list[str]:
        start = len(self.prefix) + 1 if self.prefix else 0
        objects = self.client.list_objects(self.bucket, prefix=self._name(prefix), recursive=True)
        return sorted(o.object_name[start:] for o in objects)

    def delete(self, key: str) -> None:
        self.client.remove_object(self.bucket, self._name(key))

    def delete_prefix(self, prefix: str) -> int:
        """Delete the objects under ``prefix`` in batches (one S3 DeleteObjects per 1,000 keys)."""
        from minio.deleteobjects import DeleteObject

        keys = self.list(_checked_prefix(prefix))
        errors = list(self.client.remove_objects(self.bucket, [DeleteObject(self._name(k)) for k in keys]))
        if errors:
            raise OSError(f"{len(errors)} objects under {self.uri(prefix)} were not deleted: {errors[0]}")
        return len(keys)


def open_store(url: str) -> ObjectStore:
    """``file:///abs/dir`` or ``s3://bucket[/prefix]``; anything else is a clear error."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        # file://dir/x parses as host "dir" + path "/x": refuse it rather than write to /x
        if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
            raise ValueError(
                f"store URL {url!r} is not an absolute path: use file:///ABS/DIR (three slashes)"
            )
        return FileStore(parsed.path)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"store URL {url!r} names no bucket: use s3://BUCKET[/PREFIX]")
        return S3Store(parsed.netloc, parsed.path)
    raise ValueError(f"unsupported store URL {url!r}: use file:///DIR or s3://BUCKET[/PREFIX]")
