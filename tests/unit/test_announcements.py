"""Rollout's reaction to a policy announcement (the pure core of its handler), case by case."""

import msgspec
import pytest

from marlaas.platform.events import JobRecord, JobSpec, JobState
from services.rollout.announcements import Plan, Reaction, next_step, plan_announcement, published_through

SPEC = JobSpec(id="acme.j", tenant="acme", name="j", task="addition", steps=5)


def record(state: JobState = JobState.RUNNING, eval_every: int = 0) -> JobRecord:
    return JobRecord(spec=msgspec.structs.replace(SPEC, eval_every=eval_every), state=state)


@pytest.mark.parametrize("version,committed,sampled,sampling,expected", [
    (2, 2, 1, False, Reaction.SAMPLE),  # the committed version, not sampled yet
    (2, 2, 2, False, Reaction.REPEAT),  # sampled already (a restarted trainer re-announced it)
    (2, 2, 1, True, Reaction.REPEAT),  # being sampled by this process right now
    (1, 2, 1, False, Reaction.OLD),  # an older announcement after a newer one
    (1, 2, 0, False, Reaction.OLD),  # ... even if its batch was never recorded as sampled
    (5, 5, 4, False, Reaction.FORGET),  # the last version: nothing more to sample
])
def test_a_running_job_s_announcements(version, committed, sampled, sampling, expected):
    assert plan_announcement(version, record(), committed, sampled, sampling) == Plan(expected)


@pytest.mark.parametrize("state", [JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED])
def test_a_finished_job_is_forgotten_whatever_is_announced(state):
    assert plan_announcement(2, record(state), 2, 1, False).reaction is Reaction.FORGET


def test_the_last_version_is_evaluated_once_committed_unless_the_job_failed_or_was_cancelled():
    evaluated = record(eval_every=2)
    assert plan_announcement(5, evaluated, 5, 4, False) == Plan(Reaction.FORGET, evaluate_final=True)
    assert plan_announcement(5, record(JobState.COMPLETED, eval_every=2), 5, 4, False).evaluate_final
    assert not plan_announcement(5, record(JobState.CANCELLED, eval_every=2), 5, 4, False).evaluate_final
    assert not plan_announcement(4, evaluated, 5, 4, False).evaluate_final  # not the last version
    assert not plan_announcement(5, record(), 5, 4, False).evaluate_final  # no evaluations asked for


def stale_record(max_staleness: int) -> JobRecord:
    spec = msgspec.structs.replace(SPEC, grpo=msgspec.structs.replace(SPEC.grpo, max_staleness=max_staleness))
    return JobRecord(spec=spec, state=JobState.RUNNING)


@pytest.mark.parametrize("committed,sampled,k,expected", [
    (2, 1, 0, 2),  # strictly on-policy: the committed version's own step
    (2, 2, 0, None),  # ... sampled already
    (2, 2, 1, 3),  # one step ahead, sampled by version 2 while the trainer trains step 2
    (2, 3, 1, None),  # two ahead: beyond the bound
    (2, 3, 2, 4),
    (3, 4, 4, None),  # the job has 5 steps (0..4): none left to sample
])
def test_the_next_step_to_sample_stays_within_the_bound(committed, sampled, k, expected):
    assert next_step(sampled, committed, SPEC.steps, k) == expected


def test_an_announcement_samples_ahead_only_within_the_jobs_bound():
    assert plan_announcement(2, stale_record(1), 2, 2, False) == Plan(Reaction.SAMPLE)  # step 3 by v2
    assert plan_announcement(2, stale_record(1), 2, 3, False) == Plan(Reaction.REPEAT)
    assert plan_announcement(2, stale_record(1), 2, 2, True) == Plan(Reaction.REPEAT)  # step 3 underway


def test_an_older_announcement_samples_what_is_due_at_bounded_staleness():
    """A handler sampling ahead with version 2 died; version 3's announcement was acked meanwhile
    (step 4 was underway): the redelivered older one must sample step 4, or the job stalls."""
    assert plan_announcement(2, stale_record(1), 3, 3, False) == Plan(Reaction.SAMPLE)
    assert plan_announcement(2, stale_record(1), 3, 4, False) == Plan(Reaction.OLD)


def test_a_lagging_record_of_the_step_being_sampled_does_not_hide_the_next_announcement():
    """Step 2's last group is out and trained, version 3 committed and announced, before the sampler
    has recorded step 2 (the record says 1, and (job, 2) is still being sampled): the announcement
    of 3 must sample step 3, not pass for a repeat of step 2 (acked, the job stalled at version 3,
    as a CI chaos run saw), nor ask for step 2 again (another replica reading the lagging record)."""
    sampled = published_through(1, 3)
    assert sampled == 2 and next_step(sampled, 3, 5, 0) == 3
    sampling_step_3 = False  # (job, sampled + 1) in the sampling set: step 2's sampler is not step 3's
    assert plan_announcement(3, record(), 3, sampled, sampling_step_3) == Plan(Reaction.SAMPLE)
    # the plan as it read the record alone: a repeat (the stall)
    assert plan_announcement(3, record(), 3, 1, True) == Plan(Reaction.REPEAT)
    assert published_through(4, 3) == 4  # a record ahead (bounded staleness) is kept
    assert published_through(-1, 0) == -1  # nothing published, version 0 committed
