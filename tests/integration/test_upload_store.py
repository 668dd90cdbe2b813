"""An upload goes from the gateway's temp file to the store streamed (never read whole into
memory), whole or not at all, on both stores: the local one and S3 (a real SeaweedFS server)."""

from __future__ import annotations

import hashlib
import os
import uuid

import pytest

from marlaas.platform.files import put_local_file, read_file_record
from marlaas.platform.store import S3_PART_BYTES, FileStore, S3Store

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        return FileStore(tmp_path / "store")
    return S3Store("marlaas", prefix=f"upload-{uuid.uuid4().hex[:8]}", endpoint=request.getfixturevalue("s3_server"))


def test_a_checked_upload_is_stored_from_its_temp_file(store, tmp_path):
    line = b'{"text": "' + b"x" * 1000 + b'"}\n'
    data = line * ((S3_PART_BYTES + (1 << 20)) // len(line))  # over one S3 part: a multipart upload
    path = tmp_path / "upload.tmp"
    path.write_bytes(data)
    sha256 = hashlib.sha256(data).hexdigest()
    record = put_local_file(store, "alice", path, sha256, data.count(b"\n"), "big.jsonl")
    assert record.id == f"file-{sha256[:32]}" and record.size == len(data) and record.records == data.count(b"\n")
    assert store.get_bytes(f"files/alice/{record.id}", sha256) == data
    assert read_file_record(store, "alice", record.id) == record
    again = put_local_file(store, "alice", path, sha256, record.records, "renamed.jsonl")
    assert again == record  # the same bytes: the first record stays
    if isinstance(store, FileStore):
        assert not [p for p in os.listdir(store.path("files/alice")) if p.endswith(".tmp")]
