"""``GET /v1/usage``: what a tenant's work used, by job and by UTC day (metering, issue 40).

A tenant's token sees its own records only (the ``usage`` bucket's keys under ``<tenant>.``,
so the subject filter itself keeps the others out); the operator's token sees every tenant's,
also summed by tenant. The records are the manager's (``services/manager/usage.py``), read
straight from JetStream like job records.
"""

from __future__ import annotations

import asyncio
import re
from typing import Annotated

import msgspec
import structlog
from litestar import Request, get
from litestar.params import Parameter

from marlaas.platform import subjects
from marlaas.platform.bus import USAGE_BUCKET, Bus
from marlaas.platform.events import EventDecodeError
from marlaas.platform.files import list_files
from marlaas.platform.tenants import TENANT_RE
from marlaas.platform.usage import USAGE_RECORD, UsageRecord, UsageReport, summarize
from services.gateway.auth import authenticated_tenant, is_operator
from services.gateway.context import ApiError, gateway_of
from services.gateway.reads import read_messages

log = structlog.get_logger("gateway")
_DAY = re.compile(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$")


async def usage_records(bus: Bus, tenant: str = "") -> list[UsageRecord]:
    """The ``usage`` records of ``tenant`` (every tenant's when empty); an unreadable one is
    logged and skipped."""
    subject = subjects.kv(USAGE_BUCKET, f"{tenant}.>" if tenant else ">")
    found = []
    for msg in await read_messages(bus, subjects.kv_stream(USAGE_BUCKET), subject, last_per_subject=True):
        if not msg.data or (msg.headers and msg.headers.get("KV-Operation")):
            continue
        try:
            record = USAGE_RECORD.decode(msg.data)
        except EventDecodeError as exc:
            log.error("unreadable usage record skipped", subject=msg.subject, error=str(exc))
            continue
        if not tenant or record.tenant == tenant:
            found.append(record)
    return found


@get("/usage", summary="What your jobs used, by job and by day",
     description="Engine tokens prefilled and generated, episodes, tool calls and the seconds waited on them, "
                 "trainer seconds and tokens trained, Tinker requests: summed over every job (total), by job "
                 "and by UTC day, with the records (one per job and day) and the bytes of your data files. "
                 "?day=YYYY-MM-DD and ?job=ID narrow it. The operator's token sees every tenant's "
                 "(?tenant=NAME narrows it), also by tenant.")
async def get_usage(request: Request, day: str = "", job: str = "",
                    of: Annotated[str, Parameter(query="tenant")] = "") -> UsageReport:
    # ``?tenant=`` arrives as ``of``: ``tenant`` is the /v1 router's dependency (the token's tenant)
    gateway = gateway_of(request)
    if day and not _DAY.fullmatch(day):
        raise ApiError(400, f"day must be a UTC date as YYYY-MM-DD, e.g. 2026-01-31, not {day!r}")
    operator = is_operator(request)
    if operator:
        if of and not TENANT_RE.fullmatch(of):
            raise ApiError(400, f"no tenant {of!r}: a tenant name is lowercase letters, digits and '-'")
        whose = of
    else:
        whose = (await authenticated_tenant(request)).name
    records = [r for r in await usage_records(gateway.bus, whose)
               if (not day or r.day == day) and (not job or r.job == job)]
    report = summarize(records, by_tenant=operator)
    if whose and not operator:
        files = await asyncio.to_thread(list_files, gateway.store, whose)
        report = msgspec.structs.replace(report, files_bytes=sum(f.size for f in files))
    return report


USAGE_ROUTES = [get_usage]
