"""Manager: the user API, the job registry (KV ``jobs``), admission, lifecycle and metrics.

It is the only writer of job records. It creates version 0 of an admitted job
(a seeded LoRA init, committed like any other version), follows policy-committed
announcements to record each job's version, rewards, TTFS and TPTS, and turns
failure reports and cancellations into final states, admitting queued jobs as
room frees up.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import threading
import time
import uuid
from collections.abc import Callable

import msgspec
import structlog

from marlaas.platform import api, limits, subjects
from marlaas.platform import tinker_records as tinker
from marlaas.platform.adapters import init_adapter, write_adapter
from marlaas.platform.bus import JOBS_BUCKET, VERSIONS_BUCKET, Bus, Delivery, StaleRevision
from marlaas.platform.commits import announce
from marlaas.platform.config import Config
from marlaas.platform.events import (
    COMMITTED, JOB, JOB_RECORD, METRIC, POLICY, EventDecodeError, CommittedVersion, EvalPoint, JobEvaluated, JobFailureReported, JobRecord, JobWarningReported,
    JobSpec,
    JobState, JobStateChanged, JobSubmitted, RewardRequest, TRUNCATED_MODES, encode,
)
from marlaas.platform.files import DataFiles
from marlaas.platform.runtime import Runtime
from marlaas.platform.store import ObjectStore
from marlaas.tasks import TaskError, get_task
from marlaas.tools.registry import BUILTIN_REWARDS, ToolNameError, read_tool, reward_subject, split_qualified
from services.manager.adaptive import AdaptiveAdmission
from services.manager.admission import job_footprint, kv_bytes_per_token, to_admit
from services.manager.gc import collect_job
from services.manager.job_admin import (
    LiveSessions, create_tinker_model, create_tinker_session, delete_job, pin_version, quota_refusal, remove_job_data,
    size_refusal,
)
from services.manager.sizing import longest_prompt_tokens, max_token_chars, prompts_refusal, system_refusal

log = structlog.get_logger("manager")
_SLUG = re.compile(r"[^a-z0-9]+")
_TENANT = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
# the range of sampling temperatures accepted: random sampling only (greedy has no logprobs to
# train on), and not so flat or so sharp that float32 logprobs of engine and trainer drift apart
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.05, 5.0
# upper bounds of a submission's integers: generous for real jobs, and within what torch, peft and
# vLLM take (a seed is a torch generator's, which holds a signed 64-bit integer)
MAX_PROMPTS_PER_STEP, MAX_GROUP_SIZE = 4096, 1024
MAX_LORA_ALPHA = 4096
AGENT_METRICS = ("tool/", "episode/")  # per-version figures kept in the job record, beside rewards
GC_EVERY = 5  # versions between garbage collections of a job's stored objects


def linear_module_names(model_dir) -> set[str]:
    """Names LoRA can target: the base model's linear layers (built on the meta device: no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name != "lm_head"}


class Unadmittable(Exception):
    """A queued job that no admission pass can ever admit (its settings cannot be trained)."""


