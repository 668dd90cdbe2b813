"""The manager's tenant-facing job administration: quotas, status, cancelling, pinning versions,
deleting a job.

The manager stays the only writer of job records, so these run here (``marlaas.api.pin``,
``marlaas.api.delete``) and not in the gateway; the quota is checked here too, inside the
registry's submission lock, so gateway replicas cannot race past it (the same quota counts a
tenant's Tinker models: ``tinker_sessions.py``).

Deleting a job removes everything of it (``lifecycle.remove_job_data``). An unfinished job
is cancelled first; work already in flight for it (a trainer's update, a rollout batch)
may still write an object or two after that, so the same sweep runs again a little later.
"""

from __future__ import annotations

import asyncio

import msgspec
import structlog

from marlaas.platform import api
from marlaas.platform import tinker_records as tinker
from marlaas.platform.bus import Bus
from marlaas.platform.events import JobRecord, JobSpec, JobState
from marlaas.platform.store import ObjectStore
from marlaas.platform.tenants import get_tenant
from services.manager.lifecycle import JobRegistry, remove_job_data

log = structlog.get_logger("manager")
RESWEEP_AFTER_S = (5.0, 30.0)  # in-flight work of a just-cancelled job may still land a write


def no_job(job: str) -> str:
    return f"no job {job!r}; `marlaas list` shows your jobs"


SUBMIT_AGAIN = "wait for one to finish or cancel one (`marlaas cancel JOB`), then submit again"
CREATE_MODEL_AGAIN = ("finish a Tinker session (close its ServiceClient) or cancel a job (`marlaas cancel JOB`), "
                      "then create the model again")


def lora_slots(spec: JobSpec) -> int:
    """The adapters a job has the engine serve at once: its current version, and at bounded
    staleness up to ``max_staleness`` older ones still generating."""
    return 1 + max(spec.grpo.max_staleness, 0)


async def quota_refusal(bus: Bus, tenant: str, unfinished_jobs: list[JobRecord], then: str = SUBMIT_AGAIN,
                        slots: int = 1) -> str:
    """Why ``tenant`` may not add a job or a Tinker model now ("" = it may): its queued or running
    jobs' LoRA slots (``lora_slots``: one a job, 1 + k at ``max_staleness = k``) and its live Tinker
    models, plus the ``slots`` the new one takes, would exceed ``max_jobs`` (``unfinished_jobs``:
    every tenant's, from the manager's index); ``then`` says what to do about it.

    A tenant without a record (jobs submitted straight over NATS by internal tools) is not limited.
    """
    record = await get_tenant(bus, tenant)
    if record is None:
        return ""
    mine = [job for job in unfinished_jobs if job.spec.tenant == tenant]
    held = sum(lora_slots(job.spec) for job in mine)
    models = await tinker.active_models(bus, tenant) if held + slots <= record.max_jobs else 0
    if held + models + slots <= record.max_jobs:
        return ""
    also = f" and {models} Tinker models in live sessions" if models else ""
    stale = f", holding {held} LoRA slots (a job at max_staleness = k holds 1 + k)" if held != len(mine) else ""
    needs = f"; this one needs {slots} (1 + grpo.max_staleness)" if slots > 1 else ""
    return (f"tenant {tenant!r} already has {len(mine)} jobs queued or running{stale}{also}, its quota "
            f"(max_jobs = {record.max_jobs}){needs}: {then}")


async def size_refusal(bus: Bus, spec: JobSpec) -> str:
    """Why ``spec`` is larger than its tenant may run ("" = it is not): samples per version above
    the tenant's ``max_samples``. A tenant without a record is not limited."""
    record = await get_tenant(bus, spec.tenant)
    samples = spec.grpo.prompts_per_step * spec.grpo.group_size
    if record is None or samples <= record.max_samples:
        return ""
    return (f"grpo.prompts_per_step x grpo.group_size = {samples} samples per version, above tenant "
            f"{spec.tenant!r}'s quota (max_samples = {record.max_samples}): lower either")


async def job_status(jobs: JobRegistry, data: bytes) -> api.StatusReply:
    """The jobs a status request names (one, a tenant's, or all), oldest submission first."""
    request = msgspec.json.decode(data or b"{}", type=api.StatusRequest)
    records = [r for r in await jobs.records()
               if (not request.job or r.spec.id == request.job)
               and (not request.tenant or r.spec.tenant == request.tenant)]
    if request.job and not records:
        return api.StatusReply(error=f"no job {request.job!r}; `marlaas status` lists your jobs")
    records.sort(key=lambda r: r.spec.submitted_at)
    return api.StatusReply(jobs=[api.job_view(r) for r in records])


async def cancel_job(jobs: JobRegistry, data: bytes) -> api.CancelReply:
    """Cancel an unfinished job; a finished or missing one is answered as such."""
    request = msgspec.json.decode(data, type=api.CancelRequest)
    record = await jobs.read(request.job, request.tenant)
    if record is None:
        return api.CancelReply(error=f"no job {request.job!r}; `marlaas status` lists your jobs",
                               code=api.NOT_FOUND)
    if record.state.finished:
        return api.CancelReply(id=request.job, state=record.state.value, code=api.FINISHED,
                               error=f"job {request.job} already {record.state.value}")
    await jobs.transition(request.job, JobState.CANCELLED, "cancelled by user")
    return api.CancelReply(id=request.job, state=JobState.CANCELLED.value)


async def pin_version(jobs: JobRegistry, data: bytes) -> api.PinReply:
    """Record ``version`` as pinned in the job record (sorted, each once)."""
    request = msgspec.json.decode(data, type=api.PinRequest)
    record = await jobs.read(request.job, request.tenant)
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

    new = await jobs.update(request.job, change)
    pinned = new.pinned if new is not None else sorted({*record.pinned, request.version})
    log.info("version pinned", job=request.job, version=request.version)
    return api.PinReply(id=request.job, pinned=pinned)


async def delete_job(jobs: JobRegistry, store: ObjectStore, data: bytes) -> api.DeleteReply:
    """Cancel the job if unfinished, then remove all of it (and sweep again a little later)."""
    request = msgspec.json.decode(data, type=api.DeleteRequest)
    record = await jobs.read(request.job, request.tenant)
    if record is None:
        return api.DeleteReply(error=no_job(request.job), code=api.NOT_FOUND)
    if not record.state.finished:
        await jobs.transition(request.job, JobState.CANCELLED, "deleted by user")
    async with jobs.admission_lock:  # an admission pass in progress must not commit v0 after this
        deleted = await remove_job_data(jobs.bus, store, request.job)
    log.info("job deleted", job=request.job, objects=deleted)
    jobs.in_background(resweep(jobs.bus, store, request.job))
    return api.DeleteReply(id=request.job, deleted_objects=deleted)


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
