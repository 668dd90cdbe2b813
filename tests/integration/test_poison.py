"""Poison and bad input at the manager and the trainer: each consumer terminates what it cannot
read, logs a readable reason, and goes on serving other jobs; the user API answers bad requests
with an error that says what was wrong. (The rollout's consumer: ``test_rollout_faults.py``.)

The services' classes run in the test against a real nats-server, driven through their durable
consumers and request/reply subjects as in the services; JetStream's termination advisories
tell which messages were terminated.
"""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import nats.errors
import pytest
from polling import eventually
from structlog.testing import capture_logs

from marlaas.basemodel import builtin_model_dir
from marlaas.platform import api, subjects
from marlaas.platform.adapters import init_adapter, write_adapter
from marlaas.platform.bus import JOBS_BUCKET, VERSIONS_BUCKET, Bus
from marlaas.platform.config import load_config
from marlaas.platform.events import (
    JOB_RECORD,
    CommittedVersion,
    EvalPoint,
    JobEvaluated,
    JobFailureReported,
    JobRecord,
    JobSpec,
    JobState,
    PolicyCommitted,
    Sample,
    TrajectoryBatch,
    TrajectoryReady,
    encode,
)
from marlaas.tools.registry import reward_subject
from marlaas.tools.serving import answer_reward_request, reward
from services.manager.job_admin import cancel_job, job_status
from services.manager.service import Manager, api_responder

pytestmark = pytest.mark.timeout(180)
TERMINATED = "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.>"


def poison_for(subject_kind: str, job: str) -> dict[str, tuple[bytes, str]]:
    """Undecodable messages for a stream, with the reason each is refused for."""
    return {
        "not JSON": (b"\xff\x00 not an event", "JSON is malformed"),
        "empty": (b"", "Input data was truncated"),
        "unknown kind": (json.dumps({"kind": f"{subject_kind}.v2", "job": job}).encode(),
                         f"Invalid value '{subject_kind}.v2' - at `$.kind`"),
        "wrong type": (json.dumps({"kind": subject_kind, "job": job, "version": "one", "service": 1,
                                   "reason": 2, "score": "x"}).encode(), "Expected `"),
    }


async def watch_terminations(bus: Bus) -> list[tuple[str, int]]:
    """(consumer, stream sequence) of every message a consumer terminates from now on."""
    seen: list[tuple[str, int]] = []

    async def advisory(msg) -> None:
        data = json.loads(msg.data)
        seen.append((data["consumer"], data["stream_seq"]))

    await bus.nc.subscribe(TERMINATED, cb=advisory)
    await bus.nc.flush()
    return seen


async def record_of(bus: Bus, job: str) -> JobRecord:
    return JOB_RECORD.decode((await bus.kv_get(JOBS_BUCKET, job)).value)


async def running_job(bus: Bus, name: str, steps: int = 5) -> JobSpec:
    spec = JobSpec(id=f"acme.{name}", tenant="acme", name=name, task="addition", steps=steps,
                   submitted_at=time.time())
    await bus.kv_create(JOBS_BUCKET, spec.id, encode(JobRecord(spec=spec, state=JobState.RUNNING, version=0)))
    return spec


@pytest.fixture
async def manager(bus, file_store, tmp_path):
    config = load_config(overrides={"home": str(tmp_path / "home")}, env={})
    return await asyncio.to_thread(Manager, bus, file_store, config)


# --- the manager's consumers ----------------------------------------------------------------


