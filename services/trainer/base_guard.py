"""The trainer's guard of the shared base and of on-policy training: the IO around ``gap_watch``.

After a step and before its commit, ``after_step`` decides (``gap_watch.GapWatch``) whether the
version may be committed: not when the base's weights changed during the job's first step in
this process (the job is failed, the base reloaded), nor when the batch's engine-vs-trainer
logprob gap is past its bound (the job is failed, or on a platform fault the base is reloaded and
the batch put back). ``watch`` compares the base with its digest on a schedule as well. Each finding
is an operator alert (``telemetry.raise_alert``).
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
        self.stepped: set[str] = set()  # jobs with a step in this process (their first one was checked)

    def first_step_changed_base(self, job: str) -> bool:
        """In the training thread, right after ``job``'s step (lock held): whether this was the job's
        first step in this process and the base no longer matches its digest."""
        if job in self.stepped:
            return False
        self.stepped.add(job)
        return self.policy.base_changed()

    async def after_step(self, job: str, version: int, on_policy: bool, metrics: dict[str, float],
                         changed_base: bool, deliveries: list[Delivery]) -> bool:
        """Whether ``job``'s step to ``version`` + 1 may be committed. If not, its batch (its
        ``deliveries``) is terminated and the job failed, or put back after a reload of the base."""
        if changed_base:
            await self.reload("base_changed", job, version, found_by="first step")
            await self.refuse(job, version, deliveries, "the shared base model's weights changed during this job's "
                              "first step (no job may change them): the job is failed and the base reloaded")
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
            for delivery in deliveries:  # trained again, on the base as loaded
                with contextlib.suppress(Exception):
                    await delivery.nak(0.5)
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
