"""An uploaded adapter's .tar.gz (issues 38, 48): only its two files are read, in bounded memory and
work; the tar headers tarfile would read out of proportion (a PAX header of 160,000 digits, a GNU
long name of 104 MiB, sparse maps) are refused from their header, before tarfile parses them."""

from __future__ import annotations

import io
import tarfile
import time

import pytest

from marlaas.basemodel import builtin_model_dir
from marlaas.platform import adapter_archives, adapter_uploads
from marlaas.platform.adapter_archives import adapter_archive, read_adapter_archive, tar_entry
from marlaas.platform.adapter_uploads import AdapterRefused
from marlaas.platform.adapters import CONFIG_FILE, WEIGHTS_FILE, init_adapter
from marlaas.platform.events import LoraSettings
from marlaas.sdk.http import read_adapter_dir
from tests.archives import gz, header, member, padded, pax_bomb, tar_gz


@pytest.fixture(scope="module")
def good() -> tuple[bytes, bytes]:
    """A rank-4 adapter on the built-in base, as PEFT would save it (built on the meta device)."""
    return init_adapter(builtin_model_dir(), LoraSettings(rank=4, target_modules=("q_proj", "v_proj")), seed=0)


def files(good: tuple[bytes, bytes]) -> bytes:
    """The adapter's two files as tar entries (plain headers)."""
    return b"".join(header(name, tarfile.REGTYPE, len(data)) + padded(data)
                    for name, data in zip((CONFIG_FILE, WEIGHTS_FILE), good))


def refused(body: bytes, says: str) -> None:
    with pytest.raises(AdapterRefused, match=says.replace("(", r"\(").replace(")", r"\)")):
        read_adapter_archive(io.BytesIO(body))


def test_the_archive_marlaas_pull_downloads_reads_back_as_its_two_files(good):
    assert read_adapter_archive(io.BytesIO(adapter_archive(*good, 0.0))) == good
    folder = tar_gz((member("out", tarfile.DIRTYPE), b""), (member("out/README.md"), b"# model card"),
                    (member(f"out/{CONFIG_FILE}"), good[0]), (member(f"out/{WEIGHTS_FILE}"), good[1]))
    assert read_adapter_archive(io.BytesIO(folder)) == good  # a folder of it, PEFT's README skipped


def test_what_the_sdk_uploads_for_a_peft_directory_reads_back(good, tmp_path):
    """``marlaas submit`` / ``Client.upload_adapter``: the directory's two files, packed at upload time."""
    (tmp_path / CONFIG_FILE).write_bytes(good[0])
    (tmp_path / WEIGHTS_FILE).write_bytes(good[1])
    (tmp_path / "README.md").write_text("# model card")
    assert read_adapter_archive(io.BytesIO(adapter_archive(*read_adapter_dir(tmp_path), time.time()))) == good


@pytest.mark.parametrize("tar_format, pax", [
    (tarfile.GNU_FORMAT, {}),  # GNU tar's default: a GNU long name for the long folder
    (tarfile.PAX_FORMAT, {}),  # a PAX path record for it
    (tarfile.PAX_FORMAT, {"comment": "3f2a9c"}),  # a global header, as `git archive` writes
])
def test_archives_that_tar_writes_with_long_names_or_extended_attributes_read_back(good, tar_format, pax):
    folder = "checkpoints/" + "run-" * 40 + "é"  # past ustar's 100 characters, and not ASCII
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", format=tar_format, pax_headers=pax) as tar:
        for name, data in ((CONFIG_FILE, good[0]), (WEIGHTS_FILE, good[1])):
            info = tarfile.TarInfo(f"{folder}/{name}")
            info.size = len(data)
            if tar_format == tarfile.PAX_FORMAT:  # what macOS's tar adds for a file's extended attributes
                info.pax_headers = {"LIBARCHIVE.xattr.com.apple.provenance": "AQAAM3B3Y2hlY2s=", "mtime": "1.5"}
            tar.addfile(info, io.BytesIO(data))
    assert read_adapter_archive(io.BytesIO(buffer.getvalue())) == good


def test_a_pax_header_of_160000_digits_is_refused_from_its_header():
    """CVE-2024-6232: tarfile's PAX regexes are quadratic in the header (46 s for this 320-byte upload)."""
    body = pax_bomb()
    assert len(body) < 1024
    refused(body, "the archive has a PAX extended header of 160000 bytes, and this stack reads up to 4096")


def test_a_gnu_long_name_of_104_mib_is_refused_from_its_header():
    """tarfile reads a long name whole: 104 MiB of name from 106 KB of upload. The header alone declares
    it here (little data follows): the check refuses on the declared size, before any is read."""
    size = 104 << 20
    refused(gz(header("././@LongLink", tarfile.GNUTYPE_LONGNAME, size) + b"a" * 4096),
            f"the archive has a GNU long name of {size} bytes")
    refused(gz(header("././@LongLink", tarfile.GNUTYPE_LONGLINK, size)), "GNU long link name of")


