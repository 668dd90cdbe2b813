"""Tenant isolation on the bus, against a real nats-server running the generated auth.conf.

The broker is the embedded stack's (``Stack`` with no services): it starts with auth on,
makes tenant ``default``, and ``marlaas tenant add / revoke`` change its users by reload.
nats-py reports a refused subscribe or publish only through ``error_cb`` (a refused request
just times out), so each connection here records its errors and the tests wait for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import stat

import nats
import nats.errors
import pytest
from nats.js.api import ConsumerConfig
from tenant_admin import tenant_cli

from marlaas.platform import nats_access
from marlaas.platform.bus import Bus
from marlaas.platform.config import load_config
from marlaas.platform.events import RewardItem, RewardRequest, ToolCall, ToolSpec, encode
from marlaas.platform.tenants import TenantError
from marlaas.stack import broker_auth
from marlaas.stack.launcher import Stack
from marlaas.tools import registry
from marlaas.tools import serving as tool_serving
from marlaas.tools.serving import reward, serve_async, tool

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.own_stack("a broker with no services, to read tenants' NATS permissions")]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("tenants")
    running = Stack(load_config(env={"MARLAAS_HOME": str(home)}), services=()).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def tokens(stack):
    """Tenants acme and other, added through the CLI (module-wide: each add reloads the broker)."""
    found = {}
    for name in ("acme", "other"):
        code, out = tenant_cli(stack.home, "add", name)
        assert code == 0 and out["tenant"] == name
        found[name] = out["token"]
    return found


class Conn:
    """A raw nats-py connection that keeps every error the server reported to it."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: nats.NATS | None = None

    @classmethod
    async def open(cls, url: str, user: str, password: str, inbox: str | None = None,
                   reconnect: bool = False) -> Conn:
        conn = cls()

        async def on_error(exc: Exception) -> None:
            conn.errors.append(str(exc).lower())

        conn.nc = await asyncio.wait_for(nats.connect(
            servers=[url], user=user, password=password, error_cb=on_error,
            inbox_prefix=inbox or nats_access.inbox_prefix(user), allow_reconnect=reconnect,
            max_reconnect_attempts=3, reconnect_time_wait=0.2, connect_timeout=2,
        ), 5)
        return conn

    async def refused(self, kind: str, subject: str, timeout_s: float = 3.0) -> None:
        """Wait for the server's permission violation for ``kind`` (publish|subscription) to ``subject``."""
        wanted = f'permissions violation for {kind} to "{subject.lower()}"'
        for _ in range(int(timeout_s / 0.05)):
            if any(wanted in e for e in self.errors):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"no violation for {kind} to {subject}; errors: {self.errors}")

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.nc.close()


@pytest.fixture
async def services(stack):
    """The platform's connection, keeping the tool registry as env does (the stack runs no services)."""
    bus = await Bus.connect(stack.nats_url, name="test-services", timeout_s=5)
    await registry.serve_registrar(bus)
    yield bus
    await bus.close()


@pytest.fixture
async def acme(stack, tokens):
    conn = await Conn.open(nats_access.redact_url(stack.nats_url), "acme", tokens["acme"])
    yield conn
    await conn.close()


def plain_url(stack) -> str:
    return nats_access.redact_url(stack.nats_url)


# --- the embedded stack's credentials --------------------------------------------------------


async def test_the_embedded_broker_wants_credentials_and_keeps_them_private(stack):
    run = stack.run_dir
    for name in ("nats.url", "services.password", "config.json", "default-tenant.token"):
        assert stat.S_IMODE((run / name).stat().st_mode) == 0o600, name
    assert stat.S_IMODE((stack.home / "nats" / "auth.conf").stat().st_mode) == 0o600
    auth = (stack.home / "nats" / "auth.conf").read_text()
    assert (run / "services.password").read_text() not in auth  # only hashes
    assert (run / "default-tenant.token").read_text() not in auth
    assert stack.summary()["nats_url"] == plain_url(stack)  # printed by `up`: no password
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(servers=[plain_url(stack)], allow_reconnect=False, connect_timeout=2)
    bus = await Bus.connect(stack.nats_url, timeout_s=5)  # what every test and service does
    assert "default" in await bus.kv_keys("tenants")
    await bus.close()


