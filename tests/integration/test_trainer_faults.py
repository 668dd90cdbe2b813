"""The trainer service's error branches, each with the fault injected at exactly its point.

``Trainer`` runs in the test over a real nats-server, file store and ``PolicyTrainer`` (the
built-in tiny base, real torch + peft steps): through the consume loop of services/trainer
where the broker's retries matter, or handed one real delivery at a time where an
interleaving must be exact (a second replica, a cancel, a crash while the batch is held).
Faults come from a store or bus with one method failing, the trainer's own crash hook, or
a training step held at a gate. The test plays the manager (records, version 0) and
rollout (``publish_batch``), except where the manager's own handling is the point.

Poison on this consumer is in test_poison.py; the protocol under every interleaving of
these faults is test_version_state_machine.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import threading
import time

import msgspec
import pytest
import torch
from nats.js.api import AckPolicy, ConsumerConfig
from safetensors.torch import load as load_safetensors
from structlog.testing import capture_logs

import services.trainer.service as trainer_service
from marlaas.basemodel import builtin_model_dir
from marlaas.platform import api, subjects
from marlaas.platform.adapters import init_adapter, read_adapter, write_adapter
from marlaas.platform.bus import JOBS_BUCKET, VERSIONS_BUCKET, Bus, Delivery
from marlaas.platform.config import load_config
from marlaas.platform.events import (
    COMMITTED,
    JOB,
    JOB_RECORD,
    POLICY,
    TRAJECTORY,
    CommittedVersion,
    GrpoSettings,
    JobRecord,
    JobSpec,
    JobState,
    JobStateChanged,
    LoraSettings,
    Sample,
    TrajectoryBatch,
    TrajectoryReady,
    encode,
)
from marlaas.platform.store import FileStore
from marlaas.platform.telemetry import read_spans
from services.manager.job_admin import cancel_job
from services.manager.service import Manager
from services.rollout.service import INLINE_BATCH_LIMIT, publish_batch
from services.trainer.gap_watch import FP32_GAP, GapWatch
from services.trainer.policy import PolicyTrainer
from services.trainer.service import Trainer

pytestmark = pytest.mark.timeout(180)

BASE = builtin_model_dir()
GRPO = GrpoSettings(prompts_per_step=1, group_size=2, learning_rate=1e-2)
LORA = LoraSettings(rank=2, alpha=4, target_modules=("q_proj", "v_proj"))
TERMINATED = "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.TRAJ.trainer"


# --- what the manager and rollout would have done --------------------------------------------


async def running_job(bus: Bus, store: FileStore, name: str, *, seed: int = 3, grpo: GrpoSettings = GRPO,
                      state: JobState = JobState.RUNNING, tenant: str = "acme") -> JobSpec:
    """A job as the manager leaves it on admission: its record, and version 0 committed."""
    spec = JobSpec(id=f"{tenant}.{name}", tenant=tenant, name=name, task="addition", steps=10, seed=seed,
                   grpo=grpo, lora=LORA, submitted_at=time.time())
    await bus.kv_create(JOBS_BUCKET, spec.id, encode(JobRecord(spec=spec, state=state, version=0)))
    config_json, weights = await asyncio.to_thread(init_adapter, BASE, LORA, seed)
    adapter = await asyncio.to_thread(write_adapter, store, spec.id, 0, config_json, weights)
    await bus.kv_create(VERSIONS_BUCKET, spec.id, encode(CommittedVersion(job=spec.id, version=0, adapter=adapter)))
    return spec


async def a_manager(bus: Bus, store: FileStore, home) -> Manager:
    """The real manager, where its handling is the point (a cancel, a failure report)."""
    return await asyncio.to_thread(Manager, bus, store, load_config(overrides={"home": str(home)}, env={}))


def batch_of(version: int, rewards: tuple[float, ...] = (1.0, 0.0), text: str = "") -> TrajectoryBatch:
    """A group sampled with ``version``: the same prompt, a different completion each."""
    return TrajectoryBatch(policy_version=version, samples=[
        Sample(group=0, prompt_ids=[10, 11, 12], completion_ids=[5 + i, 6], logprobs=[-1.0, -1.0],
               loss_mask=[1, 1], reward=r, text=text) for i, r in enumerate(rewards)])


async def publish_resampled(bus: Bus, job: str, version: int, batch: TrajectoryBatch) -> None:
    """A second batch of ``version`` under the same id, past the duplicate window (a rollout that
    crashed before recording it sampled, and sampled it again)."""
    event = TrajectoryReady(job=job, version=version, batch_id=f"{job}:v{version}", batch=batch)
    await bus.publish(f"marlaas.trajectory.ready.{job}", encode(event))


# --- reading back what the trainer did ------------------------------------------------------


async def committed(bus: Bus, job: str) -> CommittedVersion:
    return COMMITTED.decode((await bus.kv_get(VERSIONS_BUCKET, job)).value)


async def version_history(bus: Bus, job: str) -> list[int]:
    """Every value the job's ``versions`` entry has held, oldest first (read off the bucket's stream:
    nats-py's ``history`` can race its first message under load and report no keys)."""
    return [COMMITTED.decode(data).version for data in await versions_written(bus, job)]


async def read_v0(bus: Bus, job: str) -> CommittedVersion:
    """Version 0 as the manager committed it (the first value of the job's ``versions`` entry)."""
    return COMMITTED.decode((await versions_written(bus, job))[0])


async def versions_written(bus: Bus, job: str) -> list[bytes]:
    return await bus.read_all(f"KV_{VERSIONS_BUCKET}", f"$KV.{VERSIONS_BUCKET}.{job}")


async def announced(bus: Bus, job: str) -> list[int]:
    return [POLICY.decode(data).version for data in await bus.read_all("POLICY", subjects.policy_committed(job))]


async def trained(bus: Bus, job: str) -> list[int]:
    """The version of each training step the trainer recorded, committed or not."""
    return [s.version for s in await read_spans(bus, job) if s.phase == "train"]


async def failures(bus: Bus, job: str) -> list[str]:
    return [JOB.decode(data).reason for data in await bus.read_all("JOBS", f"marlaas.job.failure.{job}")]


