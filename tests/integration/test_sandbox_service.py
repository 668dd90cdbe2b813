"""The python tool's own ``sandbox`` service: what its process holds and what its broker user may do.

The stack here is the embedded broker with ``env`` (the registrar) and ``sandbox``, spawned by the
launcher as ``marlaas up`` spawns them, from a launcher whose environment holds the secrets a
deployment has (the store's keys, the operator's token). Refused publishes and subscribes reach
nats-py only through ``error_cb`` (see ``test_tenant_isolation.py``'s ``Conn``).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import nats.errors
import pytest

from marlaas.platform import nats_access
from marlaas.platform.bus import Bus
from marlaas.platform.config import load_config
from marlaas.platform.events import ToolCall, ToolSpec, encode
from marlaas.stack.launcher import Stack
from marlaas.tools import registry
from tests.integration.test_tenant_isolation import Conn, kv_snapshot

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.own_stack("env and sandbox alone, with the launcher's secrets set")]

LAUNCHER_SECRETS = {"MARLAAS_S3_ACCESS_KEY": "launcher-access-key",
                    "MARLAAS_S3_SECRET_KEY": "launcher-secret-key-0123456789",
                    "MARLAAS_OPERATOR_TOKEN": "launcher-operator-token-0123456789",
                    "AWS_SECRET_ACCESS_KEY": "launcher-aws-secret-0123456789"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("sandbox")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in LAUNCHER_SECRETS.items():
            patch.setenv(name, value)
        running = Stack(load_config(env={"MARLAAS_HOME": str(home)}), services=("env", "sandbox")).start()
        services_password = (running.run_dir / "services.password").read_text()
    yield running, services_password
    running.stop()


@pytest.fixture
async def services(stack):
    bus = await Bus.connect(stack[0].nats_url, name="test-services", timeout_s=5)
    yield bus
    await bus.close()


@pytest.fixture
async def sandbox(stack):
    running, services_password = stack
    conn = await Conn.open(nats_access.redact_url(running.nats_url), nats_access.SANDBOX_USER,
                           nats_access.sandbox_password(services_password))
    yield conn
    await conn.close()


def environ_of(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode().partition("=")[::2] for p in pairs if p)


def test_the_sandbox_process_holds_no_platform_secret(stack):
    running, services_password = stack
    proc = running.procs["sandbox"]
    environ = environ_of(proc.pid)
    raw = Path(f"/proc/{proc.pid}/environ").read_bytes().decode()
    assert services_password not in raw
    assert not any(secret in raw for secret in LAUNCHER_SECRETS.values())
    assert not [name for name in environ if "S3" in name or "AWS" in name or "TOKEN" in name]
    assert [name for name in environ if name.startswith("MARLAAS_")] == ["MARLAAS_NATS_URL"]
    assert nats_access.url_credentials(environ["MARLAAS_NATS_URL"]) == (
        nats_access.SANDBOX_USER, nats_access.sandbox_password(services_password))
    cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode().split("\0")
    config_file = Path(cmdline[cmdline.index("--config") + 1])
    assert config_file != running.config_path  # not the services' config, which holds their URL
    config = json.loads(config_file.read_text())
    assert config["nats_url"] == "" and config["store_url"] == "" and config["gateway"]["operator_token"] == ""
    assert services_password not in config_file.read_text()
    env_environ = environ_of(running.procs["env"].pid)  # the env beside it does inherit them
    assert env_environ["MARLAAS_S3_SECRET_KEY"] == LAUNCHER_SECRETS["MARLAAS_S3_SECRET_KEY"]


async def test_a_python_call_through_the_bus_is_answered_by_the_sandbox(stack, services):
    spec = await registry.read_tool(services, "python")  # announced through env's registrar
    assert spec is not None and spec.qualified == "builtin.python"
    assert [s.name for s in await registry.list_tools(services, "builtin")] == ["calculator", "python", "search"]
    call = ToolCall(call_id="c1", tool="builtin.python", job="default.j1",
                    arguments=json.dumps({"code": "print(6 * 7)"}))
    reply = json.loads(await services.request("marlaas.tool.builtin.python", encode(call), timeout_s=20))
    assert reply["error"] == "" and reply["output"].startswith("42\n[exit code 0]"), reply
    log = (stack[0].home / "logs" / "sandbox.log").read_text()
    assert "builtin.python" in log and "ready" in log  # served by the sandbox: env serves no python
    assert "marlaas.tool.builtin.python" not in (stack[0].home / "logs" / "env.log").read_text()


async def test_the_sandbox_user_may_do_nothing_else(sandbox, services):
    for subject in ("marlaas.tool.builtin.search", "marlaas.tool.builtin.python",  # outside its queue group
                    "marlaas.tool.>", "marlaas.reward.>", "marlaas.job.*.default.>", "marlaas.policy.committed.>",
                    "marlaas.registry.*.announce", "marlaas.trajectory.ready.>", "$KV.>", "$JS.>", "_INBOX.>",
                    "_INBOX_acme.>", ">"):
        await sandbox.nc.subscribe(subject)
        await sandbox.refused("subscription", subject)
    before = await kv_snapshot(services)
    for subject in ("marlaas.registry.acme.announce", "marlaas.tool.builtin.search", "marlaas.api.submit",
                    "marlaas.job.submitted.default.j1", "marlaas.policy.committed.default.j1",
                    "$KV.tools.builtin.search", "$KV.jobs.default.j1", "$JS.API.STREAM.PURGE.KV_tools",
                    "$JS.API.DIRECT.GET.KV_tenants"):
        await sandbox.nc.publish(subject, b"{}")
        await sandbox.refused("publish", subject)
    assert await kv_snapshot(services) == before


async def test_the_sandbox_user_cannot_reach_jetstream(sandbox):
    with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
        await sandbox.nc.request("$JS.API.INFO", b"", timeout=1)
    await sandbox.refused("publish", "$JS.API.INFO")
    with pytest.raises(Exception):  # noqa: B017 - refused, whatever nats-py makes of it
        await sandbox.nc.jetstream(timeout=1).account_info()


async def test_a_reply_subject_from_the_sandbox_user_stores_nothing(sandbox, services):
    """The registrar answers only to an inbox: a reply of ``$KV.jobs.x`` from a platform user would
    otherwise be published by the services user, whom JetStream obeys."""
    before = await kv_snapshot(services)
    spec = encode(ToolSpec(name="python", namespace="builtin"))
    for reply in ("$KV.jobs.x", "$KV.tools.builtin.search", "$KV.tenants.default"):
        for body in (spec, b"junk"):
            await sandbox.nc.publish("marlaas.registry.builtin.announce", body, reply=reply)
    await sandbox.nc.flush()
    await asyncio.sleep(1.0)  # a stored reply would be there well within this
    after = await kv_snapshot(services)
    assert "x" not in after["jobs"] and after["jobs"] == before["jobs"]
    assert after["tenants"] == before["tenants"]
    assert set(after["tools"]) == set(before["tools"])
    assert after["tools"]["builtin.search"] == before["tools"]["builtin.search"]
    assert sandbox.errors == []  # the publishes themselves were allowed: the registrar dropped them


async def test_through_the_registrar_the_sandbox_announces_only_python(sandbox):
    refused = await sandbox.nc.request("marlaas.registry.builtin.announce",
                                       encode(ToolSpec(name="search", namespace="builtin")), timeout=5)
    assert b"not announced through the registrar" in refused.data
    refused = await sandbox.nc.request("marlaas.registry.builtin.announce",
                                       encode(ToolSpec(name="weather", namespace="acme")), timeout=5)
    assert b"may announce only its own tools" in refused.data


async def test_one_tenants_runs_take_turns_by_its_jobs_and_another_tenant_runs_beside_them(stack, services):
    """Issue 35, F6, through the bus: the tenant of each call is its job's, so twelve calls of
    mallory's jobs run at most ``env.python_max_runs_per_tenant`` (4) at once, though the replica
    holds 8, and alice's call, asked after them, runs beside them rather than after them."""
    code = "import time; s = time.time(); time.sleep(1.0); print(s, time.time())"

    async def call(job: str, n: int) -> tuple[float, float]:
        request = ToolCall(call_id=f"c{n}", tool="builtin.python", job=job, arguments=json.dumps({"code": code}))
        reply = json.loads(await services.request("marlaas.tool.builtin.python", encode(request), timeout_s=30))
        assert reply["error"] == "", reply
        start, end = reply["output"].split()[:2]
        return float(start), float(end)

    mallory = [asyncio.create_task(call(f"mallory.job{n % 3}-0a0b0c", n)) for n in range(12)]
    await asyncio.sleep(0.5)  # mallory's calls reach the sandbox first
    alice = await call("alice.job-0d0e0f", 99)
    mallorys = await asyncio.gather(*mallory)
    edges = sorted([(s, 1) for s, _ in mallorys] + [(e, -1) for _, e in mallorys])
    assert max(sum(step for _, step in edges[:i + 1]) for i in range(len(edges))) <= 4
    assert sum(start > alice[0] for start, _ in mallorys) >= 4  # alice did not wait behind the queue
