"""Tenants and their API tokens (KV bucket ``tenants``, key = tenant name).

A token is ``mlt_<tenant>_<secret>``: the tenant's name is readable in it, so a check is
one KV read, and only the token's sha256 is stored (the token itself is printed once, when
the tenant is added). A revoked tenant keeps its record (its jobs keep their owner) but no
token of it is accepted. The tenant of every API call comes from its token, never from a
field a caller writes.

The token is also the tenant's NATS password (user = tenant name, in a NATS account of its
own): the record keeps its bcrypt hash too, so the broker's ``auth.conf`` can be rendered from
this bucket alone (:func:`write_broker_auth`, rules in :mod:`marlaas.stack.broker_auth`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import re
import secrets
import time

import msgspec
import structlog

from marlaas.platform import nats_access, subjects
from marlaas.platform.bus import TENANTS_BUCKET, TOOLS_BUCKET, Bus, StaleRevision
from marlaas.platform.events import Codec, Wire, encode

log = structlog.get_logger("marlaas.platform.tenants")

TENANT_RE = re.compile(rf"^{subjects.TENANT_NAME}\Z")  # \Z, not $: "$" also matches before a trailing newline
# 128 random bits: with the longest name a token is 69 bytes, within the 72 that bcrypt reads
TOKEN_RE = re.compile(rf"^mlt_({subjects.TENANT_NAME})_([0-9a-f]{{32}})\Z")
DEFAULT_MAX_JOBS = 8
# samples per version (grpo.prompts_per_step x grpo.group_size) of any one job of the tenant: one
# tenant's 64 x 64 job would otherwise hold the shared engine for as long as 64 jobs of 8 x 8
DEFAULT_MAX_SAMPLES = 256
# the data one submission names, summed over its data fields (dataset, eval_dataset, corpus) and every
# link of its ``then`` chain: the manager reads and checks all of it before it answers (four submits
# naming a 60,000-row, 62 MB dataset once took 16-27 s each, and held up other tenants', issue 48)
DEFAULT_MAX_DATASET_ROWS = 20_000
DEFAULT_MAX_DATASET_BYTES = 16 << 20
# names the platform speaks for: the built-in namespace (tools, rewards), its services and their
# broker user, and NATS' own account and inbox prefixes
RESERVED_NAMES = ("builtin", "judge", nats_access.SERVICES_USER, nats_access.SANDBOX_USER, "platform", "sys")
RESERVED_PREFIXES = ("$", "_")


class TenantError(ValueError):
    """A tenant that cannot be added, or a name that is not a tenant's."""


class TenantRecord(Wire):
    """One tenant: the hashes of its token, its quota, and whether it was revoked."""

    name: str
    token_sha256: str
    token_bcrypt: str = ""  # the broker's copy (auth.conf); "" = no NATS user (an older record)
    max_jobs: int = DEFAULT_MAX_JOBS  # jobs queued or running at once
    max_samples: int = DEFAULT_MAX_SAMPLES  # samples per version of one job
    max_dataset_rows: int = DEFAULT_MAX_DATASET_ROWS  # rows of the data one submission names, every link
    max_dataset_bytes: int = DEFAULT_MAX_DATASET_BYTES  # ... and their bytes
    weight: float = 1.0  # its share where tenants take turns (engine, trainer, tools, Tinker), against the others'
    created_at: float = 0.0
    revoked_at: float = 0.0
    paused_at: float = 0.0  # `marlaas tenant pause`: its queued work waits (0: not paused)

    @property
    def active(self) -> bool:
        return not self.revoked_at

    @property
    def paused(self) -> bool:
        return bool(self.paused_at)


TENANT = Codec("tenant record", TenantRecord)


def check_tenant_name(name: str) -> str:
    """``name`` if it can be a tenant's (it becomes a subject token and a NATS user name)."""
    if name in RESERVED_NAMES or name.startswith(RESERVED_PREFIXES):
        raise TenantError(f"tenant name {name!r} is reserved (the platform's names are "
                          f"{', '.join(RESERVED_NAMES)}, and any starting with "
                          f"{' or '.join(map(repr, RESERVED_PREFIXES))}): choose another name")
    if not TENANT_RE.match(name):
        raise TenantError(f"tenant name {name!r} is invalid: use 1-32 lowercase letters, digits and '-', "
                          "starting with a letter or digit")
    return name


