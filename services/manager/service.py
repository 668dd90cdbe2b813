"""Manager: the user API, the job registry (KV ``jobs``), admission, lifecycle and metrics.

It is the only writer of job records. It creates version 0 of an admitted job
(a seeded LoRA init, committed like any other version), follows policy-committed
announcements to record each job's version, rewards, TTFS and TPTS, and turns
failure reports and cancellations into final states, admitting queued jobs as
room frees up.

This module wires the manager's parts to the bus; each concern has its own module:

- ``validation``: a submission checked against the stack's facts, to a job record (pure);
- ``admission`` (pure) and ``adaptive``: which queued jobs to admit now;
- ``lifecycle``: the job registry, the one writer of job records and their state changes;
- ``job_admin``: tenants' quotas, pinning a version, deleting a job;
- ``gc``: deleting the stored objects no version needs;
- ``tinker_sessions``: Tinker sessions and models under the tenants' quotas, and the sweep;
- ``usage``: metering events folded into the ``usage`` bucket, each exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import msgspec
import structlog

from marlaas.platform import api, subjects
from marlaas.platform.adapter_uploads import adapter_problem_on_base, is_adapter_id
from marlaas.platform.adapters import init_adapter, linear_module_names, lora_of, write_adapter
from marlaas.platform.bus import JOBS_BUCKET, VERSIONS_BUCKET, Bus, Delivery, StaleRevision
from marlaas.platform.commits import announce
from marlaas.platform.config import Config
from marlaas.platform.events import (
    COMMITTED,
    JOB,
    METRIC,
    POLICY,
    CommittedVersion,
    EvalPoint,
    EventDecodeError,
    JobEvaluated,
    JobFailureReported,
    JobRecord,
    JobSpec,
    JobState,
    JobWarningReported,
    RewardRequest,
    encode,
)
from marlaas.platform.files import DataFiles
from marlaas.platform.runtime import Runtime
from marlaas.platform.store import ObjectStore
from marlaas.platform.tenants import TenantRecord, broadcast_shares, get_tenant
from marlaas.tasks import get_task
from marlaas.tools.registry import read_tool, reward_subject
from services.manager.adaptive import AdaptiveAdmission
from services.manager.admission import kv_bytes_per_token, to_admit
from services.manager.gc import JobCollections, acknowledge_collected
from services.manager.job_admin import delete_job, lora_slots, pin_version, quota_refusal, size_refusal
from services.manager.lifecycle import JobRegistry, RecordChange, delete_oldest_finished, progressed
from services.manager.lifecycle import oldest_beyond as oldest_beyond  # re-exported: tests import it here
from services.manager.sizing import max_token_chars
from services.manager.tinker_sessions import TinkerQuotas, sweep_tinker_sessions
from services.manager.usage import keep_ledger
from services.manager.validation import (
    DataSize,
    StackFacts,
    data_refs,
    data_refusal,
    submission_chain,
    validate_submission,
)
from services.manager.validation import job_id as job_id  # re-exported: tests import it here
from services.manager.warm_start import resolve_init, servable_problem

log = structlog.get_logger("manager")
GC_EVERY = 5  # versions between garbage collections of a job's stored objects


class Unadmittable(Exception):
    """A queued job that no admission pass can ever admit (its settings cannot be trained)."""


class Manager:
    """The manager's steps on the bus: submissions, admission passes, commits and job events, the API.

    Every record change goes through :attr:`jobs` (the registry: compare-and-set on the ``jobs`` KV)."""

    def __init__(self, bus: Bus, store: ObjectStore, config: Config) -> None:
        self.bus, self.store, self.config = bus, store, config
        self.model_dir = config.base_model_dir
        self.files = DataFiles(store, config.home_dir / "cache" / "files", get_task)  # tenants' uploads
        self.bytes_per_token = kv_bytes_per_token(self.model_dir, config.rollout.dtype)
        self.budget_bytes = int(config.manager.kv_budget_gib * 2**30)
        mc = config.manager
        self.jobs = JobRegistry(bus, on_finished=self.job_finished)
        self.tinker = TinkerQuotas(self.jobs, mc.max_tinker_sessions)
        self.collections = JobCollections(bus, store, mc.gc_keep_last, self.jobs.in_background)
        self._tokenizing = threading.Lock()  # validations run in threads; a fast tokenizer is not re-entrant
        self._waiting = True  # jobs may be queued, or the last admission pass failed
        self.adaptive = (AdaptiveAdmission(mc.target_engine_busy, mc.target_tpts_s, mc.target_trainer_busy)
                         if mc.admission == "adaptive" else None)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.token_chars = max_token_chars(list(self.tokenizer.get_vocab()))
        self.lora_targets = linear_module_names(self.model_dir)
        self.facts = StackFacts(max_model_len=config.rollout.max_model_len, max_lora_rank=config.rollout.max_lora_rank,
                                lora_targets=frozenset(self.lora_targets), token_chars=self.token_chars,
                                kv_bytes_per_token=self.bytes_per_token, kv_budget_bytes=self.budget_bytes)

    # --- the registry's, for callers that hold the manager -------------------------------------

    async def read(self, job: str, tenant: str = "") -> JobRecord | None:
        """The job's record (``JobRegistry.read``)."""
        return await self.jobs.read(job, tenant)

    async def update(self, job: str, change: RecordChange) -> JobRecord | None:
        """Change the job's record by compare-and-set (``JobRegistry.update``)."""
        return await self.jobs.update(job, change)

    async def transition(self, job: str, state: JobState, reason: str = "", *, admit_next: bool = True,
                         **fields) -> bool:
        """Move a job to ``state`` (``JobRegistry.transition``)."""
        return await self.jobs.transition(job, state, reason, admit_next=admit_next, **fields)

    async def unfinished_records(self) -> list[JobRecord]:
        """The queued and running jobs' records (``JobRegistry.unfinished_records``)."""
        return await self.jobs.unfinished_records()

    @property
    def _background(self) -> set[asyncio.Task]:
        """The manager's background work (garbage collection, deletions), for tests to await."""
        return self.jobs.background

    async def job_finished(self, record: JobRecord, admit_next: bool) -> None:
        """A job finished: delete its tenant's oldest finished jobs beyond the bound, and admit
        what now fits (unless the caller is an admission pass)."""
        self.jobs.in_background(delete_oldest_finished(self.jobs, self.store, record.spec.tenant,
                                                       self.config.manager.max_finished_jobs))
        if admit_next:
            await self.try_admission()

    # --- submission ---------------------------------------------------------------------------

    def validate(self, request: api.SubmitRequest, tenant: TenantRecord | None = None) -> JobRecord:
        """A queued job record from a submission, or :class:`api.SubmitError` saying what to fix
        (``validation.validate_submission``). First, the data that it and its follow-ups name
        against ``tenant``'s bounds, from the files' records (``validation.data_refusal``; no
        record: the platform's own jobs, not bounded).

        It reads the job's data and tokenizes its prompts: :meth:`submit` runs it in a thread."""
        def check(request: api.SubmitRequest) -> JobRecord:
            def load_task(dataset: str | None):  # a file id is looked up among the submitting tenant's files only
                return self.files.task(request.tenant, request.task, dataset, request.corpus)

            return validate_submission(request, self.facts, load_task, self.count_tokens, time.time())

        chain = submission_chain(request)
        if tenant is not None:
            sizes = [DataSize(field, ref, *size) for field, ref in data_refs(chain)
                     if (size := self.files.size(request.tenant, ref, tenant.max_dataset_bytes)) is not None]
            if refusal := data_refusal(sizes, tenant.name, tenant.max_dataset_rows, tenant.max_dataset_bytes):
                raise api.SubmitError(refusal)
        record = check(request)
        for where, follow in chain[1:]:  # each follow-up is checked now, not later
            try:
                check(follow)
            except api.SubmitError as exc:
                raise api.SubmitError(f"{where}: {exc}") from None
        return record

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Each text's tokens (no special tokens added), one batch call: a fast tokenizer counts
        a batch in parallel, outside the GIL."""
        with self._tokenizing:
            return [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    async def resolve_tools(self, record: JobRecord) -> JobRecord:
        """Fix the job's tools to their registry entries now; a tool nobody serves is refused."""
        specs = []
        for name in record.spec.tools:
            spec = await read_tool(self.bus, name)
            if spec is None:
                raise api.SubmitError(f"tool {name!r} is not served right now (no live announcement): start "
                                      "its server first (built-ins come with the env service)")
            specs.append(spec)
        return msgspec.structs.replace(record, spec=msgspec.structs.replace(record.spec, tool_specs=tuple(specs)))

    async def check_reward_served(self, spec: JobSpec) -> None:
        """A tenant's reward must be served right now, as its tools must: a request with no items
        (no reward function runs) finds whether anyone answers on its subject."""
        if "." not in spec.reward:
            return  # none (the task's own), or a built-in one: the env serves those with the tasks
        subject = reward_subject(spec.reward)
        if not await self.bus.answered(subject, encode(RewardRequest(job=spec.id, task=spec.task, items=[]))):
            raise api.SubmitError(f"reward {spec.reward!r} is not served right now (nothing answers on {subject}): "
                                  "start the process that serves it (@reward, serve(...)) first, then submit")

    async def submit(self, data: bytes) -> api.SubmitReply:
        try:
            request = api.parse_submission(msgspec.json.decode(data))
            # off the event loop: reading the data and tokenizing take time (bounded, see validate)
            tenant = await get_tenant(self.bus, request.tenant)
            record = await self.resolve_tools(await asyncio.to_thread(self.validate, request, tenant))
            if refusal := await size_refusal(self.bus, record.spec):
                raise api.SubmitError(refusal)
            await self.check_reward_served(record.spec)
            warm = (await resolve_init(self.bus, self.store, record.spec.tenant, record.spec.init_from)
                    if record.spec.init_from else None)
            problem = ""
            if warm and is_adapter_id(record.spec.init_from):  # a tenant's file: its shapes against this base too
                problem = await asyncio.to_thread(adapter_problem_on_base, *warm, base_model_dir=self.model_dir,
                                                  max_rank=self.facts.max_lora_rank)
            elif warm:  # the platform's own weights: only whether this engine serves their shape
                problem = servable_problem(warm[0], self.facts.max_lora_rank, self.facts.lora_targets)
            if problem:
                raise api.SubmitError(f"init_from {record.spec.init_from!r}: {problem}")
        except (api.SubmitError, msgspec.DecodeError) as exc:
            return api.SubmitReply(error=str(exc), code=api.INVALID)
        spec = record.spec
        async with self.jobs.submitting_lock:
            if request.idempotency_key and await self.bus.kv_get(JOBS_BUCKET, spec.id) is not None:
                log.info("submission repeated: answered with its job", job=spec.id)
                return api.SubmitReply(id=spec.id)  # the id is the key's: the same submission, retried
            refusal = await quota_refusal(self.bus, spec.tenant, await self.jobs.unfinished_records(),
                                          slots=lora_slots(spec))
            if refusal:
                return api.SubmitReply(error=refusal, code=api.QUOTA)
            if warm is not None:  # version 0 is the source's weights, copied now (it may be collected later)
                config_json, weights = warm
                blob = await asyncio.to_thread(write_adapter, self.store, spec.id, 0, config_json, weights)
                spec = msgspec.structs.replace(spec, lora=lora_of(config_json), init_adapter=blob)
                record = msgspec.structs.replace(record, spec=spec)
            try:
                await self.jobs.create(record)
            except Exception as exc:  # the broker refused or lost the write: the user must hear it
                log.exception("submission not recorded; nothing was created", job=spec.id)
                return api.SubmitReply(code=api.UNAVAILABLE, error=(
                    f"the job could not be recorded ({type(exc).__name__}: {exc}); nothing was created: "
                    "submit it again"))
        log.info("job submitted", job=spec.id, task=spec.task, steps=spec.steps)
        await self.try_admission()
        return api.SubmitReply(id=spec.id)

    async def try_admission(self) -> None:
        """Admit what fits; a failure (store or broker down) is logged and retried by :meth:`keep_admitting`."""
        try:
            self._waiting = await self.admit_queued()
        except Exception:
            self._waiting = True
            log.exception("admission pass failed; will retry")

    async def keep_admitting(self, stop: asyncio.Event, every_s: float = 2.0) -> None:
        """Repeat the admission pass while jobs wait or a pass failed (submits and finishes
        trigger one themselves), so the registry is not re-read when nothing can change."""
        self._waiting = True  # a restarted manager picks up where the last one left off
        while not stop.is_set():
            if self._waiting:
                await self.try_admission()
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except TimeoutError:
                pass

    # --- admission and version 0 --------------------------------------------------------------

    async def admit_queued(self) -> bool:
        """Admit the queued jobs that fit; return whether any job is left waiting."""
        async with self.jobs.admission_lock:
            records = await self.jobs.unfinished_records()
            limit = self.adaptive.slots(records) if self.adaptive else None
            admitted = to_admit(records, self.budget_bytes, self.config.manager.schedule, limit)
            for job in admitted:
                try:
                    await self.admit(next(r for r in records if r.spec.id == job).spec)
                except Unadmittable as exc:  # the job's own fault: it alone fails, the pass goes on
                    log.warning("job cannot be admitted", job=job, reason=str(exc))
                    await self.jobs.transition(job, JobState.FAILED, str(exc), admit_next=False)
                    continue
                except Exception as exc:  # FIFO: the jobs behind it wait too; the next pass retries
                    await self.jobs.note_queued(job, f"not admitted yet: admission failed ({type(exc).__name__}: "
                                                     f"{exc}); retrying")
                    raise
                if self.adaptive:
                    self.adaptive.admitted(job)
            queued = sum(r.state is JobState.QUEUED for r in records)
            return queued > len(admitted)

    async def admit(self, spec: JobSpec) -> None:
        """Commit version 0 (seeded LoRA init), then mark the job running."""
        if await self.bus.kv_get(VERSIONS_BUCKET, spec.id) is None and spec.init_adapter is not None:
            v0 = CommittedVersion(job=spec.id, version=0, adapter=spec.init_adapter, committed_at=time.time())
            with contextlib.suppress(StaleRevision):  # a previous manager run committed v0 already
                await self.bus.kv_create(VERSIONS_BUCKET, spec.id, encode(v0))
        if await self.bus.kv_get(VERSIONS_BUCKET, spec.id) is None:
            try:
                config_json, weights = await asyncio.to_thread(init_adapter, self.model_dir, spec.lora,
                                                               spec.seed)
            except (OSError, MemoryError):
                raise  # the machine's fault (the base model's config unreadable): retried
            except Exception as exc:  # init_adapter is a function of the spec: retrying cannot help
                raise Unadmittable(f"not admitted: version 0 cannot be built from the job's settings "
                                   f"({type(exc).__name__}: {exc}); fix them and submit the job again") from exc
            adapter = await asyncio.to_thread(write_adapter, self.store, spec.id, 0, config_json, weights)
            v0 = CommittedVersion(job=spec.id, version=0, adapter=adapter, committed_at=time.time())
            try:
                await self.bus.kv_create(VERSIONS_BUCKET, spec.id, encode(v0))
            except StaleRevision:
                pass  # a previous manager run committed v0 already
        committed = COMMITTED.decode((await self.bus.kv_get(VERSIONS_BUCKET, spec.id)).value)
        await announce(self.bus, committed)  # before "running": a crash in between re-admits
        await self.jobs.transition(spec.id, JobState.RUNNING, admitted_at=time.time())
        log.info("job admitted", job=spec.id)

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

    # --- commits and job events ---------------------------------------------------------------

    async def on_policy(self, delivery: Delivery) -> None:
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
        event = JOB.decode(delivery.data)
        if isinstance(event, JobFailureReported):
            await self.jobs.transition(event.job, JobState.FAILED, f"{event.service}: {event.reason}")
        elif isinstance(event, JobWarningReported):
            await self.jobs.update(event.job, lambda r: _with_warning(r, event))
        elif isinstance(event, JobEvaluated):
            await self.jobs.update(event.job, lambda r: None if any(e.version == event.version for e in r.evals) else
                              msgspec.structs.replace(r, evals=[*r.evals, EvalPoint(version=event.version,
                                                                                     score=event.score)]))

    # --- API ----------------------------------------------------------------------------------

    async def status(self, data: bytes) -> api.StatusReply:
        request = msgspec.json.decode(data or b"{}", type=api.StatusRequest)
        records = [r for r in await self.jobs.records()
                   if (not request.job or r.spec.id == request.job)
                   and (not request.tenant or r.spec.tenant == request.tenant)]
        if request.job and not records:
            return api.StatusReply(error=f"no job {request.job!r}; `marlaas status` lists your jobs")
        records.sort(key=lambda r: r.spec.submitted_at)
        return api.StatusReply(jobs=[api.job_view(r) for r in records])

    async def cancel(self, data: bytes) -> api.CancelReply:
        request = msgspec.json.decode(data, type=api.CancelRequest)
        record = await self.jobs.read(request.job, request.tenant)
        if record is None:
            return api.CancelReply(error=f"no job {request.job!r}; `marlaas status` lists your jobs",
                                   code=api.NOT_FOUND)
        if record.state.finished:
            return api.CancelReply(id=request.job, state=record.state.value, code=api.FINISHED,
                                   error=f"job {request.job} already {record.state.value}")
        await self.jobs.transition(request.job, JobState.CANCELLED, "cancelled by user")
        return api.CancelReply(id=request.job, state=JobState.CANCELLED.value)