def attempts(store: FileStore, kind: str, job: str, version: int) -> set[str]:
    """The attempt folders written for ``version`` (the committed one and any orphans)."""
    return {key.rsplit("/", 1)[0] for key in store.list(f"{kind}/{job}/v{version:06d}/")}


def folder_of(store: FileStore, blob) -> str:
    return store.key_of(blob.uri).rsplit("/", 1)[0]


def weights(store: FileStore, version: CommittedVersion) -> dict[str, torch.Tensor]:
    return load_safetensors(read_adapter(store, version.adapter)[1])


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same update, up to float noise. A weight whose gradient is ~0 moves by a noise-driven
    share of lr in AdamW's first steps (the update is g / (|g| + eps)), so a few elements may
    differ; two different updates differ in most of them."""
    if a.keys() != b.keys():
        return False
    off = sum(int((~torch.isclose(a[k], b[k], rtol=0, atol=1e-6)).sum()) for k in a)
    return off <= 0.005 * sum(t.numel() for t in a.values())


def reference_step(store: FileStore, start: CommittedVersion, batch: TrajectoryBatch) -> dict[str, torch.Tensor]:
    """The weights one step on ``batch`` gives from ``start`` as stored, in a fresh trainer."""
    policy = PolicyTrainer(BASE)
    config_json, adapter = read_adapter(store, start.adapter)
    optimizer = store.fetch(start.optimizer) if start.optimizer else None
    policy.load(start.job, start.version, config_json, adapter, optimizer, GRPO)
    return load_safetensors(policy.train_step(start.job, batch, GRPO).weights)


async def wait_for(predicate, timeout_s: float = 60.0, what: str = ""):
    deadline = time.monotonic() + timeout_s
    while not (result := await predicate()):
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        await asyncio.sleep(0.05)
    return result


async def at_version(bus: Bus, job: str, version: int) -> bool:
    return (await committed(bus, job)).version >= version


async def watch_terminations(bus: Bus) -> list[int]:
    """The stream sequence of every batch the trainer's consumer terminates from now on."""
    seen: list[int] = []

    async def advisory(msg) -> None:
        seen.append(msgspec.json.decode(msg.data)["stream_seq"])

    await bus.nc.subscribe(TERMINATED, cb=advisory)
    await bus.nc.flush()
    return seen


# --- driving the trainer ---------------------------------------------------------------------


@contextlib.asynccontextmanager
async def trainer_running(bus: Bus, trainer: Trainer, *, max_deliver: int = 20, ack_wait_s: float = 60.0):
    """The trainer's consume loop as services/trainer runs it (retries sped up)."""
    stop = asyncio.Event()
    loop = asyncio.create_task(bus.consume(
        "TRAJ", "trainer", "marlaas.trajectory.ready.>", trainer.handle, stop=stop, ack_wait_s=ack_wait_s,
        concurrency=1, on_give_up=trainer.give_up, max_deliver=max_deliver, retry_delay_s=0.05,
        max_ack_pending=trainer_service.MAX_HELD))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(loop, 30)


class Recorded(Delivery):
    """A delivery that remembers how the handler settled it."""

    outcome = ""

    async def ack(self) -> None:
        self.outcome = "ack"
        await super().ack()

    async def nak(self, delay_s: float | None = None) -> None:
        self.outcome = "nak"
        await super().nak(delay_s)

    async def term(self) -> None:
        self.outcome = "term"
        await super().term()


class Deliveries:
    """The trainers' durable consumer, one message at a time (as a replica's consume loop takes them)."""

    def __init__(self, sub) -> None:
        self.sub = sub

    @classmethod
    async def open(cls, bus: Bus, ack_wait_s: float = 60.0) -> Deliveries:
        config = ConsumerConfig(durable_name="trainer", ack_policy=AckPolicy.EXPLICIT, ack_wait=ack_wait_s)
        return cls(await bus.js.pull_subscribe("marlaas.trajectory.ready.>", durable="trainer",
                                               stream="TRAJ", config=config))

    async def next(self, timeout_s: float = 5.0) -> Recorded:
        [msg] = await self.sub.fetch(1, timeout=timeout_s)
        return Recorded(msg)

    async def close(self) -> None:
        await self.sub.unsubscribe()


@pytest.fixture
async def deliveries(bus, request):
    """The trainers' consumer; its AckWait is 60 s unless a test asks for another (indirect param)."""
    opened = await Deliveries.open(bus, ack_wait_s=getattr(request, "param", 60.0))
    yield opened
    await opened.close()  # an open pull subscription would hold the bus's drain at close


class Held:
    """Holds a PolicyTrainer inside its training step (after the handler has read the committed
    version and its revision) until released."""

    def __init__(self, policy: PolicyTrainer) -> None:
        self.reached, self.released = threading.Event(), threading.Event()
        step = policy.train_step

        def held_step(*args):
            self.reached.set()
            assert self.released.wait(60), "never released"
            return step(*args)

        policy.train_step = held_step

    async def until_reached(self) -> None:
        assert await asyncio.to_thread(self.reached.wait, 30), "the step was never reached"


class SimulatedCrash(BaseException):
    """The trainer process dying at a crash point (SIGKILL in a chaos run): nothing after it runs."""


def crash_at(monkeypatch, point: str) -> None:
    """Arm the trainer's fault hook (chaos runs: SIGKILL) to raise once at ``point``."""
    armed = [point]

    def hook(*args) -> None:
        if armed and args[-1] == armed[0]:
            armed.clear()
            raise SimulatedCrash(point)

    monkeypatch.setattr(trainer_service, "maybe_crash", hook)


# --- the commit protocol's faults -------------------------------------------------------------


