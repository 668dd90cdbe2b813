"""The embedded stack: nats-server, a ``file://`` store and the services as processes.

``marlaas up``, ``make demo``, the integration tests and the benchmarks all start
the stack through :class:`Stack`. Children run in their own sessions so a Ctrl-C
reaches only the launcher, which then stops them in reverse start order (each
drains its in-flight work on SIGTERM) and the broker last.

The embedded broker requires credentials (:mod:`marlaas.stack.broker_auth`). Under ``<home>/run``,
each readable by its owner only: ``services.password`` (new at every start),
``nats.url`` (the broker's URL with the services' credentials in it: what the services,
``marlaas status`` and the test suite connect with), ``default-tenant.token`` (the token
of tenant ``default``, made once, for the CLI and the SDK) and ``operator.token`` (new at
every start unless the config names the operator's own: the bearer token of the gateway's
``/metrics`` and API schema, for Prometheus and the operator, never a tenant).

The ``sandbox`` service (the python tool's runs) is started apart: with an environment scrubbed
of everything but the interpreter's basics and ``MARLAAS_NATS_URL`` carrying the broker's
``sandbox`` user (:func:`sandbox_environment`), and ``run/sandbox-config.json``, the config
without the broker's credentials, the store's location or the operator's token.

``nats_cluster=3`` (``marlaas up --nats-cluster 3``) runs the broker as a three-node JetStream
cluster on loopback (:class:`~marlaas.stack.embedded_nats.EmbeddedNatsCluster`, under
``<home>/nats/node-<i>``, keeping its own state apart from the single server's): ``nats.url``
then lists all three servers, and every stream and bucket has three copies, so any one node
may die without losing an acked write or stopping the jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import structlog

from marlaas.platform import nats_access
from marlaas.platform.config import Config, dump_config
from marlaas.platform.processes import SHUTDOWN_GRACE_S, kill_group, spawn
from marlaas.platform.store import make_private_dirs
from marlaas.sdk import discovery
from marlaas.sdk.discovery import DEFAULT_TOKEN_FILE
from marlaas.stack import broker_auth
from marlaas.stack.broker_auth import write_private
from marlaas.stack.embedded_nats import EmbeddedNats, EmbeddedNatsCluster

log = structlog.get_logger("marlaas.stack.launcher")
SERVICES = ("manager", "gateway", "env", "sandbox", "trainer", "rollout")
# What the sandbox's environment keeps of the launcher's: the interpreter's basics, no secret.
SANDBOX_ENV_KEPT = ("PATH", "PYTHONPATH", "VIRTUAL_ENV", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR")
DEFAULT_TENANT = "default"
DEFAULT_TENANT_MAX_JOBS = 64
CLUSTER_REPLICAS = 3  # copies of each stream and bucket on an embedded cluster (of 3 or 5 nodes)


class StackError(RuntimeError):
    """A service did not start, or died."""


SINGLETONS = ("manager",)  # the job registry's one writer: never replicated


def parse_replicas(text: str) -> dict[str, int]:
    """``"rollout=2,trainer=2"`` -> ``{"rollout": 2, "trainer": 2}``, with errors that say what to fix."""
    replicas = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, count = part.partition("=")
        if name not in SERVICES or not count.isdigit() or int(count) < 1:
            raise StackError(f"--replicas {part!r}: write SERVICE=N with N >= 1, SERVICE one of {', '.join(SERVICES)}")
        if name in SINGLETONS and int(count) > 1:
            raise StackError(f"--replicas {part!r}: the {name} is the job registry's one writer; run one")
        replicas[name] = int(count)
    return replicas


def sandbox_environment(environ: dict[str, str], sandbox_url: str) -> dict[str, str]:
    """The sandbox process's whole environment: :data:`SANDBOX_ENV_KEPT` of ``environ`` and its
    own broker URL; never the services' URL, the store's keys or any other ``MARLAAS_*``."""
    kept = {name: environ[name] for name in SANDBOX_ENV_KEPT if name in environ}
    return {**kept, "PYTHONUNBUFFERED": "1", "MARLAAS_NATS_URL": sandbox_url}


def sandbox_config(config: Config) -> Config:
    """``config`` as the sandbox gets it: no broker URL (its own comes by environment), no store
    location, no operator token."""
    return msgspec.structs.replace(
        config, nats_url="", store_url="",
        gateway=msgspec.structs.replace(config.gateway, operator_token="", operator_token_file=""),
    )


def sandbox_url(services_url: str) -> str:
    """The broker URL of the ``sandbox`` user, given the services' (its password derives from theirs)."""
    user, password = nats_access.url_credentials(services_url)
    if user != nats_access.SERVICES_USER or not password:
        raise StackError(f"the sandbox's broker password derives from the {nats_access.SERVICES_USER!r} "
                         "user's: nats_url must carry it (nats://services:PASSWORD@host:port)")
    return nats_access.url_with_credentials(services_url, nats_access.SANDBOX_USER,
                                            nats_access.sandbox_password(password))


