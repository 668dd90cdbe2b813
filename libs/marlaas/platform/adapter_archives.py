"""The ``.tar.gz`` of a PEFT adapter directory: what a version's download answers, what an upload sends.

An upload is untrusted (:mod:`marlaas.platform.adapter_uploads` checks its two files), and Python's
``tarfile`` spends memory and time on some entries out of all proportion to the archive: it parses a
PAX extended header with regexes that are quadratic in its length (CVE-2024-6232: 160,000 digits in
a 320-byte upload held the gateway 46 s), reads a GNU long name whole into memory (a 104 MiB name
from 106 KB), and reads a sparse file's map record by record without a bound. So each tar header
is checked as the unpacked stream passes, before tarfile can parse it (:func:`tar_entry`,
:func:`pax_problem`): PAX headers and GNU long names are bounded (4 KiB each, 16 KiB in all, their
headers counted), sparse files and PAX records that move the next header (``size``) refused.

The check finds the headers exactly where tarfile does: tarfile's own parser reads each header
block, and the data skipped after it is what tarfile skips (``TarInfo._proc_member``), so tarfile
never parses a header the check has not passed. The platform's own archives (:func:`adapter_archive`,
which the SDK uploads and ``marlaas pull`` downloads) have no such entry at all; ``tar -czf`` of
a PEFT directory, GNU's (long names) or macOS's (PAX headers of extended attributes), stays far
within the bounds.
"""

from __future__ import annotations

import gzip
import io
import tarfile
import zlib
from pathlib import PurePosixPath
from typing import BinaryIO, NamedTuple

from marlaas.platform.adapter_uploads import HOW, MAX_ADAPTER_BYTES, MAX_CONFIG_BYTES, AdapterRefused
from marlaas.platform.adapters import CONFIG_FILE, WEIGHTS_FILE

MAX_ARCHIVE_BYTES = MAX_ADAPTER_BYTES + 4 * MAX_CONFIG_BYTES  # an upload, gzip'd and unpacked (tar headers, a README)
MAX_ARCHIVE_MEMBERS = 16  # the two files, their folder, PEFT's README.md, a few more
MAX_TAR_METADATA_BYTES = 4 << 10  # one PAX header or GNU long name: a path, a few extended attributes
MAX_TAR_METADATA_TOTAL = 16 << 10  # all of them, each with its 512-byte header (so their number is bounded too)
TAR_METADATA = {  # entries tarfile reads whole and parses before the member they describe
    tarfile.XHDTYPE: "PAX extended header", tarfile.XGLTYPE: "PAX global header",
    tarfile.SOLARIS_XHDTYPE: "Solaris extended header", tarfile.GNUTYPE_LONGNAME: "GNU long name",
    tarfile.GNUTYPE_LONGLINK: "GNU long link name",
}
PAX_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE)
# PAX records refused, as their bytes appear ("<length> <keyword>=<value>\n"): a size moves where
# the next header starts, and a GNU sparse map is read without a bound
PAX_REFUSED = ((b" size=", "size", "a size that overrides the header's"),
               (b" GNU.sparse.", "GNU.sparse.*", "a sparse file's map"))
PACK = (f"pack the adapter's two files only: `tar -czf adapter.tar.gz -C DIR {CONFIG_FILE} {WEIGHTS_FILE}`, "
        "or upload the directory with `marlaas submit` / the SDK")


class _Bounded:
    """A reader that refuses to give more than ``limit`` bytes in all (a gzip bomb stops there)."""

    def __init__(self, raw: BinaryIO, limit: int) -> None:
        self.raw, self.left = raw, limit

    def read(self, size: int = -1) -> bytes:
        want = self.left + 1 if size is None or size < 0 else min(size, self.left + 1)
        data = self.raw.read(want)
        self.left -= len(data)
        if self.left < 0:
            raise AdapterRefused(f"the archive unpacks to more than {MAX_ARCHIVE_BYTES} bytes: upload the adapter's "
                                 f"two files only ({CONFIG_FILE}, {WEIGHTS_FILE})")
        return data


