"""The job registry (KV ``jobs``) and its one writer: job records, their state changes, and their removal.

:class:`JobRegistry` is the only code that writes a job record: every change is a compare-and-set
(:meth:`JobRegistry.update`), and a state change is published on the job's state subject. It owns
the locks the manager's steps share: the admission lock (an admission pass may commit version 0
of a queued job, so a delete waits for it) and the submission lock (a tenant's quota is counted
and what it counts created as one step). It keeps the index of unfinished jobs, so admission and
quotas read only those records, however many finished jobs the registry holds.

What a finished job sets off (an admission pass, deleting its tenant's oldest finished jobs) is
the manager's: the registry calls the ``on_finished`` it is given.

Deleting a job removes everything of it (:func:`remove_job_data`): the job record and ``versions``
entry (with their history), its adapters, optimizer states and trajectory blobs in the object
store, and its messages in the JOBS, POLICY, TRAJ and METRICS streams.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import msgspec
import structlog

from marlaas.platform import limits, subjects
from marlaas.platform.bus import JOBS_BUCKET, SAMPLED_BUCKET, VERSIONS_BUCKET, Bus, StaleRevision
from marlaas.platform.events import (
    JOB_RECORD,
    EventDecodeError,
    JobRecord,
    JobState,
    JobStateChanged,
    JobSubmitted,
    JobWarningReported,
    PolicyCommitted,
    encode,
)
from marlaas.platform.store import ObjectStore
from services.manager.gc import OBJECT_KINDS

log = structlog.get_logger("manager")
AGENT_METRICS = ("tool/", "episode/")  # per-version figures kept in the job record, beside rewards
MAX_WARNINGS = 16  # per job: what it depends on is bounded (its tools and reward), and so is this
MAX_WARNING_CHARS = 500

OnFinished = Callable[[JobRecord, bool], Awaitable[None]]  # (the finished record, admit next?)
RecordChange = Callable[[JobRecord], JobRecord | None]  # None: no change


class JobRegistry:
    """The ``jobs`` KV's records and their transitions; the locks the manager's steps share."""

    def __init__(self, bus: Bus, on_finished: OnFinished | None = None) -> None:
        self.bus = bus
        self.on_finished = on_finished
        self.admission_lock = asyncio.Lock()  # held by each admission pass (which may commit version 0)
        # held while a tenant's quota is counted and what it counts (a job, a Tinker model) created
        self.submitting_lock = asyncio.Lock()
        self.background: set[asyncio.Task] = set()
        # the index of unfinished (queued or running) job ids, built by one scan of the registry
        # and kept by this process, the registry's one writer
        self._unfinished: set[str] | None = None

    def in_background(self, work) -> asyncio.Task:
        """Run ``work`` (a coroutine) as a task the registry keeps a reference to."""
        task = asyncio.get_running_loop().create_task(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    # --- reading ------------------------------------------------------------------------------

    async def read(self, job: str, tenant: str = "") -> JobRecord | None:
        """The job's record; None when missing or (with ``tenant``) owned by another tenant."""
        entry = await self.bus.kv_get(JOBS_BUCKET, job)
        record = JOB_RECORD.decode(entry.value) if entry else None
        if record is None or (tenant and record.spec.tenant != tenant):
            return None
        return record

    async def records(self) -> list[JobRecord]:
        """Every job's record (an unreadable one is logged and skipped)."""
        out = []
        for key in await self.bus.kv_keys(JOBS_BUCKET):
            entry = await self.bus.kv_get(JOBS_BUCKET, key)
            if entry is None:
                continue
            try:
                out.append(JOB_RECORD.decode(entry.value))
            except EventDecodeError as exc:  # hides only itself: status and admission go on
                log.error("unreadable job record skipped", job=key, error=str(exc))
        return out

    async def unfinished_records(self) -> list[JobRecord]:
        """The queued and running jobs' records, read fresh, through the index (built on first use)."""
        if self._unfinished is None:
            unfinished = [r for r in await self.records() if not r.state.finished]
            self._unfinished = {r.spec.id for r in unfinished}
            return unfinished
        out = []
        for job in sorted(self._unfinished):
            entry = await self.bus.kv_get(JOBS_BUCKET, job)
            record = JOB_RECORD.decode(entry.value) if entry else None
            if record is None or record.state.finished:  # deleted, or finished meanwhile
                self._unfinished.discard(job)
            else:
                out.append(record)
        return out

    # --- writing ------------------------------------------------------------------------------

    async def create(self, record: JobRecord) -> None:
        """Write the job's record, then announce it; if the announcement fails, delete the record
        again, so that a submission refused with an error leaves no job behind."""
        job = record.spec.id
        await self.bus.kv_create(JOBS_BUCKET, job, encode(record))
        try:
            await self.bus.publish(subjects.job_submitted(job), encode(JobSubmitted(spec=record.spec)))
        except Exception:
            await self.bus.kv_delete(JOBS_BUCKET, job)
            raise
        self._unfinished.add(job)

    async def update(self, job: str, change: RecordChange) -> JobRecord | None:
        """Apply ``change`` by compare-and-set, retrying on conflict; None from it means no change."""
        while True:
            entry = await self.bus.kv_get(JOBS_BUCKET, job)
            if entry is None:
                return None
            new = change(JOB_RECORD.decode(entry.value))
            if new is None:
                return None
            try:
                await self.bus.kv_update(JOBS_BUCKET, job, encode(new), entry.revision)
                return new
            except StaleRevision:
                continue

    async def transition(self, job: str, state: JobState, reason: str = "", *, admit_next: bool = True,
                         **fields) -> bool:
        """Move a job to ``state`` unless it is already finished; publish the change. A finished
        job frees room: ``on_finished`` follows, told whether to run an admission pass
        (``admit_next`` is False when the caller is one, holding its lock). ``reason`` is cut to
        ``limits.MAX_ERROR_CHARS``."""
        reason = limits.cut(reason)
        if (record := await self.update(job, lambda r: moved(r, state, reason, fields, time.time()))) is None:
            return False
        await self.bus.publish(subjects.job_state(job),
                               encode(JobStateChanged(job=job, state=state, reason=reason, at=time.time())))
        log.info("job state", job=job, state=state.value, reason=reason)
        if state.finished:
            if self._unfinished is not None:
                self._unfinished.discard(job)
            if self.on_finished is not None:
                await self.on_finished(record, admit_next)
        return True

    async def note_queued(self, job: str, reason: str) -> None:
        """Say on a queued job's record, and on its state subject, why it is still queued (the
        reason is cleared when it is admitted). A failure here is only logged."""
        reason = limits.cut(reason)

        def change(r: JobRecord) -> JobRecord | None:
            return None if r.state is not JobState.QUEUED or r.reason == reason else msgspec.structs.replace(
                r, reason=reason)

        try:
            if await self.update(job, change) is not None:
                await self.bus.publish(subjects.job_state(job), encode(JobStateChanged(
                    job=job, state=JobState.QUEUED, reason=reason, at=time.time())))
        except Exception:
            log.exception("could not record why the job is still queued", job=job, reason=reason)


