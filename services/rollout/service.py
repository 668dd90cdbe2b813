# over 500 lines: one class, Rollout; its sample, eval and reward paths share its adapters, locks and job sets
"""Rollout shell: on policy-committed(v) sample the job's next GRPO batch with version v only.

Each announcement is handled as its own task (up to ``rollout.concurrency`` jobs at
once), so every job's requests sit in the one engine together and one job's slow
rollout or reward never blocks another's. The message is acked only after the
trajectory batch is published (deduplicated by ``Nats-Msg-Id = <job>:<v>``), so a
rollout crash re-samples the batch rather than stalling the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import shutil
import time
from collections import Counter

import msgspec
import structlog

from marlaas.platform import limits, subjects
from marlaas.platform.adapters import attempt_prefix, materialize
from marlaas.platform.bus import JOBS_BUCKET, SAMPLED_BUCKET, Bus, Delivery, PoisonMessage, StaleRevision
from marlaas.platform.commits import read_job, report_failure, to_announcement
from marlaas.platform.events import (
    JOB,
    JOB_RECORD,
    POLICY,
    REWARD,
    EventDecodeError,
    JobEvaluated,
    JobSpec,
    JobState,
    JobStateChanged,
    PolicyCommitted,
    RewardItem,
    RewardRequest,
    Sample,
    Span,
    TrajectoryBatch,
    TrajectoryReady,
    encode,
)
from marlaas.platform.files import DataFiles, is_file_id
from marlaas.platform.runtime import Runtime
from marlaas.platform.samples import write_samples
from marlaas.platform.store import ObjectStore
from marlaas.platform.telemetry import UTILIZATION_JOB, record_span, span
from marlaas.platform.tenants import tenant_weights
from marlaas.platform.usage import report_usage
from marlaas.tasks import Task, TaskError, get_task
from marlaas.tools.registry import reward_subject
from services.rollout.agent import ConversationFormat, EpisodeLimits, ToolBox, run_episode
from services.rollout.announcements import Reaction, plan_announcement, published_through
from services.rollout.engine import PolicyEngine
from services.rollout.episode import Episode, episode_metrics, episodes_usage, settle_truncated, to_score
from services.rollout.fair_share import RANKS
from services.rollout.frontier import Frontier
from services.rollout.liveness import Liveness
from services.rollout.rounds import SyncRounds, round_members
from services.rollout.tinker_sampling import serve_tinker

log = structlog.get_logger("rollout")
SERVICE = "rollout"
INLINE_BATCH_LIMIT = 256 * 1024  # bigger batches travel through the object store
PUBLISHED = TrajectoryBatch(samples=[])  # sample_groups: every group is out already


# Test-only fault injection: serve the first adapter's weights under every later version's
# fresh name, the failure of vllm#47724 / #42125 that the logprob-gap audit must catch.
EVAL_SEED = 987654321  # the held-out problems: a fixed draw, apart from every training version's
STALE_ADAPTER_FAULT = os.environ.get("MARLAAS_FAULT_STALE_ADAPTER") == "1"


def _seed(*parts: object) -> int:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def batch_seed(spec: JobSpec, version: int) -> int:
    """The problems of a version: decided by (task, dataset, seed, version), never by the job id,
    so the same spec submitted twice trains on the same problems."""
    return _seed("problems", spec.task, spec.dataset or "", spec.seed, version)


def sample_seed(spec: JobSpec, version: int, prompt: int, sample: int, turn: int = 0) -> int:
    """Each (prompt, sample, turn) of a version draws from its own seed stream (none overlap)."""
    return _seed("sample", spec.task, spec.dataset or "", spec.seed, version, prompt, sample, turn)


def digest(values: object) -> str:
    """A short fingerprint recorded in spans, to compare runs without shipping their data."""
    return hashlib.sha256(repr(values).encode()).hexdigest()[:16]


def remove_dead_replicas_caches(root) -> None:
    """Delete the adapter caches of rollout processes that no longer run (killed, crashed)."""
    for cache in root.glob("adapters-*"):
        pid = cache.name.removeprefix("adapters-")
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(cache, ignore_errors=True)
        except PermissionError:
            pass  # alive, someone else's


class UnknownJob(PoisonMessage):
    """An announcement of a job the registry does not hold (deleted, or never submitted)."""


class EngineGone(Exception):
    """The engine cannot serve anymore; the message is retried by the restarted replica."""


class Rollout:
    """Turns policy announcements into trajectory batches."""

    def __init__(self, rt: Runtime, engine: PolicyEngine) -> None:
        self.bus: Bus = rt.bus
        self.store = rt.store
        self.engine = engine
        self.config = rt.config
        self.format = ConversationFormat(engine.tokenizer, rt.config.rollout.prompt_format)
        # per process: replicas on one machine never delete each other's adapter files
        self.cache_dir = rt.config.home_dir / "cache" / f"adapters-{os.getpid()}"
        self.files = DataFiles(rt.store, rt.config.home_dir / "cache" / "files", get_task)  # tenants' uploads
        remove_dead_replicas_caches(self.cache_dir.parent)
        self.tasks: dict[str, Task] = {}
        self.adapter_locks: dict[str, asyncio.Lock] = {}
        self.finished: set[str] = set()  # jobs forgotten: never load an adapter for them again
        self.stopped: set[str] = set()  # jobs cancelled or failed: their episodes start no more turns
        self.keeping: set[asyncio.Task] = set()  # samples being written (``keep_samples``)
        self.sampling: set[tuple[str, int]] = set()  # (job, step) being sampled by this process
        self.in_use: Counter[tuple[str, int]] = Counter()  # (job, version): batches generating with it
        self.released = asyncio.Condition()  # notified when a version is in use no more
        self.eval_tasks: dict[str, Task] = {}  # each job's held-out task (its eval_dataset, if any)
        self.pinned: dict[str, object] = {}  # STALE_ADAPTER_FAULT only: each job's first adapter dir
        # the paper's ablations: sync rounds with a global barrier, and no multi-LoRA batching
        # (one job's requests in the engine at a time)
        self.rounds = (SyncRounds(self.sync_round_members, rt.config.rollout.concurrency)
                       if rt.config.manager.schedule == "sync" else None)
        self.engine_gate = None if rt.config.rollout.multi_lora else asyncio.Lock()
        self.liveness = Liveness(rt.bus, rt.config.rollout.give_up_s)  # jobs' silent tools and rewards

    async def sync_round_members(self) -> set[str]:
        """Ids of the jobs a ``sync`` round waits for: the running ones and those being admitted."""
        records = []
        for key in await self.bus.kv_keys(JOBS_BUCKET):
            entry = await self.bus.kv_get(JOBS_BUCKET, key)
            if entry is not None:
                records.append(JOB_RECORD.decode(entry.value))
        return round_members(records, time.time())

    def engine_turn(self):
        """Held while a job's requests are in the engine; exclusive without multi-LoRA batching."""
        return self.engine_gate or contextlib.nullcontext()

    def prompt_ids(self, spec: JobSpec, problem: dict) -> list[int]:
        """A problem's prompt ids: its ``prompt`` or its conversation (``messages``), the job's
        system prompt and its tools' schemas."""
        messages = problem.get("messages")
        return self.format.prompt_ids(None if messages else problem["prompt"], list(spec.tool_specs),
                                      system=spec.system or None, messages=messages)

    def task_of(self, spec: JobSpec) -> Task:
        if spec.id not in self.tasks:
            try:
                self.tasks[spec.id] = self.files.task(spec.tenant, spec.task, spec.dataset, spec.corpus)
            except TaskError as exc:  # e.g. the dataset file went away since submission
                raise PoisonMessage(str(exc)) from exc
        return self.tasks[spec.id]

    async def handle(self, delivery: Delivery) -> None:
        event: PolicyCommitted = POLICY.decode(delivery.data)
        job, version = event.job, event.version
        state = await read_job(self.bus, job)
        if state is None:
            raise UnknownJob(f"policy-committed for unknown job {job}")
        spec = state.record.spec
        if self.engine.dead:  # vLLM's engine core died: exit, so the supervisor restarts this replica
            raise EngineGone("the vLLM engine is dead")
        sampled = published_through(await sampled_version(self.bus, job), state.committed.version)
        plan = plan_announcement(version, state.record, state.committed.version, sampled,
                                 (job, sampled + 1) in self.sampling)
        if plan.evaluate_final:
            async with delivery.keep_alive():
                await self.evaluate(spec, event)  # the last version is scored too
        if plan.reaction is Reaction.FORGET:
            return await self.forget(job)
        if plan.reaction is not Reaction.SAMPLE:
            return  # an old announcement, or a repeat of the current one: never sampled twice
        if spec.grpo.max_staleness:
            return await self.sample_ahead(delivery, spec)
        step = sampled + 1
        self.sampling.add((job, step))  # no await since the plan: no other task slips in between
        try:
            await self.sample_and_publish(delivery, spec, event, step)
        finally:
            self.sampling.discard((job, step))

    async def sample_ahead(self, delivery: Delivery, spec: JobSpec) -> None:
        """Bounded staleness (``grpo.max_staleness`` = k >= 1): sample every due step at once, each
        with the version committed when it starts, and keep starting the steps that fall due as the
        trainer commits (step s is due once s <= committed + k), until none is running or due.
        Several versions of the job are then in the engine together, each batch (and each
        episode) with one; the batches are published in step order (:meth:`wait_turn`). The
        announcement is acked when this returns; a replica that dies first has it delivered again,
        and an older announcement samples what is due (``plan_announcement``). Once the job is
        cancelled or failed, the steps running end at their episodes' next turn, metered, and
        publish nothing; they are cancelled only when a step fails."""
        job, k = spec.id, spec.grpo.max_staleness
        running: set[asyncio.Task] = set()
        try:
            async with delivery.keep_alive():
                while True:
                    state = await read_job(self.bus, job)
                    if self.engine.dead:
                        break  # the steps running are cancelled (below): this replica restarts
                    if state is None or state.record.state.finished:
                        if state is None or state.record.state is not JobState.COMPLETED:
                            self.stopped.add(job)  # deleted, cancelled or failed: no more turns
                        await asyncio.gather(*running, return_exceptions=True)  # metered, publishing nothing
                        break
                    sampled = published_through(await sampled_version(self.bus, job), state.committed.version)
                    last = min(state.committed.version + k, spec.steps - 1)
                    for step in range(sampled + 1, last + 1):
                        if (job, step) not in self.sampling:  # no await between the check and the add
                            self.sampling.add((job, step))
                            event = to_announcement(state.committed)
                            running.add(asyncio.create_task(self.sample_step(delivery, spec, event, step)))
                    if not running:
                        break
                    done, running = await asyncio.wait(running, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        task.result()  # a failed step fails the announcement (retried, or the job failed)
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def sample_step(self, delivery: Delivery, spec: JobSpec, event: PolicyCommitted, step: int) -> None:
        try:
            await self.sample_and_publish(delivery, spec, event, step)
        finally:
            self.sampling.discard((spec.id, step))

    async def wait_turn(self, spec: JobSpec, step: int) -> bool:
        """Bounded staleness: wait until the batch of ``step - 1`` is published (by this replica or
        another), so the trainer gets the job's batches in step order (no wait at k = 0). False:
        the job finished meanwhile, publish nothing."""
        if not spec.grpo.max_staleness:
            return True
        while True:
            state = await read_job(self.bus, spec.id)
            if state is None or state.record.state.finished:
                return False
            if published_through(await sampled_version(self.bus, spec.id), state.committed.version) >= step - 1:
                return True
            await asyncio.sleep(0.2)

    @contextlib.asynccontextmanager
    async def adapter(self, spec: JobSpec, event: PolicyCommitted):
        """The LoRARequest of ``event``'s version for the body's generation (None once the job is
        finished). At max_staleness 0 the job's lock is held throughout (its one version, never
        cleaned up under a request); at k >= 1 the lock is held only to load, and the version is
        counted in use, so several versions serve at once and none is unloaded or deleted while
        a batch of it generates (``forget`` waits for them)."""
        job, version = spec.id, event.version
        if not spec.grpo.max_staleness:
            async with self._lock(job), self.engine_turn():
                yield await self.load_adapter(job, version, event)
            return
        async with self._lock(job):
            lora = await self.load_adapter(job, version, event)
            if lora is not None:
                self.in_use[(job, version)] += 1
        try:  # no engine_turn (the single-LoRA ablation's gate): a batch waiting to publish its
            yield lora  # turn would hold it from the batch before, which needs it to finish
        finally:
            if lora is not None:
                self.in_use[(job, version)] -= 1
                if not self.in_use[(job, version)]:
                    del self.in_use[(job, version)]
                    async with self.released:
                        self.released.notify_all()

    async def sample_and_publish(self, delivery: Delivery, spec: JobSpec, event: PolicyCommitted,
                                 step: int) -> None:
        """Sample the batch of ``step`` with ``event``'s version (the same at max_staleness 0; in
        its round, under ``sync``), publish it, record it as sampled, then evaluate the version if
        it is due."""
        job, version = spec.id, event.version
        async with delivery.keep_alive():
            if self.task_of(spec).kind == "supervised":  # nothing to generate: the tenant's conversations
                batch = await self.supervised_batch(spec, step)
            elif self.rounds is None and pipelined(spec.grpo):  # each group published as it is scored
                batch = await self.sample_groups(spec, event, step)
            elif self.rounds is None:
                batch = await self.sample_batch(spec, event, step)
            else:  # sync rounds (the paper's baseline) keep whole batches: the barrier is per batch
                async with self.rounds.member(job) as round_:
                    batch = await self.sample_batch(spec, event, step)
                    await round_.sampled(job)  # the barrier: no round member trains before all sampled
            if batch is not None:
                if batch is not PUBLISHED:
                    if not await self.wait_turn(spec, step):
                        return
                    await publish_batch(self.bus, self.store, job, step, batch)
                    self.keep_samples(spec, step, batch, spec.grpo.prompts_per_step)
                await record_sampled(self.bus, job, step)
                if spec.eval_every and version % spec.eval_every == 0 and step == version:  # after the
                    await self.evaluate(spec, event)  # batch: the trainer works on it; the next waits one eval

    async def evaluate(self, spec: JobSpec, event: PolicyCommitted) -> None:
        """Score ``event.version`` greedily on the job's held-out set; publish it as ``job.eval``."""
        version = event.version
        try:
            task = self.eval_tasks.get(spec.id) or self.files.task(spec.tenant, spec.task,
                                                                    spec.eval_dataset or spec.dataset, spec.corpus)
            self.eval_tasks[spec.id] = task
            problems = task.problems(spec.eval_problems, EVAL_SEED)
            prompt_ids = [self.prompt_ids(spec, p) for p in problems]
            async with self.adapter(spec, event) as lora:
                if lora is None:
                    return
                async with (span(self.bus, SERVICE, "eval", spec.id, version, problems=len(problems)),
                            metered(self.bus, spec.id) as started):
                    episodes = await gather_or_cancel(*(
                        self.episode(spec, task, ids, lora, version, i, 0, temperature=0.0, started=started)
                        for i, ids in enumerate(prompt_ids)))
            if spec.id in self.stopped:
                return  # cancelled or failed meanwhile: metered, not scored
            rewards = await self.rewards(spec, [(p, self.final_turn(e)) for p, e in zip(problems, episodes)])
        except (TaskError, PoisonMessage, EventDecodeError, TimeoutError) as exc:  # an eval never fails the training
            log.warning("evaluation failed; training goes on", job=spec.id, version=version, error=str(exc))
            return
        score = sum(rewards) / len(rewards)
        await self.bus.publish(subjects.job_eval(spec.id), encode(JobEvaluated(
            job=spec.id, version=version, score=score, problems=len(problems), at=time.time())),
            msg_id=f"{spec.id}:eval:{version}")
        log.info("evaluated", job=spec.id, version=version, score=round(score, 4))

    async def forget(self, job: str, final: bool = True) -> None:
        """Free what a finished job held: its engine adapter, task and adapter cache. ``final``:
        never load an adapter for it again (else a late announcement may still load one)."""
        async with self._lock(job):
            if final:
                self.finished.add(job)
            async with self.released:  # bounded staleness: its batches still generating finish first
                await self.released.wait_for(lambda: not any(j == job for j, _ in self.in_use))
            self.tasks.pop(job, None)
            self.eval_tasks.pop(job, None)
            self.liveness.forget(job)
            await self.engine.drop_job(job)
            await asyncio.to_thread(shutil.rmtree, self.cache_dir / job, True)

    def _lock(self, job: str) -> asyncio.Lock:
        """Serializes a job's adapter load + generation with its cleanup: vLLM must never find an
        adapter directory deleted under a request (a failed adapter load kills the whole engine)."""
        return self.adapter_locks.setdefault(job, asyncio.Lock())

    async def load_adapter(self, job: str, version: int, event: PolicyCommitted):
        """The LoRARequest for (job, version), or None once the job is finished. Call with the job's lock."""
        if job in self.finished:
            return None
        job_dir = self.cache_dir / job
        adapter_dir = job_dir / f"v{version:06d}"
        await asyncio.to_thread(materialize, self.store, event.adapter, adapter_dir)
        if STALE_ADAPTER_FAULT:
            adapter_dir = self.pinned.setdefault(job, adapter_dir)
        keep = {v for j, v in self.in_use if j == job}  # bounded staleness: versions still generating
        lora = await self.engine.use_adapter(job, version, adapter_dir, keep)
        kept = {job_dir / f"v{v:06d}" for v in keep}
        for old in job_dir.iterdir():  # the engine holds older versions no more
            if old != adapter_dir and old not in kept:
                await asyncio.to_thread(shutil.rmtree, old, True)
        return lora

    async def on_job_state(self, msg) -> None:
        """Free finished jobs when their state says so (on every replica, not only the one that
        sampled last). A completed job is released but not barred: its last announcement may
        still reach this replica and evaluate the final version."""
        try:
            event = JOB.decode(msg.data)
        except EventDecodeError:
            return
        if isinstance(event, JobStateChanged) and event.state.finished:
            if event.state is not JobState.COMPLETED:  # before forget, which waits for its generation
                self.stopped.add(event.job)
            await self.forget(event.job, final=event.state is not JobState.COMPLETED)

    async def give_up(self, delivery: Delivery, exc: Exception) -> None:
        """An announcement that failed every attempt (or was poison): fail its job, not the service."""
        try:
            event = POLICY.decode(delivery.data)
        except EventDecodeError:
            return  # not an announcement at all: no job to fail (the consume loop logged why)
        if isinstance(exc, UnknownJob):
            return  # no such job to fail
        await report_failure(self.bus, event.job, SERVICE,
                             f"sampling version {event.version} failed: {exc}", event.version)

    async def sample_batch(self, spec: JobSpec, event: PolicyCommitted, step: int) -> TrajectoryBatch | None:
        """The job's GRPO batch of ``step`` with version ``event.version`` (the same, but at
        bounded staleness); None if the job just finished."""
        task, grpo, version = self.task_of(spec), spec.grpo, event.version
        problems = task.problems(grpo.prompts_per_step, batch_seed(spec, step))
        prompt_ids = [self.prompt_ids(spec, p) for p in problems]
        # vLLM may (re)load an adapter from its directory whenever a request uses it, so the
        # job's cleanup (forget) waits until its generation is done
        async with self.adapter(spec, event) as lora:
            if lora is None:
                return None
            async with span(self.bus, SERVICE, "generate", spec.id, step, sampled_version=version,
                            problems_sha=digest([p.get("prompt", p.get("messages")) for p in problems])) as attrs:
                frontier = self.frontier(len(prompt_ids), grpo.group_size)
                async with metered(self.bus, spec.id) as started:
                    episodes = await gather_or_cancel(*(
                        self.episode(spec, task, ids, lora, step, i, j, frontier=frontier, started=started)
                        for i, ids in enumerate(prompt_ids) for j in range(grpo.group_size)))
                attrs["completions"] = len(episodes)
                attrs["tokens"] = sum(len(seg.ids) for e in episodes for seg in e.segments if seg.kind == "sampled")
                metrics = episode_metrics(episodes) if task.kind == "agentic" else {}
                attrs.update(metrics)
            # the version that generated it, read while it is held: once the adapter is released (the
            # rewards below take a while) a newer version's load may unload it (bounded staleness)
            served = self.engine.served_version(spec.id, lora)
        if spec.id in self.stopped:
            return None  # cancelled or failed meanwhile: its episodes were cut short, and are metered
        # decoding the model's output is CPU work on untrusted ids: off the event loop
        texts = await asyncio.to_thread(lambda: [self.transcript(e) for e in episodes])
        scored = to_score(episodes, grpo.truncated)
        async with span(self.bus, SERVICE, "reward", spec.id, step) as attrs:
            finals = await asyncio.to_thread(
                lambda: [self.final_turn(e) if s else "" for e, s in zip(episodes, scored)])
            pairs = [(problems[k // grpo.group_size], final)
                     for k, (final, s) in enumerate(zip(finals, scored)) if s]
            judged = iter(await self.rewards(spec, pairs))
            rewards = settle_truncated(episodes, [next(judged) if s else None for s in scored], grpo.truncated)
            attrs["rewards_sha"] = digest([None if r is None else round(r, 6) for r in rewards])
        samples = [e.to_sample(group=k // grpo.group_size, reward=r, text=t)
                   for k, (e, r, t) in enumerate(zip(episodes, rewards, texts)) if r is not None]
        metrics = self.batch_metrics(task, grpo, episodes, len(samples))
        if not all(math.isfinite(lp) for s in samples for lp in s.logprobs):  # JSON would carry null:
            raise PoisonMessage(f"the engine returned a non-finite logprob at version {version}; "  # unreadable
                                "the batch is not published")
        return TrajectoryBatch(samples=samples, policy_version=served, metrics=metrics)

    async def supervised_batch(self, spec: JobSpec, step: int) -> TrajectoryBatch:
        """An ``sft`` job's batch of ``step``: its rows of that step (``Sft.rows_for_step``), each
        rendered with the chat template and the job's tools, the loss mask on the assistant's
        tokens, cut to ``rollout.max_model_len``; one supervised sample a row (no engine work)."""
        task, max_len = self.task_of(spec), self.config.rollout.max_model_len
        rows = task.rows_for_step(step, spec.sft.batch_size, spec.seed)

        def render() -> list[Sample]:
            samples = []
            for i, row in enumerate(rows):
                ids, mask = self.format.conversation_ids(row["messages"], list(spec.tool_specs),
                                                         system=spec.system or None)
                samples.append(Sample(group=i, prompt_ids=[], completion_ids=ids[:max_len], logprobs=[],
                                      loss_mask=mask[:max_len], reward=0.0))
            return samples

        async with span(self.bus, SERVICE, "render", spec.id, step, rows=len(rows)) as attrs:
            samples = await asyncio.to_thread(render)  # tokenizing is CPU work: off the event loop
            attrs["tokens"] = sum(sum(s.loss_mask) for s in samples)
        return TrajectoryBatch(samples=samples, policy_version=step, objective="sft")

    async def sample_groups(self, spec: JobSpec, event: PolicyCommitted, step: int) -> TrajectoryBatch | None:
        """``grpo.pipeline = "groups"``: sample the version's batch as :meth:`sample_batch` does, but
        score each GRPO group and publish it (``publish_group``) the moment its last episode ends,
        so the trainer works on it while later groups are generated. The last group out carries
        the batch's episode metrics. Returns :data:`PUBLISHED`, or None if the job just finished.
        A failure cancels the groups still running; the retried announcement samples the batch
        again, and the groups already out are dropped as repeats (by the broker within its
        duplicate window, by the trainer after it)."""
        task, grpo, version = self.task_of(spec), spec.grpo, event.version
        problems = task.problems(grpo.prompts_per_step, batch_seed(spec, step))
        prompt_ids = [self.prompt_ids(spec, p) for p in problems]
        every: dict[int, tuple[list[Episode], list[float | None]]] = {}
        reward_times: list[tuple[float, float]] = []
        frontier = self.frontier(len(prompt_ids), grpo.group_size)
        finished: list[int] = []  # groups left unpublished: the job finished while they waited their turn

        async def group(i: int, ids: list[int], lora) -> None:
            async with metered(self.bus, spec.id) as started:
                episodes = await gather_or_cancel(*(
                    self.episode(spec, task, ids, lora, step, i, j, frontier=frontier, started=started)
                    for j in range(grpo.group_size)))
            if spec.id in self.stopped:
                finished.append(i)  # cancelled or failed meanwhile: metered, never scored
                return
            texts = await asyncio.to_thread(lambda: [self.transcript(e) for e in episodes])
            scored = to_score(episodes, grpo.truncated)
            scoring = time.time()
            finals = await asyncio.to_thread(
                lambda: [self.final_turn(e) if s else "" for e, s in zip(episodes, scored)])
            judged = iter(await self.rewards(spec, [(problems[i], f) for f, s in zip(finals, scored) if s]))
            rewards = settle_truncated(episodes, [next(judged) if s else None for s in scored], grpo.truncated)
            reward_times.append((scoring, time.time()))
            samples = [e.to_sample(group=i, reward=r, text=t) for e, r, t in zip(episodes, rewards, texts)
                       if r is not None]
            if not all(math.isfinite(lp) for s in samples for lp in s.logprobs):
                raise PoisonMessage(f"the engine returned a non-finite logprob at version {version}; "
                                    "the group is not published")
            every[i] = (episodes, rewards)
            last = len(every) == len(prompt_ids)  # no await since the line above: the last group out knows
            metrics = self.batch_metrics(task, grpo, [e for k in sorted(every) for e in every[k][0]],
                                         sum(r is not None for _, rs in every.values() for r in rs)) if last else {}
            if not await self.wait_turn(spec, step):
                finished.append(i)  # the job finished: publish nothing more
                return
            batch = TrajectoryBatch(samples=samples, policy_version=self.engine.served_version(spec.id, lora),
                                    metrics=metrics)
            await publish_group(self.bus, self.store, spec.id, step, i, len(prompt_ids), batch)
            self.keep_samples(spec, step, batch, len(prompt_ids))

        async with self.adapter(spec, event) as lora:
            if lora is None:
                return None
            started = time.time()
            await gather_or_cancel(*(group(i, ids, lora) for i, ids in enumerate(prompt_ids)))
        if finished:
            return None
        episodes = [e for k in sorted(every) for e in every[k][0]]
        rewards = [r for k in sorted(every) for r in every[k][1]]
        generate = {"problems_sha": digest([p.get("prompt", p.get("messages")) for p in problems]),
                    "completions": len(episodes), "pipeline": "groups", "sampled_version": version,
                    "tokens": sum(len(seg.ids) for e in episodes for seg in e.segments if seg.kind == "sampled"),
                    **(episode_metrics(episodes) if task.kind == "agentic" else {})}
        generated = max(scoring_began for scoring_began, _ in reward_times)  # the last group's last episode
        await record_span(self.bus, SERVICE, "generate", spec.id, step, started, generated, **generate)
        await record_span(self.bus, SERVICE, "reward", spec.id, step, min(s for s, _ in reward_times),
                          max(e for _, e in reward_times),
                          rewards_sha=digest([None if r is None else round(r, 6) for r in rewards]))
        return PUBLISHED

    def keep_samples(self, spec: JobSpec, step: int, batch: TrajectoryBatch, batch_groups: int) -> None:
        """Keep a bounded record of a published batch's (or group's) episodes for the job's tenant
        (``marlaas.platform.samples``), in the background: a view for people, so the next version
        never waits on it and its failure is logged, never the batch's."""
        task = asyncio.create_task(self._keep_samples(spec, step, batch, batch_groups))
        self.keeping.add(task)
        task.add_done_callback(self.keeping.discard)

    async def _keep_samples(self, spec: JobSpec, step: int, batch: TrajectoryBatch, batch_groups: int) -> None:
        tokenizer = self.engine.tokenizer
        try:
            await asyncio.to_thread(write_samples, self.store, spec.id, step, batch,
                                    lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                                    scale_by_std=spec.grpo.scale_by_std, batch_groups=batch_groups)
        except Exception:  # noqa: BLE001 -- deliberately tolerated: the batch is out already
            log.exception("this version's samples were not kept", job=spec.id, version=step)

    @staticmethod
    def batch_metrics(task: Task, grpo, episodes: list[Episode], kept: int) -> dict[str, float]:
        """A batch's episode figures (agentic tasks, or episodes settled by ``grpo.truncated``)."""
        metrics = episode_metrics(episodes) if task.kind == "agentic" else {}
        if task.kind == "agentic" or grpo.truncated != "train":
            metrics["episode/truncated"] = float(sum(e.truncated for e in episodes))
            metrics["episode/dropped"] = float(len(episodes) - kept)
        return metrics

    async def episode(self, spec: JobSpec, task: Task, prompt_ids: list[int], lora, step: int,
                      prompt: int, sample: int, temperature: float | None = None,
                      frontier: Frontier | None = None, started: list[Episode] | None = None) -> Episode:
        """One sample: a single turn for single-turn tasks, a tool-using episode for agentic ones
        (one adapter version, ``lora``, from its first token to its last); ``step`` seeds it.
        ``frontier``: its batch's count, under ``rollout.dispatch = "frontier"``. ``started``: the
        list of :func:`metered` it goes into before its first request. Once its job is cancelled
        or failed it starts no more turns (``stopped``)."""
        grpo, rc = spec.grpo, self.config.rollout
        limits = EpisodeLimits(
            max_new_tokens=grpo.max_new_tokens,
            max_tool_calls=task.max_tool_calls if task.kind == "agentic" else 0,
            max_observation_tokens=task.max_observation_tokens,
            max_total_tokens=min(rc.max_model_len, len(prompt_ids) + task.max_episode_tokens(grpo.max_new_tokens)),
            tool_timeout_s=rc.tool_timeout_s,
        )
        tools = ToolBox(spec.id, list(spec.tools), self.watched_request(spec.id), rc.tool_timeout_s,
                        self.engine.utilization, context=tool_context(spec, task))
        episode = Episode(prompt_ids)
        if started is not None:
            started.append(episode)
        try:
            return await run_episode(
                self.engine, self.format, prompt_ids, tools=tools, limits=limits,
                temperature=grpo.temperature if temperature is None else temperature,
                lora=lora, seed=lambda turn: sample_seed(spec, step, prompt, sample, turn),
                ignore_eos=grpo.ignore_eos and temperature is None,  # evaluations answer freely
                priority=frontier.of(prompt) if frontier else None, tenant=spec.tenant,
                rank=RANKS.get(spec.priority, RANKS["normal"]), episode=episode,
                stopped=lambda: spec.id in self.stopped)
        finally:
            if frontier:
                frontier.done(prompt)

    def frontier(self, groups: int, group_size: int) -> Frontier | None:
        """A batch's count for frontier-group dispatch (None under ``rollout.dispatch = "fifo"``)."""
        return Frontier(groups, group_size) if self.config.rollout.dispatch == "frontier" else None

    def watched_request(self, job: str):
        """``bus.request`` for ``job``'s tool calls, telling :attr:`liveness` which tools answer."""
        async def request(subject: str, data: bytes, timeout_s: float) -> bytes:
            what = "tool " + subject.removeprefix(f"{subjects.TOOL}.")
            try:
                reply = await self.bus.request(subject, data, timeout_s)
            except TimeoutError:
                await self.liveness.unanswered(job, what)
                raise
            await self.liveness.answered(job, what)
            return reply

        return request

    def transcript(self, episode: Episode) -> str:
        """Everything after the prompt, as text (the sample's ``text``, for people to read)."""
        return self.engine.tokenizer.decode(episode.ids[len(episode.prompt_ids):], skip_special_tokens=True)

    def final_turn(self, episode: Episode) -> str:
        """What a reward judges: the model's own last turn, never a tool's output or template markup."""
        return self.engine.tokenizer.decode(episode.final_turn_ids, skip_special_tokens=True)

    async def rewards(self, spec: JobSpec, pairs: list[tuple[dict, str]]) -> list[float]:
        """Scores of each (problem, completion) by the task's or the job's reward."""
        if not pairs:  # every episode was settled without a reward (grpo.truncated)
            return []
        items = [RewardItem(problem=p, completion=text) for p, text in pairs]
        request = RewardRequest(job=spec.id, task=spec.task, items=items, dataset=spec.dataset or "",
                                corpus=spec.corpus or "", tenant=spec.tenant)
        subject = reward_subject(spec.reward) if spec.reward else subjects.task_reward(spec.task)
        data, limit = encode(request), self.bus.nc.max_payload
        if len(data) > limit:  # never sendable: fail the job now rather than after every retry
            raise PoisonMessage(
                f"the reward request for {len(items)} completions is {len(data)} bytes, over the broker's "
                f"max_payload ({limit} bytes): lower grpo.prompts_per_step, grpo.group_size or "
                "grpo.max_new_tokens, or keep the dataset's records smaller")
        what = f"reward {spec.reward or spec.task}"
        try:
            reply = REWARD.decode(await self.bus.request(subject, data, self.config.rollout.reward_timeout_s))
        except TimeoutError:
            if await self.liveness.unanswered(spec.id, what):
                raise PoisonMessage(f"{what} stopped answering") from None  # failed: no more retries
            raise  # retried (the env may be restarting)
        await self.liveness.answered(spec.id, what)
        if reply.error:
            raise PoisonMessage(reply.error)
        if len(reply.rewards) != len(items):
            raise PoisonMessage(f"env returned {len(reply.rewards)} rewards for {len(items)} completions")
        return reply.rewards



@contextlib.asynccontextmanager
async def metered(bus: Bus, job: str):
    """A list for the episodes the body starts (:meth:`Rollout.episode`'s ``started``), whose usage
    is reported for ``job`` when the body ends, however it ends: done, failed, or cancelled
    half-way. So a job cancelled or failed before its batch is published is metered too, as far
    as its episodes went (issue 48)."""
    started: list[Episode] = []
    try:
        yield started
    finally:  # shielded: a second cancellation must not lose the figures of the first
        await asyncio.shield(report_usage(bus, SERVICE, job, episodes_usage(started)))


def pipelined(grpo) -> bool:
    """Whether a job's batches travel group by group (``grpo.pipeline``; a batch of more than
    ``MAX_PIPELINED_GROUPS`` groups travels whole: the trainer holds a batch's groups unacked)."""
    return grpo.pipeline == "groups" and grpo.prompts_per_step <= limits.MAX_PIPELINED_GROUPS


def tool_context(spec: JobSpec, task: Task) -> dict[str, str]:
    """What the job's tool calls carry: the task's context, with an uploaded corpus named by its
    file id and tenant rather than by this replica's cached copy (env fetches its own)."""
    context = task.tool_context()
    if "corpus" in context and is_file_id(spec.corpus):
        context.update(corpus=spec.corpus, tenant=spec.tenant)
    return context


async def sampled_version(bus: Bus, job: str) -> int:
    """The last step of ``job`` whose batch rollout published (-1: none; the step a batch trains
    is the version it was sampled by, but at bounded staleness)."""
    entry = await bus.kv_get(SAMPLED_BUCKET, job)
    return int(entry.value) if entry else -1


async def record_sampled(bus: Bus, job: str, version: int) -> None:
    """Remember that ``version``'s batch is published: a repeated announcement samples nothing.
    Never backwards (compare-and-set): a step sampled after a later one (its announcement read a
    lagging record, :func:`published_through`) leaves the later one recorded."""
    while True:
        entry = await bus.kv_get(SAMPLED_BUCKET, job)
        if entry is None:  # the job's first batch (or its record deleted with the job): as before
            await bus.kv_put(SAMPLED_BUCKET, job, str(version).encode())
            return
        if int(entry.value) >= version:
            return
        try:
            await bus.kv_update(SAMPLED_BUCKET, job, str(version).encode(), entry.revision)
            return
        except StaleRevision:
            continue


async def publish_batch(bus: Bus, store: ObjectStore, job: str, version: int, batch: TrajectoryBatch) -> None:
    """Publish ``version``'s batch for the trainer, deduplicated by ``Nats-Msg-Id = <job>:v<version>``;
    a batch bigger than ``INLINE_BATCH_LIMIT`` goes to the object store first and travels by reference."""
    batch_id = f"{job}:v{version}"
    event = TrajectoryReady(job=job, version=version, batch_id=batch_id, batch=batch, sampled_at=time.time())
    data = encode(event)
    if len(data) > INLINE_BATCH_LIMIT:  # by reference: written fully before it is announced
        ref = await asyncio.to_thread(
            store.put_bytes, attempt_prefix("trajectories", job, version) + "/batch.json", encode(batch),
        )
        data = encode(TrajectoryReady(job=job, version=version, batch_id=batch_id,
                                      batch_ref=ref, sampled_at=event.sampled_at))
    await bus.publish(subjects.trajectory_ready(job), data, msg_id=batch_id)


async def publish_group(bus: Bus, store: ObjectStore, job: str, version: int, group: int, groups: int,
                        batch: TrajectoryBatch) -> None:
    """Publish one GRPO group of ``version``'s batch (``grpo.pipeline = "groups"``), deduplicated by
    ``Nats-Msg-Id = <job>:v<version>:g<group>``; by reference when bigger than ``INLINE_BATCH_LIMIT``."""
    batch_id = f"{job}:v{version}"
    event = TrajectoryReady(job=job, version=version, batch_id=batch_id, batch=batch, sampled_at=time.time(),
                            group=group, groups=groups)
    data = encode(event)
    if len(data) > INLINE_BATCH_LIMIT:
        ref = await asyncio.to_thread(
            store.put_bytes, attempt_prefix("trajectories", job, version) + f"/group-{group}.json", encode(batch))
        data = encode(msgspec.structs.replace(event, batch=None, batch_ref=ref))
    await bus.publish(subjects.trajectory_ready(job), data, msg_id=f"{batch_id}:g{group}")


async def gather_or_cancel(*awaitables):
    """``asyncio.gather``, but the first failure cancels the others (and is raised as itself)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def report_utilization(bus: Bus, engine: PolicyEngine, stop: asyncio.Event, every_s: float = 2.0) -> None:
    """Publish the engine's busy time (and its overlap with pending tool calls) and its busy
    intervals as spans."""
    while not stop.is_set():
        start = time.time()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
        totals = engine.utilization.take()
        if any(totals.values()):
            await bus.publish(subjects.span(UTILIZATION_JOB), encode(Span(
                job=UTILIZATION_JOB, service=SERVICE, phase="utilization", version=-1, start=start,
                end=time.time(), attrs=totals)))
        for busy_start, busy_end in engine.utilization.take_intervals():
            await bus.publish(subjects.span(UTILIZATION_JOB), encode(Span(
                job=UTILIZATION_JOB, service=SERVICE, phase="engine", version=-1, start=busy_start,
                end=busy_end)))


async def keep_weights(bus: Bus, engine: PolicyEngine, stop: asyncio.Event, every_s: float = 5.0) -> None:
    """Keep the engine's copy of the tenants' weights (its fair share) current until ``stop``."""
    while not stop.is_set():
        with contextlib.suppress(Exception):  # the bucket unreadable a moment: the last weights hold
            engine.weights = await tenant_weights(bus)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


async def run(rt: Runtime) -> None:
    """Start the engine (tens of seconds on CPU), then serve announcements until stopped."""
    engine = PolicyEngine(rt.config)
    try:
        kernels = await engine.check_lora_kernels(rt.config.rollout.cpu_lora_kernels)
    except BaseException:
        engine.shutdown()
        raise
    rollout = Rollout(rt, engine)
    rt.ready()
    log.info("ready", base_model=str(rt.config.base_model_dir), lora_kernels=kernels)
    await rt.bus.nc.subscribe(subjects.job_state(), cb=rollout.on_job_state)
    watchdog = asyncio.create_task(engine.watch(rt.stop))
    reporter = asyncio.create_task(report_utilization(rt.bus, engine, rt.stop))
    weigher = asyncio.create_task(keep_weights(rt.bus, engine, rt.stop))
    try:
        await asyncio.gather(
            rt.bus.consume("POLICY", "rollout", subjects.policy_committed(), rollout.handle,
                           stop=rt.stop, ack_wait_s=rt.config.rollout.ack_wait_s,
                           concurrency=rt.config.rollout.concurrency, on_give_up=rollout.give_up),
            # Tinker clients' asample, on the same engine (services/rollout/tinker_sampling.py)
            serve_tinker(rt, rollout),
        )
    finally:
        watchdog.cancel()
        reporter.cancel()
        weigher.cancel()
        dead = engine.dead
        engine.shutdown()
        shutil.rmtree(rollout.cache_dir, ignore_errors=True)
    if dead:
        raise SystemExit("rollout: the vLLM engine died; exiting so that this replica is restarted")
