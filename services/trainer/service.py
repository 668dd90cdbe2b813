# over 500 lines: the commit protocol (check, train, write, CAS, announce, ack) reads as one; plan_batch is pure
"""Trainer shell: take trajectory batches from the TRAJ work queue, one update at a time.

Batches are taken in tenant turns (``trainer.fair_share``, the default; the tenant with the
least trainer time for its weight goes first, a paused tenant's batches wait:
``marlaas.platform.tenant_turns``), each tenant's in the order rollout published them; with
``trainer.fair_share = false`` one first-come-first-served queue serves every tenant.

For each batch: check it against the job's committed version (strict on-policy:
a batch of any other version is terminated, never trained), train, write adapter
and optimizer state under fresh immutable keys, compare-and-set the ``versions``
entry from v to v+1, then announce policy-committed(v+1) with ``Nats-Msg-Id =
<job>:<v+1>``. Ack comes last. A crash anywhere leaves v or v+1 committed; on
start the trainer re-announces every committed version (deduplicated by NATS).
Which batches are trained, dropped or re-announced is decided by the pure
``plan_batch`` (services/trainer/batch_plan.py); this module carries the plan out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import structlog
import torch

from marlaas.platform import subjects
from marlaas.platform.adapters import attempt_prefix, read_adapter, write_adapter
from marlaas.platform.bus import VERSIONS_BUCKET, Bus, Delivery, StaleRevision
from marlaas.platform.commits import JobSnapshot, announce, read_job, report_failure
from marlaas.platform.events import (
    BATCH,
    COMMITTED,
    JOB,
    TRAJECTORY,
    CommittedVersion,
    EventDecodeError,
    JobSpec,
    JobStateChanged,
    TrajectoryBatch,
    TrajectoryReady,
    encode,
)
from marlaas.platform.runtime import Runtime
from marlaas.platform.store import ObjectStore
from marlaas.platform.telemetry import record_span, span
from marlaas.platform.tenant_turns import TenantQueues
from marlaas.platform.usage import UsageCounters, report_usage, tenant_of
from services.trainer.base_guard import BaseGuard
from services.trainer.batch_plan import (
    BatchAction,
    GroupAction,
    batch_whole,
    may_commit,
    objective_problem,
    plan_batch,
    plan_group,
    staleness_problem,
)
from services.trainer.gap_watch import GapWatch, gap_bound
from services.trainer.policy import NonFiniteUpdate, PolicyTrainer, StepResult, torch_threads
from services.trainer.tinker_training import run_tinker

log = structlog.get_logger("trainer")
SERVICE = "trainer"
# messages the trainer's consumer may hold unacked: the groups of every pipelined batch in progress
# (at most limits.MAX_PIPELINED_GROUPS a job, one batch a job)
MAX_HELD = 65536
WAIT_S = 3.0  # a batch of a later step (bounded staleness) is delivered again after this


@dataclass
class PendingBatch:
    """A pipelined batch in progress (``grpo.pipeline = "groups"``): the groups whose gradients are
    added, each held unacked until the version they make is committed (a crash before that
    delivers them all again: the version starts over from the stream)."""

    version: int
    attempt: str
    began: float
    held: dict[int, Delivery] = field(default_factory=dict)
    events: list[TrajectoryReady] = field(default_factory=list)
    sampled_versions: set[int] = field(default_factory=set)
    metrics: dict[str, float] = field(default_factory=dict)

    def sequences(self) -> dict[int, int]:
        return {group: d.msg.metadata.sequence.stream for group, d in self.held.items()}


def maybe_crash(probability: float, point: str) -> None:
    """Chaos runs only (``trainer.fault_crash_p``): die by SIGKILL at one of the two points a
    crash is hardest to survive, adapter written but not committed, committed but not announced."""
    if probability and random.random() < probability:
        log.warning("fault injection: crashing", point=point)
        os.kill(os.getpid(), signal.SIGKILL)


DURABLE = "trainer"
MAX_DELIVER = 20


class Trainer:
    """Applies GRPO updates for whichever job's batch is taken next."""

    def __init__(self, bus: Bus, store: ObjectStore, policy: PolicyTrainer, fault_crash_p: float = 0.0,
                 gaps: GapWatch | None = None) -> None:
        self.bus, self.store, self.policy = bus, store, policy
        self.fault_crash_p = fault_crash_p
        # the base's digest after each job's first step, and the logprob gap acted on (gaps None: not
        # acted on, for tests that play rollout with made-up engine logprobs)
        self.guard = BaseGuard(bus, policy, gaps)
        self.finished: set[str] = set()  # jobs to drop from memory before the next step
        self.pending: dict[str, PendingBatch] = {}  # pipelined batches in progress, by job
        self.ended: set[str] = set()  # finished jobs whose batch in progress is still to be released
        self.adding: set[str] = set()  # jobs with a group in hand, not yet held
        # the paused tenants, as the turn queues last read them (``take_batches``; none without turns)
        self.paused: Callable[[], Collection[str]] = frozenset

    async def on_job_state(self, msg) -> None:
        """Note a finished job, to drop its adapter and optimizer from memory. The drop waits for
        the training thread (``_train``): the model must not change under a step in progress."""
        try:
            event = JOB.decode(msg.data)
        except EventDecodeError:
            return
        if isinstance(event, JobStateChanged) and event.state.finished:
            self.finished.add(event.job)
            self.ended.add(event.job)

    def held(self) -> dict[str, int]:
        """The messages held unacked per tenant: the groups of the pipelined batches in progress."""
        counts: dict[str, int] = {}
        for job, pending in self.pending.items():
            counts[tenant_of(job)] = counts.get(tenant_of(job), 0) + len(pending.held)
        return counts

    async def reannounce_committed(self) -> None:
        """Crash recovery: announce every committed version (NATS dedups the ones already out)."""
        for job in await self.bus.kv_keys(VERSIONS_BUCKET):
            entry = await self.bus.kv_get(VERSIONS_BUCKET, job)
            if entry is not None:
                if await announce(self.bus, COMMITTED.decode(entry.value)):
                    log.warning("re-announced a version committed before a crash", job=job)

    async def handle(self, delivery: Delivery) -> None:
        """Read the batch and its job, plan (``plan_batch``), then carry the plan out."""
        event: TrajectoryReady = TRAJECTORY.decode(delivery.data)
        await self.release_finished()
        snapshot = await read_job(self.bus, event.job)
        state, committed = (snapshot.record.state, snapshot.committed) if snapshot else (None, None)
        plan = plan_batch(event, state, committed, snapshot.record.spec.grpo.max_staleness if snapshot else 0)
        if plan.message:
            getattr(log, plan.level)(plan.message, **plan.fields)
        pending = self.pending.get(event.job)
        if pending is not None and (committed is None or pending.version != committed.version):
            await self.release(event.job, "term")  # its version is past (or its job gone): never trained
        if plan.action.drops:
            return await delivery.term()
        if plan.action is BatchAction.REANNOUNCE:
            await announce(self.bus, committed)
            return await delivery.ack()
        if plan.action is BatchAction.WAIT:
            return await delivery.nak(WAIT_S)
        if event.group >= 0:
            self.adding.add(event.job)  # its batch is not put back for a pause until the group is held
            try:
                return await self._add_group(delivery, event, snapshot)
            finally:
                self.adding.discard(event.job)
        await self._train_and_commit(delivery, event, snapshot)

    async def release_finished(self) -> None:
        """Release the batches in progress of jobs that finished (cancelled, failed) meanwhile."""
        while self.ended:
            await self.release(self.ended.pop(), "term")

    async def release(self, job: str, how: str) -> None:
        """Give up ``job``'s batch in progress: its held groups are nak'ed (``"nak"``: delivered
        again, to start the version over) or terminated (``"term"``: never to be trained), and the
        gradients it added are dropped with the next ``begin_batch``."""
        pending = self.pending.pop(job, None)
        if pending is None:
            return
        self.policy.pinned.discard(job)
        for delivery in pending.held.values():
            with contextlib.suppress(Exception):
                await (delivery.nak(0.5) if how == "nak" else delivery.term())
        log.info("batch in progress released", job=job, version=pending.version, groups=len(pending.held), how=how)

    async def release_paused(self) -> None:
        """Put back the batches in progress of paused tenants' jobs (``marlaas tenant pause``): their
        held groups are nak'ed, to wait queued and start the version over after the resume, and their
        adapters unpinned, so a pause holds nothing of the trainer's memory. A job with a group
        in hand (not yet held) is left for the next look."""
        paused = self.paused()
        for job in [j for j in self.pending if tenant_of(j) in paused and j not in self.adding]:
            await self.release(job, "nak")

    async def hold_alive(self, stop: asyncio.Event, every_s: float = 5.0) -> None:
        """Keep the held groups' ack timers from running out while their batches fill up, and
        release the batches of jobs that finished, or whose tenant is paused."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)
            await self.release_finished()
            await self.release_paused()
            for pending in list(self.pending.values()):
                for delivery in list(pending.held.values()):
                    with contextlib.suppress(Exception):
                        await delivery.msg.in_progress()

    async def _add_group(self, delivery: Delivery, event: TrajectoryReady, snapshot: JobSnapshot) -> None:
        """Add one group's gradients to its batch in progress (``plan_group``), hold it unacked,
        and once the batch is whole, step and commit as a whole batch would."""
        job, version = event.job, event.version
        pending = self.pending.get(job)
        sequence = delivery.msg.metadata.sequence.stream
        with self.policy.lock:
            accumulated = self.policy.accumulated(job)
        action = plan_group(event.group, sequence, pending.version if pending else None, version,
                            pending.sequences() if pending else {}, accumulated.groups if accumulated else None)
        if action is GroupAction.SAME_MESSAGE:
            pending.held[event.group] = delivery
            return delivery.defer()
        if action is GroupAction.COPY:
            return await delivery.ack()
        if action is GroupAction.START_OVER:
            await self.release(job, "nak")
            pending = self.pending[job] = PendingBatch(version, uuid.uuid4().hex, time.time())
        batch = await self._batch(event)
        if problem := staleness_problem(version, batch.policy_version, snapshot.record.spec.grpo.max_staleness):
            await self.release(job, "term")
            await self._fail(job, version, problem)
            return await delivery.term()
        try:
            async with span(self.bus, SERVICE, "accumulate", job, version, group=event.group,
                            samples=len(batch.samples), attempt=pending.attempt):
                began = time.monotonic()
                await asyncio.to_thread(self._add, snapshot.committed, batch, snapshot.record.spec,
                                        action is GroupAction.START_OVER)
            await report_usage(self.bus, SERVICE, job, batch_usage(batch, time.monotonic() - began))
        except NonFiniteUpdate as exc:
            await report_usage(self.bus, SERVICE, job, batch_usage(batch, time.monotonic() - began))
            await self.release(job, "term")
            self.policy.evict(job)
            await self._fail(job, version, f"non-finite update, not committed: {exc}")
            return await delivery.term()
        except Exception:  # the gradients may hold half a group: the version starts over
            await report_usage(self.bus, SERVICE, job, UsageCounters(train_s=time.monotonic() - began))
            await self.release(job, "nak")
            self.policy.evict(job)
            raise
        if self.pending.get(job) is not pending:  # released while it trained (its job finished)
            return await delivery.term()
        pending.held[event.group] = delivery
        delivery.defer()
        pending.events.append(event)
        pending.sampled_versions.add(batch.policy_version)
        pending.metrics.update(batch.metrics)  # the last group out carries the batch's episode figures
        if batch_whole(pending.sequences(), event.groups):
            del self.pending[job]
            await self._step_and_commit(pending, event, snapshot)

    async def _batch(self, event: TrajectoryReady) -> TrajectoryBatch:
        """The event's batch: inline, or read from the store and decoded off the event loop (a
        blob of up to a batch's size must not hold the held groups' heartbeats)."""
        if event.batch is not None:
            return event.batch
        return await asyncio.to_thread(lambda: BATCH.decode(self.store.fetch(event.batch_ref)))

    def _add(self, committed: CommittedVersion, batch: TrajectoryBatch, spec: JobSpec, begin: bool) -> None:
        """Load the job if it is cold (or at another version), begin its batch if asked, add the group."""
        self._drop_finished()
        with self.policy.lock:
            if self.policy.hot_version(committed.job) != committed.version:
                self._load(committed, spec)
            if begin:
                self.policy.begin_batch(committed.job)
                self.policy.pinned.add(committed.job)  # its gradients must not be evicted half-way
            self.policy.add_groups(committed.job, batch.samples, spec.grpo, batch.policy_version, batch.objective)

    async def _step_and_commit(self, pending: PendingBatch, event: TrajectoryReady, snapshot: JobSnapshot) -> None:
        """The step of a whole pipelined batch, then the commit protocol as for a whole batch."""
        job, committed, spec = event.job, snapshot.committed, snapshot.record.spec
        deliveries = list(pending.held.values())
        sampled = next((v for v in sorted(pending.sampled_versions) if v != pending.version), pending.version)
        stepped, began = time.time(), time.monotonic()
        try:
            adapter_version, result = await asyncio.to_thread(self._step, job, spec)
        except NonFiniteUpdate as exc:
            await report_usage(self.bus, SERVICE, job, UsageCounters(train_s=time.monotonic() - began))
            self.policy.evict(job)
            await self._fail(job, pending.version, f"non-finite update, not committed: {exc}")
            for delivery in deliveries:
                await delivery.term()
            return
        except Exception:
            await report_usage(self.bus, SERVICE, job, UsageCounters(train_s=time.monotonic() - began))
            self.policy.evict(job)
            for delivery in deliveries:
                with contextlib.suppress(Exception):
                    await delivery.nak(0.5)
            raise
        await report_usage(self.bus, SERVICE, job, UsageCounters(train_s=time.monotonic() - began))
        result.metrics.update(pending.metrics)
        result.metrics["staleness"] = float(pending.version - sampled)  # 0 but at grpo.max_staleness >= 1
        # the span of the step itself; each group's work before it is an "accumulate" span
        await record_span(self.bus, SERVICE, "train", job, pending.version, stepped, time.time(),
                          first_group_at=pending.began, batch_id=event.batch_id, attempt=pending.attempt,
                          batch_version=event.version,
                          sampled_version=sampled, committed_version=committed.version,
                          threads=torch.get_num_threads(), adapter_version=adapter_version,
                          groups=len(deliveries), pipeline="groups", max_staleness=spec.grpo.max_staleness,
                          **result.metrics)
        log.info("trained", job=job, version=pending.version, batch_id=event.batch_id, groups=len(deliveries),
                 reward=round(result.metrics.get("reward/mean", float("nan")), 4),
                 loss=round(result.metrics["loss"], 4))
        changed_base = await self.guard.first_step_changed_base(job)
        if not await self.guard.after_step(job, pending.version, sampled == pending.version, result.metrics,
                                           changed_base, deliveries):
            return
        await self._commit(deliveries, job, pending.version, snapshot, result, event.batch_id, pending.attempt,
                           [e.batch_ref for e in pending.events if e.batch_ref is not None])

    def _step(self, job: str, spec: JobSpec) -> tuple[int, StepResult]:
        with self.policy.lock:
            self.policy.pinned.discard(job)
            trained_from = self.policy.hot_version(job)
            return trained_from, self.policy.step(job, spec.grpo)

    async def _train_and_commit(self, delivery: Delivery, event: TrajectoryReady, snapshot: JobSnapshot) -> None:
        """Train the batch on the committed version, commit v+1 by compare-and-set against the
        revision read, announce it, then ack: the commit protocol of the module docstring."""
        job, version = event.job, event.version
        record, committed = snapshot.record, snapshot.committed
        batch = await self._batch(event)
        spec = record.spec
        if problem := (staleness_problem(version, batch.policy_version, spec.grpo.max_staleness)
                       or objective_problem(spec.task, batch.objective)):
            await self._fail(job, version, problem)
            return await delivery.term()
        # this attempt's own name: a crash before the commit trains the batch again, and a broker
        # restart can deliver it again under the same delivery count
        attempt = uuid.uuid4().hex
        # the audit's record of what was trained from, taken from where each fact lives (the event,
        # the batch as rollout wrote it, the adapter in memory), not from the plan's check
        async with span(self.bus, SERVICE, "train", job, version, batch_id=event.batch_id, attempt=attempt,
                        batch_version=event.version, sampled_version=batch.policy_version,
                        max_staleness=spec.grpo.max_staleness,
                        committed_version=committed.version, threads=torch.get_num_threads()) as attrs:
            async with delivery.keep_alive():
                began = time.monotonic()
                try:
                    adapter_version, result = await asyncio.to_thread(self._train, committed, batch, spec)
                except NonFiniteUpdate as exc:
                    await report_usage(self.bus, SERVICE, job, batch_usage(batch, time.monotonic() - began))
                    self.policy.evict(job)
                    await self._fail(job, version, f"non-finite update, not committed: {exc}")
                    return await delivery.term()
                except Exception:  # the step may have moved the in-memory weights: never train on them
                    await report_usage(self.bus, SERVICE, job, UsageCounters(train_s=time.monotonic() - began))
                    self.policy.evict(job)
                    raise
                trained_s = time.monotonic() - began
            attrs["adapter_version"] = adapter_version
            attrs.update({k: v for k, v in result.metrics.items()})
        await report_usage(self.bus, SERVICE, job, batch_usage(batch, trained_s))
        log.info("trained", job=job, version=version, batch_id=event.batch_id,
                 reward=round(result.metrics.get("reward/mean", float("nan")), 4),
                 loss=round(result.metrics["loss"], 4))
        changed_base = await self.guard.first_step_changed_base(job)
        if not await self.guard.after_step(job, version, batch.policy_version == version, result.metrics,
                                           changed_base, [delivery]):
            return
        await self._commit([delivery], job, version, snapshot, result, event.batch_id, attempt,
                           [event.batch_ref] if event.batch_ref is not None else [])

    async def _commit(self, deliveries: list[Delivery], job: str, version: int, snapshot: JobSnapshot,
                      result: StepResult, batch_id: str, attempt: str, blobs: list) -> None:
        """Commit v+1 by compare-and-set against the revision read, announce it, then ack the
        batch's messages (one, or each group of a pipelined batch) and delete its blobs."""
        latest = await read_job(self.bus, job)
        if not may_commit(latest.record.state if latest else None):  # cancelled while it trained
            self.policy.evict(job)
            log.info("job finished during training; update discarded", job=job, version=version)
            for delivery in deliveries:
                await delivery.term()
            return
        committed = snapshot.committed
        async with span(self.bus, SERVICE, "commit", job, version + 1, attempt=attempt):
            try:
                new = await asyncio.to_thread(self._write, committed, result, batch_id)
                maybe_crash(self.fault_crash_p, "written, not committed")
                await self.bus.kv_update(VERSIONS_BUCKET, job, encode(new), snapshot.revision)
                maybe_crash(self.fault_crash_p, "committed, not announced")
            except StaleRevision:
                self.policy.evict(job)  # someone else committed v+1: our result is an orphan
                log.warning("lost the commit race; batch terminated", job=job, version=version + 1)
                for delivery in deliveries:
                    await delivery.term()
                return
            except BaseException:
                self.policy.evict(job)  # the in-memory v+1 was never committed: never train on it
                raise
            await announce(self.bus, new)
        for delivery in deliveries:
            await delivery.ack()
        for blob in blobs:  # the batch is trained and committed: its blobs are garbage
            await asyncio.to_thread(self.store.delete, self.store.key_of(blob.uri))

    def _train(self, committed: CommittedVersion, batch: TrajectoryBatch,
               spec: JobSpec) -> tuple[int, StepResult]:
        """Load the job if it is cold (or at another version), then one GRPO step; return the
        version of the in-memory adapter the step started from, and the step's result."""
        self._drop_finished()
        with self.policy.lock:  # a Tinker request (another thread) must not evict the job in between
            if self.policy.hot_version(committed.job) != committed.version:
                self._load(committed, spec)
            trained_from = self.policy.hot_version(committed.job)
            result = self.policy.train_step(committed.job, batch, spec.grpo)
        result.metrics.update(batch.metrics)  # rollout's figures (tool calls, turns) ride with the version
        if batch.policy_version >= 0:  # how far behind the trained version its sampler was
            result.metrics["staleness"] = float(committed.version - batch.policy_version)
        return trained_from, result

    def _drop_finished(self) -> None:
        """Evict finished jobs from memory (in the training thread: never under a step)."""
        while self.finished:
            job = self.finished.pop()
            self.policy.evict(job)
            self.guard.forget(job)

    def _load(self, committed: CommittedVersion, spec: JobSpec) -> None:
        config_json, weights = read_adapter(self.store, committed.adapter)
        optimizer = self.store.fetch(committed.optimizer) if committed.optimizer else None
        self.policy.load(committed.job, committed.version, config_json, weights, optimizer, spec.grpo)

    def _write(self, committed: CommittedVersion, result: StepResult, batch_id: str) -> CommittedVersion:
        version = committed.version + 1
        adapter = write_adapter(self.store, committed.job, version, result.config_json, result.weights)
        optimizer = self.store.put_bytes(
            attempt_prefix("optimizer", committed.job, version) + "/adamw.pt", result.optimizer_state
        )
        return CommittedVersion(job=committed.job, version=version, adapter=adapter,
                                optimizer=optimizer, batch_id=batch_id, metrics=result.metrics,
                                committed_at=time.time())

    async def _fail(self, job: str, version: int, reason: str) -> None:
        log.error("job failed", job=job, version=version, reason=reason)
        await report_failure(self.bus, job, SERVICE, reason, version)

    async def give_up(self, delivery: Delivery, exc: Exception) -> None:
        """A batch that failed every attempt (or was poison): fail its job rather than stall it."""
        try:
            event = TRAJECTORY.decode(delivery.data)
        except EventDecodeError:  # not a batch at all: no job to fail (the consume loop logged why);
            return  # rollout never publishes one it could not read back (see its non-finite check)
        await self.release(event.job, "term")
        self.policy.evict(event.job)
        await self._fail(event.job, event.version,
                         f"batch {event.batch_id} failed after {delivery.num_delivered} attempts: {exc}")


