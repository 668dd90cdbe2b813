"""Spans: timed phases of a job in a service, published to the METRICS stream.

They are how overlap and the on-policy audit are shown: every service records
when each job's phase ran (``generate``, ``reward``, ``train``, ``commit``), with
the versions involved, on ``marlaas.span.<job>``.
"""

from __future__ import annotations

import contextlib
import os
import time

import structlog

from marlaas.platform import subjects
from marlaas.platform.bus import Bus
from marlaas.platform.events import Span, encode

log = structlog.get_logger("marlaas.platform.telemetry")


UTILIZATION_JOB = "_rollout"  # rollout's engine / tool utilization spans are filed under this name
PLATFORM_JOB = "_platform"  # operator alerts no one job raised (a scheduled check) are filed under this name
ALERTS = ("logprob_gap", "base_changed")  # the operator alerts (spans of phase "alert"; gateway /metrics)


@contextlib.asynccontextmanager
async def span(bus: Bus, service: str, phase: str, job: str, version: int, **attrs):
    """Time the body and publish a :class:`Span`; ``attrs`` (a dict) may be filled in by the body."""
    start = time.time()
    extra: dict = {**attrs, "pid": os.getpid()}  # which replica recorded it
    yield extra
    await record_span(bus, service, phase, job, version, start, time.time(), **extra)


async def record_span(bus: Bus, service: str, phase: str, job: str, version: int, start: float, end: float,
                      **attrs) -> None:
    """Publish a :class:`Span` timed by the caller (work that is not one block of code)."""
    record = Span(job=job, service=service, phase=phase, version=version, start=start, end=end,
                  attrs={"pid": os.getpid(), **attrs})
    try:
        await bus.publish(subjects.span(job), encode(record))
    except Exception as exc:  # telemetry never fails the work it measures
        log.warning("span not recorded", job=job, phase=phase, error=repr(exc))


async def raise_alert(bus: Bus, service: str, alert: str, job: str = PLATFORM_JOB, version: int = -1,
                      **attrs) -> None:
    """An operator alert (one of ``ALERTS``): a span of phase ``alert`` on the METRICS stream, which
    the gateway counts (``marlaas_alerts_total``) and the log names as an error."""
    now = time.time()
    log.error("operator alert", alert=alert, job=job, version=version, **attrs)
    await record_span(bus, service, "alert", job, version, now, now, alert=alert, **attrs)


async def read_spans(bus: Bus, job: str = ">") -> list[Span]:
    """Every span recorded so far (for one job, or all), oldest first."""
    from marlaas.platform.events import METRIC

    return [METRIC.decode(data) for data in await bus.read_all("METRICS", subjects.span(job))]
