"""Per-tenant turns on a work queue: each tenant with requests waiting is served in its turn.

A work-queue stream read by one consumer is one FIFO for every tenant: a tenant that queues a
hundred large requests makes every other tenant's request wait for all of them (issue 35, F4 and
F7). Here the queue is read through one durable consumer per tenant (``<durable>-<tenant>``,
filtered on ``<subject>.<tenant>``), and the next request is taken from the tenant whose turn it is
(:func:`next_turn`, pure), skipping those that already have ``per_tenant`` requests in hand: the
waiting tenant that has had the least of the queue's time for its weight (``marlaas tenant set NAME
--weight W``; seconds in hand divided by the weight, counted while it keeps requests waiting: a
tenant that comes back after idling starts level with the others, :func:`lifted`), ties in
round-robin order. Two tenants of weights 3 and 1 with requests always waiting get three quarters
and one quarter of the queue's time, however large each one's requests are. Within a tenant the
order is the stream's, as before; acks, naks, redelivery and ``max_deliver`` are the bus's (``Bus.consume``), unchanged.

Which tenants have requests waiting comes from the stream itself (its per-subject counts): a
work-queue stream holds exactly the requests not yet acked, those in hand included. A queue whose
subjects name a job rather than a tenant (``<subject>.<tenant>.<name>``, the trainer's trajectory
batches) is read the same way (``nested``): a tenant's consumer takes every job of its own. A
handler may hold messages unacked after it returns (the trainer's groups of a batch in progress,
:meth:`Delivery.defer`); ``held`` says how many per tenant, so they are not taken for waiting ones.
A turn that finds nothing (a request put back for a moment, or in another replica's hand) costs its
tenant the turn's wait, and the tenant rests ``REST_S`` while others have requests to take, so
the queue's time goes to those it can serve. An idle queue looks again every ``IDLE_S``, or at
once when a message is published (``doorbell``: a core subscription on the subjects, so each
message reaches the process twice; for small ones).

A paused tenant (``marlaas tenant pause NAME``) has no turns: its requests stay queued, untouched,
until ``marlaas tenant resume NAME``; what it had in hand finishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Mapping

import nats.errors
import nats.js.errors
import structlog
from nats.js.api import AckPolicy, ConsumerConfig

from marlaas.platform.bus import Bus, Delivery, GiveUp, Handler, settle
from marlaas.platform.tenants import TENANT_RE, tenant_shares

log = structlog.get_logger("marlaas.platform.tenant_turns")
IDLE_S = 0.2  # how often an idle queue looks for waiting requests again (a new one rings at once)
FETCH_S = 0.2  # a turn's fetch waits this long (a tenant's only request may be put back for a moment)
REST_S = 1.0  # a tenant whose turn found nothing is passed over this long while others are candidates
WEIGHTS_EVERY_S = 5.0  # the tenants' weights (and pauses) are read again this often
CONSUMER_IDLE_S = 3600.0  # a tenant's consumer unused this long is removed by the server (re-added on use)


def lifted(virtual: Mapping[str, float], waiting: Mapping[str, int]) -> dict[str, float]:
    """Each waiting tenant's time in the queue so far, for its weight (``virtual``, seconds): a tenant
    that stopped waiting is forgotten, and one that starts (again) is put level with the least of the
    others, so that idling earns no credit to spend later."""
    active = {t for t, n in waiting.items() if n > 0}
    kept = {t: v for t, v in virtual.items() if t in active}
    floor = min(kept.values(), default=0.0)
    return {t: kept.get(t, floor) for t in active}


def next_turn(waiting: Mapping[str, int], last_served: str | None,
              in_hand: Mapping[str, int] | None = None, per_tenant: int | None = None,
              virtual: Mapping[str, float] | None = None, held: Mapping[str, int] | None = None,
              paused: frozenset[str] | set[str] = frozenset()) -> str | None:
    """The tenant to take a request from next (None: nobody may be served now).

    ``waiting`` counts each tenant's requests in the queue (those in hand included), ``in_hand``
    those being served; a tenant is a candidate when it has more waiting than in hand and fewer
    than ``per_tenant`` in hand. Candidates take turns in name order, starting after
    ``last_served``: a tenant's backlog, however long, never puts another's request behind more
    than one of its own per turn. With ``virtual`` (each tenant's weighted time, :func:`lifted`), the
    candidate with the least goes first; the round-robin order breaks ties. ``held``: requests a
    handler keeps unacked after it returned (not waiting, not in hand); ``paused``: tenants
    given no turn."""
    in_hand, held = in_hand or {}, held or {}
    candidates = sorted(t for t, n in waiting.items()
                        if t not in paused and n > in_hand.get(t, 0) + held.get(t, 0)
                        and (per_tenant is None or in_hand.get(t, 0) < per_tenant))
    if not candidates:
        return None
    if virtual is not None:
        least = min(virtual.get(t, 0.0) for t in candidates)
        candidates = [t for t in candidates if virtual.get(t, 0.0) <= least + 1e-9]
    return next((t for t in candidates if last_served is None or t > last_served), candidates[0])


class TenantQueues:
    """A work queue read in per-tenant turns: the shell around :func:`next_turn`."""

    def __init__(self, bus: Bus, stream: str, durable: str, subject: str, *, ack_wait_s: float,
                 max_deliver: int, concurrency: int = 1, per_tenant: int | None = None,
                 retry_delay_s: float = 1.0, on_give_up: GiveUp | None = None, nested: bool = False,
                 max_ack_pending: int = 0, held: Callable[[], Mapping[str, int]] | None = None,
                 doorbell: bool = False) -> None:
        self.bus, self.stream, self.durable, self.subject = bus, stream, durable, subject
        self.ack_wait_s, self.max_deliver, self.retry_delay_s = ack_wait_s, max_deliver, retry_delay_s
        self.concurrency, self.per_tenant, self.on_give_up = concurrency, per_tenant, on_give_up
        self.nested, self.held, self.rings = nested, held, doorbell
        self.max_ack_pending = max_ack_pending or max(concurrency, 1) * 4
        self.in_hand: Counter[str] = Counter()
        self.virtual: dict[str, float] = {}  # each waiting tenant's seconds in hand, over its weight
        self.weights: dict[str, float] = {}
        self.paused: frozenset[str] = frozenset()
        self.weights_at = -WEIGHTS_EVERY_S
        self.last_served: str | None = None
        self.resting: dict[str, float] = {}  # tenant -> until when an empty turn passes it over
        self.empty_turns: Counter[str] = Counter()
        self.subs: dict[str, object] = {}

    async def waiting(self) -> dict[str, int]:
        """Each tenant's requests in the queue, from the stream's per-subject counts."""
        prefix = f"{self.subject}."
        info = await self.bus.js.stream_info(self.stream, subjects_filter=f"{prefix}>")
        return waiting_by_tenant(info.state.subjects or {}, prefix, self.nested)

    async def retire(self, durable: str) -> None:
        """Delete the single consumer the queue was read by before turns: on a work-queue stream a
        consumer of every tenant's subjects would overlap each tenant's, and the server refuses that."""
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self.bus.js.delete_consumer(self.stream, durable)
            log.info("retired the queue's single consumer", stream=self.stream, durable=durable)

    async def retire_turns(self) -> None:
        """Delete the per-tenant consumers (``<durable>-<tenant>``): the queue is to be read by one
        consumer again (a fair share turned off), whose filter overlaps every one of theirs."""
        with contextlib.suppress(Exception):  # a stream with none is fine; a broker error: the fetch says
            for info in await self.bus.js.consumers_info(self.stream):
                if info.name.startswith(f"{self.durable}-"):
                    with contextlib.suppress(nats.js.errors.NotFoundError):
                        await self.bus.js.delete_consumer(self.stream, info.name)
                    log.info("retired a tenant's consumer", stream=self.stream, durable=info.name)

    async def _fetch(self, tenant: str) -> list:
        sub = self.subs.get(tenant)
        if sub is None:
            config = ConsumerConfig(
                durable_name=f"{self.durable}-{tenant}",
                filter_subject=f"{self.subject}.{tenant}" + (".>" if self.nested else ""),
                ack_policy=AckPolicy.EXPLICIT, ack_wait=self.ack_wait_s, max_deliver=self.max_deliver,
                max_ack_pending=self.max_ack_pending, inactive_threshold=CONSUMER_IDLE_S)
            sub = self.subs[tenant] = await self.bus.js.pull_subscribe(
                config.filter_subject, durable=config.durable_name, stream=self.stream, config=config)
        try:
            return await sub.fetch(1, timeout=FETCH_S)
        except (TimeoutError, nats.errors.TimeoutError):
            return []
        except Exception:  # the consumer removed (idle) or the server restarting: subscribe again next turn
            self.subs.pop(tenant, None)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            raise

    async def run(self, handler: Handler, stop: asyncio.Event) -> None:
        """Serve the queue's requests in tenant turns, up to ``concurrency`` at once, until ``stop``."""
        slots = asyncio.Semaphore(self.concurrency)
        running: set[asyncio.Task] = set()
        failures = 0
        rung = asyncio.Event()  # a request published: an idle queue looks at once, not after IDLE_S

        async def ring(msg) -> None:
            rung.set()

        bell = None
        if self.rings:  # each message comes to this process twice then: for small ones (the trainer's batches)
            with contextlib.suppress(Exception):  # without it, the queue looks every IDLE_S
                bell = await self.bus.nc.subscribe(f"{self.subject}.>", cb=ring)
        try:
            while not stop.is_set():
                await slots.acquire()
                tenant = None
                rung.clear()  # before looking: a request published after the look rings again
                try:
                    waiting = await self.waiting()
                    self.virtual = lifted(self.virtual, waiting)
                    await self._refresh_weights()
                    tenant = self._next(waiting)
                    msgs = await self._fetch(tenant) if tenant is not None else []
                    failures = 0
                except Exception as exc:  # disconnected, an election, a consumer gone: look again
                    slots.release()
                    self.last_served = tenant or self.last_served  # a failing tenant's turn passes to the next
                    failures += 1
                    if failures == 1 or failures % 20 == 0:
                        log.warning("taking a turn failed; retrying", stream=self.stream, durable=self.durable,
                                    error=repr(exc), in_a_row=failures)
                    await asyncio.sleep(0.5)
                    continue
                if tenant is not None:
                    self.last_served = tenant  # an empty turn (its requests put back a moment) passes too
                    if msgs:
                        self.resting.pop(tenant, None)
                    else:  # ... costs its tenant the wait, and rests it while others are served
                        self.empty_turns[tenant] += 1
                        self.resting[tenant] = time.monotonic() + REST_S
                        if tenant in self.virtual:
                            self.virtual[tenant] += FETCH_S / self.weights.get(tenant, 1.0)
                if not msgs:
                    slots.release()
                    if tenant is None:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(rung.wait(), IDLE_S)
                    continue
                self.in_hand[tenant] += 1
                task = asyncio.create_task(self._serve(tenant, Delivery(msgs[0]), handler, slots))
                running.add(task)
                task.add_done_callback(running.discard)
            if running:  # drain: finish in-flight work and settle it before returning
                await asyncio.gather(*running, return_exceptions=True)
        finally:
            for sub in [*self.subs.values(), *([bell] if bell else [])]:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    def _next(self, waiting: Mapping[str, int]) -> str | None:
        """Whose turn it is: :func:`next_turn`, passing over resting tenants while another is a candidate."""
        held = self.held() if self.held else None
        now = time.monotonic()
        self.resting = {t: until for t, until in self.resting.items() if until > now and t in waiting}
        if self.resting:
            tenant = next_turn(waiting, self.last_served, self.in_hand, self.per_tenant, self.virtual, held,
                               self.paused | frozenset(self.resting))
            if tenant is not None:
                return tenant
        return next_turn(waiting, self.last_served, self.in_hand, self.per_tenant, self.virtual, held, self.paused)

    async def _refresh_weights(self) -> None:
        """The tenants' weights and pauses, read again every ``WEIGHTS_EVERY_S`` (a change applies
        within it)."""
        if time.monotonic() - self.weights_at < WEIGHTS_EVERY_S:
            return
        self.weights_at = time.monotonic()
        with contextlib.suppress(Exception):  # the bucket unreadable a moment: the last weights hold
            self.weights, self.paused = await tenant_shares(self.bus)

    async def _serve(self, tenant: str, delivery: Delivery, handler: Handler, slots: asyncio.Semaphore) -> None:
        started = time.monotonic()
        try:  # settled as Bus.consume settles: ack, or nak / term by the handler's outcome
            await settle(delivery, handler, self.retry_delay_s, self.max_deliver, self.on_give_up, slots)
        finally:
            if tenant in self.virtual:  # its time in hand, for its weight (a put-back request's moment too)
                self.virtual[tenant] += (time.monotonic() - started) / self.weights.get(tenant, 1.0)
            self.in_hand[tenant] -= 1
            if self.in_hand[tenant] <= 0:
                del self.in_hand[tenant]


def waiting_by_tenant(counts: Mapping[str, int], prefix: str, nested: bool = False) -> dict[str, int]:
    """Each tenant's messages, from a stream's per-subject ``counts`` under ``prefix``: the subject's
    next token is the tenant (``nested``: one subject per job, ``<tenant>.<name>``, summed)."""
    waiting: Counter[str] = Counter()
    for subject, n in counts.items():
        rest = subject[len(prefix):] if subject.startswith(prefix) else ""
        tenant = rest.split(".", 1)[0] if nested else rest
        # only tenant names make consumer names: a subject the gateway never writes cannot stall the turns
        if TENANT_RE.match(tenant):
            waiting[tenant] += n
    return dict(waiting)