def batch_usage(batch: TrajectoryBatch, seconds: float) -> UsageCounters:
    """What training ``batch`` (or a group of it) used: its samples, the tokens its loss masks
    train on, and the trainer's ``seconds`` (metering, ``marlaas.platform.usage``)."""
    return UsageCounters(train_tokens=sum(sum(s.loss_mask) for s in batch.samples),
                         train_samples=len(batch.samples), train_s=seconds)


async def run(rt: Runtime) -> None:
    """Load the base model once, re-announce committed versions, then train until stopped."""
    cfg = rt.config
    # sync and sequential never train while the engine generates: their train steps get every core
    threads = torch_threads(cfg.trainer.torch_threads, cfg.trainer.device,
                            beside_engine=cfg.manager.schedule == "async")
    if threads:
        torch.set_num_threads(threads)
    policy = await asyncio.to_thread(
        PolicyTrainer, cfg.base_model_dir, cfg.trainer.device, cfg.trainer.hot_adapters,
        cfg.trainer.micro_batch_tokens, int(cfg.trainer.hot_memory_gib * (1 << 30)),
    )
    trainer = Trainer(rt.bus, rt.store, policy, cfg.trainer.fault_crash_p,
                      GapWatch(gap_bound(cfg.trainer.max_logprob_gap, cfg.rollout.dtype, cfg.trainer.device)))
    await rt.bus.nc.subscribe(subjects.job_state(), cb=trainer.on_job_state)
    await trainer.reannounce_committed()
    rt.ready()
    log.info("ready", device=cfg.trainer.device, base_model=str(cfg.base_model_dir))
    await asyncio.gather(
        take_batches(rt, trainer),
        trainer.hold_alive(rt.stop),
        trainer.guard.watch(rt.stop, cfg.trainer.base_check_every_s),
        run_tinker(rt, policy),  # Tinker clients' requests, on the same policy (services/trainer/tinker_training.py)
    )


async def take_batches(rt: Runtime, trainer: Trainer) -> None:
    """Run the trainer on the TRAJ queue: in tenant turns by weight (``trainer.fair_share``), or
    first come first served. Either way the other way's consumers are deleted first: on a
    work-queue stream the server refuses consumers whose subjects overlap."""
    cfg = rt.config.trainer
    queues = TenantQueues(rt.bus, "TRAJ", DURABLE, subjects.TRAJECTORY_READY, nested=True,
                          ack_wait_s=cfg.ack_wait_s, max_deliver=MAX_DELIVER, on_give_up=trainer.give_up,
                          max_ack_pending=MAX_HELD, held=trainer.held, doorbell=True)
    if cfg.fair_share:
        trainer.paused = lambda: queues.paused
        await queues.retire(DURABLE)
        await queues.run(trainer.handle, rt.stop)
    else:
        await queues.retire_turns()
        await rt.bus.consume("TRAJ", DURABLE, subjects.trajectory_ready(), trainer.handle, stop=rt.stop,
                             ack_wait_s=cfg.ack_wait_s, concurrency=1, max_deliver=MAX_DELIVER,
                             on_give_up=trainer.give_up, max_ack_pending=MAX_HELD)
