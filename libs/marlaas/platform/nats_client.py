"""The platform's own client on the bus (``BusClient``): submit, watch and cancel jobs through
the manager's NATS API, follow a job's events, and pull adapters, with the services' credentials.
For benchmarks, the demo, tests and operator scripts; tenants use ``marlaas.Client`` (HTTP)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
from nats.js.api import DeliverPolicy

from marlaas.platform import api, subjects
from marlaas.platform.bus import Bus
from marlaas.platform.events import JOB, POLICY, TRAJECTORY, JobState, JobStateChanged, PolicyCommitted, TrajectoryReady

FINISHED = {s.value for s in JobState if s.finished}


class ApiError(RuntimeError):
    """The manager refused a request; the message says why."""


class AdapterGone(ApiError):
    """The asked-for version's adapter was garbage-collected."""


class BusClient:
    """The operator's handle on a running marlaas, over NATS (not the tenants' SDK)."""

    def __init__(self, bus: Bus, tenant: str = "", store_url: str = "") -> None:
        self.bus = bus
        self.tenant = tenant
        self.store_url = store_url

    @classmethod
    async def connect(cls, nats_url: str, tenant: str = "", timeout_s: float = 10.0,
                      store_url: str = "") -> BusClient:
        """Connect to the broker; ``store_url`` (the stack's object store) is needed only to pull adapters."""
        return cls(await Bus.connect(nats_url, name="marlaas-client", timeout_s=timeout_s), tenant, store_url)

    async def events(self, job: str, replay: bool = True, until_finished: bool = True,
                     ) -> AsyncIterator[PolicyCommitted | JobStateChanged | TrajectoryReady]:
        """A job's events as they happen: policy-committed and state changes (replayed from the
        start when ``replay``, then live), and trajectory-ready (live only: the trainer's work
        queue deletes a batch once trained). Ends after the job's final state if ``until_finished``."""
        queue: asyncio.Queue = asyncio.Queue()
        deliver = DeliverPolicy.ALL if replay else DeliverPolicy.NEW

        async def put(msg) -> None:
            await queue.put(msg.subject)
            await queue.put(msg.data)

        subs = [
            await self.bus.js.subscribe(subjects.policy_committed(job), cb=put, ordered_consumer=True,
                                        deliver_policy=deliver),
            await self.bus.js.subscribe(subjects.job_state(job), cb=put, ordered_consumer=True,
                                        deliver_policy=deliver),
            await self.bus.nc.subscribe(subjects.trajectory_ready(job), cb=put),
        ]
        seen_version, final_version = -1, None  # the two streams interleave: finish after both ends
        try:
            while final_version is None or seen_version < final_version:
                subject, data = await queue.get(), await queue.get()
                if subject.startswith(subjects.policy_committed("")):
                    event = POLICY.decode(data)
                    seen_version = max(seen_version, event.version)
                    yield event
                elif subject.startswith(subjects.trajectory_ready("")):
                    yield TRAJECTORY.decode(data)
                else:
                    event = JOB.decode(data)
                    yield event
                    if until_finished and isinstance(event, JobStateChanged) and event.state.finished:
                        (view,) = await self.status(job)
                        final_version = view.version
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def pull_adapter(self, event: PolicyCommitted, dest: str | Path) -> Path:
        """Copy a committed version's adapter (a PEFT directory) to ``dest``, its sha256 verified."""
        if not self.store_url:
            raise ApiError("pulling adapters needs the stack's object store: BusClient.connect(..., store_url=...)")
        from marlaas.platform.adapters import materialize
        from marlaas.platform.store import ObjectNotFound, open_store

        try:
            return await asyncio.to_thread(materialize, open_store(self.store_url), event.adapter, Path(dest))
        except ObjectNotFound as exc:
            raise AdapterGone(
                f"version {event.version} of {event.job} is no longer stored: garbage collection keeps a "
                "job's last manager.gc_keep_last versions and the ones you pinned (pin a version to keep it)"
            ) from exc

    async def close(self) -> None:
        await self.bus.close()

    async def _call(self, subject: str, payload: object, reply_type: type, timeout_s: float = 30.0):
        data = await self.bus.request(subject, msgspec.json.encode(payload), timeout_s)
        reply = msgspec.json.decode(data, type=reply_type)
        if reply.error:
            raise ApiError(reply.error)
        return reply

    async def submit(self, job: dict) -> str:
        """Submit a job (the TOML / JSON shape of :class:`api.SubmitRequest`); returns its id."""
        if self.tenant and "tenant" not in job:
            job = {**job, "tenant": self.tenant}
        api.parse_submission(dict(job))  # fail fast, before the round trip
        return (await self._call(subjects.API_SUBMIT, job, api.SubmitReply)).id

    async def status(self, job: str = "") -> list[api.JobView]:
        reply = await self._call(subjects.API_STATUS, api.StatusRequest(job=job, tenant=self.tenant), api.StatusReply)
        return reply.jobs

    async def cancel(self, job: str) -> str:
        return (await self._call(subjects.API_CANCEL, api.CancelRequest(job=job, tenant=self.tenant),
                                 api.CancelReply)).state

    async def wait(self, jobs: list[str], timeout_s: float = 3600.0, poll_s: float = 1.0,
                   on_update: Callable[[list[api.JobView]], None] | None = None) -> list[api.JobView]:
        """Poll until every job in ``jobs`` is finished; ``on_update`` sees each poll."""
        deadline = time.monotonic() + timeout_s
        while True:
            views = [v for v in await self.status() if v.id in jobs]
            if on_update:
                on_update(views)
            if len(views) == len(jobs) and all(v.state in FINISHED for v in views):
                return views
            if time.monotonic() > deadline:
                raise TimeoutError(f"jobs not finished after {timeout_s:.0f}s: "
                                   + ", ".join(f"{v.id}={v.state}@v{v.version}" for v in views))
            await asyncio.sleep(poll_s)