async def test_poison_on_each_manager_consumer_is_terminated_logged_and_the_rest_served(bus, manager, file_store):
    served, failing = await running_job(bus, "served"), await running_job(bus, "failing")
    terminated = await watch_terminations(bus)
    stop = asyncio.Event()
    consumers = {  # as services/manager/service.py runs them
        "manager": ("POLICY", "marlaas.policy.committed.>", manager.events.on_policy),
        "manager-failures": ("JOBS", "marlaas.job.failure.>", manager.events.on_job_event),
        "manager-evals": ("JOBS", "marlaas.job.eval.>", manager.events.on_job_event),
    }
    poisoned = {"manager": (subjects.policy_committed(served.id), "policy", "policy.committed"),
                "manager-failures": (f"marlaas.job.failure.{failing.id}", "job", "job.failure"),
                "manager-evals": (f"marlaas.job.eval.{served.id}", "job", "job.eval")}
    with capture_logs() as logs:
        tasks = [asyncio.create_task(bus.consume(stream, durable, subject, handler, stop=stop))
                 for durable, (stream, subject, handler) in consumers.items()]
        sent: dict[tuple[str, int], str] = {}  # (consumer, sequence) -> the reason expected
        for durable, (subject, codec, kind) in poisoned.items():
            for data, _reason in poison_for(kind, served.id).values():
                seq = (await bus.js.publish(subject, data)).seq
                sent[(durable, seq)] = f"malformed {codec} event ({len(data)} bytes): "
        # then the real thing on each, one of them from a newer writer (schema 7, a field this
        # reader lacks), which old readers still read
        adapter = await asyncio.to_thread(write_adapter, file_store, served.id, 1, b"{}", b"w")
        await bus.publish(subjects.policy_committed(served.id), encode(PolicyCommitted(
            job=served.id, version=1, adapter=adapter, metrics={"reward/mean": 0.25}, committed_at=time.time())))
        await bus.publish(f"marlaas.job.eval.{served.id}", encode(JobEvaluated(job=served.id, version=1, score=0.5)))
        newer = {**msgspec.to_builtins(JobFailureReported(job=failing.id, service="trainer", reason="loss is nan")),
                 "schema": 7, "trace_id": "abc"}
        await bus.js.publish(f"marlaas.job.failure.{failing.id}", json.dumps(newer).encode())

        await eventually(lambda: set(sent) <= set(terminated), what="every poison message terminated")
        await eventually(lambda: _record_matches(bus, served.id, lambda r: r.version == 1 and r.evals),
                         what="the announcement and the eval after the poison")
        await eventually(lambda: _record_matches(bus, failing.id, lambda r: r.state is JobState.FAILED),
                         what="the newer writer's failure report")
        stop.set()
        await asyncio.gather(*tasks)

    refusals = [e for e in logs if e["event"] == "terminating message"]
    assert len(refusals) == len(sent)
    for (durable, _seq), reason in sent.items():  # each says which stream and what was wrong
        assert any(e["error"].startswith(reason) for e in refusals), (durable, reason)
    assert not [e for e in logs if e["log_level"] in ("error", "critical") and e["event"] != "terminating message"]
    record = await record_of(bus, served.id)
    assert record.state is JobState.RUNNING and record.rewards == [0.25]
    assert record.evals == [EvalPoint(version=1, score=0.5)]
    assert (await record_of(bus, failing.id)).reason == "trainer: loss is nan"
    for durable in consumers:
        info = await bus.js.consumer_info(consumers[durable][0], durable)
        assert info.num_pending == 0 and info.num_ack_pending == 0, durable


async def _record_matches(bus: Bus, job: str, predicate) -> bool:
    return bool(predicate(await record_of(bus, job)))


# --- the trainer's consumer -----------------------------------------------------------------


@pytest.mark.timeout(300)
async def test_poison_on_the_trainers_consumer_is_terminated_and_the_next_batch_trained(bus, file_store):
    from services.trainer.policy import PolicyTrainer
    from services.trainer.service import Trainer

    spec = await running_job(bus, "trained", steps=3)
    config_json, weights = await asyncio.to_thread(init_adapter, builtin_model_dir(), spec.lora, spec.seed)
    adapter = await asyncio.to_thread(write_adapter, file_store, spec.id, 0, config_json, weights)
    await bus.kv_create(VERSIONS_BUCKET, spec.id, encode(CommittedVersion(job=spec.id, version=0, adapter=adapter)))
    policy = await asyncio.to_thread(PolicyTrainer, builtin_model_dir(), "cpu", 2, 4096)
    trainer = Trainer(bus, file_store, policy)
    terminated = await watch_terminations(bus)
    subject = f"marlaas.trajectory.ready.{spec.id}"
    stop = asyncio.Event()
    with capture_logs() as logs:
        consuming = asyncio.create_task(bus.consume("TRAJ", "trainer", "marlaas.trajectory.ready.>", trainer.handle,
                                                    stop=stop, on_give_up=trainer.give_up))
        sent = {}
        for data, _ in poison_for("trajectory.ready", spec.id).values():
            sent[("trainer", (await bus.js.publish(subject, data)).seq)] = (f"malformed trajectory event "
                                                                            f"({len(data)} bytes): ")
        batch = TrajectoryBatch(samples=[
            Sample(group=0, prompt_ids=[4, 6, 77, 10], completion_ids=[11, 12, 1], logprobs=[-2.0, -2.0, -2.0],
                   loss_mask=[1, 1, 1], reward=r) for r in (0.0, 1.0)], policy_version=0)
        await bus.publish(subject, encode(TrajectoryReady(job=spec.id, version=0, batch_id=f"{spec.id}:v0",
                                                          batch=batch)))
        committed = await eventually(lambda: _version(bus, spec.id, 1), 120, "the real batch trained and committed")
        await eventually(lambda: set(sent) <= set(terminated), what="every poison message terminated")
        stop.set()
        await consuming

    assert committed.batch_id == f"{spec.id}:v0"
    refusals = [e for e in logs if e["event"] == "terminating message"]
    assert len(refusals) == len(sent)
    assert all(any(e["error"].startswith(reason) for e in refusals) for reason in sent.values())
    assert not await bus.read_all("JOBS", f"marlaas.job.failure.{spec.id}")  # poison names no job to fail