def service_of(process: str) -> str:
    """The service a process name runs: ``rollout-2`` -> ``rollout``."""
    return process.partition("-")[0]


class Stack:
    """Start / stop the whole system on this machine; ``replicas`` runs more than one process
    of a service (``{"rollout": 2}`` starts ``rollout`` and ``rollout-2``); ``nats_cluster``
    runs the embedded broker as a JetStream cluster of that many nodes (3 or 5; 1: one server)."""

    def __init__(self, config: Config, services: tuple[str, ...] = SERVICES,
                 child_env: dict[str, str] | None = None, replicas: dict[str, int] | None = None,
                 nats_cluster: int = 1) -> None:
        self.config = config
        if nats_cluster not in (1, 3, 5):
            raise StackError(f"--nats-cluster {nats_cluster}: run 1 server, or a cluster of 3 or 5 nodes "
                             "(an odd number, so that a majority survives a failed node)")
        if nats_cluster > 1 and config.nats_url:
            raise StackError("--nats-cluster starts the embedded broker, but nats_url is set "
                             "(MARLAAS_NATS_URL?): unset it, or point nats_url at your own cluster")
        self.nats_cluster = nats_cluster
        self.replicas = replicas or {}
        if self.replicas.get("rollout", 1) > 1 and config.manager.schedule == "sync":
            raise StackError("the sync schedule's barrier lives in one rollout process: run one rollout "
                             "replica with manager.schedule = 'sync'")
        if config.env.python_tool == "env":  # env serves python itself: no sandbox beside it
            services = tuple(name for name in services if name != "sandbox")
        self.services = tuple(name if i == 1 else f"{name}-{i}" for name in services
                              for i in range(1, self.replicas.get(name, 1) + 1))
        self.child_env = child_env or {}
        self.home = config.home_dir
        self.nats: EmbeddedNats | EmbeddedNatsCluster | None = None
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def run_dir(self) -> Path:
        return self.home / "run"

    @property
    def nats_url(self) -> str:
        """The broker's URL with the services' credentials in it (the embedded broker's)."""
        return self.resolved.nats_url

    @property
    def gateway_url(self) -> str | None:
        """The gateway's HTTP address, once it listens (it writes ``run/gateway.url``)."""
        marker = self.run_dir / "gateway.url"
        return marker.read_text().strip() if marker.exists() else None

    @property
    def default_token_file(self) -> Path:
        return self.run_dir / DEFAULT_TOKEN_FILE

    @property
    def operator_token(self) -> str:
        """The bearer token of the gateway's ``/metrics`` and API schema (the operator's only)."""
        return self.config.gateway.operator_token or self.config.operator_token_path.read_text().strip()

    def summary(self) -> dict:
        """What ``marlaas up`` prints: addresses (no secrets), the home dir, the token file."""
        token_file = self.default_token_file
        return {
            "nats_url": nats_access.redact_url(self.nats_url),
            "gateway_url": self.gateway_url,
            "home": str(self.home),
            "store": self.resolved.store_url,
            "default_token_file": str(token_file) if token_file.exists() else None,
            "operator_token_file": None if self.config.gateway.operator_token else str(self.config.operator_token_path),
        }

    def start(self, timeout_s: float = 180.0) -> Stack:
        """Start the broker and every service; return once all report ready."""
        make_private_dirs(self.home)  # a new home is 0700; an existing one keeps its mode
        ready_dir = self.run_dir / "ready"
        for folder in (self.home / "logs", self.run_dir, ready_dir):
            make_private_dirs(folder)
            folder.chmod(0o700)  # ours: private also when an older version made it 0755
        for stale in ready_dir.iterdir():
            stale.unlink()
        (self.run_dir / "gateway.url").unlink(missing_ok=True)
        discovery.write_state(self.run_dir, discovery.STARTING)  # a client started beside us waits
        url = self.config.nats_url or self._start_broker()
        self.resolved = msgspec.structs.replace(
            self.config, nats_url=url, store_url=self.config.resolved_store_url,
            nats_replicas=self.nats_replicas,
        )
        self.config_path = self.run_dir / "config.json"
        write_private(self.config_path, dump_config(self.resolved).decode())  # holds the password
        self.sandbox_config_path = self.run_dir / "sandbox-config.json"
        write_private(self.sandbox_config_path, dump_config(sandbox_config(self.resolved)).decode())
        write_private(self.run_dir / "nats.url", url)
        gateway = self.config.gateway
        if not (gateway.operator_token or gateway.operator_token_file):
            write_private(self.config.operator_token_path, secrets.token_hex(24))
        try:
            for name in self.services:
                self._spawn(name)
            deadline = time.monotonic() + timeout_s
            self.wait_ready(timeout_s)
            if any(service_of(name) == "gateway" for name in self.services):
                self.wait_gateway_ready(deadline - time.monotonic())
        except BaseException:
            self.stop()
            raise
        discovery.write_state(self.run_dir, discovery.READY)
        return self

    def wait_gateway_ready(self, timeout_s: float) -> None:
        """Wait until the gateway's ``/readyz`` says the manager answers: the signal that a
        submission will be served (a listening gateway alone answers 503 until then)."""
        import httpx

        deadline = time.monotonic() + max(timeout_s, 1.0)
        answer = "no answer"
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                response = httpx.get(f"{self.gateway_url}/readyz", timeout=5.0)
                if response.status_code == 200:
                    return
                answer = response.text
            except httpx.HTTPError as exc:
                answer = str(exc)
            time.sleep(0.2)
        raise StackError(f"the gateway is not ready after {timeout_s:.0f}s ({answer}); see {self.home / 'logs'}")

    @property
    def nats_replicas(self) -> int:
        """Copies of each stream and bucket: the embedded cluster's, else the configured."""
        return CLUSTER_REPLICAS if self.nats_cluster > 1 else self.config.nats_replicas

    def _start_broker(self) -> str:
        """Start the embedded nats-server (or cluster) with auth; return its URL with the
        services' credentials (every node's, for a cluster).

        It starts with the last run's users under a new services password; once the bucket is
        readable and tenant ``default`` exists (made here the first time), the users are
        rendered from the ``tenants`` bucket and reloaded.
        """
        password = secrets.token_hex(24)
        write_private(self.run_dir / "services.password", password)
        auth_file = self.home / "nats" / broker_auth.AUTH_FILE
        text = broker_auth.render_auth(password, [])
        if auth_file.exists():  # the last run's tenants can reconnect from the first moment
            with contextlib.suppress(broker_auth.AuthConfigError):  # not ours: start from scratch
                text = broker_auth.with_services_password(auth_file.read_text(), password)
        broker_auth.write_auth_conf(auth_file, text)
        if self.nats_cluster > 1:
            self.nats = EmbeddedNatsCluster(auth_file.parent, self.nats_cluster, auth=True).start()
        else:
            self.nats = EmbeddedNats(auth_file.parent, auth=True).start()
        url = nats_access.url_with_credentials(self.nats.url, nats_access.SERVICES_USER, password)
        try:
            run_coroutine(provision_tenants(url, self.nats, password, self.default_token_file,
                                            self.config.duplicate_window_s, self.nats_replicas))
        except BaseException:
            self.nats.stop()
            self.nats = None
            raise
        return url

    def _spawn(self, name: str) -> None:
        config_path, env = self.config_path, {**os.environ, "PYTHONUNBUFFERED": "1", **self.child_env}
        if service_of(name) == "sandbox":  # nothing of ours: not even child_env (tests' settings)
            config_path, env = self.sandbox_config_path, sandbox_environment(os.environ, sandbox_url(self.nats_url))
        with open_private_log(self.home / "logs" / f"{name}.log") as logfile:  # the child holds its own handle
            self.procs[name] = spawn(
                [sys.executable, "-m", f"services.{service_of(name)}", "--config", str(config_path)],
                stdout=logfile, stderr=subprocess.STDOUT, env=env,
            )

    def kill(self, name: str) -> None:
        """SIGKILL one service and everything it started (a crash, for chaos tests); its
        engine core goes with it. :meth:`restart` brings it back."""
        proc = self.procs[name]
        kill_group(proc.pid)
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
            pending = [n for n, p in self.procs.items()
                       if not (ready_dir / f"{service_of(n)}-{p.pid}").exists()]
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
                kill_group(proc.pid)  # what it left behind (a vLLM engine core) goes first
                self._spawn(name)
                restarted.append(name)
        return restarted

    def stop(self, timeout_s: float = SHUTDOWN_GRACE_S) -> None:
        """SIGTERM the services in reverse start order (each drains), then stop the broker."""
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    log.warning("service did not stop in time; killed", service=name)
            kill_group(proc.pid, signal.SIGTERM)  # the service and anything of it still running
            proc.wait()
        self.procs.clear()
        if self.nats is not None:
            self.nats.stop()
            self.nats = None
        for marker in ("nats.url", "gateway.url", "services.password"):
            (self.run_dir / marker).unlink(missing_ok=True)
        discovery.clear_state(self.run_dir)

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def open_private_log(path: Path):
    """``path`` opened for appending, readable by its owner only (0600, also when it existed):
    a service's log names tenants, jobs and their errors."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "ab")


def run_coroutine(coroutine):
    """Run ``coroutine`` to its end from sync code, even under a running event loop."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


