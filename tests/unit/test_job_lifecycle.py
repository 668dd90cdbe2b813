"""The job registry's pure record changes (``services.manager.lifecycle``): state changes, a
committed version's figures, and which finished jobs a tenant's bound deletes. No broker."""

from __future__ import annotations

import msgspec

from marlaas.platform.events import Blob, JobRecord, JobSpec, JobState, PolicyCommitted
from services.manager.lifecycle import moved, oldest_beyond, progressed

RECORD = JobRecord(spec=JobSpec(id="acme.run-1", tenant="acme", name="run", task="addition", steps=3))


def committed(version: int, **metrics: float) -> PolicyCommitted:
    return PolicyCommitted(job="acme.run-1", version=version, adapter=Blob(uri="file:///a", sha256="0"),
                           metrics=metrics, committed_at=100.0 + version)


def test_a_state_change_sets_the_reason_fields_and_the_finish_time():
    running = moved(RECORD, JobState.RUNNING, "", {"admitted_at": 5.0}, now=7.0)
    assert running.state is JobState.RUNNING and running.admitted_at == 5.0 and running.finished_at == 0.0
    failed = moved(running, JobState.FAILED, "trainer: out of memory", {}, now=9.0)
    assert failed.state is JobState.FAILED and failed.reason == "trainer: out of memory" and failed.finished_at == 9.0


def test_a_finished_job_and_a_repeated_state_do_not_change():
    assert moved(RECORD, JobState.QUEUED, "again", {}, now=1.0) is None
    cancelled = moved(RECORD, JobState.CANCELLED, "cancelled by user", {}, now=1.0)
    assert moved(cancelled, JobState.RUNNING, "", {}, now=2.0) is None
    assert moved(cancelled, JobState.FAILED, "late", {}, now=2.0) is None


def test_a_committed_version_records_its_reward_agent_metrics_and_times():
    v0 = progressed(RECORD, committed(0))
    assert v0.version == 0 and v0.rewards == [] and v0.first_commit_at == 0.0 and v0.last_commit_at == 100.0
    v1 = progressed(v0, committed(1, **{"reward/mean": 0.5, "tool/calls": 2.0, "loss": 0.1}))
    assert v1.version == 1 and v1.rewards == [0.5] and v1.metrics == {"tool/calls": [2.0]}
    assert v1.first_commit_at == 101.0 and v1.last_commit_at == 101.0
    v2 = progressed(v1, committed(2, **{"reward/mean": 0.7, "episode/turns": 3.0}))
    assert v2.rewards == [0.5, 0.7] and v2.metrics == {"tool/calls": [2.0], "episode/turns": [3.0]}
    assert v2.first_commit_at == 101.0 and v2.last_commit_at == 102.0


def test_the_staleness_of_each_trained_batch_is_shown_for_a_job_that_allows_it():
    strict = progressed(progressed(RECORD, committed(0)), committed(1, **{"reward/mean": 0.5, "staleness": 0.0}))
    assert strict.metrics == {}
    grpo = msgspec.structs.replace(RECORD.spec.grpo, max_staleness=1)
    stale = msgspec.structs.replace(RECORD, spec=msgspec.structs.replace(RECORD.spec, grpo=grpo))
    v1 = progressed(progressed(stale, committed(0)), committed(1, **{"reward/mean": 0.5, "staleness": 0.0}))
    v2 = progressed(v1, committed(2, **{"reward/mean": 0.6, "staleness": 1.0}))
    assert v2.metrics == {"staleness": [0.0, 1.0]}


def test_a_repeated_announcement_changes_nothing():
    v1 = progressed(progressed(RECORD, committed(0)), committed(1, **{"reward/mean": 0.5}))
    assert progressed(v1, committed(1, **{"reward/mean": 0.5})) is None
    assert progressed(v1, committed(0)) is None


def test_the_oldest_finished_jobs_beyond_the_bound_go():
    finished = [(3.0, "a.c"), (1.0, "a.a"), (2.0, "a.b"), (4.0, "a.d")]
    assert oldest_beyond(finished, 2) == [(1.0, "a.a"), (2.0, "a.b")]
    assert oldest_beyond(finished, 5) == []