class Manager:
    """Job registry and lifecycle; every record change is a compare-and-set on the ``jobs`` KV."""

    def __init__(self, bus: Bus, store: ObjectStore, config: Config) -> None:
        self.bus, self.store, self.config = bus, store, config
        self.model_dir = config.base_model_dir
        self.files = DataFiles(store, config.home_dir / "cache" / "files", get_task)  # tenants' uploads
        self.bytes_per_token = kv_bytes_per_token(self.model_dir, config.rollout.dtype)
        self.budget_bytes = int(config.manager.kv_budget_gib * 2**30)
        self._admission = asyncio.Lock()
        self._submitting = asyncio.Lock()  # a tenant's quota is counted and its job created as one step
        self._tokenizing = threading.Lock()  # validations run in threads; a fast tokenizer is not re-entrant
        self.sessions = LiveSessions(bus)  # each tenant's Tinker sessions, counted under _submitting
        self._background: set[asyncio.Task] = set()
        self._collecting: dict[str, asyncio.Task] = {}  # each job's running garbage collection
        self._collect_again: set[str] = set()  # ... and committed again meanwhile
        self._waiting = True  # jobs may be queued, or the last admission pass failed
        # the index of unfinished (queued or running) job ids, built by one scan of the registry
        # and kept by this process, the registry's one writer: admission and quotas read only
        # these records, however many finished jobs the registry holds
        self._unfinished: set[str] | None = None
        mc = config.manager
        self.adaptive = (AdaptiveAdmission(mc.target_engine_busy, mc.target_tpts_s, mc.target_trainer_busy)
                         if mc.admission == "adaptive" else None)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.token_chars = max_token_chars(list(self.tokenizer.get_vocab()))
        self.lora_targets = linear_module_names(self.model_dir)

    # --- submission ---------------------------------------------------------------------------

    def validate(self, request: api.SubmitRequest) -> JobRecord:
        """A queued job record from a submission, or :class:`api.SubmitError` saying what to fix.

        It reads the job's data and tokenizes its prompts: :meth:`submit` runs it in a thread. The
        cheap bounds come first (fields, then each text's length in characters: see ``sizing``),
        so that an oversized submission is refused before any costly step."""
        g, lora, rc = request.grpo, request.lora, self.config.rollout
        system_too_long = system_refusal(request.system, rc.max_model_len, self.token_chars)
        problems = [
            (bool(system_too_long), system_too_long),
            (len(request.idempotency_key) > api.MAX_IDEMPOTENCY_KEY_CHARS,
             f"idempotency_key must be at most {api.MAX_IDEMPOTENCY_KEY_CHARS} characters (send one per "
             "submission, e.g. a UUID)"),
            (len(request.name) > 64, "name must be at most 64 characters"),
            (not _TENANT.match(request.tenant), "tenant must be lowercase letters, digits and '-'"),
            (not 1 <= request.steps <= limits.MAX_STEPS, f"steps must be between 1 and {limits.MAX_STEPS}"),
            (not 0 <= request.seed <= limits.MAX_JOB_SEED, f"seed must be between 0 and {limits.MAX_JOB_SEED} (2**63 - 1)"),
            (not 1 <= g.prompts_per_step <= MAX_PROMPTS_PER_STEP,
             f"grpo.prompts_per_step must be between 1 and {MAX_PROMPTS_PER_STEP}"),
            (not 2 <= g.group_size <= MAX_GROUP_SIZE, f"grpo.group_size must be at least 2 and at most "
             f"{MAX_GROUP_SIZE} (GRPO compares samples in a group)"),
            (not MIN_TEMPERATURE <= g.temperature <= MAX_TEMPERATURE,
             f"grpo.temperature must be in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}] (sampling is "
             "random; the trainer scores the same tempered policy)"),
            (not 0 < g.learning_rate < 1, "grpo.learning_rate must be in (0, 1)"),
            (not 0 < g.clip_eps < 1, "grpo.clip_eps must be in (0, 1)"),
            (g.kl_coef < 0, "grpo.kl_coef must be >= 0"),
            (g.truncated not in TRUNCATED_MODES, f"grpo.truncated must be one of {', '.join(TRUNCATED_MODES)} "
             f"(what becomes of an episode cut off before it answered), not {g.truncated!r}"),
            (g.ignore_eos and g.truncated != "train", "grpo.ignore_eos makes every episode end by length "
             "(truncated): with it, grpo.truncated must be 'train'"),
            (not 1 <= lora.rank <= rc.max_lora_rank,
             f"lora.rank must be between 1 and {rc.max_lora_rank} (rollout.max_lora_rank)"),
            (g.max_new_tokens < 0, "grpo.max_new_tokens must be >= 0 (0 = the task's own budget); its "
             "upper bound is rollout.max_model_len less the prompt, checked with the task below"),
            (not 0 <= request.eval_every <= limits.MAX_STEPS,
             f"eval_every must be >= 0 and at most {limits.MAX_STEPS} (0 = no evaluation)"),
            (not 1 <= request.eval_problems <= 1000, "eval_problems must be between 1 and 1000"),
            (bool(request.eval_dataset) and not request.eval_every,
             "eval_dataset is set but eval_every is 0: set eval_every = N to evaluate every N versions"),
            (not 1 <= lora.alpha <= MAX_LORA_ALPHA, f"lora.alpha must be between 1 and {MAX_LORA_ALPHA}"),
            (lora.dropout != 0, "lora.dropout must be 0 for RL jobs: dropout makes the trained policy "
             "differ from the one that sampled the batch (off-policy); drop lora.dropout"),
            (not lora.target_modules, "lora.target_modules must name at least one module"),
            (not set(lora.target_modules) <= self.lora_targets,
             f"lora.target_modules {sorted(set(lora.target_modules) - self.lora_targets)} are not linear "
             f"layers of the base model; choose from {sorted(self.lora_targets)}"),
        ]
        errors = [message for bad, message in problems if bad]
        if errors:
            raise api.SubmitError("; ".join(errors))
        try:  # a file id is looked up among the submitting tenant's files only
            task = self.files.task(request.tenant, request.task, request.dataset, request.corpus)
        except TaskError as exc:
            raise api.SubmitError(str(exc)) from exc
        if request.eval_dataset:
            try:
                self.files.task(request.tenant, request.task, request.eval_dataset, request.corpus)
            except TaskError as exc:
                raise api.SubmitError(f"eval_dataset: {exc}") from exc
        g = msgspec.structs.replace(g, max_new_tokens=g.max_new_tokens or task.max_new_tokens)
        tools = tuple(request.tools) if request.tools is not None else task.tools
        self.check_tool_names(request, task, tools)
        if g.max_new_tokens >= rc.max_model_len:
            raise api.SubmitError(f"grpo.max_new_tokens ({g.max_new_tokens}) leaves no room for the prompt: it "
                                  f"exceeds rollout.max_model_len ({rc.max_model_len}); lower max_new_tokens")
        prompts = task.longest_prompts()
        if refusal := prompts_refusal(prompts, rc.max_model_len, self.token_chars):
            raise api.SubmitError(refusal)
        prompt_tokens = longest_prompt_tokens(self.count_tokens, request.system, prompts, rc.max_model_len,
                                              g.max_new_tokens)
        episode_tokens = min(task.max_episode_tokens(g.max_new_tokens), rc.max_model_len - prompt_tokens)
        footprint = job_footprint(g.prompts_per_step, g.group_size, prompt_tokens, episode_tokens,
                                  self.bytes_per_token)
        if footprint > self.budget_bytes:
            raise api.SubmitError(
                f"the job's rollout needs ~{footprint / 2**20:.1f} MiB of KV cache, more than the "
                f"whole budget ({self.budget_bytes / 2**20:.1f} MiB, manager.kv_budget_gib): lower "
                "grpo.prompts_per_step, grpo.group_size or grpo.max_new_tokens"
            )
        name = request.name.strip() or request.task
        slug = _SLUG.sub("-", name.lower()).strip("-")[:40] or "job"
        spec = JobSpec(id=job_id(request.tenant, slug, request.idempotency_key), tenant=request.tenant,
                       name=name, task=request.task, steps=request.steps, seed=request.seed,
                       dataset=request.dataset, corpus=request.corpus, tools=tools,
                       eval_every=request.eval_every, eval_problems=request.eval_problems,
                       eval_dataset=request.eval_dataset, reward=request.reward, system=request.system,
                       grpo=g, lora=lora,
                       submitted_at=time.time())
        return JobRecord(spec=spec, kv_cache_bytes=footprint)

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Each text's tokens (no special tokens added), one batch call: a fast tokenizer counts
        a batch in parallel, outside the GIL."""
        with self._tokenizing:
            return [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    @staticmethod
    def check_tool_names(request: api.SubmitRequest, task, tools: tuple[str, ...]) -> None:
        """Tools only for agentic tasks, each a valid name in ``builtin`` or the submitter's namespace."""
        if tools and task.kind != "agentic":
            raise api.SubmitError(f"task {task.name!r} is single-turn: it cannot call tools; drop 'tools' "
                                  "or choose an agentic task (`marlaas tasks`)")
        if task.needs_tools and not tools:
            raise api.SubmitError(f"task {task.name!r} needs 'tools': the tools the model may call, at least one "
                                  f"(built-in ones by name, your own as '{request.tenant}.<name>')")
        if not task.has_reward and not request.reward:
            raise api.SubmitError(f"task {task.name!r} needs 'reward': a built-in one "
                                  f"({', '.join(BUILTIN_REWARDS)}) or your own '{request.tenant}.<name>'")
        for name in (*tools, *([request.reward] if "." in request.reward else [])):
            try:
                namespace, _ = split_qualified(name)
            except ToolNameError as exc:
                raise api.SubmitError(str(exc)) from exc
            if namespace not in ("builtin", request.tenant):
                raise api.SubmitError(f"{name!r} belongs to tenant {namespace!r}: a job may use only built-in "
                                      f"tools and its own tenant's ({request.tenant}.<name>)")
        if request.reward and "." not in request.reward and request.reward not in BUILTIN_REWARDS:
            raise api.SubmitError(f"reward {request.reward!r}: name your reward function as "
                                  f"'{request.tenant}.<name>', or a built-in one ({', '.join(BUILTIN_REWARDS)}); "
                                  "the task's own reward needs no 'reward' field")

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
            record = await self.resolve_tools(await asyncio.to_thread(self.validate, request))
            if refusal := await size_refusal(self.bus, record.spec):
                raise api.SubmitError(refusal)
            await self.check_reward_served(record.spec)
        except (api.SubmitError, msgspec.DecodeError) as exc:
            return api.SubmitReply(error=str(exc), code=api.INVALID)
        spec = record.spec
        async with self._submitting:
            if request.idempotency_key and await self.bus.kv_get(JOBS_BUCKET, spec.id) is not None:
                log.info("submission repeated: answered with its job", job=spec.id)
                return api.SubmitReply(id=spec.id)  # the id is the key's: the same submission, retried
            refusal = await quota_refusal(self.bus, spec.tenant, await self.unfinished_records())
            if refusal:
                return api.SubmitReply(error=refusal, code=api.QUOTA)
            try:
                await self.create_job(record)
            except Exception as exc:  # the broker refused or lost the write: the user must hear it
                log.exception("submission not recorded; nothing was created", job=spec.id)
                return api.SubmitReply(code=api.UNAVAILABLE, error=(
                    f"the job could not be recorded ({type(exc).__name__}: {exc}); nothing was created: "
                    "submit it again"))
        log.info("job submitted", job=spec.id, task=spec.task, steps=spec.steps)
        await self.try_admission()
        return api.SubmitReply(id=spec.id)

    async def create_job(self, record: JobRecord) -> None:
        """Write the job's record, then announce it; if the announcement fails, delete the record
        again, so that a submission refused with an error leaves no job behind."""
        job = record.spec.id
        await self.bus.kv_create(JOBS_BUCKET, job, encode(record))
        try:
            await self.bus.publish(subjects.job_submitted(job), encode(JobSubmitted(spec=record.spec)))
        except Exception:
            await self.bus.kv_delete(JOBS_BUCKET, job)
            raise
        self._unfinished.add(job)

    @property
    def submitting_lock(self) -> asyncio.Lock:
        """Held while a tenant's quota is counted and what it counts (a job, a Tinker model) created."""
        return self._submitting

    @property
    def admission_lock(self) -> asyncio.Lock:
        """Held by each admission pass (which may commit version 0 of a queued job)."""
        return self._admission

    def in_background(self, work) -> asyncio.Task:
        """Run ``work`` (a coroutine) as a task the manager keeps a reference to."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

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
        async with self._admission:
            records = await self.unfinished_records()
            limit = self.adaptive.slots(records) if self.adaptive else None
            admitted = to_admit(records, self.budget_bytes, self.config.manager.schedule, limit)
            for job in admitted:
                try:
                    await self.admit(next(r for r in records if r.spec.id == job).spec)
                except Unadmittable as exc:  # the job's own fault: it alone fails, the pass goes on
                    log.warning("job cannot be admitted", job=job, reason=str(exc))
                    await self.transition(job, JobState.FAILED, str(exc), admit_next=False)
                    continue
                except Exception as exc:  # FIFO: the jobs behind it wait too; the next pass retries
                    await self.note_queued(job, f"not admitted yet: admission failed ({type(exc).__name__}: "
                                                f"{exc}); retrying")
                    raise
                if self.adaptive:
                    self.adaptive.admitted(job)
            queued = sum(r.state is JobState.QUEUED for r in records)
            return queued > len(admitted)

    async def note_queued(self, job: str, reason: str) -> None:
        """Say on a queued job's record, and on its state subject, why it is still queued (the
        reason is cleared when it is admitted). A failure here is only logged."""
        reason = limits.cut(reason)

        def change(r: JobRecord) -> JobRecord | None:
            return None if r.state is not JobState.QUEUED or r.reason == reason else msgspec.structs.replace(
                r, reason=reason)

        try:
            if await self.update(job, change) is not None:
                await self.bus.publish(subjects.job_state(job), encode(JobStateChanged(
                    job=job, state=JobState.QUEUED, reason=reason, at=time.time())))
        except Exception:
            log.exception("could not record why the job is still queued", job=job, reason=reason)

    async def admit(self, spec: JobSpec) -> None:
        """Commit version 0 (seeded LoRA init), then mark the job running."""
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
        await self.transition(spec.id, JobState.RUNNING, admitted_at=time.time())
        log.info("job admitted", job=spec.id)

    # --- lifecycle ----------------------------------------------------------------------------

    async def records(self) -> list[JobRecord]:
        out = []
        for key in await self.bus.kv_keys(JOBS_BUCKET):
            entry = await self.bus.kv_get(JOBS_BUCKET, key)
            if entry is None:
                continue
            try:
                out.append(JOB_RECORD.decode(entry.value))
            except EventDecodeError as exc:  # hides only itself: status and admission go on
                log.error("unreadable job record skipped", job=key, error=str(exc))
        return out

    async def unfinished_records(self) -> list[JobRecord]:
        """The queued and running jobs' records, read fresh, through the index (built on first use)."""
        if self._unfinished is None:
            unfinished = [r for r in await self.records() if not r.state.finished]
            self._unfinished = {r.spec.id for r in unfinished}
            return unfinished
        out = []
        for job in sorted(self._unfinished):
            entry = await self.bus.kv_get(JOBS_BUCKET, job)
            record = JOB_RECORD.decode(entry.value) if entry else None
            if record is None or record.state.finished:  # deleted, or finished meanwhile
                self._unfinished.discard(job)
            else:
                out.append(record)
        return out

    async def update(self, job: str, change: Callable[[JobRecord], JobRecord | None]) -> JobRecord | None:
        """Apply ``change`` by compare-and-set, retrying on conflict; None from it means no change."""
        while True:
            entry = await self.bus.kv_get(JOBS_BUCKET, job)
            if entry is None:
                return None
            new = change(JOB_RECORD.decode(entry.value))
            if new is None:
                return None
            try:
                await self.bus.kv_update(JOBS_BUCKET, job, encode(new), entry.revision)
                return new
            except StaleRevision:
                continue

    async def transition(self, job: str, state: JobState, reason: str = "", *, admit_next: bool = True,
                         **fields) -> bool:
        """Move a job to ``state`` unless it is already finished; publish the change. A finished
        job frees room: an admission pass follows, unless ``admit_next`` is False (the caller is
        one, holding its lock). ``reason`` is cut to ``limits.MAX_ERROR_CHARS``."""
        reason = limits.cut(reason)

        def change(r: JobRecord) -> JobRecord | None:
            if r.state.finished or r.state is state:
                return None
            done = {"finished_at": time.time()} if state.finished else {}
            return msgspec.structs.replace(r, state=state, reason=reason, **fields, **done)

        if (record := await self.update(job, change)) is None:
            return False
        await self.bus.publish(subjects.job_state(job),
                               encode(JobStateChanged(job=job, state=state, reason=reason, at=time.time())))
        log.info("job state", job=job, state=state.value, reason=reason)
        if state.finished:
            if self._unfinished is not None:
                self._unfinished.discard(job)
            self.in_background(self.delete_oldest_finished(record.spec.tenant))
            if admit_next:
                await self.try_admission()
        return True

    async def delete_oldest_finished(self, tenant: str) -> None:
        """Delete ``tenant``'s finished jobs beyond its newest ``manager.max_finished_jobs``, each
        whole as a tenant's delete does (a failure is logged: the next finish tries again)."""
        keep = self.config.manager.max_finished_jobs
        try:
            # a job's id starts with its tenant's name and a dot (tenant names have no dots)
            keys = [key for key in await self.bus.kv_keys(JOBS_BUCKET) if key.startswith(f"{tenant}.")]
            if len(keys) <= keep:
                return
            finished = []
            for key in keys:
                entry = await self.bus.kv_get(JOBS_BUCKET, key)
                record = JOB_RECORD.decode(entry.value) if entry else None
                if record is not None and record.state.finished:
                    finished.append((record.finished_at, key))
            for _, job in oldest_beyond(finished, keep):
                async with self._admission:
                    deleted = await remove_job_data(self.bus, self.store, job)
                log.info("finished job deleted: its tenant has more than manager.max_finished_jobs",
                         job=job, tenant=tenant, objects=deleted, keep=keep)
        except Exception:
            log.exception("deleting a tenant's oldest finished jobs failed; the next finish retries", tenant=tenant)

    async def on_policy(self, delivery: Delivery) -> None:
        event = POLICY.decode(delivery.data)

        def change(r: JobRecord) -> JobRecord | None:
            if event.version <= r.version:
                return None  # a repeat announcement
            rewards = list(r.rewards)
            metrics = {key: list(values) for key, values in r.metrics.items()}
            if event.version >= 1 and "reward/mean" in event.metrics:
                rewards.append(event.metrics["reward/mean"])
                for key, value in event.metrics.items():
                    if key.startswith(AGENT_METRICS):
                        metrics.setdefault(key, []).append(value)
            first = r.first_commit_at or (event.committed_at if event.version == 1 else 0.0)
            return msgspec.structs.replace(r, version=event.version, rewards=rewards, metrics=metrics,
                                           first_commit_at=first, last_commit_at=event.committed_at)

        record = await self.update(event.job, change)
        if record is None:  # a repeat: still finish what a crash may have left unfinished
            entry = await self.bus.kv_get(JOBS_BUCKET, event.job)
            record = JOB_RECORD.decode(entry.value) if entry else None
        last = record is not None and record.version >= record.spec.steps
        if last:
            await self.transition(event.job, JobState.COMPLETED)
        # collect every few versions (each pass re-reads the job's announcements) and at the end
        if record is None or not (last or event.version % GC_EVERY == 0):
            return
        if event.job in self._collecting:
            self._collect_again.add(event.job)  # one more pass once the running one ends
            passes = self._collecting[event.job]
        else:
            passes = self._collecting[event.job] = self.in_background(self.collect_garbage(event.job))
        if last:
            delivery.defer()
            self.in_background(self.acknowledge_collected(delivery, event.job, passes))

    async def acknowledge_collected(self, delivery: Delivery, job: str, passes: asyncio.Task) -> None:
        """Ack a finished job's last announcement once a garbage collection pass succeeded.

        No later commit retries a finished job's collection, so until then its announcement stays
        unacknowledged: a failed pass naks it, and a manager killed during the pass leaves it to
        be delivered again; either way it comes back and is collected again. The consumer goes on
        with other announcements meanwhile (a pass over a large bucket can take a listing's time),
        until its ``max_ack_pending`` (4) announcements wait unacknowledged at once.
        """
        try:
            async with delivery.keep_alive():
                ok = await asyncio.shield(passes)
            if ok:
                await delivery.ack()
            else:
                log.warning("the last garbage collection failed; retrying it", job=job,
                            attempt=delivery.num_delivered)
                await delivery.nak(min(delivery.num_delivered, 10))
        except Exception:  # the broker is gone: the unsettled announcement comes back after AckWait
            log.exception("could not settle the last announcement", job=job)

    async def collect_garbage(self, job: str) -> bool:
        """Delete the job's objects no version needs (``services.manager.gc``); return whether the
        last pass succeeded (a failure is logged; the next commit retries it). Passes of one job
        never overlap; a commit during a pass earns one more pass after it."""
        try:
            while True:
                self._collect_again.discard(job)
                try:
                    deleted = await collect_job(self.bus, self.store, job, self.config.manager.gc_keep_last)
                    if deleted:
                        log.info("garbage collected", job=job, objects=deleted)
                    ok = True
                except Exception:
                    log.exception("garbage collection failed; the next commit retries it", job=job)
                    ok = False
                if job not in self._collect_again:
                    return ok
        finally:
            del self._collecting[job]

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
            await self.transition(event.job, JobState.FAILED, f"{event.service}: {event.reason}")
        elif isinstance(event, JobWarningReported):
            await self.update(event.job, lambda r: _with_warning(r, event))
        elif isinstance(event, JobEvaluated):
            await self.update(event.job, lambda r: None if any(e.version == event.version for e in r.evals) else
                              msgspec.structs.replace(r, evals=[*r.evals, EvalPoint(version=event.version,
                                                                                     score=event.score)]))

    # --- API ----------------------------------------------------------------------------------

    async def status(self, data: bytes) -> api.StatusReply:
        request = msgspec.json.decode(data or b"{}", type=api.StatusRequest)
        records = [r for r in await self.records()
                   if (not request.job or r.spec.id == request.job)
                   and (not request.tenant or r.spec.tenant == request.tenant)]
        if request.job and not records:
            return api.StatusReply(error=f"no job {request.job!r}; `marlaas status` lists your jobs")
        records.sort(key=lambda r: r.spec.submitted_at)
        return api.StatusReply(jobs=[api.job_view(r) for r in records])

    async def cancel(self, data: bytes) -> api.CancelReply:
        request = msgspec.json.decode(data, type=api.CancelRequest)
        entry = await self.bus.kv_get(JOBS_BUCKET, request.job)
        record = JOB_RECORD.decode(entry.value) if entry else None
        if record is None or (request.tenant and record.spec.tenant != request.tenant):
            return api.CancelReply(error=f"no job {request.job!r}; `marlaas status` lists your jobs",
                                   code=api.NOT_FOUND)
        if record.state.finished:
            return api.CancelReply(id=request.job, state=record.state.value, code=api.FINISHED,
                                   error=f"job {request.job} already {record.state.value}")
        await self.transition(request.job, JobState.CANCELLED, "cancelled by user")
        return api.CancelReply(id=request.job, state=JobState.CANCELLED.value)


