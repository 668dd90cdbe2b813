"""Gateway shell: serve the HTTP API with uvicorn inside the service's event loop until stopped.

It reads the operator's token (``/metrics``, the schema) and binds its socket first (port 0
picks a free one), writes its URL to ``<home>/run/gateway.url`` once listening, then
reports ready. SIGINT/SIGTERM (the runtime's ``stop``) make uvicorn finish the requests in
flight and close.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket

import structlog
import uvicorn

from marlaas.platform.config import Config
from marlaas.platform.runtime import Runtime
from services.gateway.app import create_app
from services.gateway.context import Gateway
from services.gateway.metrics import StackMetrics

log = structlog.get_logger("gateway")
SHUTDOWN_GRACE_S = 5.0  # open event streams are cut after this
MIN_OPERATOR_TOKEN_CHARS = 16


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the runtime's ``stop`` event decides."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (an IPv6 host works too)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY on accepted sockets only when the proto
    # says TCP, and without it a response's second write waits ~40 ms on a delayed ACK
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"gateway: cannot listen on {host}:{port} ({exc.strerror}): free the port or set "
                         "gateway.port (0 = any free port)") from None
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def operator_token(config: Config) -> str:
    """The operator's token: ``gateway.operator_token`` (MARLAAS_OPERATOR_TOKEN), else the file
    ``gateway.operator_token_file`` (by default ``<home>/run/operator.token``, which the launcher writes)."""
    token = config.gateway.operator_token
    if not token:
        path = config.operator_token_path
        try:
            token = path.read_text().strip()
        except FileNotFoundError:
            raise SystemExit(f"gateway: no operator token (for /metrics and the API schema): {path} does not "
                             "exist; set MARLAAS_OPERATOR_TOKEN, or gateway.operator_token_file to a file "
                             "holding it (`marlaas up` writes one)") from None
    if len(token) < MIN_OPERATOR_TOKEN_CHARS or any(c.isspace() for c in token):
        raise SystemExit(f"gateway: the operator token must be at least {MIN_OPERATOR_TOKEN_CHARS} characters "
                         "with no spaces: make one with `openssl rand -hex 24`")
    return token


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _report_metrics_end(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("following spans for /metrics stopped; busy-time figures freeze", error=repr(task.exception()))


async def run(rt: Runtime) -> None:
    """Serve until ``rt.stop``; the URL file goes away with the server."""
    cfg = rt.config.gateway
    metrics = StackMetrics()
    app = create_app(Gateway(rt.bus, rt.store, rt.config, metrics, operator_token=operator_token(rt.config)))
    sock = bind(cfg.host, cfg.port)
    server = _Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                    timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    following = asyncio.create_task(metrics.follow(rt.bus, rt.stop))
    following.add_done_callback(_report_metrics_end)
    while not server.started:
        if serving.done():
            await serving  # raises what stopped it
            raise SystemExit("gateway: the HTTP server exited during start-up")
        await asyncio.sleep(0.05)
    url = url_of(sock)
    url_file = rt.config.home_dir / "run" / "gateway.url"
    url_file.parent.mkdir(parents=True, exist_ok=True)
    partial = url_file.with_name(f".gateway.url.{os.getpid()}")
    partial.write_text(url)
    partial.replace(url_file)  # readers never see half a URL
    rt.ready()
    log.info("ready", url=url)
    try:
        await rt.stop.wait()
    finally:
        server.should_exit = True
        await asyncio.gather(serving, following, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            if url_file.read_text() == url:  # another replica may have written its own since
                url_file.unlink()
        sock.close()
