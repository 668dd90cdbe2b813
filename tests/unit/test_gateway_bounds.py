"""The gateway's bounds on what one request may cost: uploads checked line by line in bounded
memory, the file quota's reservation plan, the caps on open streams and uploads, bad paths and
deep JSON refused with a 4xx (issue 35: F2, F3, F9, F10, F11)."""

from __future__ import annotations

import tracemalloc

import pytest

from marlaas.platform.files import (
    RESERVATION_GRACE_S,
    FileRefused,
    FileTooBig,
    JsonlCheck,
    count_records,
    plan_reservation,
)
from marlaas.platform.limits import MAX_JSON_NESTING
from services.gateway.context import ApiError, Slots, json_object, path_problem


def fed(data: bytes, piece: int, max_line_bytes: int = 1 << 20) -> tuple[str, int]:
    check = JsonlCheck(1 << 40, max_line_bytes)
    for i in range(0, len(data), piece):
        check.feed(data[i:i + piece])
    return check.finish()


def test_a_file_checked_in_pieces_counts_and_hashes_as_a_whole():
    import hashlib

    data = b"".join(b'{"i": %d, "text": "%s"}\n' % (i, b"x" * (i % 50)) for i in range(2000)) + b"\n  \n{}"
    whole = fed(data, len(data))
    assert whole == (hashlib.sha256(data).hexdigest(), 2001)
    for piece in (1, 7, 64, 4096):
        assert fed(data, piece) == whole


@pytest.mark.parametrize("data, says", [
    (b'{"a": 1}\n\n{"b"\n', "line 3 is not JSON ("),
    (b'{"a": 1}\n[1]\n', "line 2 is a JSON list, not an object"),
    (b'{}\n{"a": "\xff"}\n', "the file is not UTF-8 text (byte 10)"),
    (b'{}\n' + b'[' * 2000 + b'\n', "line 2 is not JSON (nested too deeply)"),
    (b'{}\n{}\n{"a": "' + b"x" * 3000 + b'"}\n', "line 3 is longer than 2048 bytes (gateway.max_line_bytes)"),
    (b'{}\n{}\n' + b"x" * 3000, "line 3 is longer than 2048 bytes (gateway.max_line_bytes)"),
    (b"\n \n", "the file is empty"),
])
def test_a_bad_line_is_named_however_the_body_is_cut(data, says):
    for piece in (1, 5, 1000, len(data)):
        with pytest.raises(FileRefused) as caught:
            fed(data, piece, max_line_bytes=2048)
        assert str(caught.value).startswith(says), (piece, str(caught.value))


def test_an_upload_over_the_size_limit_is_refused_as_too_big():
    check = JsonlCheck(100)
    check.feed(b"{}\n" * 30)
    with pytest.raises(FileTooBig, match="larger than 100 bytes .gateway.max_file_bytes."):
        check.feed(b"{}\n" * 5)
    assert count_records(b"{}\n" * 30, 100) == 30


