"""Hand-made tar.gz archives for the adapter-upload tests (hostile members included)."""

import gzip
import io
import tarfile


def tar_gz(*members: tuple[tarfile.TarInfo, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for info, data in members:
            info.size = len(data) if info.isfile() else 0
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return buffer.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info


def header(name: str, kind: bytes, size: int) -> bytes:
    """One 512-byte ustar header declaring ``size`` bytes of data (whatever actually follows)."""
    info = tarfile.TarInfo(name)
    info.type, info.size = kind, size
    return info.tobuf(tarfile.USTAR_FORMAT)


def padded(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % tarfile.BLOCKSIZE)


def gz(*parts: bytes) -> bytes:
    """A .tar.gz of hand-made blocks, closed by the two end-of-archive blocks."""
    return gzip.compress(b"".join(parts) + b"\0" * 2 * tarfile.BLOCKSIZE)


def pax_bomb() -> bytes:
    """CVE-2024-6232's upload: a first entry that is a PAX header of 160,000 digits (320 bytes gzip'd)."""
    return gz(header("pax", tarfile.XHDTYPE, 160_000) + padded(b"1" * 160_000))
