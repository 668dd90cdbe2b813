"""The ``sync`` schedule's rounds: every running job samples, a global barrier, then all train.

This is the synchronous multi-LoRA baseline of the MARLaaS paper, run by the same
services as ``async``. Rollout holds each job's announcement until every running job
has one (or ``limit`` are held, so more jobs than rollout's concurrency cannot
deadlock): then the round is released and its jobs sample together in the one
engine. No batch is published until every member of the round has sampled, so the
trainer starts the round's updates only after all its generation is done, and no
job of the round announces its next version before the trainer has taken the round.
A new round therefore starts only when every job has trained: sampling and training
never overlap, the cost the ``async`` schedule removes.

A job that leaves the registry's running set (finished, cancelled, failed) stops
counting at the next check; a member whose sampling fails leaves its round, so the
others publish without it. A job submitted moments ago and still queued counts too
(:func:`round_members`): jobs submitted together are admitted one by one, and without
it the first one admitted would sample a round alone while the others catch up, one
extra round for the whole run.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import structlog

from marlaas.platform.events import JobRecord, JobState

log = structlog.get_logger("rollout.rounds")

ADMITTING_S = 10.0  # a job queued this recently is most likely being admitted: a round waits for it


def round_members(records: list[JobRecord], now: float, admitting_s: float = ADMITTING_S) -> set[str]:
    """The jobs a round waits for: the running ones, and the queued ones submitted in the last
    ``admitting_s`` seconds. A job queued longer (waiting for KV budget) is not waited for, so
    a round waits for a fresh submission at most that long."""
    return {r.spec.id for r in records
            if r.state is JobState.RUNNING
            or (r.state is JobState.QUEUED and now - r.spec.submitted_at < admitting_s)}


class Round:
    """The jobs released together; each marks itself sampled, and publishes once all have."""

    def __init__(self, number: int, members: set[str]) -> None:
        self.number = number
        self.waiting = set(members)  # members that have not sampled (or left) yet
        self._all_sampled = asyncio.Event()
        if not self.waiting:
            self._all_sampled.set()

    def leave(self, job: str) -> None:
        self.waiting.discard(job)
        if not self.waiting:
            self._all_sampled.set()

    async def sampled(self, job: str) -> None:
        """``job`` has its batch: wait until every other member has too (the barrier)."""
        self.leave(job)
        await self._all_sampled.wait()


class SyncRounds:
    """Forms rounds from the jobs whose announcements rollout is holding."""

    def __init__(self, members: Callable[[], Awaitable[set[str]]], limit: int,
                 recheck_s: float = 0.5) -> None:
        self.members = members  # the ids of the jobs a round waits for (see round_members)
        self.limit = limit  # at most this many announcements can be held at once
        self.recheck_s = recheck_s
        self.rounds = 0
        self._held: dict[str, asyncio.Future] = {}
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def member(self, job: str):
        """Wait for ``job``'s round to be released; yield it; leave it however the body ends."""
        released = asyncio.get_running_loop().create_future()
        self._held[job] = released
        try:
            while not released.done():
                await self._maybe_release()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(released), self.recheck_s)
        finally:
            if self._held.get(job) is released:
                del self._held[job]
        round_ = released.result()
        try:
            yield round_
        finally:
            round_.leave(job)

    async def _maybe_release(self) -> None:
        async with self._lock:
            held = {job for job, f in self._held.items() if not f.done()}
            if not held:
                return
            members = await self.members()
            if not (members <= held or len(held) >= self.limit):
                return  # a member is still sampling, training its previous version or being admitted
            self.rounds += 1
            round_ = Round(self.rounds, held)
            for job in held:
                self._held[job].set_result(round_)
            log.info("round released", round=self.rounds, jobs=len(held))
