"""The operations routes: liveness (``/healthz``), readiness (``/readyz``), Prometheus
(``/metrics``) and the OpenAPI schema (``/openapi.json``), none of them in the schema itself.

``/metrics`` and the schema (``/openapi.json``, Litestar's ``/schema``) are the operator's:
they take the operator's token, never a tenant's. Litestar's documentation pages (Swagger,
ReDoc, ...) are not served at all: they load their scripts from CDNs.
"""

from __future__ import annotations

import asyncio

import msgspec
from litestar import Litestar, Request, Response, get

from marlaas.platform import api, subjects
from services.gateway.auth import operator_only
from services.gateway.context import gateway_of
from services.gateway.reads import all_records
from services.gateway.usage import usage_records


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
        await asyncio.wait_for(gateway.bus.request(subjects.API_PING, b"{}", 2.0), 3.0)
    except TimeoutError:
        return Response({"error": "the manager does not answer"}, status_code=503)
    return Response({"ok": True}, status_code=200)


@get("/metrics", include_in_schema=False, media_type="text/plain; version=0.0.4", guards=[operator_only])
async def metrics(request: Request) -> bytes:
    """Prometheus text exposition (tenant labels only on the usage figures), for the operator."""
    gateway = gateway_of(request)
    # fresh: scrapes are seconds apart
    return gateway.metrics.render(await all_records(gateway.bus), await usage_records(gateway.bus))


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


OPERATIONS_ROUTES = [healthz, readyz, metrics, openapi_json]
