"""Rollout's reaction to a policy announcement (the pure core of its handler), case by case."""

import msgspec
import pytest

from marlaas.platform.events import JobRecord, JobSpec, JobState
from services.rollout.announcements import Plan, Reaction, plan_announcement

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
