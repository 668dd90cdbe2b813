"""The trainer's guard of the shared base and of on-policy training: the IO around ``gap_watch``.

After a step and before its commit, ``after_step`` decides (``gap_watch.GapWatch``) whether the
version may be committed: not when the base's weights changed by the job's first step since the
base was loaded (the base is reloaded and the batch put back; the second time, the job fails),
nor when the batch's engine-vs-trainer logprob gap is past its bound (the job is failed, or on a
platform fault the base is reloaded and the batch put back). ``watch`` compares the base with its
digest on a schedule as well. Each finding is an operator alert (``telemetry.raise_alert``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog

from marlaas.platform.bus import Bus, Delivery
from marlaas.platform.commits import report_failure
from marlaas.platform.telemetry import PLATFORM_JOB, raise_alert
from marlaas.platform.usage import tenant_of
from services.trainer.gap_watch import GapWatch, Verdict
from services.trainer.policy import PolicyTrainer

log = structlog.get_logger("trainer")
SERVICE = "trainer"


class BaseGuard:
    """Checks each step before its commit, and the base on a schedule (see the module docstring)."""

    def __init__(self, bus: Bus, policy: PolicyTrainer, gaps: GapWatch | None) -> None:
        self.bus, self.policy, self.gaps = bus, policy, gaps  # gaps None: no gap is acted on
        self.stepped: set[str] = set()  # jobs with a step since the base was (re)loaded: their first was checked
        self.suspected: set[str] = set()  # jobs after whose first step the base was found changed once

    def forget(self, job: str) -> None:
        """``job`` finished: nothing of it is kept."""
        self.stepped.discard(job)
        self.suspected.discard(job)

    async def first_step_changed_base(self, job: str) -> bool:
        """Right after ``job``'s step: whether it was the job's first since the base was loaded and
        the base no longer matches its digest. Read outside the policy's lock (the base is read
        only: other jobs' steps and Tinker requests go on meanwhile)."""
        if job in self.stepped:
            return False
        self.stepped.add(job)
        return await asyncio.to_thread(self.policy.base_changed)

    async def after_step(self, job: str, version: int, on_policy: bool, metrics: dict[str, float],
                         changed_base: bool, deliveries: list[Delivery]) -> bool:
        """Whether ``job``'s step to ``version`` + 1 may be committed. If not, its batch (its
        ``deliveries``) is terminated and the job failed, or put back after a reload of the base.

        A base found changed after a job's first step is not yet the job's fault (whatever ran since
        the last check may have changed it): the base is reloaded and the batch put back. Found
        changed after that job's first step on the reloaded base too, it is: the job fails."""
        if changed_base:
            if job in self.suspected:
                await self.refuse(job, version, deliveries, "the shared base model's weights changed during this "
                                  "job's first step, twice (no job may change them): the job is failed and the "
                                  "base reloaded")
                await self.reload("base_changed", job, version, found_by="first step, again")
            else:
                self.suspected.add(job)
                await self.reload("base_changed", job, version, found_by="first step")
                await self.put_back(deliveries)
            return False
        gap = metrics.get("logprob_gap") if on_policy else None
        if self.gaps is None or not self.gaps.over(gap):
            return True
        changed = await asyncio.to_thread(self.policy.base_changed)
        verdict = self.gaps.judge(gap, tenant_of(job), time.time(), changed)
        await raise_alert(self.bus, SERVICE, "logprob_gap", job, version, gap=gap, bound=self.gaps.bound,
                          verdict=verdict.value, base="changed" if changed else "as loaded")
        if verdict is Verdict.RELOAD_BASE:
            await self.reload("base_changed" if changed else "logprob_gap", job, version, found_by="logprob gap")
            await self.put_back(deliveries)
            return False
        await self.refuse(job, version, deliveries,
                          f"engine-vs-trainer logprob gap {gap:.3g} > {self.gaps.bound:.3g} on a batch sampled by "
                          "the version it trains: the engine did not serve the weights the trainer holds, so the "
                          "batch was not trained (an operator alert was raised)")
        return False

    async def refuse(self, job: str, version: int, deliveries: list[Delivery], reason: str) -> None:
        """Fail ``job`` with ``reason``; its batch is never trained (and its stepped adapter dropped)."""
        self.policy.evict(job)
        log.error("job failed", job=job, version=version, reason=reason)
        await report_failure(self.bus, job, SERVICE, reason, version)
        for delivery in deliveries:
            with contextlib.suppress(Exception):
                await delivery.term()

    async def put_back(self, deliveries: list[Delivery]) -> None:
        """The batch is trained again (delivered again), on the base as loaded."""
        for delivery in deliveries:
            with contextlib.suppress(Exception):
                await delivery.nak(0.5)

    async def reload(self, alert: str, job: str, version: int, **attrs) -> None:
        """Load the base again (every hot job dropped, to be loaded from its committed version)."""
        if alert == "base_changed":
            await raise_alert(self.bus, SERVICE, alert, job, version, **attrs)
        dropped = await asyncio.to_thread(self.policy.reload_base)
        self.stepped.clear()
        log.warning("base reloaded", cause=alert, job=job, hot_jobs_dropped=len(dropped))

    async def watch(self, stop: asyncio.Event, every_s: float) -> None:
        """Compare the base with its digest every ``every_s`` (0: never) until ``stop``."""
        while every_s > 0 and not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)
                return
            if await asyncio.to_thread(self.policy.base_changed):
                await self.reload("base_changed", PLATFORM_JOB, -1, found_by="schedule")
