"""Tenants' weighted shares of the engine (``rollout.fair_share``): the order vLLM serves its
waiting requests in, by start-time fair queueing over tenants.

Every engine request (a turn of a job's episode, a Tinker sample) gets a *start tag* in virtual
time: its tenant's last finish tag, or the system's virtual time if that is later (a tenant that
idled earns no credit), and moves its tenant's finish tag on by the request's cost (its prompt and
token budget) over the tenant's weight. vLLM's priority scheduler serves the lowest tag first, so
while tenants' requests wait, each tenant's share of the engine's tokens follows its weight
(``marlaas tenant set NAME --weight W``), and a tenant's own requests keep their order. Nothing
waits that the engine has room for: a tenant alone gets all of it (work-conserving). The system's
virtual time is the least start tag in the engine, or the last one served when it is empty.

Pure bookkeeping; the engine (``services/rollout/engine.py``) asks for a tag when it submits a
request and says when the request is over.

vLLM runs every request it has room for in one batch, each running sequence getting a token per
step: the tags order only what *waits*, and with free KV cache nothing does, so volume decides, and
a step's time grows with its batch. :class:`RunningShares` bounds what *runs*
(``rollout.fair_share_running`` = R): while two or more tenants are busy (requests in, held, or
one finished within :data:`LINGER_S`), the engine runs at most R of their requests, divided by
weight, max-min (:func:`running_quotas`); the rest wait in our own queue, not vLLM's, and the least
served tenant for its weight goes in next (:func:`next_turn`: S-LoRA's virtual token counter). A
tenant alone is not bounded by us: it may fill the engine. When another tenant comes, the one over
its quota is preempted (:func:`preempted`): its lowest-priority, latest requests are aborted in
vLLM (which cannot preempt by tenant) and held again in their place, to run again from the start
with the same seed (every request has one), so the samples are those it would have drawn. So a
tenant's time per step is bounded by the engine's step at R sequences, whatever the others' volume.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping

from marlaas.platform.api import PRIORITIES
from marlaas.platform.max_min import max_min_shares

TAG_SCALE = 1000  # vLLM's priorities are integers: tags in thousandths of a token
# a job's ``priority`` within its tenant's share: its rank (lower goes first)
RANKS = {p: rank for rank, p in enumerate(reversed(PRIORITIES))}  # high 0, normal 1, low 2


class FairShare:
    """The tenants' virtual clocks in one engine."""

    def __init__(self) -> None:
        self.finish: dict[str, float] = {}  # tenant -> the finish tag of its last request
        self.in_engine: dict[int, float] = {}  # request -> its start tag
        self.ranked: dict[int, tuple[str, int]] = {}  # request -> (its tenant, its job's rank)
        self.served = 0.0  # the system's virtual time when nothing is in the engine
        self._ids = itertools.count(1)

    def now(self) -> float:
        return min(self.in_engine.values(), default=self.served)

    def admit(self, tenant: str, cost: float, weight: float, rank: int = RANKS["normal"]) -> tuple[int, int]:
        """A request of ``tenant`` costing ``cost`` tokens, of a job of ``rank`` (:data:`RANKS`):
        (its id, its vLLM priority). Its tenant's clock moves on by its cost whatever its rank; the
        rank only reorders the tenant's own requests: one of a higher-priority job takes the tag of
        the tenant's earliest request of a lower one still in the engine (if that is earlier, and not
        before the tenant's own requests of its rank or higher), and so goes before it: a tenant's
        priorities never buy it more than its share over time."""
        start = max(self.finish.get(tenant, 0.0), self.now())
        self.finish[tenant] = start + cost / weight
        mine = [(self.in_engine[r], k) for r, (t, k) in self.ranked.items() if t == tenant]
        floor = max((tag for tag, k in mine if k <= rank), default=-float("inf"))  # never before its peers
        lower = [tag for tag, k in mine if k > rank and tag > floor]
        if lower:  # just before the earliest of them (vLLM serves equal tags in arrival order)
            start = min(start, max(floor, min(lower) - 1 / TAG_SCALE))
        request = next(self._ids)
        self.in_engine[request] = start
        self.ranked[request] = (tenant, rank)
        return request, int(start * TAG_SCALE)

    def done(self, request: int) -> None:
        self.ranked.pop(request, None)
        start = self.in_engine.pop(request, None)
        if start is not None:
            self.served = max(self.served, start)


