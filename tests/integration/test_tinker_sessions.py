"""Tinker sessions whose client died: the manager's sweep ends them (real nats-server, a file store)."""

from __future__ import annotations

import time

from marlaas.platform import tinker_records as wire


async def test_a_silent_session_is_ended_and_its_sampler_weights_deleted(bus, file_store):
    now = time.time()
    silent = wire.TinkerSession(id="silent", tenant="acme", created_at=now - 3600, heartbeat_at=now - 900)
    alive = wire.TinkerSession(id="alive", tenant="acme", created_at=now - 3600, heartbeat_at=now - 5)
    for session in (silent, alive):
        await wire.write(bus, "session", session.id, session)
        file_store.put_bytes(wire.session_prefix("acme", session.id, "samplers", "x", "adapter_model.safetensors"),
                             b"w")
    assert await wire.sweep_sessions(bus, file_store, now) == ["silent"]
    assert (await wire.read(bus, "session", "silent", wire.TinkerSession)).finished
    assert not (await wire.read(bus, "session", "alive", wire.TinkerSession)).finished
    assert file_store.list("tinker/acme/sessions/silent/") == []
    assert file_store.list("tinker/acme/sessions/alive/")
    assert await wire.sweep_sessions(bus, file_store, now) == []  # ended once


async def test_only_live_sessions_models_count_against_the_quota(bus):
    now = time.time()
    for sid, heard in (("s1", now - 5), ("s2", now - wire.SESSION_LIVE_S - 1)):
        await wire.write(bus, "session", sid, wire.TinkerSession(id=sid, tenant="acme", created_at=now - 999,
                                                                 heartbeat_at=heard))
        await wire.write(bus, "model", f"{sid}:train:0", wire.TinkerModel(
            id=f"{sid}:train:0", tenant="acme", session=sid, base_model="builtin:chat", rank=4))
    await wire.write(bus, "model", "s9:train:0", wire.TinkerModel(
        id="s9:train:0", tenant="other", session="s1", base_model="builtin:chat", rank=4))
    assert await wire.active_models(bus, "acme", now) == 1
    assert await wire.active_models(bus, "other", now) == 1
    assert await wire.active_models(bus, "nobody", now) == 0
