"""What the trainer does with a trajectory batch: the pure core of its handler.

A batch can arrive for a job the platform no longer knows, for a finished job, sampled
from a version that is no longer the committed one (strict on-policy: never trained), or
again after it was trained and committed but before its ack (a crash, a lost ack): then
the commit stands and only its announcement may be missing, so it is announced again and
the batch acked, not trained twice. Only a batch of the committed version is trained.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from marlaas.platform.events import CommittedVersion, JobState, TrajectoryReady


class BatchAction(enum.Enum):
    """What the batch asks of the trainer."""

    TRAIN = "train"  # of the committed version: train it, commit v+1, announce, ack
    DROP_UNKNOWN = "drop-unknown"  # no record or no committed version: terminate
    DROP_FINISHED = "drop-finished"  # the job is completed, failed or cancelled: terminate
    DROP_OFF_POLICY = "drop-off-policy"  # sampled from another version than the committed one: terminate
    REANNOUNCE = "reannounce"  # this batch made the committed version: announce it again, ack
    WAIT = "wait"  # of a later step, within the job's max_staleness: delivered again once its turn comes

    @property
    def drops(self) -> bool:
        """Whether the batch is terminated untrained."""
        return self.name.startswith("DROP_")


@dataclass(frozen=True)
class BatchPlan:
    """The action, and the line to log for it (none for TRAIN and REANNOUNCE)."""

    action: BatchAction
    level: str = ""  # the structlog method: "error", "warning" or "info"
    message: str = ""
    fields: dict[str, Any] = field(default_factory=dict)


def plan_batch(event: TrajectoryReady, state: JobState | None, committed: CommittedVersion | None,
               max_staleness: int = 0) -> BatchPlan:
    """The plan for ``event``, given the job's state and committed version (both None when the
    job is unknown: its record or its ``versions`` entry is missing). ``event.version`` is the
    step the batch trains (the version it is trained from); with ``max_staleness`` k >= 1 rollout
    samples up to k steps ahead of the committed version, and a batch of a later step than the
    committed one can arrive before the one in between is trained (a trainer restarted with a
    batch in progress): it waits its turn."""
    job = event.job
    if state is None or committed is None:
        return BatchPlan(BatchAction.DROP_UNKNOWN, "error", "batch for an unknown job; terminated",
                         {"job": job, "batch_id": event.batch_id})
    if state.finished:
        return BatchPlan(BatchAction.DROP_FINISHED, "info", "batch of a finished job; dropped",
                         {"job": job, "state": state.value})
    if event.version == committed.version:
        return BatchPlan(BatchAction.TRAIN)
    if committed.version == event.version + 1 and committed.batch_id == event.batch_id:
        return BatchPlan(BatchAction.REANNOUNCE)  # committed, but the announcement may be lost
    if 0 < event.version - committed.version <= max_staleness:
        return BatchPlan(BatchAction.WAIT, "info", "batch of a later step; waiting for its turn",
                         {"job": job, "batch_version": event.version, "committed_version": committed.version})
    return BatchPlan(BatchAction.DROP_OFF_POLICY, "warning", "off-policy batch terminated",
                     {"job": job, "batch_version": event.version, "committed_version": committed.version,
                      "batch_id": event.batch_id})


def may_commit(state: JobState | None) -> bool:
    """Whether an update trained for a job may be committed, given the job's state read after the
    step (None: the job is gone): not if it finished (was cancelled, say) while the step ran."""
    return state is not None and not state.finished


class GroupAction(enum.Enum):
    """What a group of a pipelined batch (``grpo.pipeline = "groups"``) asks of the trainer, once
    ``plan_batch`` said TRAIN (it is of the committed version)."""

    ADD = "add"  # a group not yet in the batch in progress: add its gradients and hold it unacked
    START_OVER = "start-over"  # no batch in progress, or it is gone (of another version, or its
    # gradients lost with an evicted adapter): release what it holds, begin anew with this group
    SAME_MESSAGE = "same-message"  # delivered again (its ack timer ran out): hold the new delivery
    COPY = "copy"  # a second copy of a group already added (a rollout sampled the batch again): ack it


def plan_group(group: int, sequence: int, pending_version: int | None, version: int,
               held: dict[int, int], accumulated: set[int] | None) -> GroupAction:
    """The action for ``group`` (stream sequence ``sequence``) of ``version``'s batch, given the
    batch in progress: its version (None: none), the sequence of each group it holds, and the
    groups whose gradients the trainer's memory holds for the job (None: no batch begun there)."""
    if pending_version is None or pending_version != version or accumulated != set(held):
        return GroupAction.START_OVER
    if group not in held:
        return GroupAction.ADD
    return GroupAction.SAME_MESSAGE if held[group] == sequence else GroupAction.COPY


def batch_whole(held: dict[int, int], groups: int) -> bool:
    """Whether every group of the batch is in (groups are numbered 0..groups-1)."""
    return len(held) == groups and set(held) == set(range(groups))


def staleness_problem(step: int, sampled_version: int, max_staleness: int) -> str:
    """Why a batch for ``step`` sampled by ``sampled_version`` must not be trained ("" if it may):
    its sampler more than ``max_staleness`` versions behind, or ahead of, the version it trains."""
    if sampled_version < 0:
        return ""  # no record of its sampler (not from rollout): the audit has the last word
    staleness = step - sampled_version
    if staleness < 0:
        return f"batch for step {step} claims to be sampled by version {sampled_version}, which is not committed yet"
    if staleness > max_staleness:
        return (f"batch for step {step} was sampled by version {sampled_version}, {staleness} behind: more than "
                f"grpo.max_staleness = {max_staleness}; dropped, not trained")
    return ""


def objective_problem(task: str, objective: str) -> str:
    """Why a batch with ``objective`` does not suit a job of ``task`` ("" if it does): an ``sft``
    job trains supervised batches only, any other job GRPO batches only."""
    expected = "sft" if task == "sft" else "grpo"
    if objective == expected:
        return ""
    return f"a {objective!r} batch reached a job of task {task!r}, which trains {expected!r} batches; not trained"