def moved(record: JobRecord, state: JobState, reason: str, fields: dict, now: float) -> JobRecord | None:
    """``record`` in ``state`` (with ``reason`` and ``fields``); None when it is finished already or
    in that state (a finished job's state never changes)."""
    if record.state.finished or record.state is state:
        return None
    done = {"finished_at": now} if state.finished else {}
    return msgspec.structs.replace(record, state=state, reason=reason, **fields, **done)


def progressed(record: JobRecord, event: PolicyCommitted) -> JobRecord | None:
    """``record`` at the committed version ``event`` announces: its version, reward and agent
    metrics (and the staleness of each trained batch, at ``grpo.max_staleness`` >= 1), and commit
    times; None for a repeat announcement (a version not above the record's)."""
    if event.version <= record.version:
        return None
    rewards = list(record.rewards)
    metrics = {key: list(values) for key, values in record.metrics.items()}
    if event.version >= 1 and "reward/mean" in event.metrics:
        rewards.append(event.metrics["reward/mean"])
        stale = record.spec.grpo.max_staleness > 0  # then each trained batch's staleness is shown too
        for key, value in event.metrics.items():
            if key.startswith(AGENT_METRICS) or (stale and key == "staleness"):
                metrics.setdefault(key, []).append(value)
    if event.version >= 1 and record.spec.task == "sft" and "loss" in event.metrics:  # no reward: its loss
        metrics.setdefault("loss", []).append(event.metrics["loss"])
    first = record.first_commit_at or (event.committed_at if event.version == 1 else 0.0)
    return msgspec.structs.replace(record, version=event.version, rewards=rewards, metrics=metrics,
                                   first_commit_at=first, last_commit_at=event.committed_at)


