"""The trainer's plan for a trajectory batch (the pure core of its handler), case by case."""

import pytest

from marlaas.platform.events import Blob, CommittedVersion, JobState, TrajectoryReady
from services.trainer.batch_plan import (
    BatchAction,
    BatchPlan,
    GroupAction,
    batch_whole,
    may_commit,
    plan_batch,
    plan_group,
    staleness_problem,
)

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


# --- the groups of a pipelined batch (grpo.pipeline = "groups") --------------------------------


def test_the_first_group_of_a_version_begins_its_batch():
    assert plan_group(0, 10, None, 3, {}, None) is GroupAction.START_OVER


def test_a_new_group_joins_the_batch_in_progress():
    assert plan_group(2, 12, 3, 3, {0: 10, 1: 11}, {0, 1}) is GroupAction.ADD


def test_a_redelivered_group_replaces_its_held_delivery_and_is_not_added_again():
    assert plan_group(1, 11, 3, 3, {0: 10, 1: 11}, {0, 1}) is GroupAction.SAME_MESSAGE


def test_a_second_copy_of_an_added_group_is_acked_not_added():
    """A rollout that samples the batch again past the broker's duplicate window publishes the
    group anew (another stream sequence): one of the two is trained, never both."""
    assert plan_group(1, 57, 3, 3, {0: 10, 1: 11}, {0, 1}) is GroupAction.COPY


@pytest.mark.parametrize("pending_version,held,accumulated", [
    (2, {0: 10}, {0}),  # a batch of the previous version is still held
    (3, {0: 10, 1: 11}, None),  # the adapter was evicted: its gradients are gone
    (3, {0: 10, 1: 11}, {0}),  # memory holds other groups than the ones held
])
def test_a_batch_whose_gradients_are_not_all_in_memory_starts_over(pending_version, held, accumulated):
    assert plan_group(2, 12, pending_version, 3, held, accumulated) is GroupAction.START_OVER


def test_a_batch_is_whole_with_every_group_numbered_once():
    assert batch_whole({0: 1, 1: 2, 2: 3}, 3)
    assert not batch_whole({0: 1, 2: 3}, 3)
    assert not batch_whole({0: 1, 1: 2, 5: 3}, 3)


# --- bounded staleness (grpo.max_staleness) ------------------------------------------------------


@pytest.mark.parametrize("ahead,max_staleness,action", [
    (1, 1, BatchAction.WAIT), (2, 2, BatchAction.WAIT),
    (2, 1, BatchAction.DROP_OFF_POLICY), (1, 0, BatchAction.DROP_OFF_POLICY),
])
def test_a_batch_of_a_later_step_waits_only_within_the_bound(ahead, max_staleness, action):
    plan = plan_batch(batch(3 + ahead), JobState.RUNNING, committed(3), max_staleness)
    assert plan.action is action


def test_a_batch_sampled_too_far_behind_is_refused_with_the_bound_named():
    assert staleness_problem(5, 5, 0) == staleness_problem(5, 4, 1) == staleness_problem(5, 3, 2) == ""
    assert "2 behind: more than grpo.max_staleness = 1" in staleness_problem(5, 3, 1)
    assert "not committed yet" in staleness_problem(5, 6, 2)
    assert staleness_problem(5, -1, 0) == ""  # no sampler recorded: the audit decides


def test_a_batch_must_carry_the_objective_its_job_trains():
    from services.trainer.batch_plan import objective_problem

    assert objective_problem("addition", "grpo") == "" and objective_problem("sft", "sft") == ""
    assert "which trains 'grpo' batches" in objective_problem("addition", "sft")
    assert "which trains 'sft' batches" in objective_problem("sft", "grpo")
