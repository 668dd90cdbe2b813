"""Announcing committed policy versions (invariant 1's last step), shared by manager and trainer."""

from __future__ import annotations

from marlaas.bus import Bus
from marlaas.events import CommittedVersion, PolicyCommitted, encode


def policy_subject(job: str) -> str:
    return f"marlaas.policy.committed.{job}"


async def announce(bus: Bus, committed: CommittedVersion) -> bool:
    """Publish policy-committed for ``committed`` with ``Nats-Msg-Id = <job>:<version>``.

    Safe to repeat: the POLICY stream drops a repeat inside its duplicate window,
    and consumers ignore announcements older than the job's committed version.
    """
    event = PolicyCommitted(job=committed.job, version=committed.version, adapter=committed.adapter,
                            batch_id=committed.batch_id, metrics=committed.metrics,
                            committed_at=committed.committed_at)
    return await bus.publish(policy_subject(committed.job), encode(event),
                             msg_id=f"{committed.job}:{committed.version}")