# --- what a tenant cannot do ---------------------------------------------------------------------


async def test_a_tenant_cannot_hear_or_serve_another_tenants_subjects(acme, services):
    for subject in ("marlaas.policy.committed.other.>", "marlaas.job.state.other.j1",
                    "marlaas.job.*.other.>", "marlaas.tool.other.calc", "marlaas.reward.other.score",
                    "marlaas.trajectory.ready.acme.>", "marlaas.span.acme.>", "_INBOX.>",
                    "marlaas.tinker.train.other", "marlaas.tinker.sample.>", "$KV.tinker.>",
                    "marlaas.usage.acme", "marlaas.usage.>", "$KV.usage.acme.>",  # metering: platform only
                    "_INBOX_other.>", "marlaas.>", ">"):
        await acme.nc.subscribe(subject)
        await acme.refused("subscription", subject)
    heard = []

    async def serve_theirs(msg) -> None:
        heard.append(msg)

    await acme.nc.subscribe("marlaas.tool.other.calc", queue="tool-other", cb=serve_theirs)
    await acme.nc.flush()
    with pytest.raises((nats.errors.NoRespondersError, TimeoutError)):
        await services.nc.request("marlaas.tool.other.calc", b"{}", timeout=0.5)
    assert heard == []


async def test_a_tenant_cannot_publish_on_service_subjects_or_touch_jetstream(acme, services):
    before = {s: (await services.js.stream_info(s)).state.messages
              for s in ("JOBS", "POLICY", "TRAJ", "METRICS", "TINKER", "USAGE", "KV_jobs", "KV_tenants", "KV_tinker",
                        "KV_usage")}
    for subject in ("marlaas.trajectory.ready.acme.j1", "marlaas.policy.committed.acme.j1",
                    "marlaas.job.submitted.acme.j1", "marlaas.job.state.other.j1", "marlaas.api.submit",
                    "marlaas.span.acme.j1", "marlaas.tool.other.calc", "marlaas.reward.other.score",
                    "$KV.tools.other.calc", "$KV.jobs.acme.j1", "$KV.tenants.acme",
                    # the Tinker API's work queues and records: only the gateway writes them
                    "marlaas.tinker.train.acme", "marlaas.tinker.sample.acme", "$KV.tinker.model.acme.x",
                    "$KV.tinker_futures.future.x",
                    # metering: a tenant can neither report usage nor touch the ledger
                    "marlaas.usage.acme", "marlaas.usage.other", "$KV.usage.acme.2026-01-01.j1",
                    "$JS.API.DIRECT.GET.KV_tenants", "$JS.API.STREAM.MSG.GET.POLICY",
                    "$JS.API.STREAM.INFO.TRAJ", "$JS.API.STREAM.PURGE.KV_tools",
                    "$JS.API.CONSUMER.MSG.NEXT.POLICY.events-other",
                    "$JS.API.CONSUMER.MSG.NEXT.TRAJ.trainer"):
        await acme.nc.publish(subject, b"{}")
        await acme.refused("publish", subject)
    after = {s: (await services.js.stream_info(s)).state.messages for s in before}
    assert after == before


async def test_a_tenant_cannot_create_consumers(acme):
    js = acme.nc.jetstream(timeout=1)
    with pytest.raises(TimeoutError):  # refused: the request goes unanswered
        await js.add_consumer("POLICY", ConsumerConfig(
            durable_name="mine", filter_subject="marlaas.policy.committed.other.>",
            deliver_subject="_INBOX_acme.push"))
    await acme.refused("publish", "$JS.API.CONSUMER.DURABLE.CREATE.POLICY.mine")
    with pytest.raises(TimeoutError):
        await js.pull_subscribe("marlaas.policy.committed.acme.>", stream="POLICY")
    assert any("$js.api.consumer.create.policy" in e for e in acme.errors)


