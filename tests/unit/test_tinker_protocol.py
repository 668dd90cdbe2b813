"""The Tinker protocol's pure parts: the queue states a pending request reports, and zstd bodies
(``libs/marlaas/platform/tinker_records.py``, ``services/gateway/tinker_api.py``)."""

from __future__ import annotations

import msgspec
import pytest
import zstandard

from marlaas.platform import tinker_records as wire
from services.gateway.context import ApiError
from services.gateway.tinker_api import unzstd


def test_a_waiting_sample_is_paused_by_its_tenants_limit_or_by_the_engines_capacity():
    sample = "0abc:sample:3:17"
    assert wire.queue_state(sample, in_hand=2, waiting=5, per_tenant=2)[0] == "paused_rate_limit"
    state, reason = wire.queue_state(sample, in_hand=1, waiting=1, per_tenant=2)
    assert state == "paused_capacity" and "tinker_sample_concurrency" in reason
    assert wire.queue_state("once-alice-00ff", in_hand=3, waiting=1, per_tenant=2)[0] == "paused_rate_limit"
    assert wire.queue_state(sample, in_hand=2, waiting=0, per_tenant=2) == ("active", "")  # nothing waits
    assert wire.queue_state("0abc:train:0:4", in_hand=9, waiting=9, per_tenant=2) == ("active", "")


def test_a_zstd_body_is_decompressed_up_to_a_bound_and_a_bomb_or_garbage_is_refused():
    body = b"\x08\x01" * 1000
    assert unzstd(zstandard.ZstdCompressor().compress(body), 4096) == body
    bomb = zstandard.ZstdCompressor().compress(b"\0" * 10_000_000)  # ~1 KB that would be 10 MB
    with pytest.raises(ApiError) as refused:
        unzstd(bomb, 640 * 1024)
    assert refused.value.status_code == 413 and "over 655360 bytes" in refused.value.detail
    with pytest.raises(ApiError) as refused:
        unzstd(b"not zstd at all", 4096)
    assert refused.value.status_code == 400 and "not zstd" in refused.value.detail


def test_a_models_request_waits_for_a_live_replica_however_long_and_for_a_missing_one_a_while():
    from services.trainer.tinker_training import ORDER_WAIT_S, turn

    live = wire.TinkerLive(model_id="m", last_seq=4, done_at=100.0)
    assert turn(5, 100.0, live, "me", set(), 101.0) == (True, "")
    # another replica doing one of the model's requests, or holding its gradients: wait while it lives
    for busy in ({"working": "b"}, {"holder": "b"}):
        waiting = msgspec.structs.replace(live, **busy)
        assert turn(5, 100.0, waiting, "me", {"b"}, 100.0 + 10 * ORDER_WAIT_S) == (False, "")
    # ... and once it is gone, its gradients are said lost; a dead worker's request is redone
    go, why = turn(5, 100.0, msgspec.structs.replace(live, holder="b"), "me", set(), 101.0)
    assert go and "is gone" in why
    assert turn(5, 100.0, msgspec.structs.replace(live, working="b"), "me", set(), 101.0) == (True, "")
    # an earlier request not done: wait ORDER_WAIT_S after the model's last progress, then go on
    assert turn(7, 100.0, live, "me", set(), 100.0 + ORDER_WAIT_S / 2) == (False, "")
    go, why = turn(7, 100.0, live, "me", set(), 101.0 + ORDER_WAIT_S)
    assert go and "request 5 never came" in why
    assert turn(5, 100.0, msgspec.structs.replace(live, holder="me"), "me", set(), 101.0) == (True, "")
