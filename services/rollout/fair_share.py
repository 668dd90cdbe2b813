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
step: the tags order only what *waits*, and with free KV cache nothing does. With
``rollout.fair_share_running`` = R, :class:`RunningShares` holds requests back before vLLM: once
R requests run, a tenant at its weighted share of R (among the tenants with requests in) waits for
one of its own to finish, so while several tenants are busy their running requests, and tokens,
follow the weights; a tenant alone, or below its share, is never held (work-conserving up to R).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter, deque

from marlaas.platform.api import PRIORITIES

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


def may_run(tenant: str, running: dict[str, int], waiting: dict[str, int], weights: dict[str, float],
            bound: int) -> bool:
    """Whether a request of ``tenant`` may go into the engine now: fewer than ``bound`` run, it is
    the only tenant with requests in, or it runs fewer than its weighted share of ``bound`` among
    the tenants with requests running or waiting (itself included)."""
    if sum(running.values()) < bound:
        return True
    active = {t for t, n in running.items() if n > 0} | {t for t, n in waiting.items() if n > 0} | {tenant}
    if active == {tenant}:
        return True  # alone: all of it
    share = bound * weights.get(tenant, 1.0) / sum(weights.get(t, 1.0) for t in active)
    return running.get(tenant, 0) < max(share, 1.0)


class RunningShares:
    """The requests in the engine per tenant, and those held back (:func:`may_run`), woken in the
    order of the least running for its weight."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.running: Counter[str] = Counter()
        self.held: dict[str, deque[asyncio.Future]] = {}

    def waiting(self) -> dict[str, int]:
        return {t: len(q) for t, q in self.held.items() if q}

    async def enter(self, tenant: str, weights: dict[str, float]) -> None:
        if not self.held.get(tenant) and may_run(tenant, self.running, self.waiting(), weights, self.bound):
            self.running[tenant] += 1
            return
        turn = asyncio.get_running_loop().create_future()
        self.held.setdefault(tenant, deque()).append(turn)
        try:
            await turn  # ``leave`` counts it running before it wakes
        except BaseException:
            if turn.done() and not turn.cancelled():
                self.leave(tenant, weights)  # woken, then cancelled: give its place on
            elif turn in self.held.get(tenant, ()):
                self.held[tenant].remove(turn)
            raise

    def leave(self, tenant: str, weights: dict[str, float]) -> None:
        self.running[tenant] -= 1
        if self.running[tenant] <= 0:
            del self.running[tenant]
        while True:  # wake who may run now, the least running for its weight first
            queued = sorted((t for t, q in self.held.items() if q),
                            key=lambda t: (self.running.get(t, 0) / weights.get(t, 1.0), t))
            woken = next((t for t in queued if may_run(t, self.running, self.waiting(), weights, self.bound)), None)
            if woken is None:
                return
            turn = self.held[woken].popleft()
            if not turn.done():
                self.running[woken] += 1
                turn.set_result(None)
