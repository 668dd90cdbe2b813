"""What every request handler of the gateway shares: the :class:`Gateway` (bus, store, config,
metrics, caps), the errors it answers with, and the checks every request goes through.

Stateless: every answer is read from JetStream (or asked of the manager) when the request
comes, so gateway replicas need no coordination. Every error is ``{"error": "..."}``
saying what was wrong and what to do; a request a user can get wrong never gets a 500.

A leaf of the gateway: the route modules import it, it imports none of them (nor the app).
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import unquote_to_bytes

import msgspec
import structlog
from litestar import MediaType, Request, Response
from litestar.connection import ASGIConnection
from litestar.exceptions import HTTPException, NotFoundException, ValidationException

from marlaas.platform.bus import Bus
from marlaas.platform.config import Config
from marlaas.platform.limits import MAX_JSON_NESTING
from marlaas.platform.store import ObjectStore
from services.gateway.metrics import StackMetrics
from services.gateway.reads import BrokerRefused, RecordsSnapshot

log = structlog.get_logger("gateway")
MANAGER_TIMEOUT_S = 60.0  # a submission may wait for an admission pass (version 0 is written in it)
API_HELP = "the API is /v1/jobs and the paths under it (docs/using.md, 'HTTP API'; the operator has /openapi.json)"
MAX_PATH_BYTES = 2048  # a request path, percent-escapes decoded: ids are short, the longest real one ~200


class ApiError(HTTPException):
    """An answer this API means to give: ``status`` and a message saying what to fix."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(status_code=status, detail=message, headers=headers)


def not_found(job: str) -> ApiError:
    """The one answer for a job that is missing or another tenant's (the same body either way)."""
    return ApiError(404, f"no job {job!r}: GET /v1/jobs lists your jobs")


def json_object(raw: bytes, example: str = '{"session_id": "..."}') -> dict:
    """A request body that must be one JSON object (empty = ``{}``); a clear 400 for anything
    else, nesting deeper than ``MAX_JSON_NESTING`` included (the parser's recursion would
    otherwise surface as a 500)."""
    try:
        body = json.loads(raw or b"{}")
    except RecursionError:
        body = None
        deep = True
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are both
        raise ApiError(400, f"the body is not JSON ({exc}): send one JSON object, e.g. {example}") from None
    else:
        deep = nesting_over(body)
    if deep:
        raise ApiError(400, f"the body is nested more than {MAX_JSON_NESTING} levels deep (arrays and objects "
                            f"within each other): send one flat JSON object, e.g. {example}")
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, e.g. {example}; got a {type(body).__name__}")
    return body


def nesting_over(value, limit: int = MAX_JSON_NESTING) -> bool:
    """Whether ``value`` (a decoded JSON or TOML body) holds lists and dicts more than ``limit``
    levels deep (iterative: a recursive walk of a hostile body would itself overflow)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


class Slots:
    """How many of one kind of long-lived request (event streams, uploads) each tenant and all
    tenants have open on this gateway replica, and the caps on both: past one, a 429 that names
    its setting. In-process: each replica bounds what it holds itself (memory, broker consumers)."""

    def __init__(self, what: str, per_tenant: int, per_tenant_setting: str,
                 total: int | None = None, total_setting: str = "") -> None:
        self.what, self.per_tenant, self.per_tenant_setting = what, per_tenant, per_tenant_setting
        self.total, self.total_setting = total, total_setting
        self.open: Counter[str] = Counter()

    def refusal(self, tenant: str) -> str | None:
        """Why ``tenant`` may not open one more now, or None."""
        if self.open[tenant] >= self.per_tenant:
            return (f"you already have {self.open[tenant]} {self.what} open on this gateway, the most a tenant may "
                    f"({self.per_tenant_setting} = {self.per_tenant}): close one (or wait for one to end), then retry")
        if self.total is not None and self.open.total() >= self.total:
            return (f"this gateway has {self.open.total()} {self.what} open for all tenants, its most "
                    f"({self.total_setting} = {self.total}): retry in a moment")
        return None

    def take(self, tenant: str) -> None:
        """Count one more of ``tenant``'s, or raise the 429 that :meth:`refusal` words."""
        if (refused := self.refusal(tenant)) is not None:
            raise ApiError(429, refused, {"Retry-After": "5"})
        self.open[tenant] += 1

    def release(self, tenant: str) -> None:
        self.open[tenant] -= 1
        if self.open[tenant] <= 0:
            del self.open[tenant]

    @contextlib.contextmanager
    def held(self, tenant: str) -> Iterator[None]:
        """One of ``tenant``'s for the ``with`` block."""
        self.take(tenant)
        try:
            yield
        finally:
            self.release(tenant)