@pytest.mark.parametrize("records, says", [
    (b"12 size=999\n", "a PAX header with a 'size' record (a size that overrides the header's)"),
    (b"22 GNU.sparse.major=1\n22 GNU.sparse.minor=0\n", "a PAX header with a 'GNU.sparse.*' record (a sparse"),
])
def test_pax_records_that_move_the_next_header_or_map_a_sparse_file_are_refused(good, records, says):
    refused(gz(header("pax", tarfile.XHDTYPE, len(records)) + padded(records) + files(good)), says)
    refused(gz(header("pax", tarfile.XGLTYPE, len(records)) + padded(records) + files(good)), says)


def test_a_sparse_member_is_refused(good):
    refused(gz(header("holes", tarfile.GNUTYPE_SPARSE, 0) + files(good)), "'holes' is a sparse file")


def test_pax_headers_and_long_names_are_bounded_in_all(good):
    record = b"1024 comment=" + b"c" * (1024 - len(b"1024 comment=") - 1) + b"\n"
    many = b"".join(header("pax", tarfile.XGLTYPE, len(record)) + record for _ in range(12))
    refused(gz(many + files(good)), "PAX headers and GNU long names come to more than 16384 bytes")
    empty = header("pax", tarfile.XHDTYPE, 0) * 40  # each takes a frame of tarfile's recursion
    refused(gz(empty + files(good)), "come to more than 16384 bytes")
    assert read_adapter_archive(io.BytesIO(gz(many[:6 * 1536] + files(good)))) == good  # 9 KiB: fine


def test_the_check_finds_the_headers_where_tarfile_does(good):
    """A folder's, a link's or a device's header may claim data, which tarfile does not skip: the
    header right after it is still checked (a check that skipped the claimed bytes would miss it)."""
    long_name = header("././@LongLink", tarfile.GNUTYPE_LONGNAME, 104 << 20)
    for first in (header("d", tarfile.DIRTYPE, 1024), header("v7-dir/", tarfile.AREGTYPE, 1024),
                  header("l", tarfile.SYMTYPE, 1024), header("f", tarfile.FIFOTYPE, 1024)):
        assert tar_entry(first, 0).data_bytes == 0
        refused(gz(first + long_name), "GNU long name of")
    assert tar_entry(header("x", tarfile.REGTYPE, 513), 0).data_bytes == 1024
    assert tar_entry(header("x", b"Z", 513), 0).data_bytes == 1024  # unknown types: skipped as files
    assert tar_entry(b"\0" * 512, 0) is None and tar_entry(b"\1" * 512, 0) is None  # where tarfile stops


@pytest.mark.parametrize("members, says", [
    ([(member(CONFIG_FILE, tarfile.SYMTYPE, "/etc/passwd"), b"")], "is a link (to '/etc/passwd')"),
    ([(member(WEIGHTS_FILE, tarfile.LNKTYPE, CONFIG_FILE), b"")], "is a link"),
    ([(member(f"../{CONFIG_FILE}"), b"{}")], "leaves the archive's folder"),
    ([(member(f"/tmp/{CONFIG_FILE}"), b"{}")], "leaves the archive's folder"),
    ([(member("fifo", tarfile.FIFOTYPE), b"")], "is not a regular file or folder"),
    ([(member(CONFIG_FILE), b"{}"), (member(f"again/{CONFIG_FILE}"), b"{}")], "holds adapter_config.json twice"),
    ([(member(CONFIG_FILE), b" " * (adapter_uploads.MAX_CONFIG_BYTES + 1))],
     "adapter_config.json is larger than 1 MiB"),
    ([(member(CONFIG_FILE), b"{}")], "the archive has no adapter_model.safetensors"),
    ([(member(f"d{i}", tarfile.DIRTYPE), b"") for i in range(17)], "more than 16 members"),
])
def test_a_hostile_or_wrong_archive_is_refused_naming_what_is_wrong(members, says):
    refused(tar_gz(*members), says)


def test_bytes_that_are_not_a_tar_gz_are_refused():
    plain = io.BytesIO()
    with tarfile.open(fileobj=plain, mode="w") as tar:
        tar.addfile(member("x"), io.BytesIO(b""))
    for body in (b"", b"garbage, not gzip", plain.getvalue(), tar_gz((member("x"), b"x" * 4096))[:-20]):
        refused(body, "the body is not a .tar.gz archive")


def test_an_archive_that_unpacks_past_the_bound_is_stopped_there(monkeypatch):
    monkeypatch.setattr(adapter_archives, "MAX_ARCHIVE_BYTES", 64 * 1024)
    bomb = tar_gz((member("README.md"), b"\0" * (1 << 20)))  # 1 MiB of zeros gzips to ~1 KiB
    assert len(bomb) < 8 * 1024
    refused(bomb, "unpacks to more than 65536 bytes")
