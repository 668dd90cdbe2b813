"""Whose python run goes next: concurrent sandbox runs capped per tenant and per replica, shared by weight.

Each run is a bwrap process tree with up to ``env.python_memory_mb`` of its own, so runs at once
are what a replica's memory must hold: one job once had 119 (issue 35, F6). A replica (the
``sandbox`` service, or env with ``env.python_tool = "env"``) therefore runs at most
``env.python_max_runs`` at once, at most ``env.python_max_runs_per_tenant`` of them one tenant's.
A call past a cap waits in its tenant's queue; when a slot frees, :func:`next_turn` (pure) gives
it to the waiting tenant with the fewest runs going for its weight (``marlaas tenant set NAME
--weight W``; runs going divided by the weight, a tenant without a record weighing 1), the one
served longest ago first among equals (issue 40). Two tenants of weights 3 and 1 that keep calls
waiting hold runs 3:1, each still under its own cap; a tenant alone takes every slot up to its
cap; with equal weights it is the fewest runs going, as before. So a tenant with a long queue
takes its turn like any other and never starves the rest.

The weights are read at most every :data:`WEIGHTS_EVERY_S` while calls come, beside the calls
(a call never waits on the read; a failed read keeps the last weights): env reads the tenants
bucket; the ``sandbox`` service, whose broker user reaches no JetStream, the weights the manager
broadcasts (``marlaas.platform.tenants.SharesHeard``).

A call waits at most ``env.python_queue_timeout_s``; then it is answered with
:class:`SandboxBusy` (the run never started), which the model reads as the tool's error: queued
longer, its answer would come after rollout's own deadline (``rollout.tool_timeout_s``) and be
thrown away, while the run still took a slot. The run's own ``env.python_timeout_s`` starts
when it gets its slot.

The tenant of a call is the first part of its job id (``<tenant>.<name>-<hex>``, set by rollout,
the only caller: a tenant cannot publish on ``marlaas.tool.builtin.*``); :class:`TenantTaggingBus`
notes it for each request in :data:`CALLING_TENANT`, which the python tool reads.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass

import msgspec
import structlog

from services.env.tools.python_sandbox import SandboxError

log = structlog.get_logger("env.tools.sandbox_turns")
CALLING_TENANT: ContextVar[str] = ContextVar("calling_tenant", default="")
WEIGHTS_EVERY_S = 5.0  # the tenants' weights are read again this often (while calls come)
WeightsReader = Callable[[], Awaitable[Mapping[str, float]]]  # every tenant's weight, e.g. tenants.tenant_weights


class SandboxBusy(SandboxError):
    """No slot freed for a call within its wait: the run was not started."""


@dataclass(frozen=True)
class RunCaps:
    """How many runs a replica holds at once, in all and per tenant, and how long a call waits."""

    max_runs: int = 8
    max_runs_per_tenant: int = 4
    queue_timeout_s: float = 4.0


def next_turn(waiting: Mapping[str, int], running: Mapping[str, int], last_turn: Mapping[str, int],
              caps: RunCaps, weights: Mapping[str, float] | None = None) -> str | None:
    """The tenant whose oldest waiting call runs now, or None (every slot taken, or no tenant with
    a call waiting is under its own cap): the one with the fewest runs going for its weight.
    ``waiting``/``running``: calls per tenant; ``last_turn``: when each tenant was last given a
    slot (a counter; absent = never), which breaks ties; ``weights``: each tenant's share (absent
    or None: 1)."""
    if sum(running.values()) >= caps.max_runs:
        return None
    eligible = [t for t, n in waiting.items() if n > 0 and running.get(t, 0) < caps.max_runs_per_tenant]
    if not eligible:
        return None
    weights = weights or {}
    return min(eligible, key=lambda t: (running.get(t, 0) / weights.get(t, 1.0), last_turn.get(t, -1), t))


class RunTurns:
    """The slots of one replica (the shell around :func:`next_turn`). ``running`` and ``peak``
    say how many runs hold a slot now and at most so far; ``weights`` are the tenants' shares,
    read through ``read_weights`` at most every :data:`WEIGHTS_EVERY_S` (None: all weigh 1)."""

    def __init__(self, caps: RunCaps = RunCaps(), read_weights: WeightsReader | None = None) -> None:
        self.caps = caps
        self.queues: dict[str, collections.deque[asyncio.Future]] = collections.defaultdict(collections.deque)
        self.running: collections.Counter[str] = collections.Counter()
        self.last_turn: dict[str, int] = {}
        self.turns = 0
        self.peak = 0
        self.read_weights = read_weights
        self.weights: dict[str, float] = {}
        self.weights_at: float | None = None  # when the last read began (monotonic); None: never
        self.reading: asyncio.Task | None = None

    @contextlib.asynccontextmanager
    async def slot(self, tenant: str):
        """Hold one of ``tenant``'s run slots for the ``async with`` body; :class:`SandboxBusy`
        if none is free within ``caps.queue_timeout_s``."""
        self._refresh_weights()
        granted = asyncio.get_running_loop().create_future()
        self.queues[tenant].append(granted)
        self._grant()
        try:  # shielded: a grant that lands as the wait ends must not be lost with the slot taken
            await asyncio.wait_for(asyncio.shield(granted), self.caps.queue_timeout_s)
        except BaseException as exc:
            if granted.done():
                self._release(tenant)
            else:
                granted.cancel()
                self._forget(tenant, granted)
            if isinstance(exc, TimeoutError):
                raise SandboxBusy(
                    f"the python sandbox is busy: no run slot freed within {self.caps.queue_timeout_s:g} s "
                    f"({self.running[tenant]} of your runs going, {len(self.queues.get(tenant, ()))} more "
                    f"waiting; at most {self.caps.max_runs_per_tenant} per tenant): the code was not run, "
                    "call the tool again") from None
            raise
        try:
            yield
        finally:
            self._release(tenant)

    def _grant(self) -> None:
        while (tenant := next_turn({t: len(q) for t, q in self.queues.items()}, self.running,
                                   self.last_turn, self.caps, self.weights)) is not None:
            self.queues[tenant].popleft().set_result(None)
            if not self.queues[tenant]:
                del self.queues[tenant]
            self.running[tenant] += 1
            self.turns += 1
            self.last_turn[tenant] = self.turns
            self.peak = max(self.peak, sum(self.running.values()))

    def _release(self, tenant: str) -> None:
        self.running[tenant] -= 1
        if self.running[tenant] <= 0:
            del self.running[tenant]
        self._grant()

    def _refresh_weights(self) -> None:
        """Start reading the weights again if the last read began ``WEIGHTS_EVERY_S`` ago and is done:
        beside the call, which is granted by the weights already known."""
        if self.read_weights is None or (self.reading is not None and not self.reading.done()):
            return
        if self.weights_at is not None and time.monotonic() - self.weights_at < WEIGHTS_EVERY_S:
            return
        self.weights_at = time.monotonic()
        self.reading = asyncio.get_running_loop().create_task(self._read_weights(self.read_weights))

    async def _read_weights(self, read: WeightsReader) -> None:
        try:
            self.weights = dict(await read())
        except Exception as exc:  # tolerated: the bucket unreadable a moment, the last weights hold
            log.warning("reading the tenants' weights failed; the last ones hold", error=repr(exc),
                        weights=self.weights)

    def _forget(self, tenant: str, granted: asyncio.Future) -> None:
        queue = self.queues.get(tenant)
        if queue is not None:
            with contextlib.suppress(ValueError):
                queue.remove(granted)
            if not queue:
                del self.queues[tenant]


class _CallJob(msgspec.Struct):
    job: str = ""


def tenant_of_call(data: bytes) -> str:
    """The tenant whose job made the tool call ``data`` (its job id's first part); "" if none."""
    try:
        job = msgspec.json.decode(data, type=_CallJob).job
    except msgspec.DecodeError:  # answered as undecodable by the tool's shell
        return ""
    return job.partition(".")[0] if "." in job else ""


class TenantTaggingBus:
    """``bus`` for :func:`marlaas.tools.serve_tools`, except that each request it serves first
    sets :data:`CALLING_TENANT` (the bus runs each request as a task of its own, so the value is
    that request's alone)."""

    def __init__(self, bus) -> None:
        self.bus = bus

    def __getattr__(self, name: str):
        return getattr(self.bus, name)

    async def serve(self, subject: str, queue: str, answer: Callable[[bytes], Awaitable[bytes]]):
        async def tagged(data: bytes) -> bytes:
            CALLING_TENANT.set(tenant_of_call(data))
            return await answer(data)

        return await self.bus.serve(subject, queue, tagged)
