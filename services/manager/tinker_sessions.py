"""Tinker sessions and models: recording them under the tenants' quotas, and ending silent sessions.

The gateway's Tinker API records sessions and models through the manager (``marlaas.api.tinker_session``,
``marlaas.api.tinker_model``): a tenant's live Tinker models count against ``max_jobs`` beside its
jobs, and its live sessions against ``manager.max_tinker_sessions``, each counted and taken in one
step under the registry's submission lock (issue 35, F5: 24 concurrent ``create_model`` calls had
made 24 models against a quota of 8). A session whose client went silent is ended by
:func:`sweep_tinker_sessions`, which also deletes the checkpoints whose TTL ran out.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import structlog

from marlaas.platform import api
from marlaas.platform import tinker_records as tinker
from marlaas.platform.bus import TINKER_BUCKET, Bus
from marlaas.platform.store import ObjectStore
from services.manager.job_admin import CREATE_MODEL_AGAIN, quota_refusal
from services.manager.lifecycle import JobRegistry

log = structlog.get_logger("manager")


class LiveSessions:
    """Each tenant's Tinker sessions not known to have finished: the ids, built by one scan of the
    ``tinker`` bucket on first use and kept by the manager, which records every new session; each
    count re-reads the tenant's own sessions only (however many other tenants' the bucket holds)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._ids: dict[str, set[str]] | None = None

    async def count(self, tenant: str, now: float | None = None) -> int:
        """``tenant``'s live sessions (``marlaas.platform.tinker_records.is_live``); finished ones leave the index."""
        now = time.time() if now is None else now
        if self._ids is None:
            self._ids = {}
            for session_key in await self.bus.kv_keys(TINKER_BUCKET, under="session"):
                entry = await self.bus.kv_get(TINKER_BUCKET, session_key)
                session = msgspec.json.decode(entry.value, type=tinker.TinkerSession) if entry else None
                if session is not None and not session.finished:
                    self._ids.setdefault(session.tenant, set()).add(session.id)
        live = 0
        for session_id in sorted(self._ids.get(tenant, ())):
            session = await tinker.read(self.bus, "session", session_id, tinker.TinkerSession)
            if session is None or session.finished:
                self._ids[tenant].discard(session_id)
            else:
                live += tinker.is_live(session, now)
        return live

    def add(self, session: tinker.TinkerSession) -> None:
        if self._ids is not None:
            self._ids.setdefault(session.tenant, set()).add(session.id)


class TinkerQuotas:
    """Records Tinker sessions and models, each only within its tenant's quota (HTTP 429 past it)."""

    def __init__(self, jobs: JobRegistry, max_sessions: int) -> None:
        self.jobs, self.bus = jobs, jobs.bus
        self.max_sessions = max_sessions  # manager.max_tinker_sessions
        self.sessions = LiveSessions(jobs.bus)  # each tenant's sessions, counted under the submission lock

    async def create_session(self, data: bytes) -> api.TinkerReply:
        """Record a new Tinker session unless its tenant already has ``manager.max_tinker_sessions``
        live ones (HTTP 429)."""
        session = msgspec.json.decode(data, type=api.TinkerSessionRequest).session
        limit = self.max_sessions
        async with self.jobs.submitting_lock:
            live = await self.sessions.count(session.tenant)
            if live >= limit:
                return api.TinkerReply(code=api.QUOTA, error=(
                    f"tenant {session.tenant!r} already has {live} live Tinker sessions, the most a tenant may "
                    f"hold (manager.max_tinker_sessions = {limit}): close a ServiceClient you no longer use (its "
                    f"session ends), or wait {tinker.SESSION_LIVE_S:.0f} s for a silent one to lapse, then create "
                    "it again"))
            await tinker.write(self.bus, "session", session.id, session)
            self.sessions.add(session)
        log.info("tinker session created", tenant=session.tenant, session=session.id)
        return api.TinkerReply(id=session.id)

    async def create_model(self, data: bytes) -> api.TinkerReply:
        """Record a Tinker model if its tenant's unfinished jobs and live models stay under ``max_jobs``
        (HTTP 429); a model already recorded (a retried request) is answered as created."""
        model = msgspec.json.decode(data, type=api.TinkerModelRequest).model
        async with self.jobs.submitting_lock:
            if await tinker.read(self.bus, "model", model.id, tinker.TinkerModel, model.tenant) is not None:
                return api.TinkerReply(id=model.id)
            refusal = await quota_refusal(self.bus, model.tenant, await self.jobs.unfinished_records(),
                                          then=CREATE_MODEL_AGAIN)
            if refusal:
                return api.TinkerReply(error=refusal, code=api.QUOTA)
            await tinker.write(self.bus, "model", model.id, model)
        log.info("tinker model created", tenant=model.tenant, model=model.id)
        return api.TinkerReply(id=model.id)


async def sweep_tinker_sessions(bus: Bus, store: ObjectStore, stop: asyncio.Event) -> None:
    """End the Tinker sessions whose clients went silent (``marlaas.platform.tinker_records.sweep_sessions``)
    and delete the checkpoints whose TTL ran out (``sweep_checkpoints``)."""
    while not stop.is_set():
        try:
            for session in await tinker.sweep_sessions(bus, store):
                log.info("tinker session ended: its client went silent", session=session)
        except Exception:
            log.exception("sweeping tinker sessions failed; trying again later")
        try:
            for path in await tinker.sweep_checkpoints(bus, store):
                log.info("tinker checkpoint deleted: its TTL ran out", checkpoint=path)
        except Exception:
            log.exception("sweeping expired tinker checkpoints failed; trying again later")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), tinker.SWEEP_EVERY_S)