MAX_WARNINGS = 16  # per job: what it depends on is bounded (its tools and reward), and so is this
MAX_WARNING_CHARS = 500


def oldest_beyond(finished: list[tuple[float, str]], keep: int) -> list[tuple[float, str]]:
    """The ``(finished_at, job)`` pairs older than the newest ``keep`` (ties: by job id)."""
    return sorted(finished)[:max(len(finished) - keep, 0)]


def job_id(tenant: str, slug: str, idempotency_key: str = "") -> str:
    """A new job's id: ``<tenant>.<slug>-<suffix>``, the suffix random, or with an idempotency key
    its hash (48 bits: the same key gives the same id, and so the same job; a tenant's keys never
    collide in practice)."""
    if not idempotency_key:
        return f"{tenant}.{slug}-{uuid.uuid4().hex[:6]}"
    digest = hashlib.sha256(f"{tenant}\n{idempotency_key}".encode()).hexdigest()[:12]
    return f"{tenant}.{slug}-{digest}"


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
    await rt.bus.serve(subjects.API_DELETE, "manager", _reply(lambda data: delete_job(manager, data)))
    await rt.bus.serve(subjects.API_PIN, "manager", _reply(lambda data: pin_version(manager, data)))
    await rt.bus.serve(subjects.API_PING, "manager", _pong)
    await rt.bus.serve(subjects.API_TINKER_SESSION, "manager", _reply(lambda data: create_tinker_session(manager, data)))
    await rt.bus.serve(subjects.API_TINKER_MODEL, "manager", _reply(lambda data: create_tinker_model(manager, data)))
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
    )


async def sweep_tinker_sessions(bus, store, stop: asyncio.Event) -> None:
    """End the Tinker sessions whose clients went silent (``marlaas.platform.tinker_records.sweep_sessions``)."""
    while not stop.is_set():
        try:
            for session in await tinker.sweep_sessions(bus, store):
                log.info("tinker session ended: its client went silent", session=session)
        except Exception:
            log.exception("sweeping tinker sessions failed; trying again later")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), tinker.SWEEP_EVERY_S)
