"""The gateway's operator pages: ``/metrics`` and the API schema take the operator's token and
nothing else (a tenant's token is refused, saying what to send), and no page the gateway
serves loads anything from another host (Litestar's documentation pages pull their scripts
from CDNs, so they are not served).

The gateway's ASGI app runs in the test against a real nats-server (tenant tokens are
checked in the tenants bucket), as in ``test_hostile_input.py``.
"""

from __future__ import annotations

import re
import stat

import httpx
import pytest

from marlaas.platform.config import load_config
from marlaas.platform.tenants import add_tenant
from marlaas.stack.launcher import Stack
from services.gateway.app import create_app
from services.gateway.context import Gateway
from services.gateway.metrics import StackMetrics
from services.gateway.service import operator_token

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.own_stack("manager and gateway alone, reading the operator token the launcher wrote")]
OPERATOR = "op-" + "7" * 40
OPERATOR_PAGES = ("/metrics", "/openapi.json", "/schema", "/schema/openapi.json", "/schema/swagger")
# what Litestar serves under /schema when its documentation pages are on
DOCUMENTATION_PAGES = ("/schema/swagger", "/schema/redoc", "/schema/elements", "/schema/rapidoc",
                       "/schema/openapi.yaml", "/schema/openapi.yml")
URL = re.compile(r"https?://([^/\s\"'<>)]+)", re.IGNORECASE)


@pytest.fixture
def config(tmp_path):
    return load_config(overrides={"home": str(tmp_path / "home")}, env={})


@pytest.fixture
async def app(bus, file_store, config):
    return create_app(Gateway(bus, file_store, config, StackMetrics(), operator_token=OPERATOR))


@pytest.fixture
async def gateway(app):
    """An HTTP client of the gateway app, sending no token of its own."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        yield client


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_metrics_and_the_schema_take_the_operator_token_only(gateway, bus):
    _, tenant_token = await add_tenant(bus, "acme")
    for path in OPERATOR_PAGES:
        answer = await gateway.get(path)
        assert answer.status_code == 401 and answer.headers["WWW-Authenticate"].startswith("Bearer"), path
        assert "for the operator only" in answer.json()["error"], path
        assert "Bearer <operator token>" in answer.json()["error"] and "operator.token" in answer.json()["error"]
        for wrong in (tenant_token, OPERATOR[:-1], "x" * len(OPERATOR)):
            answer = await gateway.get(path, headers=bearer(wrong))
            assert answer.status_code == 403, (path, answer.text)
            assert "not the operator token" in answer.json()["error"] and "MARLAAS_OPERATOR_TOKEN" in answer.text
            assert tenant_token not in answer.text
        assert (await gateway.get(path, headers={"Authorization": f"Basic {OPERATOR}"})).status_code == 401

    metrics = await gateway.get("/metrics", headers=bearer(OPERATOR))
    assert metrics.status_code == 200 and "marlaas_jobs" in metrics.text
    schema = (await gateway.get("/openapi.json", headers=bearer(OPERATOR))).json()
    assert "/v1/jobs" in schema["paths"] and "SubmitRequest" in schema["components"]["schemas"]
    assert (await gateway.get("/schema/openapi.json", headers=bearer(OPERATOR))).json()["paths"]
    for open_page in ("/healthz",):  # what a load balancer asks stays open
        assert (await gateway.get(open_page)).status_code == 200


DASHBOARD = ("/ui/", "/ui/app.js", "/ui/app.css")
SVG_NAMESPACE = '"http://www.w3.org/2000/svg"'


async def test_no_documentation_page_is_served(gateway):
    for path in DOCUMENTATION_PAGES:
        answer = await gateway.get(path, headers=bearer(OPERATOR))
        assert answer.status_code == 404, (path, answer.text[:200])


async def test_no_served_page_references_another_host(app, gateway):
    paths = {route.path for route in app.routes if "{" not in route.path and "GET" in route.methods}
    paths |= set(OPERATOR_PAGES) | set(DOCUMENTATION_PAGES) | {"/", "/docs", "/schema/"} | set(DASHBOARD)
    assert {"/metrics", "/openapi.json", "/healthz", "/v1/jobs"} <= paths
    for path in DASHBOARD:  # the dashboard is served, and everything it needs comes from here
        assert (await gateway.get(path)).status_code == 200, path
    for path in sorted(paths):
        for headers in ({}, bearer(OPERATOR)):
            answer = await gateway.get(path, headers=headers)
            text = answer.text.replace(SVG_NAMESPACE, "")  # a name for SVG elements, never fetched
            hosts = {host.lower() for host in URL.findall(text)}
            assert hosts <= {"gateway"}, (path, answer.status_code, hosts)


def test_the_gateway_reads_the_operator_token_from_config_env_or_file(tmp_path):
    home = tmp_path / "home"
    with pytest.raises(SystemExit, match="no operator token .* set MARLAAS_OPERATOR_TOKEN"):
        operator_token(load_config(env={"MARLAAS_HOME": str(home)}))
    (home / "run").mkdir(parents=True)
    (home / "run" / "operator.token").write_text(OPERATOR + "\n")
    assert operator_token(load_config(env={"MARLAAS_HOME": str(home)})) == OPERATOR
    assert operator_token(load_config(env={"MARLAAS_HOME": str(home),
                                           "MARLAAS_OPERATOR_TOKEN": "env-" + "5" * 30})) == "env-" + "5" * 30
    mounted = tmp_path / "secret"
    mounted.write_text("file-" + "3" * 30)
    assert operator_token(load_config(overrides={"home": str(home), "gateway.operator_token_file": str(mounted)},
                                      env={})) == "file-" + "3" * 30
    for weak in ("short", "has spaces in the middle of it"):
        with pytest.raises(SystemExit, match="at least 16 characters with no spaces"):
            operator_token(load_config(env={"MARLAAS_HOME": str(home), "MARLAAS_OPERATOR_TOKEN": weak}))


def test_a_launched_gateway_takes_the_operator_token_the_launcher_wrote(tmp_path):
    config = load_config(overrides={"home": str(tmp_path / "home"), "gateway.port": 0}, env={})
    with Stack(config, services=("manager", "gateway")) as stack:  # no engine: nothing reads /metrics' spans
        url, token = stack.gateway_url, (stack.run_dir / "operator.token").read_text()
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/metrics", headers=bearer(stack.default_token_file.read_text())).status_code == 403
        answer = httpx.get(f"{url}/metrics", headers=bearer(token))
        assert answer.status_code == 200 and "marlaas_jobs" in answer.text
        for name in ("manager", "gateway"):
            assert stat.S_IMODE((stack.home / "logs" / f"{name}.log").stat().st_mode) == 0o600
