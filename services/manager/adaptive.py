"""Adaptive admission: admit another job only while engine and trainer have idle time (pure core).

The KV budget says what *fits*; it does not say what *helps*. Past the point where the
engine is saturated, every job admitted stretches every running job's time per step
(TPTS) and adds no throughput. This policy, the MARLaaS paper's stated future work,
admits queued jobs one at a time, each after the last one has settled (taken its
first steps, so its effect is visible), and only while

- the engine's busy fraction over the recent window is under ``target_engine_busy``,
- the trainers' busy fraction (train spans, per trainer replica seen) is under
  ``target_trainer_busy``: a saturated trainer makes every added job wait in its queue, and
- no running job's time per step so far (its TPTS) exceeds ``target_tpts_s`` (if set).

It never preempts: a job once admitted runs to its end. The KV budget still applies.
"""

from __future__ import annotations

import time
from collections import deque

from marlaas.platform.events import JobRecord, JobState

WINDOW_S = 10.0  # the engine's busy fraction is judged over this much recent time
SETTLE_STEPS = 2  # a newly admitted job must commit this many versions before the next admission
SETTLE_MAX_S = 60.0  # ... or this much time must pass (a job stuck in a long first step)


class AdaptiveAdmission:
    """How many of the queued jobs to admit now, from engine and trainer utilization and running jobs' TPTS."""

    def __init__(self, target_engine_busy: float, target_tpts_s: float = 0.0,
                 target_trainer_busy: float = 1.0) -> None:
        self.target_engine_busy = target_engine_busy
        self.target_tpts_s = target_tpts_s
        self.target_trainer_busy = target_trainer_busy
        self._windows: deque[tuple[float, float, float]] = deque()  # (start, end, busy seconds)
        self._train_steps: deque[tuple[float, float, str]] = deque()  # (start, end, trainer replica)
        self._last_admission: tuple[str, float] | None = None  # (job, when)

    def observe_engine(self, start: float, end: float, busy_s: float) -> None:
        """A ``utilization`` span from rollout: the engine was busy ``busy_s`` of [start, end]."""
        self._windows.append((start, end, busy_s))
        while self._windows and self._windows[0][1] < end - WINDOW_S * 3:
            self._windows.popleft()

    def observe_train(self, start: float, end: float, replica: str) -> None:
        """A ``train`` span: one trainer replica updated a job over [start, end]."""
        self._train_steps.append((start, end, replica))
        while self._train_steps and self._train_steps[0][1] < end - WINDOW_S * 3:
            self._train_steps.popleft()

    def trainer_busy(self, now: float) -> float:
        """The trainers' busy fraction over the last ``WINDOW_S``, per replica seen there (0 if none)."""
        since = now - WINDOW_S
        recent = [(max(start, since), min(end, now), replica) for start, end, replica in self._train_steps
                  if end > since]
        if not recent:
            return 0.0
        replicas = len({replica for _, _, replica in recent})
        return sum(max(end - start, 0.0) for start, end, _ in recent) / (WINDOW_S * replicas)

    def engine_busy(self, now: float) -> float | None:
        """The busy fraction over the last ``WINDOW_S``; None before anything was observed."""
        recent = [w for w in self._windows if w[1] >= now - WINDOW_S]
        span = sum(end - start for start, end, _ in recent)
        return sum(busy for _, _, busy in recent) / span if span > 0 else None

    def settled(self, records: list[JobRecord], now: float) -> bool:
        if self._last_admission is None:
            return True
        job, when = self._last_admission
        record = next((r for r in records if r.spec.id == job), None)
        return (record is None or record.state.finished or record.version >= SETTLE_STEPS
                or now - when >= SETTLE_MAX_S)

    def slots(self, records: list[JobRecord], now: float | None = None) -> int:
        """0 or 1: whether one more queued job may be admitted now."""
        now = time.time() if now is None else now
        running = [r for r in records if r.state is JobState.RUNNING]
        if not running:
            return 1  # an idle system admits its first job at once
        if not self.settled(records, now):
            return 0
        if self.target_tpts_s and any((r.tpts_s or 0.0) > self.target_tpts_s for r in running):
            return 0
        if self.trainer_busy(now) >= self.target_trainer_busy:
            return 0
        busy = self.engine_busy(now)
        return 1 if busy is not None and busy < self.target_engine_busy else 0

    def admitted(self, job: str, now: float | None = None) -> None:
        self._last_admission = (job, time.time() if now is None else now)