async def test_a_commit_that_loses_the_race_is_evicted_and_its_batch_terminated(bus, file_store, deliveries):
    """Two replicas hold a batch of v0 each (re-sampled past the duplicate window: one id, other
    rewards). B commits v1 while A trains; A's compare-and-set from v0's revision fails: its result
    is evicted, its batch terminated, and its next batch trains from B's v1 as stored."""
    spec = await running_job(bus, file_store, "race")
    a_policy = PolicyTrainer(BASE)
    held = Held(a_policy)
    a, b = Trainer(bus, file_store, a_policy), Trainer(bus, file_store, PolicyTrainer(BASE))
    a_batch, b_batch = batch_of(0, (1.0, 0.0)), batch_of(0, (0.0, 1.0))
    await publish_batch(bus, file_store, spec.id, 0, a_batch)
    await publish_resampled(bus, spec.id, 0, b_batch)
    first, second = await deliveries.next(), await deliveries.next()
    with capture_logs() as logs:
        a_handling = asyncio.create_task(a.handle(first))
        await held.until_reached()
        await b.handle(second)
        held.released.set()
        await a_handling

    v1 = await committed(bus, spec.id)
    assert (first.outcome, second.outcome, v1.version) == ("term", "ack", 1)
    assert any(e["event"] == "lost the commit race; batch terminated" for e in logs)
    assert a_policy.hot_version(spec.id) is None  # A's v1 was never committed: out of memory
    assert await version_history(bus, spec.id) == [0, 1] and await announced(bus, spec.id) == [1]
    orphans = attempts(file_store, "adapters", spec.id, 1) - {folder_of(file_store, v1.adapter)}
    assert len(orphans) == 1  # A's attempt, written under its own key and referenced by nothing

    assert same_weights(weights(file_store, v1), reference_step(file_store, await read_v0(bus, spec.id), b_batch))
    await publish_batch(bus, file_store, spec.id, 1, batch_of(1))
    third = await deliveries.next()
    await a.handle(third)
    v2 = await committed(bus, spec.id)
    assert (third.outcome, v2.version) == ("ack", 2)
    assert same_weights(weights(file_store, v2), reference_step(file_store, v1, batch_of(1)))  # from B's v1


@pytest.mark.parametrize("fault", ["export", "store"])
async def test_a_step_that_fails_before_its_commit_leaves_nothing_in_memory_to_train_from(
        bus, file_store, deliveries, fault):
    """A's step on its batch of v0 fails after the optimizer moved its weights (exporting them, or
    writing them to the store); meanwhile B commits v1 from another batch of v0. A's next batch,
    of v1, must train from B's v1 as stored, not from A's own uncommitted v1 still in memory."""
    spec = await running_job(bus, file_store, f"failed-step-{fault}")
    a_policy = PolicyTrainer(BASE)
    a_store = StoreFailingOnce(file_store.root, f"optimizer/{spec.id}/") if fault == "store" else file_store
    if fault == "export":
        export = a_policy.export

        def export_failing_once(job: str):
            a_policy.export = export
            raise OSError("No space left on device")

        a_policy.export = export_failing_once
    a, b = Trainer(bus, a_store, a_policy), Trainer(bus, file_store, PolicyTrainer(BASE))
    await publish_batch(bus, file_store, spec.id, 0, batch_of(0, (1.0, 0.0)))
    await publish_resampled(bus, spec.id, 0, batch_of(0, (0.0, 1.0)))
    first, second = await deliveries.next(), await deliveries.next()
    with pytest.raises(OSError):
        await a.handle(first)
    await first.nak()  # what the consume loop does with a failure
    await b.handle(second)
    v1 = await committed(bus, spec.id)
    assert v1.version == 1
    again = await deliveries.next()  # A's batch, back: v1 is committed under its id, so it is acked
    await a.handle(again)
    assert (again.num_delivered, again.outcome) == (2, "ack")

    await publish_batch(bus, file_store, spec.id, 1, batch_of(1))
    third = await deliveries.next()
    await a.handle(third)
    v2 = await committed(bus, spec.id)
    assert (third.outcome, v2.version) == ("ack", 2)
    assert same_weights(weights(file_store, v2), reference_step(file_store, v1, batch_of(1)))


class StoreFailingOnce(FileStore):
    """A file store whose first write under ``prefix`` fails (the store out of reach for a moment)."""

    def __init__(self, root, prefix: str) -> None:
        super().__init__(root)
        self.prefix, self.failed = prefix, False

    def put_bytes(self, key: str, data: bytes):
        if key.startswith(self.prefix) and not self.failed:
            self.failed = True
            raise OSError("store unreachable")
        return super().put_bytes(key, data)


async def test_a_store_failure_after_the_adapter_is_written_is_retried_and_commits_once(bus, file_store):
    """The optimizer state fails to write after the adapter did: nothing is committed, the batch
    is retried (nak), and the retry trains from v0 again and commits v1 once."""
    spec = await running_job(bus, file_store, "store-fault")
    store = StoreFailingOnce(file_store.root, f"optimizer/{spec.id}/")
    trainer = Trainer(bus, store, PolicyTrainer(BASE))
    with capture_logs() as logs:
        async with trainer_running(bus, trainer):
            await publish_batch(bus, store, spec.id, 0, batch_of(0))
            await wait_for(lambda: at_version(bus, spec.id, 1), what="v1 committed")

    assert store.failed and any(e["event"] == "handler failed; will retry" for e in logs)
    v1 = await committed(bus, spec.id)
    assert await version_history(bus, spec.id) == [0, 1] and await announced(bus, spec.id) == [1]
    assert await trained(bus, spec.id) == [0, 0]  # the failed attempt, then the one committed
    assert len(attempts(store, "adapters", spec.id, 1)) == 2  # the failed attempt's adapter: an orphan
    assert attempts(store, "optimizer", spec.id, 1) == {folder_of(store, v1.optimizer)}
    assert same_weights(weights(store, v1), reference_step(store, await read_v0(bus, spec.id), batch_of(0)))


class KvFailingOnce(Bus):
    """A bus whose first compare-and-set on ``versions`` fails; with ``applied``, only its reply is
    lost (the write is stored, the trainer hears a timeout)."""

    def __init__(self, nc, applied: bool) -> None:
        super().__init__(nc)
        self.applied, self.failed = applied, False

    async def kv_update(self, bucket: str, key: str, value: bytes, revision: int) -> int:
        if bucket == VERSIONS_BUCKET and not self.failed:
            self.failed = True
            if self.applied:
                await super().kv_update(bucket, key, value, revision)
            raise TimeoutError(f"kv write {bucket}/{key}: no reply")
        return await super().kv_update(bucket, key, value, revision)


