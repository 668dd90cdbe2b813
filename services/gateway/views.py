"""The ``/v1/jobs`` endpoints. Every one acts for the token's tenant only: another tenant's job
answers exactly like a missing one (404, same body), and never shows up in a list or a stream."""

from __future__ import annotations

import asyncio
import re

from litestar import Request, delete, get, post
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from marlaas.platform import api, limits, subjects
from marlaas.platform.adapter_archives import adapter_archive
from marlaas.platform.adapters import read_adapter
from marlaas.platform.events import PolicyCommitted
from marlaas.platform.http_api import Cancelled, Deleted, JobInfo, PhaseSpan, Pinned, Submitted, VersionInfo
from marlaas.platform.store import ObjectNotFound
from marlaas.platform.tenants import TenantRecord
from services.gateway.context import ApiError, gateway_of, not_found
from services.gateway.event_stream import BadEventId, JobEvents, parse_event_id
from services.gateway.reads import (
    committed_versions,
    job_info,
    job_record,
    job_timeline,
    tenant_records,
    version_info,
)
from services.gateway.submission import SubmissionRefused, check_submission, parse_body

CHUNK_BYTES = 64 * 1024
_VERSION = re.compile(r"[0-9]{1,6}")
REFUSALS = {api.QUOTA: 429, api.NOT_FOUND: 404, api.FINISHED: 409, api.INVALID: 400,
            api.UNAVAILABLE: 503}


def version_number(raw: str, name: str) -> int:
    """A version from a path or query parameter; a clear 400 when it is not ASCII digits
    (``int`` would read other scripts' digits: '٣' is 3) or not a number from 0 to limits.MAX_STEPS."""
    if not _VERSION.fullmatch(raw) or int(raw) > limits.MAX_STEPS:
        raise ApiError(400, f"{name} must be a whole number from 0 to {limits.MAX_STEPS} (a committed version, "
                            f"in the digits 0-9, e.g. 3), not {raw!r}")
    return int(raw)


async def owned(request: Request, tenant: TenantRecord, job: str):
    """The tenant's job record, or the 404 that a missing job gets."""
    record = await job_record(gateway_of(request).bus, tenant.name, job)
    if record is None:
        raise not_found(job)
    return record


@post("/jobs", status_code=201, summary="Submit a job",
      description="Body: a job as JSON, or TOML with Content-Type application/toml (fields of a job file: "
                  "task, steps, name, seed, grpo.*, lora.*, ...). The job belongs to the token's tenant. "
                  "429 when the tenant already has max_jobs queued or running.")
async def submit_job(request: Request, tenant: TenantRecord) -> Submitted:
    gateway = gateway_of(request)
    try:
        tree = check_submission(parse_body(await request.body(), request.headers.get("content-type", "")),
                                tenant.name, gateway.config.gateway.allow_server_paths_under,
                                request.headers.get("idempotency-key", ""))
    except SubmissionRefused as exc:
        raise ApiError(exc.status, str(exc)) from None
    reply = await gateway.call(subjects.API_SUBMIT, tree, api.SubmitReply)
    if reply.error:
        raise ApiError(REFUSALS.get(reply.code, 400), reply.error)
    return Submitted(id=reply.id)


@get("/jobs", summary="Your jobs, in submission order")
async def list_jobs(request: Request, tenant: TenantRecord) -> list[JobInfo]:
    gateway = gateway_of(request)
    records = await tenant_records(gateway.bus, tenant.name)
    positions = await gateway.snapshot.positions_for(gateway.bus, records)
    return [job_info(r, positions.get(r.spec.id)) for r in records]


@get("/jobs/{job:str}", summary="One job: state, versions, rewards, evals, timings, queue position")
async def get_job(request: Request, tenant: TenantRecord, job: str) -> JobInfo:
    record = await owned(request, tenant, job)
    gateway = gateway_of(request)
    positions = await gateway.snapshot.positions_for(gateway.bus, [record])
    return job_info(record, positions.get(job))


@post("/jobs/{job:str}/cancel", status_code=200, summary="Cancel a queued or running job")
async def cancel_job(request: Request, tenant: TenantRecord, job: str) -> Cancelled:
    await owned(request, tenant, job)
    reply = await gateway_of(request).call(subjects.API_CANCEL, api.CancelRequest(job=job, tenant=tenant.name),
                                           api.CancelReply)
    if reply.code == api.NOT_FOUND:
        raise not_found(job)
    if reply.error:
        raise ApiError(REFUSALS.get(reply.code, 400), f"{reply.error}: only queued or running jobs can be cancelled")
    return Cancelled(id=job, state=reply.state)


@delete("/jobs/{job:str}", status_code=200, summary="Delete a job and everything of it",
        description="Cancels the job if it is unfinished, then removes its record, versions, adapters, "
                    "optimizer states, trajectories, kept samples and events.")
