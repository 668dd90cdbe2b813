"""The gateway's one reading of a bearer token and one check of the operator's
(``services/gateway/auth.py``): ``/metrics``, the schema and ``GET /v1/usage`` all ask it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.gateway.auth import authenticated_tenant, bearer_token, is_operator, operator_only
from services.gateway.context import ApiError

OPERATOR = "op-" + "7" * 40


def connection(authorization: str | None, operator_token: str = OPERATOR) -> SimpleNamespace:
    """What the checks read of a request: its headers, path and the app's gateway (no bus: none may be asked)."""
    gateway = SimpleNamespace(operator_token=operator_token, bus=None)
    return SimpleNamespace(headers={} if authorization is None else {"authorization": authorization},
                           url=SimpleNamespace(path="/metrics"),
                           app=SimpleNamespace(state=SimpleNamespace(gateway=gateway)))


@pytest.mark.parametrize("header, token", [
    ("Bearer abc", "abc"), ("bearer abc ", "abc"), ("  BEARER   abc", "abc"),
    ("Bearer", ""), ("Bearer   ", ""), ("Basic abc", ""), ("abc", ""), ("", ""),
])
def test_a_bearer_token_is_read_one_way(header, token):
    assert bearer_token(header) == token


def test_only_the_operators_token_is_the_operators():
    assert is_operator(connection(f"Bearer {OPERATOR}"))
    for header in (None, f"Basic {OPERATOR}", f"Bearer {OPERATOR[:-1]}", "Bearer " + "x" * len(OPERATOR)):
        assert not is_operator(connection(header)), header
    assert not is_operator(connection("Bearer ", operator_token=""))
    assert not is_operator(connection(f"Bearer {OPERATOR}", operator_token=""))  # none set: nobody is


async def test_the_operator_pages_answer_401_without_a_token_and_403_with_another():
    assert await operator_only(connection(f"Bearer {OPERATOR}"), None) is None
    for header, status in ((None, 401), (f"Basic {OPERATOR}", 401), ("Bearer tenant-token", 403)):
        with pytest.raises(ApiError) as refused:
            await operator_only(connection(header), None)
        assert refused.value.status_code == status and "for the operator only" in refused.value.detail
        assert "MARLAAS_OPERATOR_TOKEN" in refused.value.detail


@pytest.mark.parametrize("header, says", [(None, "missing Authorization header"),
                                          ("Basic abc", "must be 'Bearer <token>'"), ("Bearer ", "must be")])
async def test_a_tenant_without_a_bearer_token_is_a_401_before_any_lookup(header, says):
    with pytest.raises(ApiError) as refused:
        await authenticated_tenant(connection(header))
    assert refused.value.status_code == 401 and says in refused.value.detail
    assert refused.value.headers["WWW-Authenticate"].startswith("Bearer")
