"""The Python SDK: submit, watch and cancel jobs through the manager's NATS API."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec

from marlaas import api
from marlaas.bus import Bus
from marlaas.events import JobState

FINISHED = {s.value for s in JobState if s.finished}


class ApiError(RuntimeError):
    """The manager refused a request; the message says why."""


class Client:
    """A user's handle on a running marlaas."""

    def __init__(self, bus: Bus, tenant: str = "") -> None:
        self.bus = bus
        self.tenant = tenant

    @classmethod
    async def connect(cls, nats_url: str, tenant: str = "", timeout_s: float = 10.0) -> Client:
        return cls(await Bus.connect(nats_url, name="marlaas-client", timeout_s=timeout_s), tenant)

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
        return (await self._call(api.SUBMIT, job, api.SubmitReply)).id

    async def status(self, job: str = "") -> list[api.JobView]:
        reply = await self._call(api.STATUS, api.StatusRequest(job=job, tenant=self.tenant), api.StatusReply)
        return reply.jobs

    async def cancel(self, job: str) -> str:
        return (await self._call(api.CANCEL, api.CancelRequest(job=job, tenant=self.tenant),
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
