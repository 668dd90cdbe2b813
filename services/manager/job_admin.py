"""The manager's tenant-facing job administration: quotas, pinning versions, deleting a job.

The manager stays the only writer of job records, so these run here (``marlaas.api.pin``,
``marlaas.api.delete``) and not in the gateway; the quota is checked here too, inside the
manager's submission lock, so gateway replicas cannot race past it. For the same reason the
gateway's Tinker API records sessions and models through the manager (``marlaas.api.tinker_session``,
``marlaas.api.tinker_model``): a tenant's live Tinker models count against ``max_jobs`` beside its
jobs, and its live sessions against ``manager.max_tinker_sessions``, each counted and taken in one
step under that lock (issue 35, F5: 24 concurrent ``create_model`` calls had made 24 models
against a quota of 8).

Deleting a job removes everything of it: the job record and ``versions`` entry (with
their history), its adapters, optimizer states and trajectory blobs in the object
store, and its messages in the JOBS, POLICY, TRAJ and METRICS streams. An unfinished job
is cancelled first; work already in flight for it (a trainer's update, a rollout batch)
may still write an object or two after that, so the same sweep runs again a little later.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import msgspec
import structlog

from marlaas.platform import api, subjects
from marlaas.platform import tinker_records as tinker
from marlaas.platform.bus import JOBS_BUCKET, SAMPLED_BUCKET, TINKER_BUCKET, VERSIONS_BUCKET, Bus
from marlaas.platform.events import JOB_RECORD, JobRecord, JobSpec, JobState
from marlaas.platform.store import ObjectStore
from marlaas.platform.tenants import get_tenant

if TYPE_CHECKING:
    from services.manager.service import Manager

log = structlog.get_logger("manager")
OBJECT_KINDS = ("adapters", "optimizer", "trajectories")  # <kind>/<job>/... in the object store
RESWEEP_AFTER_S = (5.0, 30.0)  # in-flight work of a just-cancelled job may still land a write


def job_subjects(job: str) -> tuple[tuple[str, str], ...]:
    """(stream, subject) of every message the system keeps about ``job``."""
    return (("JOBS", subjects.job_events(job)), ("POLICY", subjects.policy_committed(job)),
            ("TRAJ", subjects.trajectory_ready(job)), ("METRICS", subjects.span(job)))


async def read_record(bus: Bus, job: str, tenant: str = "") -> JobRecord | None:
    """The job's record; None when missing or (with ``tenant``) owned by another tenant."""
    entry = await bus.kv_get(JOBS_BUCKET, job)
    record = JOB_RECORD.decode(entry.value) if entry else None
    if record is None or (tenant and record.spec.tenant != tenant):
        return None
    return record


def no_job(job: str) -> str:
    return f"no job {job!r}; `marlaas list` shows your jobs"


SUBMIT_AGAIN = "wait for one to finish or cancel one (`marlaas cancel JOB`), then submit again"
CREATE_MODEL_AGAIN = ("finish a Tinker session (close its ServiceClient) or cancel a job (`marlaas cancel JOB`), "
                      "then create the model again")


async def quota_refusal(bus: Bus, tenant: str, unfinished_jobs: list[JobRecord], then: str = SUBMIT_AGAIN) -> str:
    """Why ``tenant`` may not add a job or a Tinker model now ("" = it may): it has ``max_jobs``
    queued or running jobs and live Tinker models (``unfinished_jobs``: every tenant's, from the
    manager's index); ``then`` says what to do about it.

    A tenant without a record (jobs submitted straight over NATS by internal tools) is not limited.
    """
    record = await get_tenant(bus, tenant)
    if record is None:
        return ""
    unfinished = sum(job.spec.tenant == tenant for job in unfinished_jobs)
    models = await tinker.active_models(bus, tenant) if unfinished < record.max_jobs else 0
    if unfinished + models < record.max_jobs:
        return ""
    also = f" and {models} Tinker models in live sessions" if models else ""
    return (f"tenant {tenant!r} already has {unfinished} jobs queued or running{also}, its quota (max_jobs = "
            f"{record.max_jobs}): {then}")


class LiveSessions:
    """Each tenant's Tinker sessions not known to have finished: the ids, built by one scan of the
    ``tinker`` bucket on first use and kept by the manager, which records every new session; each
    count re-reads the tenant's own sessions only (however many other tenants' the bucket holds)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._ids: dict[str, set[str]] | None = None

    async def count(self, tenant: str, now: float | None = None) -> int:
        """``tenant``'s live sessions (``marlaas.platform.tinker_records.is_live``); finished ones leave the index."""
        now = time.time() if now is None else now
        if self._ids is None:
            self._ids = {}
            for session_key in await self.bus.kv_keys(TINKER_BUCKET, under="session"):
                entry = await self.bus.kv_get(TINKER_BUCKET, session_key)
                session = msgspec.json.decode(entry.value, type=tinker.TinkerSession) if entry else None
                if session is not None and not session.finished:
                    self._ids.setdefault(session.tenant, set()).add(session.id)
        live = 0
        for session_id in sorted(self._ids.get(tenant, ())):
            session = await tinker.read(self.bus, "session", session_id, tinker.TinkerSession)
            if session is None or session.finished:
                self._ids[tenant].discard(session_id)
            else:
                live += tinker.is_live(session, now)
        return live

    def add(self, session: tinker.TinkerSession) -> None:
        if self._ids is not None:
            self._ids.setdefault(session.tenant, set()).add(session.id)


