"""Reward computation: score a batch of completions with their task's verifier, or with a
built-in answer matcher the job names (pure core)."""

from __future__ import annotations

import math

from marlaas.platform.events import RewardRequest, RewardResult
from marlaas.platform.files import DataFiles
from marlaas.tasks import Task, TaskError, get_task
from marlaas.tasks.matchers import Matcher


class RewardBook:
    """Builds each (tenant, task, dataset, corpus) once and scores requests against it. A job's
    uploaded files (``file-...``) are read through ``files``, among its own tenant's only."""

    def __init__(self, files: DataFiles | None = None) -> None:
        self.files = files
        self._tasks: dict[tuple[str, str, str | None, str | None], Task] = {}

    def task(self, name: str, dataset: str | None, corpus: str | None = None, tenant: str = "") -> Task:
        key = (tenant, name, dataset, corpus)
        if key not in self._tasks:
            if self.files is None:
                self._tasks[key] = get_task(name, dataset, corpus)
            else:
                self._tasks[key] = self.files.task(tenant, name, dataset, corpus)
        return self._tasks[key]

    def score(self, request: RewardRequest) -> RewardResult:
        """Rewards in [0, 1] for every item, or an error naming what went wrong."""
        try:
            task = self.task(request.task, request.dataset or None, request.corpus or None, request.tenant)
            rewards = [float(task.reward(item.problem, item.completion)) for item in request.items]
        except (TaskError, KeyError, TypeError, ValueError) as exc:
            return RewardResult(error=f"task {request.task!r} could not score job {request.job}: {exc}")
        return checked(rewards, f"task {request.task!r}")


def score_matched(name: str, matcher: Matcher, request: RewardRequest) -> RewardResult:
    """Rewards of every item by the built-in matcher ``name``, or an error naming the item and the fix."""
    rewards = []
    for position, item in enumerate(request.items):
        try:
            rewards.append(float(matcher(item.problem, item.completion)))
        except (TaskError, TypeError, ValueError) as exc:
            return RewardResult(error=f"reward {name!r} could not score item {position} of job {request.job}: {exc}")
    return checked(rewards, f"reward {name!r}")


def checked(rewards: list[float], what: str) -> RewardResult:
    bad = [r for r in rewards if not (math.isfinite(r) and 0.0 <= r <= 1.0)]
    if bad:
        return RewardResult(error=f"{what} returned rewards outside [0, 1]: {bad[:3]}")
    return RewardResult(rewards=rewards)