# a tenant between two versions (its batch training, its rewards) still counts as busy; and a long
# linger is the bound's hysteresis: a tenant that sends one small request now and then keeps the
# bound on (a lone tenant kept under R, which costs it little) rather than making the other fill
# the engine and be preempted down again each time (its aborted requests' tokens wasted)
LINGER_S = 30.0


def running_quotas(demand: Mapping[str, int], present: Iterable[str], weights: Mapping[str, float],
                   bound: int) -> dict[str, int] | None:
    """How many requests each tenant ``present`` may run in the engine now: ``bound`` divided by
    weight, max-min (a tenant wanting less than its share, ``demand``: running and held, leaves the
    rest to the others by weight), whole requests, at least one each that wants any. None when
    fewer than two tenants are present, or ``bound`` is 0: no bound of ours, the engine's own."""
    present = sorted(set(present))
    if bound <= 0 or len(present) < 2:
        return None
    share = max_min_shares({t: weights.get(t, 1.0) for t in present}, {t: demand.get(t, 0) for t in present},
                           total=bound)
    quotas = {t: max(int(s + 1e-9), min(demand.get(t, 0), 1)) for t, s in share.items()}
    spare = min(bound, sum(demand.get(t, 0) for t in present)) - sum(quotas.values())
    for t in sorted(share, key=lambda t: (quotas[t] - share[t], t)):  # the largest remainders first
        if spare <= 0:
            break
        if quotas[t] < demand.get(t, 0):
            quotas[t] += 1
            spare -= 1
    return quotas


def next_turn(held: Mapping[str, int], running: Mapping[str, int], quotas: Mapping[str, int] | None,
              served: Mapping[str, float]) -> str | None:
    """The tenant whose held request goes into the engine next: of those with requests held and
    room under their quota, the least served for its weight (S-LoRA's virtual token counter)."""
    ready = [t for t, n in held.items() if n > 0 and (quotas is None or running.get(t, 0) < quotas.get(t, 0))]
    return min(ready, key=lambda t: (served.get(t, 0.0), t), default=None)


def preempted(running: Mapping[str, int], quotas: Mapping[str, int] | None) -> dict[str, int]:
    """How many of each tenant's running requests to take out of the engine: those over its quota
    (none while one tenant is alone)."""
    if quotas is None:
        return {}
    return {t: n - quotas.get(t, 0) for t, n in running.items() if n > quotas.get(t, 0)}


class Ticket:
    """One engine request at the gate: its place among its tenant's (rank, then arrival), where it
    is ("held", "engine", or "" before and after), and how to stop it in the engine."""

    def __init__(self, tenant: str, cost: float, rank: int, seq: int) -> None:
        self.tenant, self.cost, self.key = tenant, cost, (rank, seq)
        self.place = ""
        self.turn: asyncio.Future | None = None  # resolved when it is let in
        self.stop: Callable[[], object] | None = None  # cancels its run in the engine
        self.preempted = False  # taken out of the engine since it last entered

    def __lt__(self, other: Ticket) -> bool:
        return self.key < other.key


