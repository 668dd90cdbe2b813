"""What the gateway reads straight from JetStream (read-only): job records, committed versions,
a job's timeline of phases.

The manager stays the only writer. Lists are read in one pass through a short-lived
pull consumer rather than one KV get per key: a tenant's records are the ``jobs``
bucket's subjects ``$KV.jobs.<tenant>.>`` (a job id is ``<tenant>.<slug>``), so the
subject filter itself keeps other tenants' records out, and 1,000 records cost one
consumer and a few fetches.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from marlaas.platform import subjects
from marlaas.platform.bus import JOBS_BUCKET, Bus
from marlaas.platform.events import (
    JOB_RECORD,
    METRIC,
    POLICY,
    EventDecodeError,
    JobRecord,
    JobState,
    PolicyCommitted,
)
from marlaas.platform.http_api import EvalInfo, JobInfo, PhaseSpan, VersionInfo

log = structlog.get_logger("gateway")

_KV_OPERATION = "KV-Operation"  # set on delete / purge markers


class BrokerRefused(Exception):
    """The broker would not open a reader (a consumer) now, e.g. at its consumer limit: the
    gateway's load or the stack's, not the request's fault (a 503, retry)."""


def refused(what: str, exc: nats.js.errors.APIError) -> BrokerRefused:
    return BrokerRefused(f"the message broker refused to open a reader for {what} ({exc.description or exc}; "
                         f"JetStream error {exc.err_code}): the stack is busy, retry in a moment")


def owned_job_id(tenant: str, job: str) -> bool:
    """Whether ``job`` is a well-formed id in ``tenant``'s namespace."""
    found = subjects.JOB_ID.fullmatch(job)
    return bool(found) and found[1] == tenant


async def read_messages(bus: Bus, stream: str, subject: str, *, last_per_subject: bool = False,
                        timeout_s: float = 5.0) -> list[Msg]:
    """The messages of ``stream`` under ``subject`` stored now, oldest first (or only the
    last of each subject), read through an ephemeral pull consumer that is removed after."""
    config = ConsumerConfig(
        ack_policy=AckPolicy.NONE, mem_storage=True, num_replicas=1, inactive_threshold=30.0,
        filter_subject=subject,
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT if last_per_subject else DeliverPolicy.ALL,
    )
    try:
        consumer = await bus.js.add_consumer(stream, config=config)
    except nats.js.errors.APIError as exc:
        raise refused(subject, exc) from None
    try:
        pending = consumer.num_pending
        found: list[Msg] = []
        if not pending:
            return found
        sub = await bus.js.pull_subscribe_bind(consumer=consumer.name, stream=stream)
        try:
            while pending:
                try:
                    batch = await sub.fetch(min(pending, 1024), timeout=timeout_s)
                except TimeoutError:  # messages purged since the count: what is left is all there is
                    break
                for msg in batch:
                    found.append(msg)
                    pending = msg.metadata.num_pending
        finally:
            await sub.unsubscribe()
        return found
    finally:
        with contextlib.suppress(Exception):
            await bus.js.delete_consumer(stream, consumer.name)


def _records(msgs: list[Msg]) -> list[JobRecord]:
    """The readable job records among ``msgs``; one that cannot be read is logged and skipped,
    so it hides only itself, never every tenant's list."""
    out = []
    for m in msgs:
        if not m.data or (m.headers and m.headers.get(_KV_OPERATION)):
            continue
        try:
            out.append(JOB_RECORD.decode(m.data))
        except EventDecodeError as exc:
            log.error("unreadable job record skipped", subject=m.subject, error=str(exc))
    return out


async def tenant_records(bus: Bus, tenant: str) -> list[JobRecord]:
    """``tenant``'s job records, in submission order."""
    msgs = await read_messages(bus, subjects.kv_stream(JOBS_BUCKET), subjects.kv(JOBS_BUCKET, f"{tenant}.>"),
                               last_per_subject=True)
    records = [r for r in _records(msgs) if r.spec.tenant == tenant]
    return sorted(records, key=lambda r: r.spec.submitted_at)


async def all_records(bus: Bus) -> list[JobRecord]:
    """Every job record (for queue positions and the tenant-free /metrics)."""
    msgs = await read_messages(bus, subjects.kv_stream(JOBS_BUCKET), subjects.kv(JOBS_BUCKET), last_per_subject=True)
    return _records(msgs)


