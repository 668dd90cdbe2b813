"""Metering: what each tenant's work cost, counted where it is done (issue 40, part 1).

Each service that does a tenant's work publishes a :class:`UsageReported` on
``marlaas.usage.<tenant>`` (the USAGE stream, platform only: no tenant account imports or may
publish it, ``libs/marlaas/stack/broker_auth.py``): rollout the tokens its engine prefilled and
generated for a job's episodes and the tool calls they waited on, the trainer the seconds and
tokens of each update. The manager folds the events into one :class:`UsageRecord` per tenant,
UTC day and job in the ``usage`` KV bucket (``services/manager/usage.py``), each
event exactly once: a record keeps the last stream sequence applied to it, and an event is
applied to exactly one record. The gateway serves the records (``GET /v1/usage``), the operator
reads them with ``marlaas usage`` and on ``/metrics``.

Publishing never fails the work it measures (like :func:`marlaas.platform.telemetry.record_span`):
a figure the broker refused is logged and lost, never retried by redoing the work.

Wire rules as in ``events.py``: new fields get defaults, a field never changes type.
"""

from __future__ import annotations

import datetime
import re
import time

import structlog

from marlaas.platform import subjects
from marlaas.platform.bus import USAGE_BUCKET, Bus
from marlaas.platform.events import Codec, Event, EventDecodeError, Wire, encode

log = structlog.get_logger("marlaas.platform.usage")


def tinker_job(tenant: str) -> str:
    """The job name a tenant's Tinker API work is filed under."""
    return f"{tenant}.tinker"


class UsageCounters(Wire):
    """What was used, all additive; a field a service does not count stays 0."""

    prefill_tokens: int = 0  # prompt tokens the engine read, one request at a time (cached or not)
    generated_tokens: int = 0  # tokens the engine sampled
    episodes: int = 0  # samples generated (each one or more engine requests)
    train_tokens: int = 0  # tokens the loss trained on (the samples' loss masks)
    train_samples: int = 0
    train_s: float = 0.0  # trainer seconds of the updates (forward, backward, optimizer; a cold adapter's load)
    tool_calls: int = 0  # calls the model made to any tool (built-in, sandbox or the tenant's own)
    tool_s: float = 0.0  # seconds episodes waited on those calls
    tinker_requests: int = 0  # Tinker API requests served (filed under :func:`tinker_job`)


COUNTER_FIELDS = UsageCounters.__struct_fields__


def add(a: UsageCounters, b: UsageCounters) -> UsageCounters:
    """``a + b``, field by field."""
    return UsageCounters(**{f: getattr(a, f) + getattr(b, f) for f in COUNTER_FIELDS})


class UsageReported(Event, tag="usage"):
    """Work a service did for ``job`` of ``tenant``, finished at ``at`` (epoch seconds)."""

    tenant: str
    job: str
    service: str
    counters: UsageCounters
    at: float


class UsageRecord(Wire):
    """A ``usage`` KV entry: one tenant's use on one UTC ``day`` (YYYY-MM-DD) for one job."""

    tenant: str
    day: str
    job: str
    counters: UsageCounters = UsageCounters()
    events: int = 0  # events applied
    last_seq: int = 0  # the USAGE stream sequence of the last event applied: a repeat is skipped
    updated_at: float = 0.0


USAGE = Codec("usage", UsageReported)
USAGE_RECORD = Codec("usage record", UsageRecord)


def day_of(at: float) -> str:
    """The UTC day of epoch seconds ``at``, as YYYY-MM-DD."""
    return datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%Y-%m-%d")


_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def record_key(tenant: str, day: str, job: str) -> str:
    """The ``usage`` key of ``(tenant, day, job)``: ``<tenant>.<day>.<job without its tenant>``,
    so a tenant's records are the keys under ``<tenant>.`` (one subject filter reads them)."""
    slug = job.removeprefix(f"{tenant}.")
    return f"{tenant}.{day}.{_UNSAFE.sub('_', slug) or '_'}"


def key_of(event: UsageReported) -> str:
    """The key of the one record ``event`` is applied to."""
    return record_key(event.tenant, day_of(event.at), event.job)


def tenant_of(job: str) -> str:
    """The tenant of job id ``<tenant>.<slug>``."""
    return job.partition(".")[0]


async def report_usage(bus: Bus, service: str, job: str, counters: UsageCounters, tenant: str = "") -> None:
    """Publish what ``service`` did for ``job`` (of ``tenant``, else the job id's); never raises:
    metering never fails the work it measures. Nothing is published for all-zero counters."""
    if counters == UsageCounters():
        return
    tenant = tenant or tenant_of(job)
    event = UsageReported(tenant=tenant, job=job, service=service, counters=counters, at=time.time())
    try:
        await bus.publish(subjects.usage(tenant), encode(event))
    except Exception as exc:  # noqa: BLE001 -- deliberately tolerated, and logged with the job
        log.warning("usage not recorded", job=job, service=service, error=repr(exc))


# --- what GET /v1/usage and `marlaas usage` answer -------------------------------------------


class UsageRow(Wire):
    """The counters of one group of records (a job, a day, a tenant)."""

    key: str
    counters: UsageCounters


class UsageReport(Wire):
    """Usage summed by job, by day and (the operator's view) by tenant, plus every record."""

    total: UsageCounters
    by_job: list[UsageRow] = []
    by_day: list[UsageRow] = []
    by_tenant: list[UsageRow] = []
    records: list[UsageRecord] = []
    files_bytes: int = -1  # the tenant's stored data files (-1: not counted in this view)


def summarize(records: list[UsageRecord], *, by_tenant: bool = False) -> UsageReport:
    """The report of ``records``: totals by job (``<tenant>.<job>`` ids as they were reported),
    by day, and by tenant when ``by_tenant``."""
    def group(key) -> list[UsageRow]:
        sums: dict[str, UsageCounters] = {}
        for r in records:
            sums[key(r)] = add(sums.get(key(r), UsageCounters()), r.counters)
        return [UsageRow(key=k, counters=v) for k, v in sorted(sums.items())]

    total = UsageCounters()
    for r in records:
        total = add(total, r.counters)
    ordered = sorted(records, key=lambda r: (r.tenant, r.day, r.job))
    return UsageReport(total=total, by_job=group(lambda r: r.job), by_day=group(lambda r: r.day),
                       by_tenant=group(lambda r: r.tenant) if by_tenant else [], records=ordered)


async def read_usage(bus: Bus, tenant: str = "") -> list[UsageRecord]:
    """Every ``usage`` record (``tenant``'s only, if given), for the operator's tools; an
    unreadable one is logged and skipped. (The gateway reads them its own way, with a consumer
    that needs no acks.)"""
    subject = subjects.kv(USAGE_BUCKET, f"{tenant}.>" if tenant else ">")
    found = []
    for data in await bus.read_all(subjects.kv_stream(USAGE_BUCKET), subject):
        if not data:
            continue
        try:
            found.append(USAGE_RECORD.decode(data))
        except EventDecodeError as exc:
            log.error("unreadable usage record skipped", error=str(exc))
    return found
