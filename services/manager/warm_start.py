"""Warm starts (``init_from``): a job's version 0 taken from weights the tenant already has.

``init_from`` names one of the submitting tenant's:

- jobs, at a committed version: ``"JOB@VERSION"`` or ``"JOB@latest"`` (JOB its id, or its id
  without the tenant's prefix);
- Tinker checkpoints: ``"tinker://<model>/<weights|sampler_weights>/<name>"`` (docs/tinker.md), the
  tenant's own or one another tenant published;
- uploaded PEFT adapters: ``"adapter-..."`` (``POST /v1/adapters``; checked at upload and again
  here against this stack's base: :func:`marlaas.platform.adapter_uploads.adapter_problem_on_base`).

Another tenant's job or unpublished checkpoint is answered as a missing one. The new job's adapter shape
(rank, alpha, target modules) is the source's, which must be one the engine serves
(:func:`servable_problem`): its version 0 is a copy of the source's weights, with a fresh
optimizer. :func:`parse_init_from` and :func:`servable_problem` are the pure decisions;
:func:`resolve_init` reads the bus and the store, and :func:`checked_init` checks what it read
against this stack, as a submission does.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from marlaas.platform import api, subjects, tinker_records
from marlaas.platform.adapter_uploads import adapter_problem_on_base, is_adapter_id, read_uploaded_adapter
from marlaas.platform.adapters import lora_of, read_adapter
from marlaas.platform.bus import VERSIONS_BUCKET, Bus
from marlaas.platform.events import COMMITTED, POLICY, Blob, JobSpec
from marlaas.platform.store import ObjectNotFound, ObjectStore
from marlaas.platform.tinker_records import TinkerCheckpoint

FORMS = ("JOB@VERSION (a version number) or JOB@latest, JOB one of your jobs; a Tinker checkpoint's "
         "tinker://... path; or an uploaded adapter's id (adapter-...)")
MAX_CHECKPOINT_PATH_CHARS = 512


@dataclass(frozen=True)
class InitSource:
    job: str = ""  # the source job's id
    version: int | None = None  # None: its latest committed version
    checkpoint: str = ""  # or a Tinker checkpoint's tinker:// path
    adapter: str = ""  # or an uploaded adapter's id


def parse_init_from(value: str, tenant: str) -> InitSource:
    """The source ``value`` names, or :class:`api.SubmitError` saying what to write."""
    if value.startswith("tinker://"):
        if len(value) > MAX_CHECKPOINT_PATH_CHARS or value.count("/") < 4:
            raise api.SubmitError(f"init_from {value[:80]!r}: a Tinker checkpoint is "
                                  "tinker://<model>/<weights|sampler_weights>/<name> (save_state or "
                                  "save_weights_for_sampler answers it)")
        return InitSource(checkpoint=value)
    if is_adapter_id(value):
        return InitSource(adapter=value)
    job, at, version = value.strip().rpartition("@")
    if not at or not job:
        raise api.SubmitError(f"init_from {value!r}: write {FORMS}")
    if "." not in job:
        job = f"{tenant}.{job}"
    if not subjects.is_job_id(job):  # a wildcard (">", "*") would read every job of the tenant's at once
        raise api.SubmitError(f"init_from {value[:80]!r}: {job[:80]!r} is not a job id (<tenant>.<name>-<suffix>, "
                              "lowercase letters, digits and '-'; `marlaas status` lists yours): write "
                              "JOB@VERSION or JOB@latest")
    if version == "latest":
        return InitSource(job, None)
    if not version.isdigit() or len(version) > 9:
        raise api.SubmitError(f"init_from {value!r}: the version after '@' must be a number or 'latest'")
    return InitSource(job, int(version))


def servable_problem(config_json: bytes, max_rank: int, targets: frozenset[str]) -> str:
    """Why the engine could not serve an adapter of this PEFT config ("" = it can)."""
    lora = lora_of(config_json)
    if not 1 <= lora.rank <= max_rank:
        return (f"its LoRA rank is {lora.rank}, and this stack serves ranks up to {max_rank} "
                "(rollout.max_lora_rank): start from an adapter of a lower rank")
    if strange := sorted(set(lora.target_modules) - targets):
        return (f"it adapts {strange}, which are not linear layers of this stack's base model: it was "
                "trained on another base")
    return ""


async def resolve_init(bus: Bus, store: ObjectStore, tenant: str, value: str) -> tuple[bytes, bytes]:
    """The (config JSON, weights) of the version ``value`` names, or :class:`api.SubmitError`."""
    source = parse_init_from(value, tenant)
    if source.checkpoint:
        return await checkpoint_weights(bus, store, tenant, source.checkpoint)
    if source.adapter:
        files = await asyncio.to_thread(read_uploaded_adapter, store, tenant, source.adapter)
        if files is None:  # another tenant's reads as missing
            raise api.SubmitError(f"init_from {value!r}: no adapter of yours with that id (GET /v1/adapters "
                                  "lists them; `marlaas submit` uploads a local directory named in init_from)")
        return files
    missing = api.SubmitError(f"init_from {value!r}: no job {source.job!r} of yours (`marlaas status` lists them)")
    if not source.job.startswith(f"{tenant}."):
        raise missing  # another tenant's job: answered exactly as a missing one
    entry = await bus.kv_get(VERSIONS_BUCKET, source.job)
    if entry is None:
        raise missing
    committed = COMMITTED.decode(entry.value)
    blob: Blob | None = committed.adapter if source.version in (None, committed.version) else None
    if blob is None:
        for data in await bus.read_all("POLICY", subjects.policy_committed(source.job)):
            event = POLICY.decode(data)
            if event.version == source.version:
                blob = event.adapter
        if blob is None:
            raise api.SubmitError(f"init_from {value!r}: {source.job} has no version {source.version} (it is at "
                                  f"version {committed.version})")
    try:
        return await asyncio.to_thread(read_adapter, store, blob)
    except ObjectNotFound:
        raise api.SubmitError(f"init_from {value!r}: that version is no longer stored (garbage collection keeps "
                              "a job's last versions and the ones pinned: pin it, or start from a later one)") from None


async def checked_init(bus: Bus, store: ObjectStore, spec: JobSpec, base_model_dir: Path, max_rank: int,
                       targets: frozenset[str]) -> tuple[bytes, bytes] | None:
    """The (config JSON, weights) ``spec.init_from`` names, checked against this stack (None
    without ``init_from``), or :class:`api.SubmitError` saying what is wrong with them."""
    if not spec.init_from:
        return None
    warm = await resolve_init(bus, store, spec.tenant, spec.init_from)
    if is_adapter_id(spec.init_from):  # a tenant's file: its shapes against this base too
        problem = await asyncio.to_thread(adapter_problem_on_base, *warm, base_model_dir=base_model_dir,
                                          max_rank=max_rank)
    else:  # the platform's own weights: only whether this engine serves their shape
        problem = servable_problem(warm[0], max_rank, targets)
    if problem:
        raise api.SubmitError(f"init_from {spec.init_from!r}: {problem}")
    return warm


async def checkpoint_weights(bus: Bus, store: ObjectStore, tenant: str, path: str) -> tuple[bytes, bytes]:
    """The (config JSON, weights) of the Tinker checkpoint at ``path``: the tenant's, or a published one."""
    checkpoint = await tinker_records.read(bus, "checkpoint", path, TinkerCheckpoint)
    if checkpoint is None or not tinker_records.can_read(checkpoint, tenant):  # another's unpublished: missing
        raise api.SubmitError(f"init_from {path!r}: no Tinker checkpoint of yours there, nor a published one (the "
                              "SDK's list_user_checkpoints lists yours)")
    try:
        return await asyncio.to_thread(read_adapter, store, checkpoint.adapter)
    except ObjectNotFound:
        raise api.SubmitError(f"init_from {path!r}: that checkpoint's weights are no longer stored") from None