MAX_WARNINGS = 16  # per job: what it depends on is bounded (its tools and reward), and so is this
MAX_WARNING_CHARS = 500


def _with_warning(record: JobRecord, event: JobWarningReported) -> JobRecord | None:
    """``record`` with ``event``'s warning set (or cleared); None when nothing changes."""
    key, text = event.key[:100], event.warning[:MAX_WARNING_CHARS]
    if record.state.finished or record.warnings.get(key, "") == text:
        return None
    warnings = {k: v for k, v in record.warnings.items() if k != key}
    if text and len(warnings) < MAX_WARNINGS:
        warnings[key] = text
    return msgspec.structs.replace(record, warnings=warnings)


def _reply(handler):
    async def answer(data: bytes) -> bytes:
        try:
            return encode(await handler(data))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return msgspec.json.encode({"error": f"malformed request: {exc}"})
    return answer


async def _pong(data: bytes) -> bytes:
    return b"{}"


async def run(rt: Runtime) -> None:
    manager = await asyncio.to_thread(Manager, rt.bus, rt.store, rt.config)
    await rt.bus.serve(subjects.API_SUBMIT, "manager", _reply(manager.submit))
    await rt.bus.serve(subjects.API_STATUS, "manager", _reply(manager.status))
    await rt.bus.serve(subjects.API_CANCEL, "manager", _reply(manager.cancel))
    await rt.bus.serve(subjects.API_DELETE, "manager",
                       _reply(lambda data: delete_job(manager.jobs, manager.store, data)))
    await rt.bus.serve(subjects.API_PIN, "manager", _reply(lambda data: pin_version(manager.jobs, data)))
    await rt.bus.serve(subjects.API_PING, "manager", _pong)
    await rt.bus.serve(subjects.API_TINKER_SESSION, "manager", _reply(manager.tinker.create_session))
    await rt.bus.serve(subjects.API_TINKER_MODEL, "manager", _reply(manager.tinker.create_model))
    if manager.adaptive:
        await rt.bus.nc.subscribe(subjects.span(">"), cb=manager.on_span)  # engine and train spans
    rt.ready()
    log.info("ready", schedule=rt.config.manager.schedule, admission=rt.config.manager.admission,
             kv_budget_mib=round(manager.budget_bytes / 2**20, 1))
    await asyncio.gather(
        manager.keep_admitting(rt.stop),  # also picks up where a previous manager left off
        rt.bus.consume("POLICY", "manager", subjects.policy_committed(), manager.on_policy, stop=rt.stop),
        rt.bus.consume("JOBS", "manager-failures", subjects.job_failure(), manager.on_job_event,
                       stop=rt.stop),
        rt.bus.consume("JOBS", "manager-warnings", subjects.job_warning(), manager.on_job_event,
                       stop=rt.stop),
        rt.bus.consume("JOBS", "manager-evals", subjects.job_eval(), manager.on_job_event, stop=rt.stop),
        sweep_tinker_sessions(rt.bus, rt.store, rt.stop),
        keep_ledger(rt.bus, rt.stop),  # metering: the USAGE stream into the usage bucket
        broadcast_shares(rt.bus, rt.stop),  # tenants' weights, for the sandbox (it cannot read the bucket)
    )