@pytest.mark.parametrize("applied", [False, True], ids=["write refused", "reply lost"])
async def test_a_kv_failure_between_the_write_and_the_commit_commits_once(bus, file_store, applied):
    """Refused: nothing is committed, the retry trains again and commits. Applied with its reply
    lost: the retry finds v1 committed from this very batch, announces it and acks: no retraining."""
    spec = await running_job(bus, file_store, "kv-fault")
    flaky = KvFailingOnce(bus.nc, applied)
    async with trainer_running(flaky, Trainer(flaky, file_store, PolicyTrainer(BASE))):
        await publish_batch(bus, file_store, spec.id, 0, batch_of(0))
        await wait_for(lambda: at_version(bus, spec.id, 1), what="v1 committed")
        await wait_for(lambda: announced(bus, spec.id), what="v1 announced")

    assert flaky.failed
    assert await version_history(bus, spec.id) == [0, 1] and await announced(bus, spec.id) == [1]
    assert await trained(bus, spec.id) == ([0] if applied else [0, 0])
    assert len(attempts(file_store, "adapters", spec.id, 1)) == (1 if applied else 2)


@pytest.mark.parametrize("deliveries", [1.0], indirect=True, ids=["AckWait 1s"])
async def test_a_lost_announcement_is_re_announced_on_restart_and_the_batch_re_acked_not_retrained(
        bus, file_store, deliveries, monkeypatch):
    """The trainer dies between the compare-and-set and the announcement: v1 is committed and
    nobody hears of it. Restarted, it announces v1; the batch, back after AckWait, is acked
    without a second training step."""
    spec = await running_job(bus, file_store, "lost-announcement")
    await publish_batch(bus, file_store, spec.id, 0, batch_of(0))
    crash_at(monkeypatch, "committed, not announced")
    with pytest.raises(SimulatedCrash):
        await Trainer(bus, file_store, PolicyTrainer(BASE)).handle(await deliveries.next())
    assert (await committed(bus, spec.id)).version == 1 and await announced(bus, spec.id) == []

    restarted = Trainer(bus, file_store, PolicyTrainer(BASE))  # a new process: nothing in memory
    with capture_logs() as logs:
        await restarted.reannounce_committed()
    assert await announced(bus, spec.id) == [1]
    assert any(e["event"] == "re-announced a version committed before a crash" for e in logs)
    again = await deliveries.next(timeout_s=10)  # AckWait expired: the broker delivers it again
    assert again.num_delivered == 2
    await restarted.handle(again)
    assert again.outcome == "ack"
    assert await trained(bus, spec.id) == [0] and await announced(bus, spec.id) == [1]
    assert await version_history(bus, spec.id) == [0, 1]


# --- batches the trainer must not train -----------------------------------------------------


async def test_batches_of_unknown_completed_and_cancelled_jobs_are_terminated_and_others_trained(bus, file_store):
    completed = await running_job(bus, file_store, "completed", state=JobState.COMPLETED)
    cancelled = await running_job(bus, file_store, "cancelled", state=JobState.CANCELLED)
    healthy = await running_job(bus, file_store, "healthy")
    terminated = await watch_terminations(bus)
    trainer = Trainer(bus, file_store, PolicyTrainer(BASE))
    with capture_logs() as logs:
        async with trainer_running(bus, trainer):
            for job in ("acme.never-submitted", completed.id, cancelled.id, healthy.id):
                await publish_batch(bus, file_store, job, 0, batch_of(0))
            await wait_for(lambda: at_version(bus, healthy.id, 1), what="the healthy job's v1")

            async def three_terminated() -> bool:
                return len(terminated) >= 3

            await wait_for(three_terminated, what="three batches terminated")

    unknown = [e for e in logs if e["event"] == "batch for an unknown job; terminated"]
    finished = {e["job"]: e["state"] for e in logs if e["event"] == "batch of a finished job; dropped"}
    assert [e["job"] for e in unknown] == ["acme.never-submitted"]
    assert finished == {completed.id: "completed", cancelled.id: "cancelled"}
    for job in (completed.id, cancelled.id):
        assert (await committed(bus, job)).version == 0 and await trained(bus, job) == []
        assert await failures(bus, job) == []  # nothing to fail: the job is over already
    assert await failures(bus, "acme.never-submitted") == []
    assert not [e for e in logs if e["event"] == "terminating message"]  # the handler's own term, not a fault


async def test_a_job_cancelled_while_it_trains_commits_nothing(bus, file_store, deliveries, tmp_path):
    spec = await running_job(bus, file_store, "cancelled-mid-step")
    manager = await a_manager(bus, file_store, tmp_path)
    policy = PolicyTrainer(BASE)
    held = Held(policy)
    trainer = Trainer(bus, file_store, policy)
    await publish_batch(bus, file_store, spec.id, 0, batch_of(0))
    delivery = await deliveries.next()
    with capture_logs() as logs:
        handling = asyncio.create_task(trainer.handle(delivery))
        await held.until_reached()
        reply = await cancel_job(manager.jobs, encode(api.CancelRequest(job=spec.id)))
        held.released.set()
        await handling

    assert reply.state == "cancelled" and delivery.outcome == "term"
    assert any(e["event"] == "job finished during training; update discarded" for e in logs)
    assert await version_history(bus, spec.id) == [0] and await announced(bus, spec.id) == []
    assert policy.hot_version(spec.id) is None
    assert file_store.list(f"adapters/{spec.id}/v000001/") == []  # nothing written for the update
    assert JOB_RECORD.decode((await bus.kv_get(JOBS_BUCKET, spec.id)).value).state is JobState.CANCELLED


class StoreUnreachable(FileStore):
    """A file store that cannot read adapters (a cold job cannot be loaded)."""

    def get_bytes(self, key: str, sha256: str | None = None) -> bytes:
        if key.startswith("adapters/"):
            raise OSError("store unreachable")
        return super().get_bytes(key, sha256)


