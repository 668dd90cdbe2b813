"""Trainer shell: take trajectory batches from the TRAJ work queue (FIFO), one update at a time.

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
import os
import random
import signal
import time
import uuid

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
from marlaas.platform.telemetry import span
from services.trainer.batch_plan import BatchAction, may_commit, plan_batch
from services.trainer.policy import NonFiniteUpdate, PolicyTrainer, StepResult, torch_threads
from services.trainer.tinker_training import run_tinker

log = structlog.get_logger("trainer")
SERVICE = "trainer"


def maybe_crash(probability: float, point: str) -> None:
    """Chaos runs only (``trainer.fault_crash_p``): die by SIGKILL at one of the two points a
    crash is hardest to survive, adapter written but not committed, committed but not announced."""
    if probability and random.random() < probability:
        log.warning("fault injection: crashing", point=point)
        os.kill(os.getpid(), signal.SIGKILL)


class Trainer:
    """Applies GRPO updates for whichever job's batch is next in the FIFO."""

    def __init__(self, bus: Bus, store: ObjectStore, policy: PolicyTrainer, fault_crash_p: float = 0.0) -> None:
        self.bus, self.store, self.policy = bus, store, policy
        self.fault_crash_p = fault_crash_p
        self.finished: set[str] = set()  # jobs to drop from memory before the next step

    async def on_job_state(self, msg) -> None:
        """Note a finished job, to drop its adapter and optimizer from memory. The drop waits for
        the training thread (``_train``): the model must not change under a step in progress."""
        try:
            event = JOB.decode(msg.data)
        except EventDecodeError:
            return
        if isinstance(event, JobStateChanged) and event.state.finished:
            self.finished.add(event.job)

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
        snapshot = await read_job(self.bus, event.job)
        state, committed = (snapshot.record.state, snapshot.committed) if snapshot else (None, None)
        plan = plan_batch(event, state, committed)
        if plan.message:
            getattr(log, plan.level)(plan.message, **plan.fields)
        if plan.action.drops:
            return await delivery.term()
        if plan.action is BatchAction.REANNOUNCE:
            await announce(self.bus, committed)
            return await delivery.ack()
        await self._train_and_commit(delivery, event, snapshot)

    async def _train_and_commit(self, delivery: Delivery, event: TrajectoryReady, snapshot: JobSnapshot) -> None:
        """Train the batch on the committed version, commit v+1 by compare-and-set against the
        revision read, announce it, then ack: the commit protocol of the module docstring."""
        job, version = event.job, event.version
        record, committed = snapshot.record, snapshot.committed
        batch = event.batch if event.batch is not None else BATCH.decode(self.store.fetch(event.batch_ref))
        spec = record.spec
        # this attempt's own name: a crash before the commit trains the batch again, and a broker
        # restart can deliver it again under the same delivery count
        attempt = uuid.uuid4().hex
        # the audit's record of what was trained from, taken from where each fact lives (the event,
        # the batch as rollout wrote it, the adapter in memory), not from the plan's check
        async with span(self.bus, SERVICE, "train", job, version, batch_id=event.batch_id, attempt=attempt,
                        batch_version=event.version, sampled_version=batch.policy_version,
                        committed_version=committed.version, threads=torch.get_num_threads()) as attrs:
            async with delivery.keep_alive():
                try:
                    adapter_version, result = await asyncio.to_thread(self._train, committed, batch, spec)
                except NonFiniteUpdate as exc:
                    self.policy.evict(job)
                    await self._fail(job, version, f"non-finite update, not committed: {exc}")
                    return await delivery.term()
                except Exception:  # the step may have moved the in-memory weights: never train on them
                    self.policy.evict(job)
                    raise
            attrs["adapter_version"] = adapter_version
            attrs.update({k: v for k, v in result.metrics.items()})
        log.info("trained", job=job, version=version, batch_id=event.batch_id,
                 reward=round(result.metrics.get("reward/mean", float("nan")), 4),
                 loss=round(result.metrics["loss"], 4))

        latest = await read_job(self.bus, job)
        if not may_commit(latest.record.state if latest else None):  # cancelled while it trained
            self.policy.evict(job)
            log.info("job finished during training; update discarded", job=job, version=version)
            return await delivery.term()
        async with span(self.bus, SERVICE, "commit", job, version + 1, attempt=attempt):
            try:
                new = await asyncio.to_thread(self._write, committed, result, event.batch_id)
                maybe_crash(self.fault_crash_p, "written, not committed")
                await self.bus.kv_update(VERSIONS_BUCKET, job, encode(new), snapshot.revision)
                maybe_crash(self.fault_crash_p, "committed, not announced")
            except StaleRevision:
                self.policy.evict(job)  # someone else committed v+1: our result is an orphan
                log.warning("lost the commit race; batch terminated", job=job, version=version + 1)
                return await delivery.term()
            except BaseException:
                self.policy.evict(job)  # the in-memory v+1 was never committed: never train on it
                raise
            await announce(self.bus, new)
        await delivery.ack()
        if event.batch_ref is not None:  # the batch is trained and committed: its blob is garbage
            await asyncio.to_thread(self.store.delete, self.store.key_of(event.batch_ref.uri))

    def _train(self, committed: CommittedVersion, batch: TrajectoryBatch,
               spec: JobSpec) -> tuple[int, StepResult]:
        """Load the job if it is cold (or at another version), then one GRPO step; return the
        version of the in-memory adapter the step started from, and the step's result."""
        while self.finished:
            self.policy.evict(self.finished.pop())
        with self.policy.lock:  # a Tinker request (another thread) must not evict the job in between
            if self.policy.hot_version(committed.job) != committed.version:
                config_json, weights = read_adapter(self.store, committed.adapter)
                optimizer = self.store.fetch(committed.optimizer) if committed.optimizer else None
                self.policy.load(committed.job, committed.version, config_json, weights, optimizer, spec.grpo)
            trained_from = self.policy.hot_version(committed.job)
            result = self.policy.train_step(committed.job, batch, spec.grpo)
        result.metrics.update(batch.metrics)  # rollout's figures (tool calls, turns) ride with the version
        return trained_from, result

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
        self.policy.evict(event.job)
        await self._fail(event.job, event.version,
                         f"batch {event.batch_id} failed after {delivery.num_delivered} attempts: {exc}")


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
    trainer = Trainer(rt.bus, rt.store, policy, cfg.trainer.fault_crash_p)
    await rt.bus.nc.subscribe(subjects.job_state(), cb=trainer.on_job_state)
    await trainer.reannounce_committed()
    rt.ready()
    log.info("ready", device=cfg.trainer.device, base_model=str(cfg.base_model_dir))
    await asyncio.gather(
        rt.bus.consume("TRAJ", "trainer", subjects.trajectory_ready(), trainer.handle,
                       stop=rt.stop, ack_wait_s=rt.config.trainer.ack_wait_s, concurrency=1,
                       on_give_up=trainer.give_up),
        run_tinker(rt, policy),  # Tinker clients' requests, on the same policy (services/trainer/tinker_training.py)
    )