def token_sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token(tenant: str) -> str:
    return f"mlt_{tenant}_{secrets.token_hex(16)}"


def tinker_api_key(token: str) -> str:
    """The tenant's key for the Tinker API (``X-API-Key``): the SDK wants keys that start ``tml-``."""
    return f"tml-{token}"


def tenant_of_token(token: str) -> str | None:
    """The tenant a well-formed token names (not a check that it is valid), else None."""
    found = TOKEN_RE.match(token or "")
    return found[1] if found else None


async def add_tenant(bus: Bus, name: str, max_jobs: int = DEFAULT_MAX_JOBS,
                     max_samples: int = DEFAULT_MAX_SAMPLES, max_dataset_rows: int = DEFAULT_MAX_DATASET_ROWS,
                     max_dataset_bytes: int = DEFAULT_MAX_DATASET_BYTES) -> tuple[TenantRecord, str]:
    """Create tenant ``name``; return its record and its token (shown once, stored only hashed)."""
    check_tenant_name(name)
    if max_jobs < 1:
        raise TenantError(f"--max-jobs must be at least 1 (got {max_jobs})")
    if max_samples < 2:
        raise TenantError(f"--max-samples must be at least 2, one GRPO group (got {max_samples})")
    for flag, n in (("--max-dataset-rows", max_dataset_rows), ("--max-dataset-bytes", max_dataset_bytes)):
        if n < 1:
            raise TenantError(f"{flag} must be at least 1 (got {n})")
    token = new_token(name)
    record = TenantRecord(name=name, token_sha256=token_sha256(token), max_jobs=max_jobs, max_samples=max_samples,
                          max_dataset_rows=max_dataset_rows, max_dataset_bytes=max_dataset_bytes,
                          token_bcrypt=nats_access.bcrypt_hash(token), created_at=time.time())
    try:
        await bus.kv_create(TENANTS_BUCKET, name, encode(record))
    except StaleRevision:
        raise TenantError(f"tenant {name!r} already exists (`marlaas tenant list`)") from None
    return record, token


async def rotate_token(bus: Bus, name: str) -> tuple[TenantRecord, str]:
    """Give active tenant ``name`` a new token (returned once); the old one stops working."""
    entry = await bus.kv_get(TENANTS_BUCKET, name)
    if entry is None:
        raise TenantError(f"no tenant {name!r} (`marlaas tenant list`)")
    record = TENANT.decode(entry.value)
    if not record.active:
        raise TenantError(f"tenant {name!r} was revoked; add a tenant under another name")
    token = new_token(name)
    record = msgspec.structs.replace(record, token_sha256=token_sha256(token),
                                     token_bcrypt=nats_access.bcrypt_hash(token))
    await bus.kv_update(TENANTS_BUCKET, name, encode(record), entry.revision)
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


MAX_WEIGHT = 1000.0


async def tenant_weights(bus: Bus) -> dict[str, float]:
    """Every tenant's weight (``marlaas tenant set NAME --weight W``), for the shares that read it."""
    return (await tenant_shares(bus))[0]


async def tenant_shares(bus: Bus) -> tuple[dict[str, float], frozenset[str]]:
    """Every tenant's weight, and the tenants paused (``marlaas tenant pause NAME``): what the
    queues that take tenant turns read."""
    tenants = await list_tenants(bus)
    return {t.name: t.weight for t in tenants}, frozenset(t.name for t in tenants if t.paused)


class TenantShares(msgspec.Struct):
    """What the manager broadcasts on ``subjects.TENANT_SHARES``: each tenant's weight, the paused ones."""

    weights: dict[str, float]
    paused: list[str] = []


SHARES_EVERY_S = 5.0