async def kv_snapshot(bus: Bus) -> dict[str, dict[str, bytes]]:
    found = {}
    for bucket in ("jobs", "tenants", "tools"):
        found[bucket] = {}
        for key in await bus.kv_keys(bucket):
            entry = await bus.kv_get(bucket, key)
            if entry is not None:
                found[bucket][key] = entry.value
    return found


def beatless(bucket: str, value: bytes) -> object:
    """A registry entry without ``announced_at``, which its servers' heartbeat rewrites."""
    if bucket != "tools":
        return value
    entry = json.loads(value)
    entry.pop("announced_at", None)
    return entry


async def test_reply_subjects_never_reach_the_platforms_kv(stack, tokens, services):
    """The attack that worked with one account: any allowed publish (or request) with its reply
    subject set to a platform KV key made JetStream (or a service) store its answer there."""
    victim = {"jobs": "other.j-victim", "tenants": "other", "tools": "builtin.search"}
    await services.kv_put("jobs", victim["jobs"], b'{"kind": "job.record"}')
    await registry.announce_tool(services, ToolSpec(name="search", namespace="builtin"))
    acme = await Conn.open(plain_url(stack), "acme", tokens["acme"])
    try:
        before = await kv_snapshot(services)
        targets = [f"$KV.{bucket}.{key}" for bucket, key in victim.items()]
        spec = encode(shout.spec("acme"))
        for reply in targets:
            for subject, body in (("marlaas.registry.acme.announce", spec),  # answered: the registrar
                                  ("marlaas.registry.acme.announce", b"junk"),
                                  ("$KV.tools.acme.x", b"{}"),  # refused, and JetStream is not there
                                  ("$JS.API.STREAM.INFO.KV_jobs", b"")):
                await acme.nc.publish(subject, body, reply=reply)
        await acme.nc.flush()
        await asyncio.sleep(1.0)  # a stored reply would be there well within this
        after = await kv_snapshot(services)
    finally:
        await acme.close()
    for bucket, key in victim.items():
        assert beatless(bucket, after[bucket][key]) == beatless(bucket, before[bucket][key]), (bucket, key)
    assert {b: set(keys) - {"acme.shout"} for b, keys in after.items()} == {
        b: set(keys) for b, keys in before.items()}


async def test_a_tenant_cannot_write_the_tool_registry_directly(stack, tokens, services):
    await registry.announce_tool(services, shout.spec("other"))
    conn = await Conn.open(plain_url(stack), "acme", tokens["acme"])
    try:
        for subject in ("$KV.tools.acme.mine", "$KV.tools.other.shout", "$JS.API.STREAM.PURGE.KV_tools"):
            await conn.nc.publish(subject, b"{}", headers={"Nats-Rollup": "all"})
            await conn.refused("publish", subject)
        # through the registrar, only its own namespace, and only what the platform can reach
        refused = await conn.nc.request("marlaas.registry.acme.announce", encode(shout.spec("other")),
                                        timeout=5)
        assert b"may announce only its own tools" in refused.data
        deep: dict = {"type": "object"}
        for _ in range(20):  # every job naming the tool renders its schema into the prompt
            deep = {"type": "object", "properties": {"x": deep}}
        refused = await conn.nc.request("marlaas.registry.acme.announce",
                                        encode(ToolSpec(name="deep", namespace="acme", parameters=deep)), timeout=5)
        assert b"nests more than 16 levels deep" in refused.data
        await conn.nc.publish("marlaas.registry.other.announce", b"{}")
        await conn.refused("publish", "marlaas.registry.other.announce")
        with pytest.raises(registry.AnnounceRefused, match="does not answer"):  # nobody serves it
            await registry.request_announce(Bus(conn.nc), shout.spec("acme"))
    finally:
        await conn.close()
    assert await registry.read_tool(services, "other.shout") is not None
    assert await registry.read_tool(services, "acme.shout") is None