async def delete_job(request: Request, tenant: TenantRecord, job: str) -> Deleted:
    await owned(request, tenant, job)
    reply = await gateway_of(request).call(subjects.API_DELETE, api.DeleteRequest(job=job, tenant=tenant.name),
                                           api.DeleteReply)
    if reply.code == api.NOT_FOUND:
        raise not_found(job)
    if reply.error:
        raise ApiError(REFUSALS.get(reply.code, 400), reply.error)
    return Deleted(id=job, deleted_objects=reply.deleted_objects)


@get("/jobs/{job:str}/versions", summary="The job's committed versions, oldest first")
async def list_versions(request: Request, tenant: TenantRecord, job: str) -> list[VersionInfo]:
    record = await owned(request, tenant, job)
    return [version_info(e, record.pinned) for e in await committed_versions(gateway_of(request).bus, job)]


@get("/jobs/{job:str}/timeline", summary="When each version's phases ran: generate, reward, train, commit",
     description="Every recorded phase of the job, oldest first (unix seconds; eval for evaluations). "
                 "A version is generate and reward in rollout, then train and commit in the trainer; "
                 "other jobs' phases fill the gaps between them.")
async def get_timeline(request: Request, tenant: TenantRecord, job: str) -> list[PhaseSpan]:
    await owned(request, tenant, job)
    return await job_timeline(gateway_of(request).bus, job)


@post("/jobs/{job:str}/versions/{version:str}/pin", status_code=200,
      summary="Pin a committed version: garbage collection keeps its adapter")
async def pin_version(request: Request, tenant: TenantRecord, job: str, version: str) -> Pinned:
    await owned(request, tenant, job)
    number = version_number(version, "the version in the path")
    reply = await gateway_of(request).call(subjects.API_PIN,
                                           api.PinRequest(job=job, version=number, tenant=tenant.name), api.PinReply)
    if reply.code == api.NOT_FOUND:
        raise not_found(job)
    if reply.error:
        raise ApiError(REFUSALS.get(reply.code, 400), reply.error)
    return Pinned(id=job, pinned=reply.pinned)


async def chosen_version(request: Request, job: str, version: str | None) -> PolicyCommitted:
    versions = await committed_versions(gateway_of(request).bus, job)
    if not versions:
        raise ApiError(404, f"job {job} has no committed version yet (it is queued): try again once it runs")
    if version is None:
        return versions[-1]
    number = version_number(version, "query parameter 'version'")
    found = next((e for e in versions if e.version == number), None)
    if found is None:
        raise ApiError(404, f"job {job} has no version {number}: its committed versions are "
                            f"{versions[0].version}..{versions[-1].version} (leave out ?version= for the latest)")
    return found


@get("/jobs/{job:str}/adapter", summary="A version's adapter as a .tar.gz of the PEFT directory",
     description="adapter_config.json + adapter_model.safetensors (its sha256 verified); latest version "
                 "unless ?version=V.", response_description="application/gzip")
async def download_adapter(request: Request, tenant: TenantRecord, job: str,
                           version: str | None = None) -> Stream:
    await owned(request, tenant, job)
    event = await chosen_version(request, job, version)
    store = gateway_of(request).store
    try:
        config_json, weights = await asyncio.to_thread(read_adapter, store, event.adapter)
    except ObjectNotFound:
        raise ApiError(404, f"the adapter of {job} version {event.version} is no longer stored: download "
                            "another version (GET /v1/jobs/{job}/versions lists them)") from None
    data = await asyncio.to_thread(adapter_archive, config_json, weights, event.committed_at)
    filename = f"{job}-v{event.version}.tar.gz"
    chunks = (data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES))
    return Stream(chunks, media_type="application/gzip", headers={
        "Content-Disposition": f'attachment; filename="{filename}"', "Content-Length": str(len(data)),
        "X-Marlaas-Version": str(event.version), "X-Adapter-Sha256": event.adapter.sha256,
    })


@get("/jobs/{job:str}/events", summary="Server-sent events of the job, live and resumable",
     description="Events policy.committed, job.state and job.eval, each with an id '<n>-<m>' (counts of "
                 "the job's own messages); send it back as Last-Event-ID (or ?last_event_id=) to resume. "
                 "The stream ends after the job's final state and last version. 429 past "
                 "gateway.max_streams_per_tenant streams of the tenant's open at once (gateway.max_streams "
                 "of all tenants').")
async def stream_events(request: Request, tenant: TenantRecord, job: str,
                        last_event_id: str | None = None) -> Stream:
    await owned(request, tenant, job)
    try:
        start = parse_event_id(request.headers.get("last-event-id") or last_event_id)
    except BadEventId as exc:
        raise ApiError(400, str(exc)) from None
    gateway = gateway_of(request)
    gateway.streams.take(tenant.name)  # a 429 past the caps; given back when the stream closes
    events = await JobEvents(gateway.bus, tenant.name, job, start,
                             release=lambda: gateway.streams.release(tenant.name)).open()
    # the background task closes a stream whose body never started (the client left at once)
    return Stream(events, media_type="text/event-stream", background=BackgroundTask(events.close),
                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


JOB_ROUTES = [submit_job, list_jobs, get_job, cancel_job, delete_job, list_versions, get_timeline, pin_version,
              download_adapter, stream_events]
