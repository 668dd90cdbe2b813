"""Submissions (``marlaas.api.submit``): a job checked, then recorded as queued, or refused saying why.

A submission is checked in full before anything is written: the data it and its follow-ups name
against the tenant's bounds (from the files' records, before any of it is read), the job against
the stack's facts (``validation``), its tools and its reward served right now, its size against
the tenant's quota, and its ``init_from`` against this stack (``warm_start``). Then, inside the
registry's submission lock, a retried submission (the same idempotency key) is answered with its
job, the tenant's quota is counted, a warm start's weights are copied as version 0, and the record
is created; an admission pass follows.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable

import msgspec
import structlog

from marlaas.platform import api
from marlaas.platform.adapters import linear_module_names, lora_of, write_adapter
from marlaas.platform.bus import JOBS_BUCKET, Bus
from marlaas.platform.config import Config
from marlaas.platform.events import JobRecord, JobSpec, RewardRequest, encode
from marlaas.platform.files import DataFiles
from marlaas.platform.store import ObjectStore
from marlaas.platform.tenants import TenantRecord, get_tenant
from marlaas.tasks import get_task
from marlaas.tools.registry import read_tool, reward_subject
from services.manager.job_admin import lora_slots, quota_refusal, size_refusal
from services.manager.lifecycle import JobRegistry
from services.manager.sizing import max_token_chars
from services.manager.validation import (
    DataSize,
    StackFacts,
    data_refs,
    data_refusal,
    submission_chain,
    validate_submission,
)
from services.manager.warm_start import checked_init

log = structlog.get_logger("manager")


class Submissions:
    """The manager's submissions: each checked against the stack, the tenant's bounds and what is
    served now, then recorded through the registry; ``on_recorded`` (an admission pass) follows."""

    def __init__(self, bus: Bus, store: ObjectStore, config: Config, jobs: JobRegistry, *, kv_bytes_per_token: int,
                 kv_budget_bytes: int, on_recorded: Callable[[], Awaitable[None]]) -> None:
        self.bus, self.store, self.jobs, self.on_recorded = bus, store, jobs, on_recorded
        self.model_dir = config.base_model_dir
        self.files = DataFiles(store, config.home_dir / "cache" / "files", get_task)  # tenants' uploads
        self._tokenizing = threading.Lock()  # validations run in threads; a fast tokenizer is not re-entrant
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.token_chars = max_token_chars(list(self.tokenizer.get_vocab()))
        self.lora_targets = linear_module_names(self.model_dir)
        self.facts = StackFacts(max_model_len=config.rollout.max_model_len, max_lora_rank=config.rollout.max_lora_rank,
                                lora_targets=frozenset(self.lora_targets), token_chars=self.token_chars,
                                kv_bytes_per_token=kv_bytes_per_token, kv_budget_bytes=kv_budget_bytes)

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

    async def checked(self, request: api.SubmitRequest) -> tuple[JobRecord, tuple[bytes, bytes] | None]:
        """The queued record of a submission and its warm start's weights, every check passed
        (nothing written yet), or :class:`api.SubmitError` saying what to fix."""
        # off the event loop: reading the data and tokenizing take time (bounded, see validate)
        tenant = await get_tenant(self.bus, request.tenant)
        record = await self.resolve_tools(await asyncio.to_thread(self.validate, request, tenant))
        if refusal := await size_refusal(self.bus, record.spec):
            raise api.SubmitError(refusal)
        await self.check_reward_served(record.spec)
        warm = await checked_init(self.bus, self.store, record.spec, self.model_dir, self.facts.max_lora_rank,
                                  self.facts.lora_targets)
        return record, warm

    async def submit(self, data: bytes) -> api.SubmitReply:
        """Check a submission, then record the job as queued under the tenant's quota, or say why not."""
        try:
            request = api.parse_submission(msgspec.json.decode(data))
            record, warm = await self.checked(request)
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
        await self.on_recorded()
        return api.SubmitReply(id=spec.id)