# --- what a tenant can do ---------------------------------------------------------------------


@tool
def shout(text: str) -> str:
    """The text in capitals."""
    return text.upper()


@reward("length")
def length(problem: dict, completion: str) -> float:
    return float(len(completion) == problem["n"])


async def test_a_tenant_serves_and_announces_its_own_tools_with_its_token(stack, tokens, services):
    with pytest.raises(ValueError, match="not tenant 'other'"):
        tool_serving.broker_url("other", plain_url(stack), tokens["acme"])
    stop = asyncio.Event()
    serving = asyncio.create_task(serve_async(shout, length, tenant="acme", nats_url=plain_url(stack),
                                              token=tokens["acme"], stop=stop))
    try:
        for _ in range(100):
            if await registry.read_tool(services, "acme.shout") is not None:
                break
            assert not serving.done(), serving.exception()
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("acme.shout was never announced")
        call = ToolCall(call_id="c1", tool="acme.shout", arguments='{"text": "hi"}', job="acme.j1")
        reply = await services.request("marlaas.tool.acme.shout", encode(call), timeout_s=5)
        assert json.loads(reply)["output"] == "HI"
        request = RewardRequest(job="acme.j1", task="custom",
                                items=[RewardItem(problem={"n": 2}, completion="ab")])
        reply = await services.request("marlaas.reward.acme.length", encode(request), timeout_s=5)
        assert json.loads(reply)["rewards"] == [1.0]
    finally:
        stop.set()
        await asyncio.wait_for(serving, 15)


async def test_a_tenant_hears_its_own_events_live(acme, services):
    live = await acme.nc.subscribe("marlaas.policy.committed.acme.>")
    states = await acme.nc.subscribe("marlaas.job.*.acme.>")
    await acme.nc.flush()
    await services.publish("marlaas.policy.committed.other.j1", b"theirs")
    await services.publish("marlaas.policy.committed.acme.j1", b"v1")
    await services.publish("marlaas.job.state.other.j1", b"their state")
    await services.publish("marlaas.job.state.acme.j1", b"running")
    assert (await live.next_msg(timeout=2)).data == b"v1"
    assert (await states.next_msg(timeout=2)).data == b"running"
    with pytest.raises(TimeoutError):
        await live.next_msg(timeout=0.3)

    assert acme.errors == []


# --- tenants come and go by reload --------------------------------------------------------------


async def test_adding_and_revoking_a_tenant_takes_effect_without_a_restart(stack):
    pid = stack.nats.proc.pid
    url = plain_url(stack)
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await Conn.open(url, "gamma", "mlt_gamma_" + "0" * 32)
    code, out = await asyncio.to_thread(tenant_cli, stack.home, "add", "gamma", "--max-jobs", "2")
    token = out["token"]
    assert code == 0 and out["tenant"] == "gamma" and token.startswith("mlt_gamma_")
    gamma = await Conn.open(url, "gamma", token, reconnect=True)  # at once: no restart
    code, listed = await asyncio.to_thread(tenant_cli, stack.home, "list")
    assert {"name": "gamma", "active": True, "max_jobs": 2}.items() <= next(
        t for t in listed["tenants"] if t["name"] == "gamma").items()

    code, out = await asyncio.to_thread(tenant_cli, stack.home, "revoke", "gamma")
    assert code == 0 and out == {"tenant": "gamma", "state": "revoked", "broker": "reloaded"}
    for _ in range(100):  # cut off, and each reconnect refused until nats-py gives up
        if gamma.nc.is_closed:
            break
        await asyncio.sleep(0.1)
    assert gamma.nc.is_closed and any("authorization violation" in e for e in gamma.errors)
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await Conn.open(url, "gamma", token)
    code, listed = await asyncio.to_thread(tenant_cli, stack.home, "list")
    assert not next(t for t in listed["tenants"] if t["name"] == "gamma")["active"]
    assert stack.nats.proc.pid == pid and stack.nats.proc.poll() is None


