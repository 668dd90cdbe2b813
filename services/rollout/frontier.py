"""Frontier-group dispatch (``rollout.dispatch = "frontier"``): the engine serves first the
requests of the batches, and within a batch the groups, closest to complete.

A pure count per batch: each request asks for a priority when it is submitted (every turn of an
episode is a request), lower first, as vLLM's priority scheduler orders its waiting queue. With
groups trained as they complete (``grpo.pipeline = "groups"``) the trainer gets its next group,
and its next step, sooner; under ``"fifo"`` (vLLM's first come, first served) every request has
the same priority and none of this is consulted.
"""

from __future__ import annotations

from collections.abc import Callable


class Frontier:
    """The episodes still running in one batch, per group."""

    def __init__(self, groups: int, group_size: int) -> None:
        self.group_size = group_size
        self.left = [group_size] * groups

    def priority(self, group: int) -> int:
        """The priority of a request of ``group`` now: the batch's episodes still running first
        (fewer: served sooner), then the group's own."""
        return sum(self.left) * (self.group_size + 1) + self.left[group]

    def of(self, group: int) -> Callable[[], int]:
        """``priority`` for ``group``, asked again at each of an episode's turns."""
        return lambda: self.priority(group)

    def done(self, group: int) -> None:
        """One episode of ``group`` ended."""
        self.left[group] = max(0, self.left[group] - 1)
