"""The gateway's ASGI app (Litestar): authentication, JSON errors, health, /metrics, OpenAPI.

Stateless: every answer is read from JetStream (or asked of the manager) when the request
comes, so gateway replicas need no coordination. Every error is ``{"error": "..."}``
saying what was wrong and what to do; a request a user can get wrong never gets a 500.

``/metrics`` and the schema (``/openapi.json``, Litestar's ``/schema``) are the operator's:
they take the operator's token, never a tenant's. Litestar's documentation pages (Swagger,
ReDoc, ...) are not served at all: they load their scripts from CDNs.
"""

from __future__ import annotations

from pathlib import Path

import asyncio
import hmac
from dataclasses import dataclass, field

import msgspec
import structlog
from litestar import Litestar, MediaType, Request, Response, Router, get
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.di import Provide
from litestar.exceptions import HTTPException, NotFoundException, ValidationException
from litestar.handlers import BaseRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.static_files import create_static_files_router
from litestar.openapi.plugins import JsonRenderPlugin
from litestar.openapi.spec import Components, SecurityScheme

from marlaas.platform import api
from marlaas.platform.bus import Bus
from marlaas.platform.config import Config
from marlaas.platform.store import ObjectStore
from marlaas.platform.tenants import TenantRecord, authenticate
from services.gateway.metrics import StackMetrics
from services.gateway.reads import RecordsSnapshot, all_records

log = structlog.get_logger("gateway")
MANAGER_TIMEOUT_S = 60.0  # a submission may wait for an admission pass (version 0 is written in it)
API_HELP = "the API is /v1/jobs and the paths under it (docs/using.md, 'HTTP API'; the operator has /openapi.json)"
OPERATOR_TOKEN_HELP = ("send 'Authorization: Bearer <operator token>': `marlaas up` writes it to "
                       "<home>/run/operator.token; a deployed gateway has it from MARLAAS_OPERATOR_TOKEN")


class ApiError(HTTPException):
    """An answer this API means to give: ``status`` and a message saying what to fix."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(status_code=status, detail=message, headers=headers)


def not_found(job: str) -> ApiError:
    """The one answer for a job that is missing or another tenant's (the same body either way)."""
    return ApiError(404, f"no job {job!r}: GET /v1/jobs lists your jobs")


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

    async def call(self, subject: str, payload: msgspec.Struct, reply_type: type, timeout_s: float = MANAGER_TIMEOUT_S):
        """Ask the manager; a manager that does not answer is a 503 (retry), never a hang."""
        try:
            data = await self.bus.request(subject, msgspec.json.encode(payload), timeout_s)
        except TimeoutError as exc:
            raise ApiError(503, f"the manager did not answer ({exc}): retry in a moment") from exc
        return msgspec.json.decode(data, type=reply_type)


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


async def authenticated_tenant(request: Request) -> TenantRecord:
    """The tenant of the request's bearer token; 401 for a missing, malformed, unknown or revoked one."""
    challenge = {"WWW-Authenticate": 'Bearer realm="marlaas"'}
    header = request.headers.get("authorization")
    if not header:
        raise ApiError(401, "missing Authorization header: send 'Authorization: Bearer <token>' with your "
                            "tenant's token (`marlaas tenant add` prints it)", challenge)
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "the Authorization header must be 'Bearer <token>'", challenge)
    tenant = await authenticate(gateway_of(request).bus, token.strip())
    if tenant is None:
        raise ApiError(401, "token not accepted (malformed, unknown or revoked): use a current token of your "
                            "tenant (ask its admin for a new one)", challenge)
    return tenant


