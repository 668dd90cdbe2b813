"""Warm starts (``init_from``): a job's version 0 taken from another job's committed version.

``init_from = "JOB@VERSION"`` or ``"JOB@latest"``, JOB a job of the submitting tenant (its id, or
its id without the tenant's prefix). Another tenant's job is answered as a missing one. The new
job's adapter shape (rank, alpha, target modules) is the source's: its version 0 is a copy of the
source's weights, with a fresh optimizer. :func:`parse_init_from` is the pure decision;
:func:`resolve_init` reads the bus and the store.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from marlaas.platform import api, subjects
from marlaas.platform.adapters import read_adapter
from marlaas.platform.bus import VERSIONS_BUCKET, Bus
from marlaas.platform.events import COMMITTED, POLICY, Blob, LoraSettings
from marlaas.platform.store import ObjectNotFound, ObjectStore

FORMS = "JOB@VERSION (a version number) or JOB@latest, JOB one of your jobs"


@dataclass(frozen=True)
class InitSource:
    job: str  # the source job's id
    version: int | None  # None: its latest committed version


def parse_init_from(value: str, tenant: str) -> InitSource:
    """The source ``value`` names, or :class:`api.SubmitError` saying what to write."""
    job, at, version = value.strip().rpartition("@")
    if not at or not job:
        raise api.SubmitError(f"init_from {value!r}: write {FORMS}")
    if "." not in job:
        job = f"{tenant}.{job}"
    if version == "latest":
        return InitSource(job, None)
    if not version.isdigit() or len(version) > 9:
        raise api.SubmitError(f"init_from {value!r}: the version after '@' must be a number or 'latest'")
    return InitSource(job, int(version))


def lora_of(config_json: bytes) -> LoraSettings:
    """The LoRA shape a PEFT ``adapter_config.json`` describes."""
    config = json.loads(config_json)
    return LoraSettings(rank=int(config["r"]), alpha=int(config["lora_alpha"]),
                        target_modules=tuple(sorted(config["target_modules"])))


async def resolve_init(bus: Bus, store: ObjectStore, tenant: str, value: str) -> tuple[bytes, bytes]:
    """The (config JSON, weights) of the version ``value`` names, or :class:`api.SubmitError`."""
    source = parse_init_from(value, tenant)
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
