"""The gateway's ASGI app (Litestar): authentication, JSON errors, health, /metrics, OpenAPI.

Stateless: every answer is read from JetStream (or asked of the manager) when the request
comes, so gateway replicas need no coordination. Every error is ``{"error": "..."}``
saying what was wrong and what to do; a request a user can get wrong never gets a 500.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import msgspec
import structlog
from litestar import Litestar, MediaType, Request, Response, Router, get
from litestar.datastructures import State
from litestar.di import Provide
from litestar.exceptions import HTTPException, NotFoundException, ValidationException
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import Components, SecurityScheme

from marlaas import api
from marlaas.bus import Bus
from marlaas.config import Config
from marlaas.store import ObjectStore
from marlaas.tenants import TenantRecord, authenticate
from services.gateway.metrics import StackMetrics
from services.gateway.reads import RecordsSnapshot, all_records

log = structlog.get_logger("gateway")
MANAGER_TIMEOUT_S = 60.0  # a submission may wait for an admission pass (version 0 is written in it)


class ApiError(HTTPException):
    """An answer this API means to give: ``status`` and a message saying what to fix."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(status_code=status, detail=message, headers=headers)


def not_found(job: str) -> ApiError:
    """The one answer for a job that is missing or another tenant's (the same body either way)."""
    return ApiError(404, f"no job {job!r}: GET /v1/jobs lists your jobs")


@dataclass
class Gateway:
    """What the request handlers share: the bus, the object store, config and the metrics."""

    bus: Bus
    store: ObjectStore
    config: Config
    metrics: StackMetrics
    snapshot: RecordsSnapshot = field(default_factory=RecordsSnapshot)

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
            message = f"no endpoint {request.method} {request.url.path}: /openapi.json describes the API"
        elif status == 405:
            message = f"{request.method} is not allowed on {request.url.path}: /openapi.json describes the API"
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


@get("/metrics", include_in_schema=False, media_type="text/plain; version=0.0.4")
async def metrics(request: Request) -> bytes:
    """Prometheus text exposition (no tenant or job labels)."""
    gateway = gateway_of(request)
    return gateway.metrics.render(await all_records(gateway.bus))  # fresh: scrapes are seconds apart


@get("/openapi.json", include_in_schema=False)
async def openapi_json(request: Request) -> dict:
    """The OpenAPI schema of the API, with the job body (read raw, so the framework cannot see it)."""
    schema = request.app.openapi_schema.to_schema()
    (job,), components = msgspec.json.schema_components([api.SubmitRequest],
                                                        ref_template="#/components/schemas/{name}")
    schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
    schema["paths"]["/v1/jobs"]["post"]["requestBody"] = {
        "required": True, "content": {media: {"schema": job} for media in ("application/json", "application/toml")},
    }
    return schema


def create_app(gateway: Gateway) -> Litestar:
    """The ASGI app serving ``gateway``."""
    from services.gateway.files import FILE_ROUTES
    from services.gateway.views import JOB_ROUTES

    v1 = Router(path="/v1", route_handlers=[*JOB_ROUTES, *FILE_ROUTES],
                dependencies={"tenant": Provide(authenticated_tenant)}, security=[{"bearer": []}])
    return Litestar(
        route_handlers=[v1, healthz, readyz, metrics, openapi_json],
        state=State({"gateway": gateway}),
        exception_handlers={Exception: error_answer},
        request_max_body_size=gateway.config.gateway.max_body_bytes,
        openapi_config=OpenAPIConfig(
            title="marlaas", version="1", path="/schema",
            description="Multi-tenant asynchronous RL for LLMs: upload data, submit jobs, follow them, download "
                        "adapters.",
            components=Components(security_schemes={"bearer": SecurityScheme(type="http", scheme="bearer")}),
        ),
        debug=False,
    )