# --- the tar headers, checked before tarfile parses them ----------------------------------------


class TarEntry(NamedTuple):
    """What follows a tar header, up to the next header."""

    data_bytes: int  # bytes of data (padded to whole blocks) between this header and the next
    metadata_bytes: int  # of a PAX header or GNU long name: its bytes, header included (else 0)
    pax: bool  # whether the data is PAX records (:func:`pax_problem` reads them before tarfile does)


def tar_entry(header: bytes, metadata_seen: int) -> TarEntry | None:
    """The entry the 512-byte tar ``header`` starts, read as tarfile reads it; None where tarfile
    reads no further (the end-of-archive block, or a block it cannot parse). :class:`AdapterRefused`
    for an entry tarfile would read in memory or time out of proportion to the archive: a PAX
    header or GNU long name past :data:`MAX_TAR_METADATA_BYTES`, or past
    :data:`MAX_TAR_METADATA_TOTAL` with the ``metadata_seen`` before it, a sparse file, a negative size."""
    try:
        info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
    except tarfile.HeaderError:
        return None
    name = info.name[:120]
    if info.type == tarfile.GNUTYPE_SPARSE:
        raise AdapterRefused(f"the archive member {name!r} is a sparse file (its map is read without a bound): "
                             f"{PACK}")
    if info.size < 0:
        raise AdapterRefused(f"the archive member {name!r} has a negative size: {PACK}")
    padded = -(-info.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    if info.type in TAR_METADATA:
        kind = TAR_METADATA[info.type]
        if info.size > MAX_TAR_METADATA_BYTES:
            raise AdapterRefused(f"the archive has a {kind} of {info.size} bytes, and this stack reads up to "
                                 f"{MAX_TAR_METADATA_BYTES}: {PACK}")
        metadata = tarfile.BLOCKSIZE + padded
        if metadata_seen + metadata > MAX_TAR_METADATA_TOTAL:
            raise AdapterRefused(f"the archive's PAX headers and GNU long names come to more than "
                                 f"{MAX_TAR_METADATA_TOTAL} bytes: {PACK}")
        return TarEntry(padded, metadata, info.type in PAX_TYPES)
    # as tarfile's _proc_builtin: a link, folder or device has no data, whatever its size field says
    has_data = info.isreg() or info.type not in tarfile.SUPPORTED_TYPES
    return TarEntry(padded if has_data else 0, 0, False)


def pax_problem(records: bytes) -> str:
    """Why the records of a PAX header (at most :data:`MAX_TAR_METADATA_BYTES`) are refused ("" =
    they are not). A plain search: a refused keyword anywhere refuses the header, even inside
    another record's value (no real archive has one there)."""
    for found, keyword, what in PAX_REFUSED:
        if found in records:
            return (f"the archive has a PAX header with a {keyword!r} record ({what}), which this stack does not "
                    f"read: {PACK}")
    return ""


class _CheckedHeaders:
    """A tar stream passed on as it is read, each header checked (:func:`tar_entry`) and each PAX
    header's records (:func:`pax_problem`) as their last byte passes: before tarfile, which reads
    through this, can parse them."""

    def __init__(self, raw) -> None:
        self.raw = raw
        self.header = bytearray()  # the header being read
        self.left = 0  # bytes of the entry's data still to pass before the next header
        self.pax: bytearray | None = None  # a PAX header's records, gathered to be checked whole
        self.metadata_seen = 0
        self.ended = False  # tarfile reads no header past the one that ended the walk

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        at = 0
        while at < len(data) and not self.ended:
            if self.left:
                step = min(self.left, len(data) - at)
                if self.pax is not None:
                    self.pax += data[at:at + step]
                self.left, at = self.left - step, at + step
                if not self.left and self.pax is not None:
                    if problem := pax_problem(bytes(self.pax)):
                        raise AdapterRefused(problem)
                    self.pax = None
                continue
            step = min(tarfile.BLOCKSIZE - len(self.header), len(data) - at)
            self.header += data[at:at + step]
            at += step
            if len(self.header) == tarfile.BLOCKSIZE:
                self._entered(tar_entry(bytes(self.header), self.metadata_seen))
                self.header.clear()
        return data

    def _entered(self, entry: TarEntry | None) -> None:
        if entry is None:
            self.ended = True
            return
        self.metadata_seen += entry.metadata_bytes
        self.left = entry.data_bytes
        self.pax = bytearray() if entry.pax and entry.data_bytes else None


# --- the archive ---------------------------------------------------------------------------------


def adapter_archive(config_json: bytes, weights: bytes, mtime: float) -> bytes:
    """A .tar.gz of a PEFT adapter directory (its two files at the archive's root): what a version's
    or checkpoint's download answers, and what an upload sends (plain ustar headers: no PAX header
    or GNU long name)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in ((CONFIG_FILE, config_json), (WEIGHTS_FILE, weights)):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), int(mtime), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def read_adapter_archive(body: BinaryIO) -> tuple[bytes, bytes]:
    """The (config JSON, weights) of a ``.tar.gz`` of a PEFT adapter directory, or
    :class:`AdapterRefused` naming what is wrong. Untrusted: only the two files are read (by
    basename, in any folder of the archive), other regular files (PEFT's README.md) are skipped,
    links, devices, absolute or ``..`` paths refused; members, their sizes, the unpacked total and
    the entries tarfile reads whole (PAX headers, GNU long names) are bounded, and nothing is
    written to disk."""
    found: dict[str, bytes] = {}
    limits = {CONFIG_FILE: MAX_CONFIG_BYTES, WEIGHTS_FILE: MAX_ADAPTER_BYTES}
    unpacked = _CheckedHeaders(_Bounded(gzip.GzipFile(fileobj=body, mode="rb"), MAX_ARCHIVE_BYTES))
    try:
        with tarfile.open(fileobj=unpacked, mode="r|") as tar:
            for count, member in enumerate(tar, 1):
                if count > MAX_ARCHIVE_MEMBERS:
                    raise AdapterRefused(f"the archive has more than {MAX_ARCHIVE_MEMBERS} members: upload the "
                                         f"adapter's two files only ({CONFIG_FILE}, {WEIGHTS_FILE})")
                base = _member_name(member)
                if member.isdir() or base not in limits:
                    continue
                if base in found:
                    raise AdapterRefused(f"the archive holds {base} twice: upload one adapter directory")
                if member.size > limits[base]:
                    raise AdapterRefused(f"{base} is larger than {limits[base] >> 20} MiB: upload an adapter of a "
                                         "lower rank or of fewer target modules")
                found[base] = tar.extractfile(member).read()
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise AdapterRefused(f"the body is not a .tar.gz archive ({exc}): send the adapter directory packed with "
                             f"`tar -czf adapter.tar.gz -C DIR {CONFIG_FILE} {WEIGHTS_FILE}`") from None
    if missing := [name for name in limits if name not in found]:
        raise AdapterRefused(f"the archive has no {missing[0]}: {HOW}, packed as .tar.gz")
    return found[CONFIG_FILE], found[WEIGHTS_FILE]


def _member_name(member: tarfile.TarInfo) -> str:
    """The basename of a member the archive may hold; :class:`AdapterRefused` for any other."""
    path = PurePosixPath(member.name)
    if member.issym() or member.islnk():
        raise AdapterRefused(f"the archive member {member.name[:120]!r} is a link (to {member.linkname[:120]!r}): "
                             "pack the files themselves (tar -h follows links)")
    if not (member.isfile() or member.isdir()):
        raise AdapterRefused(f"the archive member {member.name[:120]!r} is not a regular file or folder: pack "
                             f"the adapter's two files only ({CONFIG_FILE}, {WEIGHTS_FILE})")
    if path.is_absolute() or ".." in path.parts or "\\" in member.name:
        raise AdapterRefused(f"the archive member {member.name[:120]!r} leaves the archive's folder (an absolute "
                             "or '..' path): pack the adapter directory's files by their own names")
    return path.name
