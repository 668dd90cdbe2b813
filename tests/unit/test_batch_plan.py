"""The trainer's plan for a trajectory batch (the pure core of its handler), case by case."""

import pytest

from marlaas.platform.events import Blob, CommittedVersion, JobState, TrajectoryReady
from services.trainer.batch_plan import BatchAction, BatchPlan, may_commit, plan_batch

JOB = "acme.j"


def batch(version: int, batch_id: str = "b-new") -> TrajectoryReady:
    return TrajectoryReady(job=JOB, version=version, batch_id=batch_id)


def committed(version: int, batch_id: str = "b-old") -> CommittedVersion:
    """Version ``version`` of the job, made by the batch ``batch_id``."""
    return CommittedVersion(job=JOB, version=version, adapter=Blob(uri=f"file:///a/{version}", sha256="0"),
                            batch_id=batch_id)


def test_a_batch_of_the_committed_version_is_trained():
    assert plan_batch(batch(3), JobState.RUNNING, committed(3)) == BatchPlan(BatchAction.TRAIN)


@pytest.mark.parametrize("state,version", [(None, None), (JobState.RUNNING, None), (None, 3)])
def test_a_batch_of_an_unknown_job_is_terminated(state, version):
    """No record, no ``versions`` entry, or neither: the platform does not know the job."""
    plan = plan_batch(batch(3), state, None if version is None else committed(version))
    assert plan == BatchPlan(BatchAction.DROP_UNKNOWN, "error", "batch for an unknown job; terminated",
                             {"job": JOB, "batch_id": "b-new"})
    assert plan.action.drops


@pytest.mark.parametrize("state", [JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED])
def test_a_batch_of_a_finished_job_is_dropped_whatever_its_version(state):
    for version in (2, 3, 4):
        plan = plan_batch(batch(version), state, committed(3))
        assert plan == BatchPlan(BatchAction.DROP_FINISHED, "info", "batch of a finished job; dropped",
                                 {"job": JOB, "state": state.value})
        assert plan.action.drops


@pytest.mark.parametrize("version,made_by", [
    (2, "b-old"),  # older than the committed version, by a batch other than this one
    (1, "b-new"),  # made v2 from this batch id, but the committed version is v3: not its commit
    (4, "b-old"),  # newer than the committed version (sampled from a version lost since)
    (4, "b-new"),
])
def test_a_batch_of_another_version_is_terminated_untrained(version, made_by):
    plan = plan_batch(batch(version), JobState.RUNNING, committed(3, made_by))
    assert plan == BatchPlan(BatchAction.DROP_OFF_POLICY, "warning", "off-policy batch terminated",
                             {"job": JOB, "batch_version": version, "committed_version": 3, "batch_id": "b-new"})
    assert plan.action.drops


def test_a_batch_that_made_the_committed_version_is_announced_again_not_trained_again():
    """Trained and committed, then the trainer crashed before its ack: announce v+1 again and ack."""
    plan = plan_batch(batch(2), JobState.RUNNING, committed(3, "b-new"))
    assert plan == BatchPlan(BatchAction.REANNOUNCE)
    assert not plan.action.drops


def test_a_queued_job_s_batch_is_planned_like_a_running_one():
    assert plan_batch(batch(0), JobState.QUEUED, committed(0)).action is BatchAction.TRAIN


def test_only_the_drops_are_terminated():
    assert {a for a in BatchAction if a.drops} == {
        BatchAction.DROP_UNKNOWN, BatchAction.DROP_FINISHED, BatchAction.DROP_OFF_POLICY}


@pytest.mark.parametrize("state,expected", [
    (JobState.RUNNING, True),
    (JobState.QUEUED, True),
    (None, False),  # the job's record or committed version vanished while it trained
    (JobState.COMPLETED, False),
    (JobState.FAILED, False),
    (JobState.CANCELLED, False),  # cancelled while it trained: the update is discarded
])
def test_an_update_is_committed_only_while_its_job_is_unfinished(state, expected):
    assert may_commit(state) is expected
