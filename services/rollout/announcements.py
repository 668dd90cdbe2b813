"""What rollout does with a policy-committed announcement: the pure core of its handler.

An announcement can arrive more than once (a redelivery after a lost ack, a restarted
trainer re-announcing, a copy past the broker's duplicate window) and out of order (an
older version after a newer one). Rollout samples a version only while it is the job's
committed version and no batch of it has been published or is being sampled, so each
version is sampled once whatever the broker delivers (invariant 1, the consumer's half).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from marlaas.platform.events import JobRecord, JobState


class Reaction(enum.Enum):
    """What the announcement asks of rollout."""

    SAMPLE = "sample"  # the committed version, not sampled yet: sample its batch
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
    version, the last version rollout published a batch of (-1: none) and whether this
    (job, version) is being sampled by this process right now."""
    spec = record.spec
    last = version >= spec.steps
    evaluate_final = (last and spec.eval_every > 0 and committed_version == version
                      and record.state in (JobState.RUNNING, JobState.COMPLETED))
    if record.state.finished or last:
        return Plan(Reaction.FORGET, evaluate_final)
    if committed_version != version:
        return Plan(Reaction.OLD)
    if sampling_now or sampled_version >= version:
        return Plan(Reaction.REPEAT)
    return Plan(Reaction.SAMPLE)
