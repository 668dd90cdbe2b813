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
"""

from __future__ import annotations

import itertools

TAG_SCALE = 1000  # vLLM's priorities are integers: tags in thousandths of a token


class FairShare:
    """The tenants' virtual clocks in one engine."""

    def __init__(self) -> None:
        self.finish: dict[str, float] = {}  # tenant -> the finish tag of its last request
        self.in_engine: dict[int, float] = {}  # request -> its start tag
        self.served = 0.0  # the system's virtual time when nothing is in the engine
        self._ids = itertools.count(1)

    def now(self) -> float:
        return min(self.in_engine.values(), default=self.served)

    def admit(self, tenant: str, cost: float, weight: float) -> tuple[int, int]:
        """A request of ``tenant`` costing ``cost`` tokens: (its id, its vLLM priority)."""
        start = max(self.finish.get(tenant, 0.0), self.now())
        self.finish[tenant] = start + cost / weight
        request = next(self._ids)
        self.in_engine[request] = start
        return request, int(start * TAG_SCALE)

    def done(self, request: int) -> None:
        start = self.in_engine.pop(request, None)
        if start is not None:
            self.served = max(self.served, start)
