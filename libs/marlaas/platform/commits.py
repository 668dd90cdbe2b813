"""Announcing committed policy versions (invariant 1's last step), shared by manager and trainer."""

from __future__ import annotations

import time
from dataclasses import dataclass

from marlaas.platform import subjects
from marlaas.platform.bus import JOBS_BUCKET, VERSIONS_BUCKET, Bus
from marlaas.platform.events import (
    COMMITTED,
    JOB_RECORD,
    CommittedVersion,
    JobFailureReported,
    JobRecord,
    JobWarningReported,
    PolicyCommitted,
    encode,
)
from marlaas.platform.limits import cut


async def announce(bus: Bus, committed: CommittedVersion) -> bool:
    """Publish policy-committed for ``committed`` with ``Nats-Msg-Id = <job>:<version>``.

    Safe to repeat: the POLICY stream drops a repeat inside its duplicate window,
    and consumers ignore announcements older than the job's committed version.
    """
    return await bus.publish(subjects.policy_committed(committed.job), encode(to_announcement(committed)),
                             msg_id=f"{committed.job}:{committed.version}")


def to_announcement(committed: CommittedVersion) -> PolicyCommitted:
    """The policy-committed announcement of ``committed``."""
    return PolicyCommitted(job=committed.job, version=committed.version, adapter=committed.adapter,
                           batch_id=committed.batch_id, metrics=committed.metrics,
                           committed_at=committed.committed_at)


@dataclass(frozen=True)
class JobSnapshot:
    """A job's record and committed version as read together, with the version's KV revision."""

    record: JobRecord
    committed: CommittedVersion
    revision: int  # of the ``versions`` entry: the compare-and-set commits against it


async def read_job(bus: Bus, job: str) -> JobSnapshot | None:
    """The job's record and committed version, or None if either is missing (an unknown job)."""
    record = await bus.kv_get(JOBS_BUCKET, job)
    committed = await bus.kv_get(VERSIONS_BUCKET, job)
    if record is None or committed is None:
        return None
    return JobSnapshot(JOB_RECORD.decode(record.value), COMMITTED.decode(committed.value), committed.revision)


async def report_warning(bus: Bus, job: str, service: str, key: str, warning: str) -> None:
    """Show ``warning`` in ``job``'s status under ``key`` (an empty one clears it)."""
    event = JobWarningReported(job=job, service=service, key=key, warning=warning, at=time.time())
    await bus.publish(subjects.job_warning(job), encode(event))


async def report_failure(bus: Bus, job: str, service: str, reason: str, version: int = -1) -> None:
    """Tell the manager that ``job`` (and only it) failed in ``service``; it marks the job failed."""
    event = JobFailureReported(job=job, service=service, reason=cut(reason), version=version)
    await bus.publish(subjects.job_failure(job), encode(event))