async def test_a_batch_that_fails_every_attempt_fails_its_job_with_the_reason(bus, file_store, tmp_path):
    spec = await running_job(bus, file_store, "gives-up")
    other = await running_job(bus, file_store, "unharmed")
    manager = await a_manager(bus, file_store, tmp_path)
    store = StoreUnreachable(file_store.root)
    trainer = Trainer(bus, store, PolicyTrainer(BASE))
    stop = asyncio.Event()
    failures_loop = asyncio.create_task(bus.consume("JOBS", "manager-failures", "marlaas.job.failure.>",
                                                    manager.events.on_job_event, stop=stop))

    async def record(job: str) -> JobRecord:
        return JOB_RECORD.decode((await bus.kv_get(JOBS_BUCKET, job)).value)

    async def failed() -> bool:
        return (await record(spec.id)).state is JobState.FAILED

    try:
        async with trainer_running(bus, trainer, max_deliver=3):
            await publish_batch(bus, store, spec.id, 0, batch_of(0))
            await wait_for(failed, what="the job marked failed")
    finally:
        stop.set()
        await asyncio.wait_for(failures_loop, 30)

    assert (await record(spec.id)).reason == f"trainer: batch {spec.id}:v0 failed after 3 attempts: store unreachable"
    assert await version_history(bus, spec.id) == [0] and trainer.policy.hot_version(spec.id) is None
    assert (await record(other.id)).state is JobState.RUNNING  # only that job


async def test_a_non_finite_update_fails_the_job_and_commits_nothing(bus, file_store):
    """Sampling logprobs so low that the policy ratio overflows: the loss is infinite (JSON has no
    NaN or inf, so a batch cannot carry one; an overflow is how a non-finite loss arrives)."""
    spec = await running_job(bus, file_store, "overflow")
    trainer = Trainer(bus, file_store, PolicyTrainer(BASE))
    good, bad = batch_of(0).samples  # bad has the negative advantage: its ratio is not clipped away
    overflowing = TrajectoryBatch(samples=[good, msgspec.structs.replace(bad, logprobs=[-1e30, -1e30])])
    async with trainer_running(bus, trainer):
        await publish_batch(bus, file_store, spec.id, 0, overflowing)
        reasons = await wait_for(lambda: failures(bus, spec.id), what="a failure report")

    assert reasons == ["non-finite update, not committed: loss is inf at version 0"]
    assert await version_history(bus, spec.id) == [0] and file_store.list(f"adapters/{spec.id}/v000001/") == []
    assert trainer.policy.hot_version(spec.id) is None


# --- what a step trains from ----------------------------------------------------------------


def optimizer_state(store: FileStore, version: CommittedVersion) -> dict:
    return torch.load(io.BytesIO(store.fetch(version.optimizer)), weights_only=True)


def same_optimizer_state(a: dict, b: dict) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(torch.allclose(a["state"][i][name], b["state"][i][name], atol=1e-6)
               for i in a["state"] for name in a["state"][i])


async def test_a_job_evicted_from_the_hot_set_trains_identically_when_cold_loaded(bus, file_store, deliveries):
    """Two jobs take turns on a trainer that keeps one hot: each step cold-loads the job's adapter
    and AdamW state from the store. The same steps on a trainer keeping both hot give the same
    adapters and optimizer states."""
    cold = Trainer(bus, file_store, PolicyTrainer(BASE, hot_adapters=1))
    hot = Trainer(bus, file_store, PolicyTrainer(BASE, hot_adapters=4))
    pairs = [(await running_job(bus, file_store, f"cold-{seed}", seed=seed),
              await running_job(bus, file_store, f"hot-{seed}", seed=seed)) for seed in (1, 2)]
    for version in range(3):
        for (cold_job, hot_job), rewards in zip(pairs, [(1.0, 0.0), (0.0, 1.0)]):
            for trainer, job in ((cold, cold_job), (hot, hot_job)):
                await publish_batch(bus, file_store, job.id, version, batch_of(version, rewards))
                delivery = await deliveries.next()
                await trainer.handle(delivery)
                assert delivery.outcome == "ack"
            assert list(cold.policy.hot) == [cold_job.id]  # the other job was evicted
    assert len(hot.policy.hot) == 2
    for cold_job, hot_job in pairs:
        a, b = await committed(bus, cold_job.id), await committed(bus, hot_job.id)
        assert a.version == b.version == 3
        assert same_weights(weights(file_store, a), weights(file_store, b))
        assert same_optimizer_state(optimizer_state(file_store, a), optimizer_state(file_store, b))


async def test_a_kl_penalty_scores_against_the_base_and_changes_the_update(bus, file_store, deliveries):
    """With kl_coef > 0 the trainer scores the batch under the base (adapters off) as well. At v0
    (LoRA B = 0) the policy is the base: no KL, the same step as without the penalty; from v1 on
    the penalty is measured and pulls the update."""
    with_kl = await running_job(bus, file_store, "kl", grpo=msgspec.structs.replace(GRPO, kl_coef=0.5))
    without = await running_job(bus, file_store, "no-kl")
    trainer = Trainer(bus, file_store, PolicyTrainer(BASE))  # both jobs hot in one model
    steps: dict[str, list[CommittedVersion]] = {with_kl.id: [], without.id: []}
    for version in range(2):
        for job in steps:
            await publish_batch(bus, file_store, job, version, batch_of(version))
            await trainer.handle(await deliveries.next())
            steps[job].append(await committed(bus, job))
    (kl_v1, kl_v2), (plain_v1, plain_v2) = steps[with_kl.id], steps[without.id]
    assert kl_v1.metrics["kl"] == 0.0 and same_weights(weights(file_store, kl_v1), weights(file_store, plain_v1))
    assert kl_v2.metrics["kl"] > 0.0 and plain_v2.metrics["kl"] == 0.0
    assert not same_weights(weights(file_store, kl_v2), weights(file_store, plain_v2))


# --- batches by reference -------------------------------------------------------------------