async def job_record(bus: Bus, tenant: str, job: str) -> JobRecord | None:
    """``tenant``'s job ``job``, or None: missing and another tenant's look the same."""
    if not owned_job_id(tenant, job):
        return None
    entry = await bus.kv_get(JOBS_BUCKET, job)
    record = JOB_RECORD.decode(entry.value) if entry else None
    return record if record is not None and record.spec.tenant == tenant else None


def queue_positions(records: list[JobRecord]) -> dict[str, int]:
    """1-based position of every queued job among all queued jobs, in submission order."""
    queued = sorted((r for r in records if r.state is JobState.QUEUED),
                    key=lambda r: (r.spec.submitted_at, r.spec.id))
    return {r.spec.id: i for i, r in enumerate(queued, start=1)}


class RecordsSnapshot:
    """Every job record, re-read at most every ``max_age_s``: queue positions and /metrics may
    lag by that much, and 1,000 records cost tens of milliseconds to read."""

    def __init__(self, max_age_s: float = 1.0) -> None:
        self.max_age_s = max_age_s
        self._records: list[JobRecord] = []
        self._read_at = -math.inf
        self._lock = asyncio.Lock()

    async def records(self, bus: Bus) -> list[JobRecord]:
        async with self._lock:  # concurrent requests share one read
            if time.monotonic() - self._read_at > self.max_age_s:
                self._records, self._read_at = await all_records(bus), time.monotonic()
            return self._records

    async def positions_for(self, bus: Bus, mine: list[JobRecord]) -> dict[str, int]:
        """Queue positions, from every tenant's records, read only when one of ``mine`` is queued."""
        if not any(r.state is JobState.QUEUED for r in mine):
            return {}
        return queue_positions(await self.records(bus))


def job_info(record: JobRecord, queue_position: int | None = None) -> JobInfo:
    """The user's view of a record."""
    spec = record.spec
    return JobInfo(
        id=spec.id, name=spec.name, tenant=spec.tenant, task=spec.task, state=record.state.value,
        reason=record.reason, version=record.version, steps=record.steps_done, target_steps=spec.steps,
        rewards=list(record.rewards), ttfs_s=record.ttfs_s, tpts_s=record.tpts_s, tools=list(spec.tools),
        metrics=record.metrics, evals=[EvalInfo(version=e.version, score=e.score) for e in record.evals],
        queue_position=queue_position if record.state is JobState.QUEUED else None,
        pinned=list(record.pinned), submitted_at=spec.submitted_at,
        finished_at=record.finished_at or None, warnings=dict(record.warnings), followed_by=record.followed_by,
    )


async def committed_versions(bus: Bus, job: str) -> list[PolicyCommitted]:
    """The job's policy-committed announcements, one per version (a re-announcement is dropped),
    from the POLICY stream: the ``versions`` KV holds only the latest."""
    by_version: dict[int, PolicyCommitted] = {}
    for msg in await read_messages(bus, "POLICY", subjects.policy_committed(job)):
        event = POLICY.decode(msg.data)
        by_version.setdefault(event.version, event)
    return [by_version[v] for v in sorted(by_version)]


def version_info(event: PolicyCommitted, pinned: list[int]) -> VersionInfo:
    return VersionInfo(version=event.version, committed_at=event.committed_at, metrics=event.metrics,
                       pinned=event.version in pinned, adapter_sha256=event.adapter.sha256,
                       adapter_bytes=event.adapter.size)


TIMELINE_PHASES = ("generate", "reward", "train", "commit", "eval")


async def job_timeline(bus: Bus, job: str) -> list[PhaseSpan]:
    """The job's recorded phases, oldest first: what its spans say, without their attributes
    (which replica's pid, batch ids: the platform's, not the tenant's)."""
    spans = [METRIC.decode(msg.data) for msg in await read_messages(bus, "METRICS", subjects.span(job))]
    return sorted((PhaseSpan(version=s.version, phase=s.phase, service=s.service, start=s.start, end=s.end)
                   for s in spans if s.phase in TIMELINE_PHASES and s.job == job), key=lambda s: (s.start, s.end))


async def last_sequence(bus: Bus, stream: str, subject: str) -> int:
    """Stream sequence of the last message under ``subject`` (0 when there is none)."""
    try:
        return (await bus.js.get_last_msg(stream, subject)).seq
    except nats.js.errors.NotFoundError:
        return 0