async def operator_only(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Guard of the operator's pages: 401 without a bearer token, 403 with any but the operator's."""
    path = connection.url.path
    scheme, _, token = connection.headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, f"{path} is for the operator only: {OPERATOR_TOKEN_HELP}",
                       {"WWW-Authenticate": 'Bearer realm="marlaas-operator"'})
    expected = connection.app.state.gateway.operator_token
    if not expected or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise ApiError(403, f"{path} is for the operator only, and that is not the operator token (a "
                            f"tenant's is refused here): {OPERATOR_TOKEN_HELP}")


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
    else:
        log.exception("request failed", method=request.method, path=request.url.path)
        message = "internal error: the gateway log has the details; retry, or report it if it persists"
    return Response({"error": message}, status_code=status, headers=headers, media_type=MediaType.JSON)


@get("/healthz", include_in_schema=False)
async def healthz() -> dict:
    """The process is alive."""
    return {"ok": True}


@get("/readyz", include_in_schema=False)
async def readyz(request: Request) -> Response:
    """NATS is connected and the manager answers."""
    gateway = gateway_of(request)
    if not gateway.bus.nc.is_connected:
        return Response({"error": "not connected to NATS"}, status_code=503)
    try:
        await asyncio.wait_for(gateway.bus.request(api.PING, b"{}", 2.0), 3.0)
    except TimeoutError:
        return Response({"error": "the manager does not answer"}, status_code=503)
    return Response({"ok": True}, status_code=200)


@get("/metrics", include_in_schema=False, media_type="text/plain; version=0.0.4", guards=[operator_only])
async def metrics(request: Request) -> bytes:
    """Prometheus text exposition (no tenant or job labels), for the operator."""
    gateway = gateway_of(request)
    return gateway.metrics.render(await all_records(gateway.bus))  # fresh: scrapes are seconds apart


@get("/openapi.json", include_in_schema=False, guards=[operator_only])
async def openapi_json(request: Request) -> dict:
    """The OpenAPI schema of the API, for the operator."""
    return api_schema(request.app)


def api_schema(app: Litestar) -> dict:
    """``app``'s OpenAPI schema with the job body (read raw, so the framework cannot see it);
    also what the docs' HTTP API reference is generated from (docs/hooks.py)."""
    schema = app.openapi_schema.to_schema()
    (job,), components = msgspec.json.schema_components([api.SubmitRequest],
                                                        ref_template="#/components/schemas/{name}")
    schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
    schema["paths"]["/v1/jobs"]["post"]["requestBody"] = {
        "required": True, "content": {media: {"schema": job} for media in ("application/json", "application/toml")},
    }
    return schema


UI_DIR = Path(__file__).parent / "ui"


def create_app(gateway: Gateway) -> Litestar:
    """The ASGI app serving ``gateway``."""
    from services.gateway.files import FILE_ROUTES
    from services.gateway.tinker import CHECKPOINT_ROUTES, TINKER_ROUTER
    from services.gateway.views import JOB_ROUTES

    v1 = Router(path="/v1", route_handlers=[*JOB_ROUTES, *FILE_ROUTES, *CHECKPOINT_ROUTES],
                dependencies={"tenant": Provide(authenticated_tenant)}, security=[{"bearer": []}])
    # the dashboard: static files that call /v1 with the token the tenant types in (ui/app.js)
    ui = create_static_files_router(path="/ui", directories=[UI_DIR], html_mode=True, name="ui")
    return Litestar(
        route_handlers=[v1, healthz, readyz, metrics, openapi_json, ui, TINKER_ROUTER],
        state=State({"gateway": gateway}),
        exception_handlers={Exception: error_answer},
        request_max_body_size=gateway.config.gateway.max_body_bytes,
        openapi_config=OpenAPIConfig(
            title="marlaas", version="1",
            description="Multi-tenant asynchronous RL for LLMs: upload data, submit jobs, follow them, download "
                        "adapters.",
            components=Components(security_schemes={"bearer": SecurityScheme(type="http", scheme="bearer")}),
            # Litestar always mounts /schema (its JSON, a 404 page for the rest): the operator's too;
            # only the JSON renderer, as the documentation pages' scripts come from CDNs
            render_plugins=[JsonRenderPlugin()],
            openapi_router=Router("/schema", route_handlers=[], guards=[operator_only]),
        ),
        debug=False,
    )
