"""What rollout does with a policy-committed announcement: the pure core of its handler.

An announcement can arrive more than once (a redelivery after a lost ack, a restarted
trainer re-announcing, a copy past the broker's duplicate window) and out of order (an
older version after a newer one). Rollout samples a version only while it is the job's
committed version and no batch of it has been published or is being sampled, so each
version is sampled once whatever the broker delivers (invariant 1, the consumer's half).

With bounded staleness (``grpo.max_staleness`` = k) batches are numbered by the step they
train, and the batch of step s may be sampled by the committed version v while s <= v + k:
an announcement of v samples the job's next unsampled step if it is within that bound (and
rollout then keeps sampling ahead, :func:`next_step`). At k = 0 the next step is v itself.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from marlaas.platform.events import JobRecord, JobState


class Reaction(enum.Enum):
    """What the announcement asks of rollout."""

    SAMPLE = "sample"  # a step within the committed version's bound is not sampled yet: sample it
    # with the committed version (the announced one, but at bounded staleness)
    FORGET = "forget"  # the job is finished or this is its last version: free what it holds
    OLD = "old"  # a newer version is committed: this announcement is history
    REPEAT = "repeat"  # the current version again: its batch is published or being sampled


@dataclass(frozen=True)
class Plan:
    reaction: Reaction
    evaluate_final: bool = False  # score the job's last version (then forget it)


def plan_announcement(version: int, record: JobRecord, committed_version: int,
                      sampled_version: int, sampling_now: bool) -> Plan:
    """The reaction to an announcement of ``version``, given the job's record, its committed
    version, the last step rollout published a batch of (-1: none) and whether the job's next
    step (``sampled_version + 1``) is being sampled by this process right now."""
    spec = record.spec
    last = version >= spec.steps
    evaluate_final = (last and spec.eval_every > 0 and committed_version == version
                      and record.state in (JobState.RUNNING, JobState.COMPLETED))
    if record.state.finished or last:
        return Plan(Reaction.FORGET, evaluate_final)
    k = spec.grpo.max_staleness
    if committed_version != version and not k:
        return Plan(Reaction.OLD)
    if sampling_now or next_step(sampled_version, committed_version, spec.steps, k) is None:
        return Plan(Reaction.REPEAT if committed_version == version else Reaction.OLD)
    # at k >= 1 an older announcement still samples what is due (with the committed version): the
    # newer one may have been acked while this one's handler was sampling ahead, then died
    return Plan(Reaction.SAMPLE)


def published_through(recorded: int, committed_version: int) -> int:
    """The last step whose batch is published, from the step rollout ``recorded`` as published and
    the job's committed version: every step before the committed version was trained, so its batch
    was out whatever the record says. The record lags a moment after a batch's last group is out
    (the trainer may take it, train and commit before the sampler writes it), and a second replica
    reads it meanwhile: an announcement read against the lagging record alone would look like a
    repeat of the step being sampled (acked, and the job would never sample again) or ask for an
    old step again."""
    return max(recorded, committed_version - 1)


def next_step(sampled: int, committed_version: int, steps: int, max_staleness: int) -> int | None:
    """The step whose batch to sample next, with the committed version, or None: every step up to
    ``committed_version + max_staleness`` (and short of ``steps``) is sampled already."""
    step = sampled + 1
    return step if step <= committed_version + max_staleness and step < steps else None