async def create_tinker_session(manager: Manager, data: bytes) -> api.TinkerReply:
    """Record a new Tinker session unless its tenant already has ``manager.max_tinker_sessions``
    live ones (HTTP 429)."""
    session = msgspec.json.decode(data, type=api.TinkerSessionRequest).session
    limit = manager.config.manager.max_tinker_sessions
    async with manager.submitting_lock:
        live = await manager.sessions.count(session.tenant)
        if live >= limit:
            return api.TinkerReply(code=api.QUOTA, error=(
                f"tenant {session.tenant!r} already has {live} live Tinker sessions, the most a tenant may hold "
                f"(manager.max_tinker_sessions = {limit}): close a ServiceClient you no longer use (its session "
                f"ends), or wait {tinker.SESSION_LIVE_S:.0f} s for a silent one to lapse, then create it again"))
        await tinker.write(manager.bus, "session", session.id, session)
        manager.sessions.add(session)
    log.info("tinker session created", tenant=session.tenant, session=session.id)
    return api.TinkerReply(id=session.id)


async def create_tinker_model(manager: Manager, data: bytes) -> api.TinkerReply:
    """Record a Tinker model if its tenant's unfinished jobs and live models stay under ``max_jobs``
    (HTTP 429); a model already recorded (a retried request) is answered as created."""
    model = msgspec.json.decode(data, type=api.TinkerModelRequest).model
    async with manager.submitting_lock:
        if await tinker.read(manager.bus, "model", model.id, tinker.TinkerModel, model.tenant) is not None:
            return api.TinkerReply(id=model.id)
        refusal = await quota_refusal(manager.bus, model.tenant, await manager.unfinished_records(),
                                      then=CREATE_MODEL_AGAIN)
        if refusal:
            return api.TinkerReply(error=refusal, code=api.QUOTA)
        await tinker.write(manager.bus, "model", model.id, model)
    log.info("tinker model created", tenant=model.tenant, model=model.id)
    return api.TinkerReply(id=model.id)


async def size_refusal(bus: Bus, spec: JobSpec) -> str:
    """Why ``spec`` is larger than its tenant may run ("" = it is not): samples per version above
    the tenant's ``max_samples``. A tenant without a record is not limited."""
    record = await get_tenant(bus, spec.tenant)
    samples = spec.grpo.prompts_per_step * spec.grpo.group_size
    if record is None or samples <= record.max_samples:
        return ""
    return (f"grpo.prompts_per_step x grpo.group_size = {samples} samples per version, above tenant "
            f"{spec.tenant!r}'s quota (max_samples = {record.max_samples}): lower either")


async def pin_version(manager: Manager, data: bytes) -> api.PinReply:
    """Record ``version`` as pinned in the job record (sorted, each once)."""
    request = msgspec.json.decode(data, type=api.PinRequest)
    record = await read_record(manager.bus, request.job, request.tenant)
    if record is None:
        return api.PinReply(error=no_job(request.job), code=api.NOT_FOUND)
    if not 0 <= request.version <= record.version:
        have = f"versions 0..{record.version}" if record.version >= 0 else "no committed version yet"
        return api.PinReply(id=request.job, code=api.INVALID,
                            error=f"version {request.version} of {request.job} is not committed (it has {have}): "
                                  "pin a committed version")

    def change(r: JobRecord) -> JobRecord | None:
        return None if request.version in r.pinned else msgspec.structs.replace(
            r, pinned=sorted({*r.pinned, request.version}))

    new = await manager.update(request.job, change)
    pinned = new.pinned if new is not None else sorted({*record.pinned, request.version})
    log.info("version pinned", job=request.job, version=request.version)
    return api.PinReply(id=request.job, pinned=pinned)


async def delete_job(manager: Manager, data: bytes) -> api.DeleteReply:
    """Cancel the job if unfinished, then remove all of it (and sweep again a little later)."""
    request = msgspec.json.decode(data, type=api.DeleteRequest)
    record = await read_record(manager.bus, request.job, request.tenant)
    if record is None:
        return api.DeleteReply(error=no_job(request.job), code=api.NOT_FOUND)
    if not record.state.finished:
        await manager.transition(request.job, JobState.CANCELLED, "deleted by user")
    async with manager.admission_lock:  # an admission pass in progress must not commit v0 after this
        deleted = await remove_job_data(manager.bus, manager.store, request.job)
    log.info("job deleted", job=request.job, objects=deleted)
    manager.in_background(resweep(manager.bus, manager.store, request.job))
    return api.DeleteReply(id=request.job, deleted_objects=deleted)


async def remove_job_data(bus: Bus, store: ObjectStore, job: str) -> int:
    """Remove the job's KV entries, stream messages and objects; return how many objects there were."""
    await bus.kv_delete(JOBS_BUCKET, job)
    await bus.kv_delete(VERSIONS_BUCKET, job)
    await bus.kv_delete(SAMPLED_BUCKET, job)
    for stream, subject in job_subjects(job):
        await bus.purge(stream, subject)
    deleted = 0
    for kind in OBJECT_KINDS:
        deleted += await asyncio.to_thread(store.delete_prefix, f"{kind}/{job}/")
    return deleted


async def resweep(bus: Bus, store: ObjectStore, job: str) -> None:
    """Remove what in-flight work of a deleted job wrote after the deletion."""
    for delay in RESWEEP_AFTER_S:
        await asyncio.sleep(delay)
        try:
            late = await remove_job_data(bus, store, job)
        except Exception:  # the next sweep (or a later garbage collection) gets it
            log.exception("sweep after delete failed", job=job)
            continue
        if late:
            log.info("removed objects a deleted job's in-flight work wrote late", job=job, objects=late)