async def test_a_batch_too_big_to_travel_inline_goes_by_reference_and_is_deleted_once_committed(
        bus, file_store, deliveries):
    big = await running_job(bus, file_store, "big")
    inline = await running_job(bus, file_store, "inline")
    text = "x" * INLINE_BATCH_LIMIT  # what rollout ships along (the completions' text); not trained on
    trainer = Trainer(bus, file_store, PolicyTrainer(BASE))

    await publish_batch(bus, file_store, big.id, 0, batch_of(0, text=text))
    delivery = await deliveries.next()
    event = TRAJECTORY.decode(delivery.data)
    assert event.batch is None and event.batch_ref.sha256 and len(delivery.data) < 4096
    blob_key = file_store.key_of(event.batch_ref.uri)
    assert file_store.exists(blob_key)
    await trainer.handle(delivery)
    assert delivery.outcome == "ack" and not file_store.exists(blob_key)  # trained and committed: garbage

    await publish_batch(bus, file_store, inline.id, 0, batch_of(0))
    await trainer.handle(await deliveries.next())
    by_ref, by_value = await committed(bus, big.id), await committed(bus, inline.id)
    assert by_ref.version == by_value.version == 1
    assert same_weights(weights(file_store, by_ref), weights(file_store, by_value))


async def test_a_batch_whose_stored_bytes_do_not_match_their_sha256_is_never_trained(bus, file_store):
    spec = await running_job(bus, file_store, "corrupt")
    trainer = Trainer(bus, file_store, PolicyTrainer(BASE))
    text = "x" * INLINE_BATCH_LIMIT
    await publish_batch(bus, file_store, spec.id, 0, batch_of(0, text=text))
    [key] = file_store.list(f"trajectories/{spec.id}/")
    path = file_store.path(key)
    path.write_bytes(path.read_bytes().replace(b'"reward":1.0', b'"reward":0.0'))  # bit rot, or a bad copy
    async with trainer_running(bus, trainer, max_deliver=2):
        reasons = await wait_for(lambda: failures(bus, spec.id), what="a failure report")

    assert len(reasons) == 1 and "sha256" in reasons[0], reasons
    assert reasons[0].startswith(f"batch {spec.id}:v0 failed after 2 attempts: "), reasons
    assert await version_history(bus, spec.id) == [0] and await trained(bus, spec.id) == []


async def test_a_finished_job_leaves_the_trainers_memory_before_the_next_step(bus, file_store, deliveries):
    """A job that finished (completed, cancelled, failed) gives up its hot slot: a trainer serving
    many jobs over time must not carry every finished one (each makes switching adapters slower)."""
    trainer = Trainer(bus, file_store, PolicyTrainer(BASE))
    await bus.nc.subscribe("marlaas.job.state.>", cb=trainer.on_job_state)
    done, going = await running_job(bus, file_store, "done"), await running_job(bus, file_store, "going")
    for job, version in ((done.id, 0), (going.id, 0)):
        await publish_batch(bus, file_store, job, version, batch_of(version))
        await trainer.handle(await deliveries.next())
    assert set(trainer.policy.hot) == {done.id, going.id}

    await bus.publish(f"marlaas.job.state.{done.id}", encode(JobStateChanged(job=done.id, state=JobState.COMPLETED)))
    await bus.publish(f"marlaas.job.state.{going.id}", encode(JobStateChanged(job=going.id, state=JobState.RUNNING)))
    await bus.nc.flush()
    await asyncio.sleep(0.2)
    assert set(trainer.policy.hot) == {done.id, going.id}  # dropped by the training thread, not under it
    await publish_batch(bus, file_store, going.id, 1, batch_of(1))
    delivery = await deliveries.next()
    await trainer.handle(delivery)
    assert delivery.outcome == "ack"
    assert set(trainer.policy.hot) == {going.id}
    assert (await committed(bus, going.id)).version == 2


# --- pipelined groups and bounded staleness (issue 37) -------------------------------------------


async def commit_fake(bus: Bus, job: str, version: int) -> None:
    """Move the job's committed version to ``version`` (the v0 adapter under its name): the trainer
    has trained that far, as far as this test's batch is concerned."""
    entry = await bus.kv_get(VERSIONS_BUCKET, job)
    await bus.kv_update(VERSIONS_BUCKET, job, encode(msgspec.structs.replace(
        COMMITTED.decode(entry.value), version=version, batch_id=f"{job}:v{version - 1}")), entry.revision)


async def test_a_batch_sampled_further_behind_than_its_bound_is_never_trained_and_fails_its_job(bus, file_store):
    spec = await running_job(bus, file_store, "too-stale", grpo=msgspec.structs.replace(GRPO, max_staleness=1))
    await commit_fake(bus, spec.id, 2)
    trainer = Trainer(bus, file_store, PolicyTrainer(BASE))
    async with trainer_running(bus, trainer):
        await publish_batch(bus, file_store, spec.id, 2, batch_of(0))  # step 2, sampled by version 0
        reasons = await wait_for(lambda: failures(bus, spec.id), what="a failure report")
    assert reasons == ["batch for step 2 was sampled by version 0, 2 behind: more than grpo.max_staleness = 1; "
                       "dropped, not trained"]
    assert await trained(bus, spec.id) == [] and await version_history(bus, spec.id) == [0, 2]


async def test_a_batch_within_its_bound_is_trained_off_policy_and_recorded_as_stale(bus, file_store):
    """Step 1 sampled by version 0 (k = 1): trained with the decoupled objective from version 1,
    committed once, its staleness on the train span and the committed version; the audit holds."""
    from marlaas.platform.audit import audit_training

    spec = await running_job(bus, file_store, "stale-ok", grpo=msgspec.structs.replace(GRPO, max_staleness=1))
    await commit_fake(bus, spec.id, 1)
    trainer = Trainer(bus, file_store, PolicyTrainer(BASE))
    async with trainer_running(bus, trainer):
        await publish_batch(bus, file_store, spec.id, 1, batch_of(0))
        await wait_for(lambda: at_version(bus, spec.id, 2), what="version 2")
    [span] = [s for s in await read_spans(bus, spec.id) if s.phase == "train"]
    assert (span.version, span.attrs["sampled_version"], span.attrs["staleness"]) == (1, 0, 1)
    assert span.attrs["adapter_version"] == 1 and span.attrs["max_staleness"] == 1
    assert (await committed(bus, spec.id)).metrics["staleness"] == 1.0
    assert audit_training(await read_spans(bus, spec.id)) == []