async def test_a_revoked_tenants_token_is_refused_even_to_reconnect(stack):
    code, out = await asyncio.to_thread(tenant_cli, stack.home, "add", "delta")
    token = out["token"]
    conn = await Conn.open(plain_url(stack), "delta", token)
    await conn.close()
    await asyncio.to_thread(tenant_cli, stack.home, "revoke", "delta")
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await Conn.open(plain_url(stack), "delta", token)
    with pytest.raises(TenantError, match="already exists"):  # `marlaas` prints it, exits 2
        await asyncio.to_thread(tenant_cli, stack.home, "add", "delta")


async def test_the_platforms_names_cannot_be_added_as_tenants(stack):
    for name in ("builtin", "judge", "services", "platform", "sys", "$sys", "$G", "_inbox"):
        with pytest.raises(TenantError, match=r"is reserved \(.*\): choose another name"):
            await asyncio.to_thread(tenant_cli, stack.home, "add", name)
    code, listed = await asyncio.to_thread(tenant_cli, stack.home, "list")
    reserved = {"builtin", "judge", "services", "platform", "sys"}
    assert not [t["name"] for t in listed["tenants"] if t["name"] in reserved or t["name"][0] in "$_"]


def test_a_config_nats_server_refuses_is_never_applied(stack):
    auth = stack.home / "nats" / "auth.conf"
    before = auth.read_text()
    with pytest.raises(broker_auth.AuthConfigError, match="refuses"):
        broker_auth.write_auth_conf(auth, before.replace("users: [", "users: [ {user: ", 1))
    assert auth.read_text() == before
    assert not list(auth.parent.glob(".auth.conf*"))


def test_the_sdk_finds_the_embedded_broker_and_the_default_tenants_token(stack, monkeypatch):
    monkeypatch.setenv("MARLAAS_HOME", str(stack.home))
    for var in ("MARLAAS_NATS_URL", "MARLAAS_CONFIG", "MARLAAS_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    token = (stack.run_dir / "default-tenant.token").read_text()
    assert tool_serving.broker_url("default") == nats_access.url_with_credentials(plain_url(stack), "default", token)
    with pytest.raises(ValueError, match="needs its token"):
        tool_serving.broker_url("acme")  # never the services' URL by accident
    monkeypatch.setenv("MARLAAS_TOKEN", "mlt_acme_" + "1" * 32)
    assert nats_access.url_credentials(tool_serving.broker_url("acme")) == ("acme", "mlt_acme_" + "1" * 32)
    monkeypatch.delenv("MARLAAS_TOKEN")
    monkeypatch.setenv("MARLAAS_NATS_URL", stack.nats_url)  # an explicit URL keeps its credentials
    assert tool_serving.broker_url("acme") == stack.nats_url


async def test_a_wrong_token_fails_to_connect_with_a_clear_error(stack):
    stop = asyncio.Event()
    with pytest.raises(ConnectionError, match="Authorization Violation"):
        await serve_async(shout, tenant="acme", nats_url=plain_url(stack),
                          token="mlt_acme_" + "f" * 32, stop=stop)


async def test_a_revoked_tenants_tool_process_stops_serving(stack, services, monkeypatch):
    monkeypatch.setattr(tool_serving, "REFUSED_GIVE_UP_S", 0.5)
    code, out = await asyncio.to_thread(tenant_cli, stack.home, "add", "epsilon")
    serving = asyncio.create_task(serve_async(shout, tenant="epsilon", nats_url=plain_url(stack),
                                              token=out["token"], stop=asyncio.Event()))
    for _ in range(100):
        if await registry.read_tool(services, "epsilon.shout") is not None:
            break
        await asyncio.sleep(0.1)
    await asyncio.to_thread(tenant_cli, stack.home, "revoke", "epsilon")
    await asyncio.wait_for(serving, 20)  # returns by itself: the broker refuses it for good