async def _version(bus: Bus, job: str, version: int) -> CommittedVersion | None:
    from marlaas.platform.events import COMMITTED

    entry = await bus.kv_get(VERSIONS_BUCKET, job)
    committed = COMMITTED.decode(entry.value) if entry else None
    return committed if committed is not None and committed.version == version else None


# --- the user API ---------------------------------------------------------------------------


async def test_bad_api_requests_get_a_readable_error_and_the_manager_keeps_serving(bus, manager):
    for subject, handler in ((subjects.API_SUBMIT, manager.submissions.submit),
                             (subjects.API_STATUS, lambda data: job_status(manager.jobs, data)),
                             (subjects.API_CANCEL, lambda data: cancel_job(manager.jobs, data))):
        await bus.serve(subject, "manager", api_responder(handler))

    async def ask(subject: str, data: bytes) -> dict:
        return json.loads(await bus.request(subject, data, timeout_s=10))

    submit = await ask(subjects.API_SUBMIT, b"\xff\x00 not JSON")
    assert submit["code"] == api.INVALID and "JSON is malformed" in submit["error"]
    assert (await ask(subjects.API_SUBMIT, b"[1, 2]"))["error"].startswith("invalid job: Expected `object`, "
                                                                            "got `array`")
    assert (await ask(subjects.API_STATUS, b"\xff"))["error"].startswith("malformed request: JSON is malformed")
    cancel = await ask(subjects.API_CANCEL, json.dumps({"job": 5}).encode())
    assert cancel["error"] == "malformed request: Expected `str`, got `int` - at `$.job`"

    # oversized: a 4 MB submission reaches the manager and is refused for what it is; one over the
    # broker's max_payload never leaves the client
    huge = await ask(subjects.API_SUBMIT, submission("x" * (4 << 20)))
    assert huge["code"] == api.INVALID and huge["error"] == "name must be at most 64 characters"
    with pytest.raises(nats.errors.MaxPayloadError):
        await bus.request(subjects.API_SUBMIT, submission("x" * (bus.nc.max_payload + 1)), timeout_s=10)

    assert await bus.kv_keys(JOBS_BUCKET) == []  # none of it created anything
    accepted = await ask(subjects.API_SUBMIT, submission("fine"))
    assert accepted["id"].startswith("acme.fine-") and not accepted.get("error")


def submission(name: str, **fields) -> bytes:
    return msgspec.json.encode({"name": name, "task": "addition", "steps": 2, "tenant": "acme", **fields})