def with_warning(record: JobRecord, event: JobWarningReported) -> JobRecord | None:
    """``record`` with ``event``'s warning set (or cleared); None when nothing changes."""
    key, text = event.key[:100], event.warning[:MAX_WARNING_CHARS]
    if record.state.finished or record.warnings.get(key, "") == text:
        return None
    warnings = {k: v for k, v in record.warnings.items() if k != key}
    if text and len(warnings) < MAX_WARNINGS:
        warnings[key] = text
    return msgspec.structs.replace(record, warnings=warnings)


def oldest_beyond(finished: list[tuple[float, str]], keep: int) -> list[tuple[float, str]]:
    """The ``(finished_at, job)`` pairs older than the newest ``keep`` (ties: by job id)."""
    return sorted(finished)[:max(len(finished) - keep, 0)]


def job_subjects(job: str) -> tuple[tuple[str, str], ...]:
    """(stream, subject) of every message the system keeps about ``job``."""
    return (("JOBS", subjects.job_events(job)), ("POLICY", subjects.policy_committed(job)),
            ("TRAJ", subjects.trajectory_ready(job)), ("METRICS", subjects.span(job)))


async def remove_job_data(bus: Bus, store: ObjectStore, job: str) -> int:
    """Remove the job's KV entries, stream messages and objects; return how many objects there were."""
    await bus.kv_delete(JOBS_BUCKET, job)
    await bus.kv_delete(VERSIONS_BUCKET, job)
    await bus.kv_delete(SAMPLED_BUCKET, job)
    for stream, subject in job_subjects(job):
        await bus.purge(stream, subject)
    deleted = 0
    for kind in OBJECT_KINDS:
        deleted += await asyncio.to_thread(store.delete_prefix, f"{kind}/{job}/")
    return deleted


async def delete_oldest_finished(jobs: JobRegistry, store: ObjectStore, tenant: str, keep: int) -> None:
    """Delete ``tenant``'s finished jobs beyond its newest ``keep`` (``manager.max_finished_jobs``),
    each whole as a tenant's delete does (a failure is logged: the next finish tries again)."""
    try:
        # a job's id starts with its tenant's name and a dot (tenant names have no dots): the
        # server lists this tenant's keys alone, not every tenant's at every finish
        keys = await jobs.bus.kv_keys(JOBS_BUCKET, under=tenant)
        if len(keys) <= keep:
            return
        finished = []
        for key in keys:
            record = await jobs.read(key)
            if record is not None and record.state.finished:
                finished.append((record.finished_at, key))
        for _, job in oldest_beyond(finished, keep):
            async with jobs.admission_lock:
                deleted = await remove_job_data(jobs.bus, store, job)
            log.info("finished job deleted: its tenant has more than manager.max_finished_jobs",
                     job=job, tenant=tenant, objects=deleted, keep=keep)
    except Exception:
        log.exception("deleting a tenant's oldest finished jobs failed; the next finish retries", tenant=tenant)
