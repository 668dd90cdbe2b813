"""The embedded stack: nats-server, a ``file://`` store and the four services as processes.

``marlaas up``, ``make demo``, the integration tests and the benchmarks all start
the stack through :class:`Stack`. Children run in their own sessions so a Ctrl-C
reaches only the launcher, which then stops them in reverse start order (each
drains its in-flight work on SIGTERM) and the broker last.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import structlog

from marlaas.config import Config, dump_config
from marlaas.embedded_nats import EmbeddedNats

log = structlog.get_logger("marlaas.launcher")
SERVICES = ("manager", "env", "trainer", "rollout")


class StackError(RuntimeError):
    """A service did not start, or died."""


class Stack:
    """Start / stop the whole system on this machine."""

    def __init__(self, config: Config, services: tuple[str, ...] = SERVICES,
                 child_env: dict[str, str] | None = None) -> None:
        self.config = config
        self.services = services
        self.child_env = child_env or {}
        self.home = config.home_dir
        self.nats: EmbeddedNats | None = None
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def run_dir(self) -> Path:
        return self.home / "run"

    @property
    def nats_url(self) -> str:
        return self.resolved.nats_url

    def start(self, timeout_s: float = 180.0) -> Stack:
        """Start the broker and every service; return once all report ready."""
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "logs").mkdir(exist_ok=True)
        ready_dir = self.run_dir / "ready"
        ready_dir.mkdir(parents=True, exist_ok=True)
        for stale in ready_dir.iterdir():
            stale.unlink()
        url = self.config.nats_url
        if not url:
            self.nats = EmbeddedNats(self.home / "nats").start()
            url = self.nats.url
        self.resolved = msgspec.structs.replace(
            self.config, nats_url=url, store_url=self.config.resolved_store_url
        )
        self.config_path = self.run_dir / "config.json"
        self.config_path.write_bytes(dump_config(self.resolved))
        (self.run_dir / "nats.url").write_text(url)
        try:
            for name in self.services:
                self._spawn(name)
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str) -> None:
        logfile = open(self.home / "logs" / f"{name}.log", "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.child_env}
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", f"services.{name}", "--config", str(self.config_path)],
            stdout=logfile, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )

    def kill(self, name: str) -> None:
        """SIGKILL one service (a crash, for chaos tests); :meth:`restart` brings it back."""
        proc = self.procs[name]
        proc.kill()
        proc.wait()

    def restart(self, name: str, timeout_s: float = 180.0) -> None:
        """Start a fresh process for service ``name`` and wait until it is ready."""
        if self.procs[name].poll() is None:
            raise StackError(f"service {name} is still running; kill or stop it first")
        self._spawn(name)
        self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        ready_dir = self.run_dir / "ready"
        while True:
            self.check_alive()
            pending = [n for n, p in self.procs.items() if not (ready_dir / f"{n}-{p.pid}").exists()]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise StackError(f"services not ready after {timeout_s:.0f}s: {', '.join(pending)}; "
                                 f"see {self.home / 'logs'}")
            time.sleep(0.2)

    def check_alive(self) -> None:
        """Raise if a service exited; its log's tail is in the message."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.home / "logs" / f"{name}.log").read_text(errors="replace")[-2000:]
                raise StackError(f"service {name} exited with code {proc.returncode}:\n{tail}")

    def supervise(self) -> list[str]:
        """Restart every service that exited (a crash, a dead engine); return their names."""
        restarted = []
        for name, proc in list(self.procs.items()):
            if proc.poll() is not None:
                log.warning("service exited; restarting it", service=name, code=proc.returncode)
                self._spawn(name)
                restarted.append(name)
        return restarted

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the services in reverse start order (each drains), then stop the broker."""
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    log.warning("service did not stop in time; killed", service=name)
                    proc.kill()
                    proc.wait()
        self.procs.clear()
        if self.nats is not None:
            self.nats.stop()
            self.nats = None
        (self.run_dir / "nats.url").unlink(missing_ok=True)

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def running_nats_url(config: Config) -> str:
    """The broker a CLI call should talk to: configured, or the one ``marlaas up`` started."""
    if config.nats_url:
        return config.nats_url
    marker = config.home_dir / "run" / "nats.url"
    if not marker.exists():
        raise StackError(f"no running marlaas under {config.home_dir}: start one with `marlaas up` "
                         "(or set MARLAAS_NATS_URL)")
    return marker.read_text().strip()
