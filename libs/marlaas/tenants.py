"""Tenants and their API tokens (KV bucket ``tenants``, key = tenant name).

A token is ``mlt_<tenant>_<secret>``: the tenant's name is readable in it, so a check is
one KV read, and only the token's sha256 is stored (the token itself is printed once, when
the tenant is added). A revoked tenant keeps its record (its jobs keep their owner) but no
token of it is accepted. The tenant of every API call comes from its token, never from a
field a caller writes.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time

import msgspec

from marlaas.bus import TENANTS_BUCKET, Bus, StaleRevision
from marlaas.events import Codec, Wire, encode

TENANT_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
TOKEN_RE = re.compile(r"^mlt_([a-z0-9][a-z0-9-]{0,31})_([0-9a-f]{48})$")
DEFAULT_MAX_JOBS = 8


class TenantError(ValueError):
    """A tenant that cannot be added, or a name that is not a tenant's."""


class TenantRecord(Wire):
    """One tenant: the hash of its token, its quota, and whether it was revoked."""

    name: str
    token_sha256: str
    max_jobs: int = DEFAULT_MAX_JOBS  # jobs queued or running at once
    created_at: float = 0.0
    revoked_at: float = 0.0

    @property
    def active(self) -> bool:
        return not self.revoked_at


TENANT = Codec("tenant record", TenantRecord)


def check_tenant_name(name: str) -> str:
    if not TENANT_RE.match(name):
        raise TenantError(f"tenant name {name!r} is invalid: use 1-32 lowercase letters, digits and '-', "
                          "starting with a letter or digit")
    return name


def token_sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token(tenant: str) -> str:
    return f"mlt_{tenant}_{secrets.token_hex(24)}"


async def add_tenant(bus: Bus, name: str, max_jobs: int = DEFAULT_MAX_JOBS) -> tuple[TenantRecord, str]:
    """Create tenant ``name``; return its record and its token (shown once, stored only hashed)."""
    check_tenant_name(name)
    if max_jobs < 1:
        raise TenantError(f"--max-jobs must be at least 1 (got {max_jobs})")
    token = new_token(name)
    record = TenantRecord(name=name, token_sha256=token_sha256(token), max_jobs=max_jobs, created_at=time.time())
    try:
        await bus.kv_create(TENANTS_BUCKET, name, encode(record))
    except StaleRevision:
        raise TenantError(f"tenant {name!r} already exists (`marlaas tenant list`)") from None
    return record, token


async def get_tenant(bus: Bus, name: str) -> TenantRecord | None:
    entry = await bus.kv_get(TENANTS_BUCKET, name)
    return TENANT.decode(entry.value) if entry else None


async def list_tenants(bus: Bus) -> list[TenantRecord]:
    found = [await get_tenant(bus, key) for key in await bus.kv_keys(TENANTS_BUCKET)]
    return [t for t in found if t is not None]


async def revoke_tenant(bus: Bus, name: str) -> TenantRecord:
    """Refuse every token of ``name`` from now on (its jobs and data stay until deleted)."""
    entry = await bus.kv_get(TENANTS_BUCKET, name)
    if entry is None:
        raise TenantError(f"no tenant {name!r} (`marlaas tenant list`)")
    record = TENANT.decode(entry.value)
    if record.active:
        record = msgspec.structs.replace(record, revoked_at=time.time())
        await bus.kv_update(TENANTS_BUCKET, name, encode(record), entry.revision)
    return record


async def authenticate(bus: Bus, token: str) -> TenantRecord | None:
    """The active tenant a token belongs to, or None (malformed, unknown, wrong secret, revoked)."""
    found = TOKEN_RE.match(token or "")
    if not found:
        return None
    record = await get_tenant(bus, found[1])
    if record is None or not record.active:
        return None
    return record if hmac.compare_digest(record.token_sha256, token_sha256(token)) else None