def test_checking_a_large_upload_holds_a_small_part_of_it():
    """8 MiB of short lines (the shape that cost the old whole-body check 30x its size) checked in
    the gateway's 256 KiB pieces: the peak allocation stays under a quarter of the body."""
    piece = b"{}\n" * (256 * 1024 // 3)
    pieces = (8 << 20) // len(piece)
    check = JsonlCheck(1 << 40)
    tracemalloc.start()
    try:
        for _ in range(pieces):
            check.feed(piece)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert check.finish()[1] == pieces * (len(piece) // 3)
    assert peak < (8 << 20) // 4, peak


def test_a_reservation_takes_a_free_place_or_none():
    held = {"file-a": 100.0, "file-b": 200.0}
    assert plan_reservation(held, "file-c", 3, 300.0) == {**held, "file-c": 300.0}
    assert plan_reservation(held, "file-c", 2, 300.0) is None
    assert plan_reservation(held, "file-a", 2, 300.0) is held  # the same bytes again: no new place


def test_a_full_quota_drops_only_old_reservations_of_files_never_stored():
    now = 10_000.0
    held = {"file-stored": 0.0, "file-crashed": now - RESERVATION_GRACE_S - 1, "file-uploading": now - 1}
    assert plan_reservation(held, "file-new", 3, now) is None  # without the listing, nothing is dropped
    assert plan_reservation(held, "file-new", 3, now, stored={"file-stored"}) == {
        "file-stored": 0.0, "file-uploading": now - 1, "file-new": now}
    assert plan_reservation(held, "file-new", 2, now, stored={"file-stored"}) is None


def test_slots_cap_each_tenant_and_all_and_name_the_setting():
    slots = Slots("event streams", 2, "gateway.max_streams_per_tenant", 3, "gateway.max_streams")
    slots.take("a")
    slots.take("a")
    with pytest.raises(ApiError) as caught:
        slots.take("a")
    assert caught.value.status_code == 429 and "gateway.max_streams_per_tenant = 2" in caught.value.detail
    slots.take("b")
    assert "gateway.max_streams = 3" in slots.refusal("c")
    slots.release("a")
    assert slots.refusal("c") is None
    with slots.held("c"):
        assert slots.open["c"] == 1
    assert "c" not in slots.open


@pytest.mark.parametrize("raw, says", [
    (b"/ui/%00", "control character"), (b"/ui/a%0Ab", "control character"),
    (b"/ui/%ff", "not UTF-8"), (b"/v1/jobs/%c0%af", "not UTF-8"),
    (b"/ui/../app.py", "'..' segment"), (b"/ui/%2e%2e/x", "'..' segment"), (b"/ui/a%2f..%2fb", "'..' segment"),
    (b"/v1/files/" + b"a" * 3000, "over 2048"),
])
def test_bad_paths_are_named(raw, says):
    assert says in path_problem(raw)


@pytest.mark.parametrize("raw", [b"/ui/", b"/ui/app.js", b"/v1/jobs/alice.x-1/versions/3",
                                 b"/tinker/api/v1/training_runs/abc:train:0/checkpoints/weights/a..b",
                                 "/v1/jobs/caf\u00e9".encode()])
def test_good_paths_pass(raw):
    assert path_problem(raw) is None


@pytest.mark.parametrize("raw, says", [
    (b"[" * 100_000 + b"]" * 100_000, f"nested more than {MAX_JSON_NESTING} levels"),
    (b'{"a":' * (MAX_JSON_NESTING + 1) + b"1" + b"}" * (MAX_JSON_NESTING + 1), "nested more than"),
    (b"{", "the body is not JSON"), (b"\xff", "the body is not JSON"), (b"[1]", "must be a JSON object"),
])
def test_json_bodies_that_are_not_a_plain_object_are_a_400(raw, says):
    with pytest.raises(ApiError) as caught:
        json_object(raw)
    assert caught.value.status_code == 400 and says in caught.value.detail


def test_json_bodies_within_the_nesting_limit_are_read():
    deep = b'{"a":' * (MAX_JSON_NESTING - 1) + b"1" + b"}" * (MAX_JSON_NESTING - 1)
    assert json_object(deep)["a"] and json_object(b"") == {}


def test_a_broker_that_refuses_a_reader_is_a_503_that_says_retry():
    from types import SimpleNamespace

    from services.gateway.context import error_answer
    from services.gateway.reads import BrokerRefused

    request = SimpleNamespace(method="GET", url=SimpleNamespace(path="/v1/jobs"))
    answer = error_answer(request, BrokerRefused("the message broker refused ...: retry in a moment"))
    assert answer.status_code == 503 and answer.headers["Retry-After"] == "5"
    assert answer.content == {"error": "the message broker refused ...: retry in a moment"}


async def test_the_app_answers_bad_paths_with_a_400_before_any_handler():
    import httpx

    from marlaas.platform.config import load_config
    from services.gateway.app import create_app
    from services.gateway.context import Gateway
    from services.gateway.metrics import StackMetrics

    app = create_app(Gateway(None, None, load_config(env={}), StackMetrics()))  # no bus: nothing may reach it
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        for path in ("/ui/%00", "/ui/%ff", "/v1/jobs/%00", "/tinker/api/v1/samplers/%00", "/ui/" + "a" * 3000):
            answer = await client.get(path)
            assert answer.status_code == 400 and answer.json()["error"], (path, answer.text)
        assert (await client.get("/ui/")).status_code == 200