async def test_a_dataset_line_that_is_not_json_refuses_the_submit_naming_the_line(bus, manager, tmp_path):
    dataset = tmp_path / "math.jsonl"
    dataset.write_text(json.dumps({"question": "What is 2 plus 3?", "answer": "#### 5"}) + "\n"
                       "\n"  # blank lines are skipped, but counted
                       "{'question': 'single quotes', 'answer': '#### 1'}\n")
    reply = await manager.submissions.submit(submission("bad-data", task="gsm8k", dataset=str(dataset)))
    assert reply.code == api.INVALID and not reply.id
    assert reply.error.startswith(f"{dataset}:3: not JSON (")
    assert reply.error.endswith("write one JSON object per line")
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"question": "What is 1 plus 1?", "answer": "#### 2"}) + "\n")
    held_out = await manager.submissions.submit(submission("bad-eval", task="gsm8k", dataset=str(good),
                                                           eval_every=1, eval_dataset=str(dataset)))
    assert held_out.code == api.INVALID and held_out.error.startswith(f"eval_dataset: {dataset}:3: not JSON (")
    assert await bus.kv_keys(JOBS_BUCKET) == []


@pytest.mark.parametrize("fields, says", [
    ({"seed": 10**400}, "seed must be between 0 and 9223372036854775807"),
    ({"seed": 2**64}, "seed must be between 0 and 9223372036854775807"),
    ({"seed": -1}, "seed must be between 0 and 9223372036854775807"),
    ({"steps": 10**400}, "steps must be between 1 and 100000"),
    ({"eval_every": 10**400}, "eval_every must be >= 0 and at most 100000"),
    ({"eval_problems": 10**400}, "eval_problems must be between 1 and 1000"),
    ({"grpo": {"prompts_per_step": 10**400}}, "grpo.prompts_per_step must be between 1 and 4096"),
    ({"grpo": {"group_size": 2**64}}, "grpo.group_size must be at least 2 and at most 1024"),
    ({"grpo": {"max_new_tokens": 2**64}}, "exceeds rollout.max_model_len (1024); lower max_new_tokens"),
    ({"grpo": {"max_new_tokens": -1}}, "grpo.max_new_tokens must be >= 0"),
    ({"lora": {"rank": 10**400}}, "lora.rank must be between 1 and 32"),
    ({"lora": {"alpha": 10**400}}, "lora.alpha must be between 1 and 4096"),
])
async def test_every_integer_of_a_submission_is_range_checked_and_nothing_is_created(bus, manager, fields, says):
    reply = await manager.submissions.submit(submission("huge", **fields))
    assert reply.code == api.INVALID and not reply.id
    assert says in reply.error
    assert await bus.kv_keys(JOBS_BUCKET) == []



async def test_grpo_truncated_is_checked_at_submit_and_kept_in_the_spec(bus, manager):
    bad = await manager.submissions.submit(submission("typo", grpo={"truncated": "dorp"}))
    assert bad.code == api.INVALID and "grpo.truncated must be one of train, zero, drop" in bad.error
    fixed_length = await manager.submissions.submit(submission("bench", grpo={"truncated": "drop", "ignore_eos": True}))
    assert fixed_length.code == api.INVALID and "with it, grpo.truncated must be 'train'" in fixed_length.error
    assert await bus.kv_keys(JOBS_BUCKET) == []
    ok = await manager.submissions.submit(submission("dropping", grpo={"truncated": "drop"}))
    assert not ok.error and (await record_of(bus, ok.id)).spec.grpo.truncated == "drop"
    default = await manager.submissions.submit(submission("default"))
    assert (await record_of(bus, default.id)).spec.grpo.truncated == "train"

async def test_a_tenants_reward_is_refused_at_submit_unless_it_is_served_right_now(bus, manager):
    refused = await manager.submissions.submit(submission("unserved", reward="acme.length"))
    assert refused.code == api.INVALID and not refused.id
    assert refused.error == ("reward 'acme.length' is not served right now (nothing answers on "
                             "marlaas.reward.acme.length): start the process that serves it (@reward, "
                             "serve(...)) first, then submit")
    assert await bus.kv_keys(JOBS_BUCKET) == []

    scored = []

    @reward("length")
    def length(problem: dict, completion: str) -> float:
        scored.append(completion)
        return 1.0

    async def answer(data: bytes) -> bytes:
        return encode(await answer_reward_request(length, data))

    await bus.serve(reward_subject("acme.length"), "reward-acme", answer)
    await bus.nc.flush()
    served = await manager.submissions.submit(submission("served", reward="acme.length"))
    assert served.id and not served.error
    assert scored == []  # the check ran no reward function
    builtin = await manager.submissions.submit(submission("judged", reward="judge"))  # the env serves it with the tasks
    assert builtin.id and not builtin.error
