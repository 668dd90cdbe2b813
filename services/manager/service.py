"""Manager: the user API, the job registry (KV ``jobs``), admission, lifecycle and metrics.

It is the only writer of job records. It creates version 0 of an admitted job
(a seeded LoRA init, committed like any other version), follows policy-committed
announcements to record each job's version, rewards, TTFS and TPTS, and turns
failure reports and cancellations into final states, admitting queued jobs as
room frees up.

This module wires the manager's parts to the bus; each concern has its own module:

- ``submissions``: a submission checked, then recorded (``validation``: the checks against the
  stack's facts, pure; ``warm_start``: ``init_from``'s weights);
- ``admission`` (pure) and ``adaptive``: which queued jobs to admit now; ``admission_passes``:
  admitting them, each from its version 0;
- ``job_events``: policy commits, failure and warning reports, evaluations, follow-ups;
- ``lifecycle``: the job registry, the one writer of job records and their state changes;
- ``job_admin``: tenants' quotas, status, cancelling, pinning a version, deleting a job;
- ``gc``: deleting the stored objects no version needs;
- ``tinker_sessions``: Tinker sessions and models under the tenants' quotas, and the sweep;
- ``usage``: metering events folded into the ``usage`` bucket, each exactly once.
"""

from __future__ import annotations

import asyncio

import msgspec
import structlog

from marlaas.platform import subjects
from marlaas.platform.bus import Bus
from marlaas.platform.config import Config
from marlaas.platform.events import JobRecord, encode
from marlaas.platform.runtime import Runtime
from marlaas.platform.store import ObjectStore
from marlaas.platform.tenants import broadcast_shares
from services.manager.adaptive import AdaptiveAdmission
from services.manager.admission import kv_bytes_per_token
from services.manager.admission_passes import AdmissionPasses
from services.manager.gc import JobCollections
from services.manager.job_admin import cancel_job, delete_job, job_status, pin_version
from services.manager.job_events import JobEvents
from services.manager.lifecycle import JobRegistry, delete_oldest_finished
from services.manager.submissions import Submissions
from services.manager.tinker_sessions import TinkerQuotas, sweep_tinker_sessions
from services.manager.usage import keep_ledger

log = structlog.get_logger("manager")


class Manager:
    """The manager's parts, wired to each other: the registry (:attr:`jobs`; every record change
    goes through it, by compare-and-set on the ``jobs`` KV), :attr:`submissions`,
    :attr:`admission` passes, :attr:`events` (commits and job events) and :attr:`tinker` quotas."""

    def __init__(self, bus: Bus, store: ObjectStore, config: Config) -> None:
        self.bus, self.store, self.config = bus, store, config
        mc = config.manager
        self.budget_bytes = int(mc.kv_budget_gib * 2**30)
        self.adaptive = (AdaptiveAdmission(mc.target_engine_busy, mc.target_tpts_s, mc.target_trainer_busy)
                         if mc.admission == "adaptive" else None)
        self.jobs = JobRegistry(bus, on_finished=self.job_finished)
        self.tinker = TinkerQuotas(self.jobs, mc.max_tinker_sessions)
        self.collections = JobCollections(bus, store, mc.gc_keep_last, self.jobs.in_background)
        self.admission = AdmissionPasses(bus, store, self.jobs, model_dir=config.base_model_dir,
                                         budget_bytes=self.budget_bytes, schedule=mc.schedule, adaptive=self.adaptive)
        self.submissions = Submissions(
            bus, store, config, self.jobs, kv_bytes_per_token=kv_bytes_per_token(config.base_model_dir,
                                                                                 config.rollout.dtype),
            kv_budget_bytes=self.budget_bytes, on_recorded=self.admission.try_admission)
        self.events = JobEvents(self.jobs, self.collections, self.submissions.submit, self.adaptive)

    async def job_finished(self, record: JobRecord, admit_next: bool) -> None:
        """A job finished: delete its tenant's oldest finished jobs beyond the bound, and admit
        what now fits (unless the caller is an admission pass)."""
        self.jobs.in_background(delete_oldest_finished(self.jobs, self.store, record.spec.tenant,
                                                       self.config.manager.max_finished_jobs))
        if admit_next:
            await self.admission.try_admission()


def api_responder(handler):
    """``handler`` (request bytes to a reply struct) as a bus responder: its reply encoded, a
    request that does not decode answered ``{"error": "malformed request: ..."}``."""
    async def answer(data: bytes) -> bytes:
        try:
            return encode(await handler(data))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return msgspec.json.encode({"error": f"malformed request: {exc}"})
    return answer


async def pong(data: bytes) -> bytes:
    """The readiness check's answer: nothing read, nothing written."""
    return b"{}"


async def run(rt: Runtime) -> None:
    manager = await asyncio.to_thread(Manager, rt.bus, rt.store, rt.config)
    jobs, events = manager.jobs, manager.events
    await rt.bus.serve(subjects.API_SUBMIT, "manager", api_responder(manager.submissions.submit))
    await rt.bus.serve(subjects.API_STATUS, "manager", api_responder(lambda data: job_status(jobs, data)))
    await rt.bus.serve(subjects.API_CANCEL, "manager", api_responder(lambda data: cancel_job(jobs, data)))
    await rt.bus.serve(subjects.API_DELETE, "manager",
                       api_responder(lambda data: delete_job(jobs, manager.store, data)))
    await rt.bus.serve(subjects.API_PIN, "manager", api_responder(lambda data: pin_version(jobs, data)))
    await rt.bus.serve(subjects.API_PING, "manager", pong)
    await rt.bus.serve(subjects.API_TINKER_SESSION, "manager", api_responder(manager.tinker.create_session))
    await rt.bus.serve(subjects.API_TINKER_MODEL, "manager", api_responder(manager.tinker.create_model))
    if manager.adaptive:
        await rt.bus.nc.subscribe(subjects.span(">"), cb=events.on_span)  # engine and train spans
    rt.ready()
    log.info("ready", schedule=rt.config.manager.schedule, admission=rt.config.manager.admission,
             kv_budget_mib=round(manager.budget_bytes / 2**20, 1))
    await asyncio.gather(
        manager.admission.keep_admitting(rt.stop),  # also picks up where a previous manager left off
        rt.bus.consume("POLICY", "manager", subjects.policy_committed(), events.on_policy, stop=rt.stop),
        rt.bus.consume("JOBS", "manager-failures", subjects.job_failure(), events.on_job_event,
                       stop=rt.stop),
        rt.bus.consume("JOBS", "manager-warnings", subjects.job_warning(), events.on_job_event,
                       stop=rt.stop),
        rt.bus.consume("JOBS", "manager-evals", subjects.job_eval(), events.on_job_event, stop=rt.stop),
        sweep_tinker_sessions(rt.bus, rt.store, rt.stop),
        keep_ledger(rt.bus, rt.stop),  # metering: the USAGE stream into the usage bucket
        broadcast_shares(rt.bus, rt.stop),  # tenants' weights, for the sandbox (it cannot read the bucket)
    )