async def broadcast_shares(bus: Bus, stop: asyncio.Event, every_s: float = SHARES_EVERY_S) -> None:
    """Publish every tenant's weight every ``every_s`` (core NATS: a listener that missed one gets
    the next; one that hears none keeps the last it had)."""
    while not stop.is_set():
        with contextlib.suppress(Exception):  # the bucket or the broker unavailable a moment: next time
            weights, paused = await tenant_shares(bus)
            await bus.nc.publish(subjects.TENANT_SHARES, msgspec.json.encode(TenantShares(weights, sorted(paused))))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


class SharesHeard:
    """The last :class:`TenantShares` heard on ``subjects.TENANT_SHARES`` (the sandbox's weights)."""

    def __init__(self) -> None:
        self.weights: dict[str, float] = {}

    async def listen(self, bus: Bus) -> None:
        await bus.nc.subscribe(subjects.TENANT_SHARES, cb=self._heard)

    async def _heard(self, msg) -> None:
        try:
            shares = msgspec.json.decode(msg.data, type=TenantShares)
        except msgspec.DecodeError:
            return
        self.weights = {t: w for t, w in shares.weights.items() if isinstance(w, (int, float)) and 0 < w <= MAX_WEIGHT}

    async def read(self) -> dict[str, float]:
        return dict(self.weights)


def check_weight(weight: float) -> float:
    """``weight`` if a tenant may have it: a share, above 0 and at most :data:`MAX_WEIGHT`."""
    if not (isinstance(weight, (int, float)) and 0 < weight <= MAX_WEIGHT):
        raise TenantError(f"weight {weight!r}: give a number above 0 and at most {MAX_WEIGHT:g} (1 is the default "
                          "share; 2 gets twice a tenant of 1 while both wait)")
    return float(weight)


async def set_tenant(bus: Bus, name: str, weight: float | None = None, max_jobs: int | None = None,
                     max_samples: int | None = None, paused: bool | None = None, max_dataset_rows: int | None = None,
                     max_dataset_bytes: int | None = None) -> TenantRecord:
    """Change ``name``'s weight or quotas, or pause or resume it (compare-and-set: a concurrent
    change is read again). A paused tenant's queued work (trajectory batches, Tinker requests)
    waits untouched until it is resumed; what is in hand finishes."""
    if weight is not None:
        check_weight(weight)
    quotas = {"max_jobs": max_jobs, "max_samples": max_samples, "max_dataset_rows": max_dataset_rows,
              "max_dataset_bytes": max_dataset_bytes}
    for what, n in quotas.items():
        if n is not None and n < 1:
            raise TenantError(f"{what} {n}: give a whole number of at least 1")
    while True:
        entry = await bus.kv_get(TENANTS_BUCKET, name)
        if entry is None:
            raise TenantError(f"no tenant {name!r} (`marlaas tenant list`)")
        record = TENANT.decode(entry.value)
        changes = {k: v for k, v in (("weight", weight), *quotas.items()) if v is not None}
        if paused is not None and paused != record.paused:
            changes["paused_at"] = time.time() if paused else 0.0
        record = msgspec.structs.replace(record, **changes)
        try:
            await bus.kv_update(TENANTS_BUCKET, name, encode(record), entry.revision)
            return record
        except StaleRevision:
            continue


async def authenticate(bus: Bus, token: str) -> TenantRecord | None:
    """The active tenant a token belongs to, or None (malformed, unknown, wrong secret, revoked)."""
    found = TOKEN_RE.match(token or "")
    if not found:
        return None
    record = await get_tenant(bus, found[1])
    if record is None or not record.active:
        return None
    return record if hmac.compare_digest(record.token_sha256, token_sha256(token)) else None


# --- the broker's side: the registry, auth.conf -----------------------------


async def lock_tools_registry(bus: Bus) -> None:
    """Refuse rollup headers on the tools bucket's stream.

    A tenant may publish to its own registry keys; a ``Nats-Rollup: all`` header on such a
    publish would otherwise purge every tenant's entries. (The registry never rolls up:
    entries expire, and a delete purges through the stream API.)
    """
    await bus.kv_keys(TOOLS_BUCKET)  # opens (creates if missing) the bucket
    config = (await bus.js.stream_info(subjects.kv_stream(TOOLS_BUCKET))).config
    if config.allow_rollup_hdrs:
        config.allow_rollup_hdrs = False
        await bus.js.update_stream(config)
