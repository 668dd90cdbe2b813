"""Admission passes: queued jobs admitted as room frees up, each from its version 0.

A pass reads the unfinished jobs, asks ``admission.to_admit`` (pure: the KV-cache budget and the
schedule, capped by ``adaptive`` when that policy runs) which to admit, and admits them in order:
version 0 committed (a warm start's copied weights, or a seeded LoRA init), announced, then the
job marked running. A job whose version 0 cannot be built from its settings fails alone; any
other failure stops the pass (the jobs behind it wait, in FIFO order) and the next one retries.
Submissions and finished jobs set off a pass; :meth:`AdmissionPasses.keep_admitting` repeats one
while jobs wait or the last one failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import structlog

from marlaas.platform.adapters import init_adapter, write_adapter
from marlaas.platform.bus import VERSIONS_BUCKET, Bus, StaleRevision
from marlaas.platform.commits import announce
from marlaas.platform.events import COMMITTED, CommittedVersion, JobSpec, JobState, encode
from marlaas.platform.store import ObjectStore
from services.manager.adaptive import AdaptiveAdmission
from services.manager.admission import to_admit
from services.manager.lifecycle import JobRegistry

log = structlog.get_logger("manager")


class Unadmittable(Exception):
    """A queued job that no admission pass can ever admit (its settings cannot be trained)."""


async def commit_version_zero(bus: Bus, store: ObjectStore, model_dir: Path, spec: JobSpec) -> CommittedVersion:
    """The job's version 0, committed now unless a previous manager run did: a warm start's
    copied weights (``spec.init_adapter``), else a LoRA init seeded by ``spec.seed``."""
    if await bus.kv_get(VERSIONS_BUCKET, spec.id) is None and spec.init_adapter is not None:
        v0 = CommittedVersion(job=spec.id, version=0, adapter=spec.init_adapter, committed_at=time.time())
        with contextlib.suppress(StaleRevision):  # a previous manager run committed v0 already
            await bus.kv_create(VERSIONS_BUCKET, spec.id, encode(v0))
    if await bus.kv_get(VERSIONS_BUCKET, spec.id) is None:
        try:
            config_json, weights = await asyncio.to_thread(init_adapter, model_dir, spec.lora, spec.seed)
        except (OSError, MemoryError):
            raise  # the machine's fault (the base model's config unreadable): retried
        except Exception as exc:  # init_adapter is a function of the spec: retrying cannot help
            raise Unadmittable(f"not admitted: version 0 cannot be built from the job's settings "
                               f"({type(exc).__name__}: {exc}); fix them and submit the job again") from exc
        adapter = await asyncio.to_thread(write_adapter, store, spec.id, 0, config_json, weights)
        v0 = CommittedVersion(job=spec.id, version=0, adapter=adapter, committed_at=time.time())
        with contextlib.suppress(StaleRevision):  # a previous manager run committed v0 already
            await bus.kv_create(VERSIONS_BUCKET, spec.id, encode(v0))
    return COMMITTED.decode((await bus.kv_get(VERSIONS_BUCKET, spec.id)).value)


class AdmissionPasses:
    """The manager's admission passes over the registry's queued jobs, under its admission lock."""

    def __init__(self, bus: Bus, store: ObjectStore, jobs: JobRegistry, *, model_dir: Path, budget_bytes: int,
                 schedule: str, adaptive: AdaptiveAdmission | None) -> None:
        self.bus, self.store, self.jobs = bus, store, jobs
        self.model_dir, self.budget_bytes, self.schedule, self.adaptive = model_dir, budget_bytes, schedule, adaptive
        self._waiting = True  # jobs may be queued, or the last admission pass failed

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
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)

    async def admit_queued(self) -> bool:
        """Admit the queued jobs that fit; return whether any job is left waiting."""
        async with self.jobs.admission_lock:
            records = await self.jobs.unfinished_records()
            limit = self.adaptive.slots(records) if self.adaptive else None
            admitted = to_admit(records, self.budget_bytes, self.schedule, limit)
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
        committed = await commit_version_zero(self.bus, self.store, self.model_dir, spec)
        await announce(self.bus, committed)  # before "running": a crash in between re-admits
        await self.jobs.transition(spec.id, JobState.RUNNING, admitted_at=time.time())
        log.info("job admitted", job=spec.id)
