"""``/metrics``: the stack's figures for Prometheus, with no tenant or job labels but on usage.

Two sources. Job records give, at each scrape, jobs by state, the queue length and
histograms of time to first step and time per step (one observation per job that has
one). The METRICS stream's spans give busy time: each gateway follows it (from an hour
back, so a restarted gateway is not blind) and adds up engine busy seconds (rollout's
``utilization`` spans), trainer busy seconds (``train`` spans), seconds per phase, the
commit times behind steps per hour (commits in the last 10 minutes, times 6), and operator
alerts (``alert`` spans: ``marlaas_alerts_total``, by alert).

Usage (metering, ``marlaas.platform.usage``) is the one family with a ``tenant`` label: each
scrape sums the ``usage`` bucket's records by tenant (``marlaas_usage_<counter>_total``), so the
figures survive a restart of the gateway or of any service.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import time

import structlog
from nats.js.api import ConsumerConfig, DeliverPolicy
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from marlaas.platform import subjects
from marlaas.platform.bus import Bus
from marlaas.platform.events import METRIC, EventDecodeError, JobRecord, JobState, Span
from marlaas.platform.telemetry import ALERTS, UTILIZATION_JOB
from marlaas.platform.usage import COUNTER_FIELDS, UsageRecord, summarize

log = structlog.get_logger("gateway")
TTFS_BUCKETS_S = (1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
EVAL_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
TPTS_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300)
RATE_WINDOW_S = 600.0
FOLLOW_FROM_S = 3600.0


def histogram(name: str, doc: str, values: list[float], bounds: tuple[float, ...]) -> HistogramMetricFamily:
    """A Prometheus histogram of ``values`` (cumulative buckets)."""
    buckets = [(str(float(b)), sum(v <= b for v in values)) for b in bounds]
    buckets.append(("+Inf", len(values)))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=sum(values))


class RecordFigures:
    """A Prometheus collector over the job records read for the current scrape."""

    def __init__(self) -> None:
        self.records: list[JobRecord] = []

    def collect(self):
        states = GaugeMetricFamily("marlaas_jobs", "Jobs by state", labels=["state"])
        for state in JobState:
            states.add_metric([state.value], sum(r.state is state for r in self.records))
        yield states
        yield GaugeMetricFamily("marlaas_queue_length", "Jobs queued for admission",
                                value=sum(r.state is JobState.QUEUED for r in self.records))
        yield histogram("marlaas_ttfs_seconds", "Time from submission to the first trained version, per job",
                        [r.ttfs_s for r in self.records if r.ttfs_s is not None], TTFS_BUCKETS_S)
        yield histogram("marlaas_tpts_seconds", "Time per training step after the first, per job",
                        [r.tpts_s for r in self.records if r.tpts_s is not None], TPTS_BUCKETS_S)
        yield histogram("marlaas_eval_score", "Each evaluated job's latest held-out score",
                        [r.evals[-1].score for r in self.records if r.evals], EVAL_BUCKETS)


class UsageFigures:
    """A Prometheus collector over the usage records read for the current scrape, by tenant."""

    def __init__(self) -> None:
        self.records: list[UsageRecord] = []

    def collect(self):
        by_tenant = summarize(self.records, by_tenant=True).by_tenant
        for name in COUNTER_FIELDS:
            family = CounterMetricFamily(f"marlaas_usage_{name}", f"Usage: {name.replace('_', ' ')}, "
                                         "by tenant (all days)", labels=["tenant"])
            for row in by_tenant:
                family.add_metric([row.key], getattr(row.counters, name))
            yield family


class StackMetrics:
    """The registry behind ``/metrics`` and the span follower that feeds it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.figures = RecordFigures()
        self.registry.register(self.figures)
        self.usage = UsageFigures()
        self.registry.register(self.usage)
        self.engine_busy = Counter("marlaas_engine_busy_seconds", "Seconds the rollout engine had a "
                                   "request in flight", registry=self.registry)
        self.trainer_busy = Counter("marlaas_trainer_busy_seconds", "Seconds the trainers spent in "
                                    "GRPO updates", registry=self.registry)
        self.phase_seconds = Counter("marlaas_phase_seconds", "Seconds spent per phase, summed over "
                                     "jobs (phases of different jobs overlap)", ["phase"], registry=self.registry)
        self.steps_per_hour = Gauge("marlaas_steps_per_hour", "Committed training steps per hour, over "
                                    "the last 10 minutes", registry=self.registry)
        self.alerts = Counter("marlaas_alerts", "Operator alerts raised by the services (an engine-vs-trainer "
                              "logprob gap past its bound, a changed base model), by alert", ["alert"],
                              registry=self.registry)
        for alert in ALERTS:  # each alert's series exists from the start, at 0
            self.alerts.labels(alert)
        self.commits: collections.deque[float] = collections.deque()

    def observe(self, span: Span) -> None:
        """Add one span to the counters."""
        if span.job == UTILIZATION_JOB:
            self.engine_busy.inc(float(span.attrs.get("engine_busy_s", 0.0) or 0.0))
            return
        if span.phase == "alert":  # a service's own span: still, only the alerts it may raise are labels
            alert = span.attrs.get("alert")
            self.alerts.labels(alert if alert in ALERTS else "other").inc()
            return
        seconds = max(span.end - span.start, 0.0)
        self.phase_seconds.labels(span.phase).inc(seconds)
        if span.phase == "train":
            self.trainer_busy.inc(seconds)
        elif span.phase == "commit":
            self.commits.append(span.end)

    def render(self, records: list[JobRecord], usage: list[UsageRecord] = ()) -> bytes:
        """The text exposition for one scrape."""
        self.figures.records = records
        self.usage.records = list(usage)
        horizon = time.time() - RATE_WINDOW_S
        while self.commits and self.commits[0] < horizon:
            self.commits.popleft()
        self.steps_per_hour.set(sum(t >= horizon for t in self.commits) * 3600.0 / RATE_WINDOW_S)
        return generate_latest(self.registry)

    async def follow(self, bus: Bus, stop: asyncio.Event) -> None:
        """Add up spans from the METRICS stream as they arrive, until ``stop``."""
        async def on_span(msg) -> None:
            try:
                self.observe(METRIC.decode(msg.data))
            except EventDecodeError as exc:  # a bad span never stops the figures
                log.warning("span skipped", error=str(exc))

        # by sequence, not by time: after a broker restart or failover nats-py re-creates an
        # ordered consumer by sequence but keeps a start time, which the server refuses (10094)
        first = await first_sequence_since(bus, time.time() - FOLLOW_FROM_S)
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=first)
        sub = await bus.js.subscribe(subjects.span(), stream="METRICS", cb=on_span, ordered_consumer=True,
                                     config=config)
        try:
            await stop.wait()
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


async def first_sequence_since(bus: Bus, since: float) -> int:
    """The METRICS stream's first sequence stored at or after ``since`` (epoch seconds), or the
    next one to come if none is; read with a throwaway consumer that starts at that time."""
    start = datetime.datetime.fromtimestamp(since, datetime.UTC)
    sub = await bus.js.pull_subscribe(subjects.span(), stream="METRICS", config=ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start))
    try:
        msgs = await sub.fetch(1, timeout=1.0)
        return msgs[0].metadata.sequence.stream
    except TimeoutError:
        return (await bus.js.stream_info("METRICS")).state.last_seq + 1
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
