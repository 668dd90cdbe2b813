"""The pure parts of the Tinker checkpoint API: who may read a checkpoint, TTLs and which checkpoints
have expired (``libs/marlaas/platform/tinker_records.py``), the SDK's checkpoint URLs
(``services/gateway/tinker_checkpoints.py``) and its cap on copies, and the JWTs and download URLs
the gateway signs (``services/gateway/tinker_auth.py``)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from marlaas.platform import tinker_records as wire
from marlaas.platform.bus import KvEntry, StaleRevision
from marlaas.platform.events import Blob
from services.gateway import tinker_auth
from services.gateway.context import ApiError
from services.gateway.tinker_api import checkpoint_entry
from services.gateway.tinker_checkpoints import COPY_QUOTA, MAX_COPIES, checkpoint_target

KEY = tinker_auth.derived_key("an-operator-token-of-enough-length", tinker_auth.URL_LABEL)


def checkpoint(**fields) -> wire.TinkerCheckpoint:
    return wire.TinkerCheckpoint(path="tinker://s:train:0/weights/a", tenant="alice", model_id="s:train:0",
                                 kind="state", adapter=Blob(uri="file:///x/adapter_model.safetensors", sha256="0",
                                                            size=10), **fields)


def test_a_checkpoint_is_read_by_its_owner_and_by_anyone_once_published():
    assert wire.can_read(checkpoint(), "alice") and not wire.can_read(checkpoint(), "bob")
    assert wire.can_read(checkpoint(public=True), "bob")


def test_a_ttl_is_an_hour_to_ten_years_or_none():
    assert wire.expiry(None, 100.0) == 0.0
    assert wire.expiry(3600, 100.0) == 3700.0
    assert wire.expiry(wire.MAX_TTL_S, 0.0) == wire.MAX_TTL_S
    for wrong in (3599, 0, -1, wire.MAX_TTL_S + 1, 3600.5, "3600", True):
        with pytest.raises(ValueError, match="1 hour"):
            wire.expiry(wrong, 100.0)


def test_only_checkpoints_past_their_expiry_are_expired():
    never, later, due = checkpoint(), checkpoint(expires_at=200.0), checkpoint(expires_at=100.0)
    assert wire.expired([never, later, due], 100.0) == [due]
    assert wire.expired([never, later, due], 300.0) == [later, due]


def test_the_sdks_checkpoint_urls_name_a_checkpoint_and_an_action():
    assert checkpoint_target("s:train:0", "/weights/a", "") == "tinker://s:train:0/weights/a"
    assert checkpoint_target("s:train:0", "/weights/a/publish", "publish") == "tinker://s:train:0/weights/a"
    assert checkpoint_target("m", "external_weights/a/external_weights_urls", "external_weights_urls") == \
        "tinker://m/external_weights/a"
    for wrong, action in (("/weights/a/ttl", "publish"), ("/weights", ""), ("/weights/a/b", ""), ("/weights/a", "ttl")):
        with pytest.raises(ApiError) as refused:
            checkpoint_target("m", wrong, action)
        assert refused.value.status_code == 404


def test_a_listed_checkpoint_says_its_kind_publicity_and_expiry():
    entry = checkpoint_entry(checkpoint(public=True, expires_at=86400.0))
    assert entry["checkpoint_id"] == "weights/a" and entry["checkpoint_type"] == "training"
    assert entry["public"] is True and entry["expires_at"].startswith("1970-01-02T00:00:00")
    assert checkpoint_entry(checkpoint())["expires_at"] is None


def test_a_jwt_names_its_tenant_until_it_expires_and_only_under_its_key():
    key = tinker_auth.derived_key("an-operator-token-of-enough-length", tinker_auth.JWT_LABEL)
    jwt = tinker_auth.mint_jwt(key, "alice", "ab" * 32, now=1000.0)
    claims = tinker_auth.jwt_claims(key, jwt, now=1000.0 + tinker_auth.JWT_TTL_S - 1)
    assert claims["org_id"] == "alice" and claims["sub"] == "marlaas:tenant:alice"
    assert tinker_auth.token_matches(claims, "ab" * 32) and not tinker_auth.token_matches(claims, "cd" * 32)
    assert tinker_auth.jwt_claims(key, jwt, now=1000.0 + tinker_auth.JWT_TTL_S) is None  # expired
    assert tinker_auth.jwt_claims(KEY, jwt, now=1000.0) is None  # another key (the URL label's)
    header, payload, signature = jwt.split(".")
    forged = tinker_auth.b64(b'{"org_id":"bob","exp":9999999999,"tok":"abababababababab"}')
    assert tinker_auth.jwt_claims(key, f"{header}.{forged}.{signature}", now=1000.0) is None
    assert tinker_auth.jwt_claims(key, "eyJnot-a-jwt", now=1000.0) is None


def test_a_download_url_holds_only_unchanged_and_unexpired():
    path, file = "tinker://s:train:0/external_weights/a", "adapter_config.json"
    signature = tinker_auth.url_signature(KEY, "alice", path, file, "2000")
    assert tinker_auth.url_problem(KEY, "alice", path, file, "2000", signature, now=1999.0) == ""
    assert "expired" in tinker_auth.url_problem(KEY, "alice", path, file, "2000", signature, now=2000.0)
    changed = [("bob", path, file, "2000", signature), ("alice", path + "x", file, "2000", signature),
               ("alice", path, "adapter_model.safetensors", "2000", signature),
               ("alice", path, file, "9000", signature),
               ("alice", path, file, "2000", signature[:-1] + ("1" if signature.endswith("0") else "0")),
               ("alice", path, file, "2000", "ü")]
    for fields in changed:
        assert "signature does not match" in tinker_auth.url_problem(KEY, *fields, now=1999.0), fields


class RacingKv:
    """The bus's KV calls in memory, each yielding to the event loop first, as a round trip to the
    broker does: concurrent requests interleave between their reads and their writes."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, str], KvEntry] = {}

    async def kv_get(self, bucket: str, key: str) -> KvEntry | None:
        await asyncio.sleep(0)
        return self.entries.get((bucket, key))

    async def kv_keys(self, bucket: str, under: str = "") -> list[str]:
        await asyncio.sleep(0)
        return sorted(k for b, k in self.entries if b == bucket and k.startswith(f"{under}."))

    async def kv_create(self, bucket: str, key: str, value: bytes) -> int:
        return await self.kv_update(bucket, key, value, 0)

    async def kv_update(self, bucket: str, key: str, value: bytes, revision: int) -> int:
        await asyncio.sleep(0)
        entry = self.entries.get((bucket, key))
        if (entry.revision if entry else 0) != revision:
            raise StaleRevision(f"{bucket}/{key} is no longer at revision {revision}")
        self.entries[(bucket, key)] = KvEntry(value=value, revision=revision + 1)
        return revision + 1


def test_concurrent_copies_take_the_cap_by_compare_and_set():
    """Issue 48, L1: 120 concurrent copy_weights made 84 copies against MAX_COPIES = 64, each counting
    the tenant's copies before any was written. The copy's place is taken first, by compare-and-set
    on the tenant's holdings: of 120 at once exactly MAX_COPIES win, and a place is given back when
    its copy was not made (or is deleted)."""
    gateway = SimpleNamespace(bus=RacingKv())

    async def take(run: str) -> int:
        try:
            await COPY_QUOTA.reserve(gateway, "mallory", run)
        except ApiError as exc:
            assert exc.status_code == 429 and "you keep 64 copied checkpoints" in str(exc.detail), exc.detail
            return 429
        return 200

    async def scenario() -> list[int]:
        answers = await asyncio.gather(*(take(f"copy-{i:024x}") for i in range(120)))
        await COPY_QUOTA.release(gateway, "mallory", "copy-" + "0" * 24)  # that copy failed: not stored
        return [*answers, await take("copy-" + "f" * 24)]

    answers = asyncio.run(scenario())
    assert answers[:120].count(200) == MAX_COPIES == 64 and answers[-1] == 200
