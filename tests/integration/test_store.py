"""The object store on both backends: file:// and S3 (a real SeaweedFS server through the minio SDK)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import uuid

import pytest

from marlaas.platform.store import (
    ChecksumMismatch,
    FileStore,
    ImmutableKeyError,
    ObjectNotFound,
    ObjectStore,
    S3Store,
    open_store,
)

ADAPTER_KEY = "acme.j1/v1/adapter.safetensors"


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path) -> ObjectStore:
    """Each backend in turn; the S3 one under a fresh prefix of a shared bucket."""
    if request.param == "file":
        return FileStore(tmp_path / "store")
    endpoint = request.getfixturevalue("s3_server")
    return S3Store("marlaas", prefix=f"test-{uuid.uuid4().hex[:8]}", endpoint=endpoint)


def stamp(store: ObjectStore, key: str) -> tuple:
    """What changes when an object is rewritten."""
    if isinstance(store, FileStore):
        st = store.path(key).stat()
        return (st.st_ino, st.st_mtime_ns)
    stat = store.client.stat_object(store.bucket, store._name(key))
    return (stat.etag, stat.last_modified)


def test_adapter_sized_file_round_trips_with_matching_sha256(store, tmp_path):
    payload = os.urandom(10 * 1024 * 1024)
    source = tmp_path / "adapter.safetensors"
    source.write_bytes(payload)

    blob = store.put_file(ADAPTER_KEY, source)
    copy = store.get_file(ADAPTER_KEY, tmp_path / "download" / "adapter.safetensors", blob.sha256)

    assert blob.sha256 == hashlib.sha256(payload).hexdigest()
    assert (blob.size, blob.uri) == (len(payload), store.uri(ADAPTER_KEY))
    assert hashlib.sha256(copy.read_bytes()).hexdigest() == blob.sha256
    assert store.fetch(blob) == payload


def test_a_working_copy_is_whole_and_verified_but_not_fsynced(store, tmp_path, monkeypatch):
    """``materialize``'s copies (rollout's per-process adapter cache) skip the fsync; the store's
    own writes and a durable ``get_file`` keep it."""
    from marlaas.platform.adapters import materialize, write_adapter

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    blob = write_adapter(store, "acme.j1", 3, b'{"r": 8}', os.urandom(4096))
    written = len(synced)
    copy = materialize(store, blob, tmp_path / "cache" / "v3")
    assert len(synced) == written  # no fsync for the working copy
    assert hashlib.sha256((copy / "adapter_model.safetensors").read_bytes()).hexdigest() == blob.sha256
    assert (copy / "adapter_config.json").read_bytes() == b'{"r": 8}'
    store.get_file(store.key_of(blob.uri), tmp_path / "durable", blob.sha256)
    assert len(synced) == written + 1
    assert not [p for p in copy.iterdir() if p.name.endswith(".tmp")]


def test_s3_adapter_is_written_in_one_put(s3_server):
    store = S3Store("marlaas", prefix="one-put", endpoint=s3_server)
    store.put_bytes(ADAPTER_KEY, os.urandom(10 * 1024 * 1024))
    etag = store.client.stat_object("marlaas", f"one-put/{ADAPTER_KEY}").etag
    assert "-" not in etag  # a multipart upload's ETag ends in -<parts>


def test_s3_refuses_a_wrong_secret_key(s3_server):
    from minio.error import S3Error

    with pytest.raises(S3Error, match="SignatureDoesNotMatch"):
        S3Store("marlaas", endpoint=s3_server, secret_key="not-the-secret")


def test_identical_put_is_a_noop(store):
    first = store.put_bytes(ADAPTER_KEY, b"weights v1")
    before = stamp(store, ADAPTER_KEY)
    assert store.put_bytes(ADAPTER_KEY, b"weights v1") == first
    assert stamp(store, ADAPTER_KEY) == before
    assert store.list() == [ADAPTER_KEY]


def test_different_bytes_to_an_existing_key_fail_clearly(store):
    store.put_bytes(ADAPTER_KEY, b"weights v1")
    clear = "already holds different bytes.* new version"
    with pytest.raises(ImmutableKeyError, match=clear) as info:
        store.put_bytes(ADAPTER_KEY, b"weights v1, retrained")
    assert store.uri(ADAPTER_KEY) in str(info.value)
    assert store.get_bytes(ADAPTER_KEY) == b"weights v1"


def test_exists_list_delete(store):
    keys = ["acme.j1/v1/adapter", "acme.j1/v2/adapter", "acme.j2/v1/adapter"]
    for key in reversed(keys):
        store.put_bytes(key, key.encode())

    assert store.list() == keys
    assert store.list("acme.j1/") == keys[:2]
    assert store.list("globex.") == []
    assert store.collectable("acme.j1/") == keys[:2]  # no write was interrupted
    assert all(store.exists(k) for k in keys)
    assert not store.exists("acme.j1/v3/adapter")

    store.delete(keys[0])
    store.delete("acme.j1/v9/adapter")  # deleting what is not there is fine
    assert not store.exists(keys[0])
    assert store.list() == keys[1:]


def test_delete_prefix_removes_one_job_s_folder_and_nothing_beside_it(store):
    keys = ["adapters/acme.j1/v000001/a1/adapter_config.json", "adapters/acme.j1/v000001/a1/adapter_model.safetensors",
            "adapters/acme.j1/v000002/b2/adapter_model.safetensors",
            "adapters/acme.j10/v000001/c3/adapter_model.safetensors", "optimizer/acme.j1/v000001/d4/adamw.pt"]
    for key in keys:
        store.put_bytes(key, key.encode())

    assert store.delete_prefix("adapters/acme.j1/") == 3
    assert store.list() == keys[3:]  # acme.j10 shares the text prefix, not the folder
    assert store.delete_prefix("adapters/acme.j1/") == 0
    for everything in ("", "/"):
        with pytest.raises(ValueError, match="non-empty prefix"):
            store.delete_prefix(everything)
    assert store.list() == keys[3:]
    if isinstance(store, FileStore):  # no empty folders left behind either
        assert not (store.root / "adapters" / "acme.j1").exists()


def test_missing_key_raises_object_not_found(store, tmp_path):
    with pytest.raises(ObjectNotFound, match="acme.j1/v7/adapter"):
        store.get_bytes("acme.j1/v7/adapter")
    destination = tmp_path / "out" / "adapter"
    with pytest.raises(ObjectNotFound):
        store.get_file("acme.j1/v7/adapter", destination)
    assert not destination.exists()


def test_fetch_verifies_sha256(store):
    blob = store.put_bytes(ADAPTER_KEY, b"weights v1")
    store.delete(ADAPTER_KEY)
    store.put_bytes(ADAPTER_KEY, b"weights swapped behind the event's back")
    with pytest.raises(ChecksumMismatch, match=f"{store.uri(ADAPTER_KEY)}: sha256 .* != expected"):
        store.fetch(blob)


def test_fetch_detects_a_file_tampered_in_place(file_store):
    blob = file_store.put_bytes(ADAPTER_KEY, b"weights v1")
    file_store.path(ADAPTER_KEY).write_bytes(b"weights v1 with a flipped bit")
    with pytest.raises(ChecksumMismatch, match=blob.sha256):
        file_store.fetch(blob)


def test_fetch_rejects_a_blob_of_another_store(file_store, tmp_path):
    elsewhere = FileStore(tmp_path / "other").put_bytes(ADAPTER_KEY, b"weights")
    with pytest.raises(ValueError, match="is not in this store"):
        file_store.fetch(elsewhere)


# --- crash safety of file:// -----------------------------------------------------------------

CRASH_BETWEEN_WRITE_AND_RENAME = """
import os, sys
from marlaas.platform.store import FileStore

