"""What the manager makes of a job's events: policy commits, failure and warning reports, evaluations.

Each committed version is recorded in the job's record (``lifecycle.progressed``: version,
rewards, TTFS and TPTS); the last one completes the job and starts its follow-up (``then``), if
it has one. Every few versions, and at the end, the job's stored objects no version needs are
collected (``gc``); the last commit is acknowledged only once that is done. A failure report
fails the job, a warning report sets (or clears) one of its warnings, an evaluation adds a
point to its record. Rollout's and the trainers' spans feed the adaptive admission policy.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec
import structlog

from marlaas.platform import api
from marlaas.platform.bus import Delivery
from marlaas.platform.events import (
    JOB,
    METRIC,
    POLICY,
    EvalPoint,
    EventDecodeError,
    JobEvaluated,
    JobFailureReported,
    JobSpec,
    JobState,
    JobWarningReported,
)
from services.manager.adaptive import AdaptiveAdmission
from services.manager.gc import JobCollections, acknowledge_collected
from services.manager.lifecycle import JobRegistry, progressed, with_warning

log = structlog.get_logger("manager")
GC_EVERY = 5  # versions between garbage collections of a job's stored objects


class JobEvents:
    """The manager's handlers of the POLICY stream's commits, the JOBS stream's reports and the spans."""

    def __init__(self, jobs: JobRegistry, collections: JobCollections,
                 submit: Callable[[bytes], Awaitable[api.SubmitReply]], adaptive: AdaptiveAdmission | None) -> None:
        self.jobs, self.collections, self.submit, self.adaptive = jobs, collections, submit, adaptive

    async def on_policy(self, delivery: Delivery) -> None:
        """A committed version: record it; the last one completes the job (and starts its follow-up)."""
        event = POLICY.decode(delivery.data)
        record = await self.jobs.update(event.job, lambda r: progressed(r, event))
        if record is None:  # a repeat: still finish what a crash may have left unfinished
            record = await self.jobs.read(event.job)
        last = record is not None and record.version >= record.spec.steps
        if last:
            await self.jobs.transition(event.job, JobState.COMPLETED)
            if record.spec.then and not record.followed_by:
                await self.start_follow_up(record.spec)
        # collect every few versions (each pass re-reads the job's announcements) and at the end
        if record is None or not (last or event.version % GC_EVERY == 0):
            return
        passes = self.collections.request(event.job)
        if last:
            delivery.defer()
            self.jobs.in_background(acknowledge_collected(delivery, event.job, passes))

    async def start_follow_up(self, spec: JobSpec) -> None:
        """Submit the job ``spec.then`` describes, from ``spec``'s last version, and note it in the
        finished job's record (its id, or why it was refused). A repeat (a redelivered last commit)
        answers the same job: the submission's idempotency key is the finished job's."""
        tree = api.follow_up_tree(msgspec.json.decode(spec.then), spec.tenant, spec.id)
        reply = await self.submit(msgspec.json.encode(tree))
        if reply.id:
            log.info("follow-up job started", job=spec.id, follow_up=reply.id)
            await self.jobs.update(spec.id, lambda r: None if r.followed_by == reply.id else
                                   msgspec.structs.replace(r, followed_by=reply.id))
        else:
            log.warning("follow-up job refused", job=spec.id, error=reply.error)
            reason = f"its follow-up ('then') was not started: {reply.error}"
            await self.jobs.update(spec.id, lambda r: msgspec.structs.replace(r, reason=reason))

    async def on_span(self, msg) -> None:
        """Rollout's engine utilization and the trainers' steps, for the adaptive admission policy."""
        try:
            event = METRIC.decode(msg.data)
        except EventDecodeError:
            return  # telemetry: a record we cannot read is skipped
        if event.phase == "utilization":
            self.adaptive.observe_engine(event.start, event.end, float(event.attrs.get("engine_busy_s", 0.0)))
        elif event.phase == "train" and event.service == "trainer":
            self.adaptive.observe_train(event.start, event.end, str(event.attrs.get("pid", "")))

    async def on_job_event(self, delivery: Delivery) -> None:
        """A failure report fails the job; a warning report sets one of its warnings; an evaluation adds a point."""
        event = JOB.decode(delivery.data)
        if isinstance(event, JobFailureReported):
            await self.jobs.transition(event.job, JobState.FAILED, f"{event.service}: {event.reason}")
        elif isinstance(event, JobWarningReported):
            await self.jobs.update(event.job, lambda r: with_warning(r, event))
        elif isinstance(event, JobEvaluated):
            await self.jobs.update(event.job, lambda r: None if any(e.version == event.version for e in r.evals) else
                                   msgspec.structs.replace(r, evals=[*r.evals, EvalPoint(version=event.version,
                                                                                          score=event.score)]))
