"""The fixtures of the Tinker API's test modules (each imports them): the embedded stack on its own
defaults (no config of its own: the cookbook's rank-32 LoRAs and 1024-token games must run on
them, issue 39), the API's URL, each tenant's Tinker key, and alice's SDK client. The stack is the
session's shared one (the module is marked ``shared_stack``), unless the module sets ``TRAINERS``
above 1: then it starts its own with that many trainer replicas. ``TENANTS`` (default alice and
bob) names the tenants, added as ``TENANT_PREFIX`` + name (default no prefix: two modules on the
shared stack must not add the same name). tests/ is on sys.path beside conftest.py, so any test
imports this."""

from __future__ import annotations

import pytest

from marlaas.platform.config import load_config
from marlaas.stack.launcher import SERVICES, Stack
from tests.tenant_admin import tenant_cli_ok


@pytest.fixture(scope="module")
def stack(request, tmp_path_factory):
    trainers = getattr(request.module, "TRAINERS", 1)
    if trainers == 1:
        yield request.getfixturevalue("shared_stack")
        return
    config = load_config(overrides={"home": str(tmp_path_factory.mktemp("tinker-home")), "gateway.port": 0}, env={})
    with Stack(config, services=SERVICES, replicas={"trainer": trainers}) as running:
        yield running


@pytest.fixture(scope="module")
def url(stack) -> str:
    return (stack.run_dir / "gateway.url").read_text().strip() + "/tinker"


@pytest.fixture(scope="module")
def keys(request, stack) -> dict[str, str]:
    """Each tenant added, and its Tinker key as `marlaas tenant add NAME --json` prints it (by the
    name in ``TENANTS``)."""
    found = {}
    prefix = getattr(request.module, "TENANT_PREFIX", "")
    for name in getattr(request.module, "TENANTS", ("alice", "bob")):
        out = tenant_cli_ok(stack.home, "add", prefix + name)
        assert out["tinker_api_key"] == f"tml-{out['token']}"
        found[name] = out["tinker_api_key"]
    return found


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def service(url, keys, monkeypatch_module):
    """Alice's ``tinker.ServiceClient`` (the SDK's telemetry off)."""
    import tinker

    monkeypatch_module.setenv("TINKER_TELEMETRY", "0")
    with tinker.ServiceClient(base_url=url, api_key=keys["alice"]) as client:
        yield client