store = FileStore(sys.argv[1])
os.replace = lambda *args, **kwargs: os._exit(1)  # the process dies right before the rename
store.put_bytes(sys.argv[2], b"x" * (1 << 20))
"""


def test_crash_between_temp_write_and_rename_leaves_no_object(tmp_path):
    root = tmp_path / "store"
    crashed = subprocess.run(
        [sys.executable, "-c", CRASH_BETWEEN_WRITE_AND_RENAME, str(root), ADAPTER_KEY],
        capture_output=True, text=True,
    )
    assert crashed.returncode == 1, crashed.stderr
    [temp] = [p for p in root.rglob("*") if p.is_file()]
    assert temp.stat().st_size == 1 << 20  # fully written, never renamed

    store = FileStore(root)
    assert not store.exists(ADAPTER_KEY)
    assert store.list() == []
    # ... but garbage collection finds it (``interrupted_writes``) and deletes it with its attempt
    assert store.interrupted_writes() == [temp.relative_to(store.root).as_posix()]
    sibling = store.put_bytes(ADAPTER_KEY.rpartition("/")[0] + "/config.json", b"{}")
    assert store.collectable() == sorted([*store.list(), *store.interrupted_writes()])  # both, one walk
    assert len(store.collectable()) == 2
    store.delete(store.key_of(sibling.uri))
    with pytest.raises(ObjectNotFound):
        store.get_bytes(ADAPTER_KEY)
    blob = store.put_bytes(ADAPTER_KEY, b"the retried write")  # the retry after restart succeeds
    assert store.fetch(blob) == b"the retried write"
    assert store.list() == [ADAPTER_KEY]


def test_failed_rename_cleans_up_its_temp_file(file_store, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(OSError, match="No space left"):
        file_store.put_bytes(ADAPTER_KEY, b"weights")
    monkeypatch.undo()
    assert not file_store.exists(ADAPTER_KEY)
    assert [p for p in file_store.root.rglob("*") if p.is_file()] == []


def test_file_keys_cannot_escape_the_root(file_store):
    with pytest.raises(ValueError, match="escapes the store root"):
        file_store.put_bytes("../outside", b"x")


# --- open_store --------------------------------------------------------------------------


def test_open_store_picks_the_backend_by_url(tmp_path, s3_server, monkeypatch):
    local = open_store(f"file://{tmp_path}/store")
    assert isinstance(local, FileStore)
    assert local.root == (tmp_path / "store").resolve()

    monkeypatch.setenv("MARLAAS_S3_ENDPOINT", s3_server)
    remote = open_store("s3://marlaas/adapters/")
    assert isinstance(remote, S3Store)
    assert remote.url == "s3://marlaas/adapters"
    blob = remote.put_bytes(ADAPTER_KEY, b"weights")
    assert blob.uri == f"s3://marlaas/adapters/{ADAPTER_KEY}"
    assert remote.fetch(blob) == b"weights"


@pytest.mark.parametrize(("url", "reason"), [
    ("http://minio:9000/marlaas", "unsupported store URL"),
    ("/var/lib/marlaas/store", "unsupported store URL"),
    ("", "unsupported store URL"),
    ("s3://", "names no bucket"),
    ("s3:///adapters", "names no bucket"),
    ("file://relative/store", "not an absolute path"),
    ("file://", "not an absolute path"),
])
def test_open_store_rejects_bad_urls(url, reason):
    with pytest.raises(ValueError, match=reason):
        open_store(url)


def test_a_file_store_listing_survives_folders_deleted_while_it_walks(tmp_path):
    """The manager collects several jobs' garbage at once: one job's listing must not fail when
    another job's folder disappears under it (rglob over the whole store raised FileNotFoundError)."""
    import threading

    store = FileStore(tmp_path / "store")
    kept = [f"trajectories/acme.keep/v{v:06d}/a/batch.json" for v in range(3)]
    for key in kept:
        store.put_bytes(key, b"kept")
    stop, errors = threading.Event(), []

    def churn() -> None:  # what another job's writer and collector do meanwhile
        n = 0
        while not stop.is_set():
            for v in range(20):
                store.put_bytes(f"trajectories/acme.gone/v{v:06d}/{n}/batch.json", b"x")
            store.delete_prefix("trajectories/acme.gone/")
            n += 1

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(300):
            try:
                assert store.list("trajectories/acme.keep/") == kept
                assert set(kept) <= set(store.list())  # the whole store too, while folders vanish
            except FileNotFoundError as exc:
                errors.append(exc)
    finally:
        stop.set()
        thread.join()
    assert errors == []


def test_an_s3_store_that_never_answers_is_a_clear_error_after_its_wait():
    """A service waits for S3 on its first connect (a deployment may start it first), then says
    which endpoint did not answer."""
    import socket

    from marlaas.platform.store import S3Store

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{probe.getsockname()[1]}"
    with pytest.raises(ConnectionError, match=f"object store at {endpoint} did not answer within 1 s"):
        S3Store("marlaas", endpoint=endpoint, access_key="a", secret_key="b", connect_wait_s=1)