async def provision_tenants(url: str, broker: EmbeddedNats | EmbeddedNatsCluster, services_password: str,
                            token_file: Path, duplicate_window_s: float = 300.0, replicas: int = 1) -> None:
    """Create the topology (``replicas`` copies of each stream and bucket) and tenant ``default``
    (its token into ``token_file``), then render the broker's users from the ``tenants`` bucket
    and reload it (every node of a cluster)."""
    from marlaas.platform.bus import Bus

    bus = await Bus.connect(url, name="marlaas-launcher", timeout_s=15.0)
    try:
        await bus.ensure_topology(duplicate_window_s=duplicate_window_s, replicas=replicas)
        await ensure_default_tenant(bus, token_file)
        await broker_auth.write_broker_auth(bus, broker.auth_file, services_password)
        broker.reload()
    finally:
        await bus.close()


async def ensure_default_tenant(bus, token_file: Path) -> None:
    """Add tenant ``default`` if missing; give it a new token if ``token_file`` lost the old one.

    A revoked ``default`` stays revoked (and its token file goes).
    """
    from marlaas.platform import tenants

    record = await tenants.get_tenant(bus, DEFAULT_TENANT)
    if record is None:  # the machine's own user: a quota that a benchmark's sweep fits in
        _, token = await tenants.add_tenant(bus, DEFAULT_TENANT, max_jobs=DEFAULT_TENANT_MAX_JOBS)
    elif not record.active:
        log.warning("tenant default was revoked; not recreating it")
        token_file.unlink(missing_ok=True)
        return
    else:
        token = token_file.read_text().strip() if token_file.exists() else ""
        if record.token_bcrypt and await tenants.authenticate(bus, token) is not None:
            return
        _, token = await tenants.rotate_token(bus, DEFAULT_TENANT)
    write_private(token_file, token)