async def publish_group(bus: Bus, job: str, group: int) -> None:
    """Group ``group`` of version 0's two-group batch of ``job`` (``grpo.pipeline = "groups"``)."""
    batch = batch_of(0, rewards=(1.0, 0.0) if group == 0 else (0.0, 0.5))
    batch = msgspec.structs.replace(batch, samples=[msgspec.structs.replace(x, group=group) for x in batch.samples])
    await bus.publish(subjects.trajectory_ready(job), encode(TrajectoryReady(
        job=job, version=0, batch_id=f"{job}:v0", batch=batch, group=group, groups=2)), msg_id=f"{job}:v0:g{group}")


async def test_a_trainer_that_dies_holding_half_a_batch_of_groups_starts_the_version_over(bus, file_store):
    """grpo.pipeline = "groups": group 0 is added and held unacked; the trainer dies (its consume
    loop gone, nothing acked). A fresh trainer gets group 1, then group 0 again when its ack timer
    runs out, and commits version 1 once, from both groups, with no group in it twice."""
    grpo = msgspec.structs.replace(GRPO, prompts_per_step=2, pipeline="groups")
    spec = await running_job(bus, file_store, "halfway", grpo=grpo)

    first = Trainer(bus, file_store, PolicyTrainer(BASE))
    async with trainer_running(bus, first, ack_wait_s=3.0):
        await publish_group(bus, spec.id, 0)
        await wait_for(lambda: asyncio.sleep(0, spec.id in first.pending and first.pending[spec.id].held),
                       what="group 0 added and held")
        assert set(first.pending[spec.id].held) == {0}
    # the first trainer is gone with group 0 unacked (a SIGKILL leaves the same)
    second = Trainer(bus, file_store, PolicyTrainer(BASE))
    async with trainer_running(bus, second, ack_wait_s=3.0):
        await publish_group(bus, spec.id, 1)
        await wait_for(lambda: at_version(bus, spec.id, 1), what="version 1")
    assert await version_history(bus, spec.id) == [0, 1] and await announced(bus, spec.id) == [1]
    spans = await read_spans(bus, spec.id)
    [train] = [s for s in spans if s.phase == "train"]
    assert train.attrs["groups"] == 2 and train.attrs["tokens"] == 8.0  # 2 groups x 2 samples x 2 tokens
    committed_attempt = train.attrs["attempt"]
    added = sorted(s.attrs["group"] for s in spans
                   if s.phase == "accumulate" and s.attrs["attempt"] == committed_attempt)
    assert added == [0, 1]  # each group once in the committed update (group 0 was added twice in all)
    assert sorted(s.attrs["group"] for s in spans if s.phase == "accumulate") == [0, 0, 1]


async def test_a_tenant_paused_half_way_through_a_batch_holds_nothing_and_its_version_starts_over(bus, file_store):
    """grpo.pipeline = "groups": group 0 is added and held, then the tenant is paused (the trainer
    reads it from its turn queues). Its batch is put back: group 0 nak'ed, the adapter unpinned.
    Resumed, version 1 commits once, from both groups, each once in the committed update."""
    grpo = msgspec.structs.replace(GRPO, prompts_per_step=2, pipeline="groups")
    spec = await running_job(bus, file_store, "paused", grpo=grpo)

    trainer = Trainer(bus, file_store, PolicyTrainer(BASE))
    paused: set[str] = set()
    trainer.paused = lambda: paused
    async with trainer_running(bus, trainer):
        await publish_group(bus, spec.id, 0)
        await wait_for(lambda: asyncio.sleep(0, spec.id in trainer.pending and trainer.pending[spec.id].held),
                       what="group 0 added and held")
        assert spec.id in trainer.policy.pinned
        await trainer.release_paused()  # nobody paused: the batch stays
        assert set(trainer.pending[spec.id].held) == {0}
        paused.add("acme")
        await trainer.release_paused()
        assert spec.id not in trainer.pending and spec.id not in trainer.policy.pinned
        paused.clear()  # resumed (this consume loop has no turns: group 0 comes back after its nak's delay)
        await publish_group(bus, spec.id, 1)
        await wait_for(lambda: at_version(bus, spec.id, 1), what="version 1")
    assert await version_history(bus, spec.id) == [0, 1] and await announced(bus, spec.id) == [1]
    spans = await read_spans(bus, spec.id)
    [train] = [s for s in spans if s.phase == "train"]
    assert train.attrs["groups"] == 2
    added = sorted(s.attrs["group"] for s in spans
                   if s.phase == "accumulate" and s.attrs["attempt"] == train.attrs["attempt"])
    assert added == [0, 1]
    assert sorted(s.attrs["group"] for s in spans if s.phase == "accumulate") == [0, 0, 1]


# --- the base guard: the logprob gap acted on, the shared base kept as loaded (issue 48) ------


def engine_like(policy: PolicyTrainer, start: tuple[bytes, bytes], job: str,
                unsampled: TrajectoryBatch) -> TrajectoryBatch:
    """``unsampled`` with each completion token's logprob as an engine holding ``start`` gives it
    (the trainer's own scoring on a base as loaded: the gap is float noise)."""
    policy.load(job, 0, *start, None, GRPO)
    samples = []
    for sample in unsampled.samples:
        tokens = torch.tensor(sample.prompt_ids + sample.completion_ids)
        with torch.no_grad():
            (logprobs_T,) = policy.target_logprobs(job, [(tokens[:-1], tokens[1:])])
        samples.append(msgspec.structs.replace(sample, logprobs=logprobs_T[-len(sample.completion_ids):].tolist()))
    policy.evict(job)
    return msgspec.structs.replace(unsampled, samples=samples)


async def alerts(bus: Bus, job: str = ">") -> list[dict]:
    return [s.attrs for s in await read_spans(bus, job) if s.phase == "alert"]


