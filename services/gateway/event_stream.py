"""A job's server-sent events: its committed versions, state changes and held-out scores, live.

Two JetStream ordered consumers, one per stream (POLICY ``marlaas.policy.committed.<job>``
and JOBS ``marlaas.job.*.<job>``), feed one queue. Each event's id is ``<policy_n>-<jobs_n>``:
how many of the job's own messages had been taken from each stream when the event was sent.
Stream sequence numbers would not do: they count every tenant's messages, so the gaps
between a job's ids would show how busy the others are. Resuming from an id replays the
job's messages from the start and skips that many of each stream's, so nothing is lost or
repeated whatever the interleaving was: a job's messages are only removed with the job.

The stream ends once the job is finished and every event of it is sent: its final state,
its last version, and (for a completed job that evaluates) its last version's score,
which rollout sends just after completion (waited for up to ``EVAL_GRACE_S``).

The broker's consumers are shared by every tenant and service (about 1,000 in all): one
tenant holding ~1,200 streams once left the others' job lists, and the manager's garbage
collection, failing. So a replica keeps ``gateway.max_streams_per_tenant`` streams of one
tenant open and ``gateway.max_streams`` in all (a 429 past either, in views), and a stream's
consumers are deleted the moment it ends, its client gone included (:class:`JobEvents`).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Callable

import msgspec
import nats.js.errors
import structlog
from nats.js.api import ConsumerConfig, DeliverPolicy

from marlaas.platform import subjects
from marlaas.platform.bus import Bus
from marlaas.platform.events import (
    JOB,
    POLICY,
    EventDecodeError,
    JobEvaluated,
    JobState,
    JobStateChanged,
    PolicyCommitted,
)
from services.gateway.reads import job_record, last_sequence, refused

log = structlog.get_logger("gateway")
KEEPALIVE_S = 15.0
CHECK_EVERY_S = 2.0  # while idle, look whether the job ended (e.g. deleted, or its eval grace ran out)
EVAL_GRACE_S = 60.0
CONSUMER_DESCRIPTION = "gateway event stream"  # how an operator (and a test) tells these consumers apart
_EVENT_ID = re.compile(r"([0-9]{1,19})-([0-9]{1,19})")  # ASCII digits: \d takes any script's


class BadEventId(ValueError):
    """A Last-Event-ID this API never sent."""


def parse_event_id(raw: str | None) -> tuple[int, int]:
    """(policy_n, jobs_n) from ``<policy_n>-<jobs_n>``; (0, 0) = from the start."""
    if not raw:
        return 0, 0
    found = _EVENT_ID.fullmatch(raw.strip())
    if not found:
        raise BadEventId(f"Last-Event-ID {raw!r} is not an id this API sent: give the id of the last event "
                         "you received ('<n>-<m>', e.g. '4-2'), or none to start over")
    return int(found[1]), int(found[2])


def sse(event_id: str, kind: str, data: dict) -> bytes:
    """One event in the text/event-stream format."""
    return f"id: {event_id}\nevent: {kind}\ndata: {msgspec.json.encode(data).decode()}\n\n".encode()


def public_data(event) -> tuple[str, dict] | None:
    """What a tenant sees of an event (no store URIs); None for events not shown."""
    if isinstance(event, PolicyCommitted):
        return "policy.committed", {"job": event.job, "version": event.version, "metrics": event.metrics,
                                    "committed_at": event.committed_at, "adapter_sha256": event.adapter.sha256}
    if isinstance(event, JobStateChanged):
        return "job.state", {"job": event.job, "state": event.state.value, "reason": event.reason, "at": event.at}
    if isinstance(event, JobEvaluated):
        return "job.eval", {"job": event.job, "version": event.version, "score": event.score,
                            "problems": event.problems, "at": event.at}
    return None  # submitted (the spec is in GET /v1/jobs/{id}), failure reports (the state says why)


async def end_positions(bus: Bus, tenant: str, job: str) -> tuple[int, int] | None:
    """Where the job's streams end once it is finished: (last policy seq, last shown jobs seq);
    None while more may come. A deleted job ends at once."""
    record = await job_record(bus, tenant, job)
    if record is None:
        return 0, 0
    if not record.state.finished:
        return None
    last_scored = any(e.version == record.version for e in record.evals)
    if (record.state is JobState.COMPLETED and record.spec.eval_every and not last_scored
            and time.time() - record.finished_at < EVAL_GRACE_S):
        return None
    jobs_end = max(await last_sequence(bus, "JOBS", subjects.job_state(job)),
                   await last_sequence(bus, "JOBS", subjects.job_eval(job)))
    return await last_sequence(bus, "POLICY", subjects.policy_committed(job)), jobs_end


class JobEvents:
    """One client's live stream of a job's events (iterate it for the SSE bytes).

    Its two ordered consumers are opened by :meth:`open`, before the answer starts, so a broker
    at its consumer limit is a 503 rather than a stream that breaks after its headers. They are
    closed exactly once, however the stream ends (the job's last event, the client gone, a
    stream never started): :meth:`close` deletes them at the broker at once rather than leaving
    them to its inactivity timeout, and gives back the stream's place (``release``). Clients
    that come and go must not pile consumers up: the broker's are shared by every tenant.
    """

    def __init__(self, bus: Bus, tenant: str, job: str, start: tuple[int, int],
                 release: Callable[[], None] = lambda: None) -> None:
        self.bus, self.tenant, self.job, self.start = bus, tenant, job, start
        self._release = release
        self._queue: asyncio.Queue = asyncio.Queue()
        self._subs: list = []
        self._closing: asyncio.Task | None = None

    async def open(self) -> JobEvents:
        """Subscribe to the job's two streams; :class:`BrokerRefused` (closed again) if refused."""
        try:
            for stream, subject in (("POLICY", subjects.policy_committed(self.job)),
                                    ("JOBS", subjects.job_events(self.job))):
                self._subs.append(await self._follow(stream, subject))
        except nats.js.errors.APIError as exc:
            await self.close()
            raise refused(f"the events of {self.job}", exc) from None
        except BaseException:
            await self.close()
            raise
        return self

    async def _follow(self, stream: str, subject: str):
        async def put(msg) -> None:
            self._queue.put_nowait((stream, msg))

        return await self.bus.js.subscribe(subject, stream=stream, cb=put, ordered_consumer=True,
                                           config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL,
                                                                 description=CONSUMER_DESCRIPTION))

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._events()

    async def close(self) -> None:
        """Give back the stream's place and delete its consumers (once; later calls wait for it).
        The deletion runs as a task of its own: a client that went away cancels the request,
        which must not cut the clean-up short."""
        if self._closing is None:
            self._release()
            self._closing = asyncio.create_task(_unsubscribe(self.bus, self._subs))
            _CLOSING.add(self._closing)
            self._closing.add_done_callback(_CLOSING.discard)
        await asyncio.shield(self._closing)

    async def _events(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in _sse(self.bus, self.tenant, self.job, self.start, self._queue):
                yield chunk
        finally:
            await self.close()


_CLOSING: set[asyncio.Task] = set()  # clean-ups under way (the loop holds tasks only weakly)


async def _unsubscribe(bus: Bus, subs: list) -> None:
    """Stop ``subs`` and delete their consumers at the broker (an ordered consumer's current one:
    nats-py recreates it under a new name after a gap, and keeps that name in ``_consumer``)."""
    for sub in subs:
        with contextlib.suppress(Exception):  # the connection may be gone; the broker drops them then
            await sub.unsubscribe()
        consumer = getattr(sub, "_consumer", None)
        if consumer:
            with contextlib.suppress(Exception):  # already gone (inactive, or deleted with the job)
                await bus.js.delete_consumer(sub._stream, consumer)


async def job_events(bus: Bus, tenant: str, job: str, start: tuple[int, int]) -> AsyncIterator[bytes]:
    """The job's events after ``start`` (an id parsed by :func:`parse_event_id`) as SSE bytes,
    live, until the job's last event (its consumers opened and closed here)."""
    async for chunk in await JobEvents(bus, tenant, job, start).open():
        yield chunk


async def _sse(bus: Bus, tenant: str, job: str, start: tuple[int, int], queue: asyncio.Queue) -> AsyncIterator[bytes]:
    """:func:`job_events` from the messages put in ``queue`` by :class:`JobEvents`' consumers."""
    seen = dict(zip(("POLICY", "JOBS"), start))  # the client has these many of each stream's
    taken = {"POLICY": 0, "JOBS": 0}  # the job's messages taken from each stream: the event ids
    policy_seq = jobs_seq = 0  # stream sequences, only ever compared with where the job ends
    yield b"retry: 2000\n\n"
    end = await end_positions(bus, tenant, job)
    idle_since = time.monotonic()
    while end is None or policy_seq < end[0] or jobs_seq < end[1]:
        try:
            stream, msg = await asyncio.wait_for(queue.get(), CHECK_EVERY_S)
        except TimeoutError:
            end = await end_positions(bus, tenant, job)
            if time.monotonic() - idle_since >= KEEPALIVE_S:
                idle_since = time.monotonic()
                yield b": keepalive\n\n"
            continue
        seq = msg.metadata.sequence.stream
        if stream == "POLICY":
            policy_seq = seq
        else:
            jobs_seq = seq
        taken[stream] += 1
        if taken[stream] <= seen[stream]:  # sent before the client resumed
            continue
        try:
            event = (POLICY if stream == "POLICY" else JOB).decode(msg.data)
        except EventDecodeError as exc:  # one bad message never ends a tenant's stream
            log.warning("event skipped", job=job, stream=stream, seq=seq, error=str(exc))
            continue
        if isinstance(event, (JobStateChanged, JobEvaluated)):
            end = await end_positions(bus, tenant, job)
        shown = public_data(event)
        if shown is not None:
            idle_since = time.monotonic()
            yield sse(f"{taken['POLICY']}-{taken['JOBS']}", *shown)