@dataclass
class Gateway:
    """What the request handlers share: the bus, the object store, config, the metrics and the
    operator's token ("" = no operator pages for anyone)."""

    bus: Bus
    store: ObjectStore
    config: Config
    metrics: StackMetrics
    snapshot: RecordsSnapshot = field(default_factory=RecordsSnapshot)
    operator_token: str = ""
    streams: Slots = field(init=False)  # open event streams (each holds two broker consumers)
    uploads: Slots = field(init=False)  # uploads being received (each a temp file and a line buffer)

    def __post_init__(self) -> None:
        cfg = self.config.gateway
        self.streams = Slots("event streams", cfg.max_streams_per_tenant, "gateway.max_streams_per_tenant",
                             cfg.max_streams, "gateway.max_streams")
        self.uploads = Slots("uploads", cfg.max_uploads_per_tenant, "gateway.max_uploads_per_tenant")

    async def call(self, subject: str, payload: msgspec.Struct, reply_type: type, timeout_s: float = MANAGER_TIMEOUT_S):
        """Ask the manager; a manager that does not answer is a 503 (retry), never a hang."""
        try:
            data = await self.bus.request(subject, msgspec.json.encode(payload), timeout_s)
        except TimeoutError as exc:
            raise ApiError(503, f"the manager did not answer ({exc}): retry in a moment") from exc
        return msgspec.json.decode(data, type=reply_type)


def gateway_of(connection: ASGIConnection) -> Gateway:
    """The :class:`Gateway` serving a request (or any connection: a guard gets one)."""
    return connection.app.state.gateway


def path_problem(raw_path: bytes) -> str | None:
    """What is wrong with a request path (as sent, percent-escapes and all), or None: no route
    takes NUL or other control characters, invalid UTF-8, '..' segments or a path longer than
    ``MAX_PATH_BYTES``, and the file and id lookups behind them must never see one."""
    decoded = unquote_to_bytes(raw_path)
    if len(decoded) > MAX_PATH_BYTES:
        return f"the path is {len(decoded)} bytes long, over {MAX_PATH_BYTES}"
    try:
        text = decoded.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"the path is not UTF-8 (byte {exc.start} after decoding %-escapes)"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
        return "the path holds a control character (NUL, a newline, ...)"
    if ".." in text.replace("\\", "/").split("/"):
        return "the path holds a '..' segment"
    return None


def path_guard(app):
    """ASGI middleware: a 400 naming what is wrong for a path no route can take (see
    :func:`path_problem`), before any handler (or the dashboard's file lookup) sees it."""
    async def guarded(scope, receive, send) -> None:
        if scope["type"] == "http":
            raw = scope.get("raw_path") or scope["path"].encode("utf-8", "surrogateescape")
            problem = path_problem(raw.split(b"?", 1)[0])
            if problem is not None:  # answered by error_answer, like any ApiError
                raise ApiError(400, f"{problem}: {API_HELP}")
        await app(scope, receive, send)

    return guarded


def api_help(request: Request) -> str:
    if request.url.path.startswith("/tinker/"):
        return "this Tinker endpoint is not served here (docs/tinker.md says what is, and why the rest is not)"
    return API_HELP


def error_answer(request: Request, exc: Exception) -> Response:
    """Every error as ``{"error": ...}``; the framework's own errors reworded to say what to do."""
    status, headers = 500, None
    if isinstance(exc, HTTPException):
        status, message, headers = exc.status_code, exc.detail, exc.headers
        if isinstance(exc, ApiError):
            pass
        elif status == 413:
            limit = gateway_of(request).config.gateway.max_body_bytes
            message = f"the request body is larger than {limit} bytes (gateway.max_body_bytes): send a smaller job"
        elif isinstance(exc, NotFoundException):
            message = f"no endpoint {request.method} {request.url.path}: {api_help(request)}"
        elif status == 405:
            message = f"{request.method} is not allowed on {request.url.path}: {api_help(request)}"
        elif isinstance(exc, ValidationException):
            message = f"{exc.detail}: {exc.extra}" if exc.extra else str(exc.detail)
    elif isinstance(exc, BrokerRefused):  # e.g. its consumer limit reached: load, not the request's fault
        status, message, headers = 503, str(exc), {"Retry-After": "5"}
        log.warning("the broker refused a read", method=request.method, path=request.url.path, error=str(exc))
    else:
        log.exception("request failed", method=request.method, path=request.url.path)
        message = "internal error: the gateway log has the details; retry, or report it if it persists"
    return Response({"error": message}, status_code=status, headers=headers, media_type=MediaType.JSON)