async def test_a_batch_the_engine_and_trainer_agree_on_is_trained_with_the_gap_acted_on(bus, file_store, deliveries):
    spec = await running_job(bus, file_store, "agreed")
    policy = PolicyTrainer(BASE)
    trainer = Trainer(bus, file_store, policy, gaps=GapWatch(FP32_GAP))
    v0 = read_adapter(file_store, (await committed(bus, spec.id)).adapter)
    await publish_batch(bus, file_store, spec.id, 0, engine_like(policy, v0, spec.id, batch_of(0)))
    delivery = await deliveries.next()
    await trainer.handle(delivery)
    assert (delivery.outcome, (await committed(bus, spec.id)).version) == ("ack", 1)
    assert await alerts(bus) == [] and await failures(bus, spec.id) == []


async def test_a_batch_past_the_logprob_gap_bound_fails_its_job_with_an_alert(bus, file_store, deliveries):
    """An engine that served other weights than the trainer holds (here: made-up logprobs, -1 a
    token): the batch is never trained, the job fails saying why, and operators get an alert."""
    spec = await running_job(bus, file_store, "apart")
    trainer = Trainer(bus, file_store, PolicyTrainer(BASE), gaps=GapWatch(FP32_GAP))
    await publish_batch(bus, file_store, spec.id, 0, batch_of(0))
    delivery = await deliveries.next()
    await trainer.handle(delivery)
    assert (delivery.outcome, (await committed(bus, spec.id)).version) == ("term", 0)
    (reason,) = await failures(bus, spec.id)
    assert reason.startswith("engine-vs-trainer logprob gap ") and f"> {FP32_GAP:.3g}" in reason
    (alert,) = await alerts(bus, spec.id)
    assert (alert["alert"], alert["verdict"], alert["base"]) == ("logprob_gap", "fail_job", "as loaded")
    assert trainer.policy.hot_version(spec.id) is None  # the stepped adapter was never committed: dropped


async def test_gaps_of_two_tenants_at_once_reload_the_base_and_put_the_batch_back(bus, file_store, deliveries):
    """A platform fault, not each job's: the second tenant's batch past the bound in the window
    reloads the base (every hot job dropped) and is delivered again, not failed."""
    alice = await running_job(bus, file_store, "one", tenant="alice")
    bob = await running_job(bus, file_store, "two", tenant="bob")
    policy = PolicyTrainer(BASE)
    trainer = Trainer(bus, file_store, policy, gaps=GapWatch(FP32_GAP))
    await publish_batch(bus, file_store, alice.id, 0, batch_of(0))
    await publish_batch(bus, file_store, bob.id, 0, batch_of(0))
    first, second = await deliveries.next(), await deliveries.next()
    await trainer.handle(first)
    digest = policy.base_digest
    await trainer.handle(second)
    assert (first.outcome, second.outcome) == ("term", "nak")
    assert await failures(bus, alice.id) != [] and await failures(bus, bob.id) == []
    assert [a["verdict"] for a in await alerts(bus)] == ["fail_job", "reload_base"]
    assert policy.hot == {} and policy.base_digest == digest  # reloaded from disk: the same base


async def test_a_base_changed_by_a_jobs_first_step_twice_fails_that_job(bus, file_store, deliveries):
    """However a job changes the shared base (peft rewrote it for an adapter asking for PiSSA:
    issue 48 H2), the digest after its first step sees it: the base is reloaded from disk with an
    alert and the batch put back (whatever ran since the last check may have changed it); the job's
    first step on the reloaded base changes it again, and the job fails."""
    spec = await running_job(bus, file_store, "rewrites")
    policy = PolicyTrainer(BASE)
    trainer = Trainer(bus, file_store, policy)
    step = policy.train_step

    def rewriting_step(*args):
        result = step(*args)
        with torch.no_grad():
            next(p for n, p in policy.base.named_parameters() if "base_layer" in n).mul_(1.5)
        return result

    policy.train_step = rewriting_step
    await publish_batch(bus, file_store, spec.id, 0, batch_of(0))
    first = await deliveries.next()
    await trainer.handle(first)
    assert first.outcome == "nak" and await failures(bus, spec.id) == [] and not policy.base_changed()
    again = await deliveries.next()
    await trainer.handle(again)
    assert (again.outcome, (await committed(bus, spec.id)).version) == ("term", 0)
    (reason,) = await failures(bus, spec.id)
    assert "base model's weights changed during this job's first step, twice" in reason
    assert [(a["alert"], a["found_by"]) for a in await alerts(bus, spec.id)] == [
        ("base_changed", "first step"), ("base_changed", "first step, again")]
    assert not policy.base_changed() and policy.hot == {}


async def test_a_base_changed_before_a_jobs_first_step_is_reloaded_and_the_job_trains(bus, file_store, deliveries):
    """The first step only finds the change: the job is not blamed. The base is reloaded, the
    batch delivered again and trained on the base as loaded."""
    spec = await running_job(bus, file_store, "innocent")
    policy = PolicyTrainer(BASE)
    trainer = Trainer(bus, file_store, policy)
    with torch.no_grad():
        next(iter(policy.base.parameters())).add_(1.0)
    await publish_batch(bus, file_store, spec.id, 0, batch_of(0))
    first = await deliveries.next()
    await trainer.handle(first)
    again = await deliveries.next()
    await trainer.handle(again)
    assert (first.outcome, again.outcome, (await committed(bus, spec.id)).version) == ("nak", "ack", 1)
    assert await failures(bus, spec.id) == []
    assert [a["found_by"] for a in await alerts(bus, spec.id)] == ["first step"]


async def test_the_scheduled_check_reloads_a_base_changed_under_no_job(bus, file_store):
    policy = PolicyTrainer(BASE)
    trainer = Trainer(bus, file_store, policy)
    with torch.no_grad():
        next(iter(policy.base.parameters())).add_(1.0)
    stop = asyncio.Event()
    watching = asyncio.create_task(trainer.guard.watch(stop, every_s=0.1))
    await wait_for(lambda: asyncio.to_thread(lambda: not policy.base_changed()), what="the base reloaded")
    stop.set()
    await asyncio.wait_for(watching, 10)
    (alert,) = await alerts(bus)
    assert (alert["alert"], alert["found_by"]) == ("base_changed", "schedule")
