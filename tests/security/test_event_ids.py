"""A job's server-sent event ids count the job's own messages only: they reveal nothing of
other tenants' activity (stream sequence numbers would: their gaps are everyone else's
messages), and resuming from any of them is still exact. Against a real nats-server."""

from __future__ import annotations

import time

import pytest

from marlaas.platform.bus import JOBS_BUCKET
from marlaas.platform.events import (
    Blob,
    JobEvaluated,
    JobFailureReported,
    JobRecord,
    JobSpec,
    JobState,
    JobStateChanged,
    JobSubmitted,
    PolicyCommitted,
    encode,
)
from marlaas.sdk.http import parse_sse
from services.gateway.event_stream import job_events, parse_event_id

pytestmark = pytest.mark.timeout(120)
JOB, RIVAL = "acme.job-1a2b3c", "rival.job-9z9z9z"


def spec(job: str) -> JobSpec:
    return JobSpec(id=job, tenant=job.split(".")[0], name="job", task="addition", steps=2, submitted_at=time.time())


def committed(job: str, version: int) -> PolicyCommitted:
    return PolicyCommitted(job=job, version=version, adapter=Blob(uri=f"file:///a/{job}/{version}", sha256="0" * 64))


async def rival_activity(bus, count: int) -> None:
    """Another tenant's job, busy: its messages take stream sequence numbers in both streams."""
    for version in range(count):
        await bus.publish(f"marlaas.policy.committed.{RIVAL}", encode(committed(RIVAL, version)))
        await bus.publish(f"marlaas.job.state.{RIVAL}", encode(JobStateChanged(job=RIVAL, state=JobState.RUNNING)))


async def events_of(bus, last_event_id: str | None = None) -> list:
    chunks = [chunk async for chunk in job_events(bus, "acme", JOB, parse_event_id(last_event_id))]
    return list(parse_sse(iter(b"".join(chunks).decode().split("\n"))))


@pytest.fixture
async def finished_job(bus):
    """acme's job, its messages interleaved with a rival's many: JOBS gets submitted, running, a
    failure report (not shown), a score and completed; POLICY versions 0, 1 and 2."""
    await rival_activity(bus, 20)
    await bus.publish(f"marlaas.job.submitted.{JOB}", encode(JobSubmitted(spec=spec(JOB))))
    await bus.publish(f"marlaas.job.state.{JOB}", encode(JobStateChanged(job=JOB, state=JobState.RUNNING)))
    for version in range(3):
        await rival_activity(bus, 7)
        await bus.publish(f"marlaas.policy.committed.{JOB}", encode(committed(JOB, version)))
    await bus.publish(f"marlaas.job.failure.{JOB}", encode(JobFailureReported(job=JOB, service="env", reason="x")))
    await rival_activity(bus, 5)
    await bus.publish(f"marlaas.job.eval.{JOB}", encode(JobEvaluated(job=JOB, version=2, score=0.5)))
    await bus.publish(f"marlaas.job.state.{JOB}", encode(JobStateChanged(job=JOB, state=JobState.COMPLETED)))
    await bus.kv_put(JOBS_BUCKET, JOB, encode(JobRecord(spec=spec(JOB), state=JobState.COMPLETED, version=2,
                                                        finished_at=time.time())))


async def test_event_ids_count_the_jobs_own_messages_whatever_others_do(bus, finished_job):
    events = await events_of(bus)
    ids = [tuple(map(int, e.id.split("-"))) for e in events]
    # each event's own stream's part is its place among the job's messages of that stream
    assert [(e.data["version"], i[0]) for e, i in zip(events, ids) if e.event == "policy.committed"] == [
        (0, 1), (1, 2), (2, 3)]
    assert [(e.event, i[1]) for e, i in zip(events, ids) if e.event != "policy.committed"] == [
        ("job.state", 2), ("job.eval", 4), ("job.state", 5)]  # 1: submitted, 3: the failure report
    assert all(a[0] <= b[0] and a[1] <= b[1] for a, b in zip(ids, ids[1:]))  # both parts only grow
    assert ids[-1] == (3, 5)  # the rival's 60-odd messages in each stream are nowhere to be seen


async def test_resuming_from_any_event_id_sends_each_event_once_in_order(bus, finished_job):
    full = await events_of(bus)
    assert len(full) == 6
    for i, event in enumerate(full):
        rest = await events_of(bus, event.id)
        for kind in ("policy.committed", "job.state", "job.eval"):
            assert [e.data for e in full[:i + 1] + rest if e.event == kind] == [
                e.data for e in full if e.event == kind], (event.id, kind)
    assert await events_of(bus, full[-1].id) == []  # resumed at the end: nothing more