class RunningShares:
    """The requests in the engine per tenant and those held before it, with a tenant over its
    quota (:func:`running_quotas`) preempted: its lowest-priority, latest requests taken out of the
    engine and held again in their place, to run again from the start. The engine asks for a
    :meth:`ticket` per request, :meth:`enter` s before submitting it (again after a preemption,
    which calls the ticket's ``stop``) and says when it :meth:`leave` s."""

    def __init__(self, bound: int, linger_s: float = LINGER_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.bound, self.linger_s, self.clock = bound, linger_s, clock
        self.in_engine: dict[str, set[Ticket]] = {}
        self.held: dict[str, list[Ticket]] = {}  # per tenant, sorted by (rank, arrival)
        self.served: dict[str, float] = {}  # tenant -> tokens let in over its weight (a preempted one counts again)
        self.last_busy: dict[str, float] = {}  # tenant -> when its last request left the engine
        self._seq = itertools.count()

    @property
    def running(self) -> Counter[str]:
        return Counter({t: len(s) for t, s in self.in_engine.items() if s})

    def waiting(self) -> dict[str, int]:
        return {t: len(q) for t, q in self.held.items() if q}

    def ticket(self, tenant: str, cost: float, rank: int = RANKS["normal"]) -> Ticket:
        """A request of ``tenant`` costing ``cost`` tokens, of a job of ``rank`` (:data:`RANKS`)."""
        return Ticket(tenant, cost, rank, next(self._seq))

    def present(self) -> set[str]:
        """The tenants with requests in or held, or one in the engine within ``linger_s``."""
        now = self.clock()
        return ({t for t, s in self.in_engine.items() if s} | set(self.waiting())
                | {t for t, at in self.last_busy.items() if now - at < self.linger_s})

    async def enter(self, ticket: Ticket, weights: Mapping[str, float]) -> None:
        """Until ``ticket`` may run in the engine (at once if its tenant is under its quota); a
        preempted ticket enters again the same way, from its old place."""
        if ticket.place == "":
            self._hold(ticket)
            self._settle(weights)
        while ticket.place != "engine":  # (let in, then preempted again before it woke: wait on)
            ticket.turn = asyncio.get_running_loop().create_future()
            try:
                await ticket.turn  # ``_settle`` moves it into the engine before it wakes
            except BaseException:
                self.leave(ticket, weights)  # held: given up; let in: give its place on
                raise
        ticket.preempted = False

    def leave(self, ticket: Ticket, weights: Mapping[str, float]) -> None:
        """``ticket``'s request is over, or given up."""
        if ticket.place == "engine":
            self.in_engine[ticket.tenant].discard(ticket)
            self.last_busy[ticket.tenant] = self.clock()
        elif ticket.place == "held":
            self.held[ticket.tenant].remove(ticket)
        ticket.place = ""
        self._settle(weights)

    def _hold(self, ticket: Ticket) -> None:
        tenant = ticket.tenant
        if tenant not in self.present():  # back after idling: level with the least served, no credit
            self.served[tenant] = max(self.served.get(tenant, 0.0),
                                      min((self.served.get(t, 0.0) for t in self.present()), default=0.0))
        bisect.insort(self.held.setdefault(tenant, []), ticket)
        ticket.place = "held"

    def _settle(self, weights: Mapping[str, float]) -> None:
        """Preempt who runs over its quota, then let in held requests while quotas allow."""
        running, held = self.running, self.waiting()
        demand = {t: running.get(t, 0) + held.get(t, 0) for t in set(running) | set(held)}
        quotas = running_quotas(demand, self.present(), weights, self.bound)
        for tenant, count in preempted(running, quotas).items():
            for ticket in sorted(self.in_engine[tenant], reverse=True)[:count]:  # lowest rank, latest first
                self.in_engine[tenant].discard(ticket)
                self._hold(ticket)
                ticket.preempted = True
                if ticket.stop is not None:
                    ticket.stop()
        while (tenant := next_turn(self.waiting(), self.running, quotas, self.served)) is not None:
            ticket = self.held[tenant].pop(0)
            self.in_engine.setdefault(tenant, set()).add(ticket)
            ticket.place = "engine"
            self.served[tenant] = self.served.get(tenant, 0.0) + ticket.cost / weights.get(tenant, 1.0)
            if ticket.turn is not None and not ticket.turn.done():
                ticket.turn.set_result(None)
