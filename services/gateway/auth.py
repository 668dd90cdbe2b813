"""Who is asking: a tenant by its bearer token (``/v1``), or the operator by theirs.

A tenant's token is looked up in the ``tenants`` bucket on every request (a revoked one stops at
once, on every replica). The operator's token opens ``/metrics``, the schema and every tenant's
usage; it is checked in one place, :func:`is_operator`. The Tinker API's keys and JWTs are
``tinker_api.py``'s (signed by ``tinker_auth.py``).
"""

from __future__ import annotations

import hmac

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from marlaas.platform.tenants import TenantRecord, authenticate
from services.gateway.context import ApiError, gateway_of

OPERATOR_TOKEN_HELP = ("send 'Authorization: Bearer <operator token>': `marlaas up` writes it to "
                       "<home>/run/operator.token; a deployed gateway has it from MARLAAS_OPERATOR_TOKEN")


def bearer_token(header: str) -> str:
    """The token of an ``Authorization: Bearer <token>`` header; "" for any other header."""
    scheme, _, token = header.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


async def authenticated_tenant(request: Request) -> TenantRecord:
    """The tenant of the request's bearer token; 401 for a missing, malformed, unknown or revoked one."""
    challenge = {"WWW-Authenticate": 'Bearer realm="marlaas"'}
    header = request.headers.get("authorization")
    if not header:
        raise ApiError(401, "missing Authorization header: send 'Authorization: Bearer <token>' with your "
                            "tenant's token (`marlaas tenant add` prints it)", challenge)
    token = bearer_token(header)
    if not token:
        raise ApiError(401, "the Authorization header must be 'Bearer <token>'", challenge)
    tenant = await authenticate(gateway_of(request).bus, token)
    if tenant is None:
        raise ApiError(401, "token not accepted (malformed, unknown or revoked): use a current token of your "
                            "tenant (ask its admin for a new one)", challenge)
    return tenant


def is_operator(connection: ASGIConnection) -> bool:
    """Whether the request carries the operator's token (never, where the gateway has none)."""
    token = bearer_token(connection.headers.get("authorization", ""))
    expected = gateway_of(connection).operator_token
    return bool(token and expected) and hmac.compare_digest(token.encode(), expected.encode())


async def operator_only(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Guard of the operator's pages: 401 without a bearer token, 403 with any but the operator's."""
    path = connection.url.path
    if not bearer_token(connection.headers.get("authorization", "")):
        raise ApiError(401, f"{path} is for the operator only: {OPERATOR_TOKEN_HELP}",
                       {"WWW-Authenticate": 'Bearer realm="marlaas-operator"'})
    if not is_operator(connection):
        raise ApiError(403, f"{path} is for the operator only, and that is not the operator token (a "
                            f"tenant's is refused here): {OPERATOR_TOKEN_HELP}")
