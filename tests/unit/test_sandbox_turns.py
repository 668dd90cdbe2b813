"""Turns of python sandbox runs (issue 35, F6; by weight, issue 40): the pure decision, then the
slots around it with stand-in work (an ``asyncio.Event`` a test releases), so what holds a slot when
is exact."""

from __future__ import annotations

import asyncio
import collections
import random

import pytest

from marlaas.platform.events import ToolCall, encode
from services.env.tools.sandbox_turns import (
    WEIGHTS_EVERY_S,
    RunCaps,
    RunTurns,
    SandboxBusy,
    next_turn,
    tenant_of_call,
)

pytestmark = pytest.mark.timeout(30)

CAPS = RunCaps(max_runs=8, max_runs_per_tenant=4, queue_timeout_s=10.0)


def test_nobody_runs_past_the_replicas_cap():
    assert next_turn({"a": 3}, {"b": 4, "c": 4}, {}, CAPS) is None


def test_a_tenant_at_its_own_cap_waits_while_another_goes():
    assert next_turn({"a": 30}, {"a": 4}, {}, CAPS) is None
    assert next_turn({"a": 30, "b": 1}, {"a": 4}, {}, CAPS) == "b"


def test_the_tenant_with_fewest_runs_going_goes_first_then_the_one_served_longest_ago():
    assert next_turn({"a": 30, "b": 1}, {"a": 2, "b": 3}, {}, CAPS) == "a"
    assert next_turn({"a": 30, "b": 1}, {"a": 3, "b": 3}, {"a": 9, "b": 4}, CAPS) == "b"
    assert next_turn({"a": 30, "b": 1}, {}, {"a": 1}, CAPS) == "b"  # never served: first


def test_without_a_waiting_call_there_is_no_turn():
    assert next_turn({}, {}, {}, CAPS) is None
    assert next_turn({"a": 0}, {}, {}, CAPS) is None


def granted_while_both_wait(weights, caps: RunCaps, grants: int, seed: int = 0):
    """Slots granted by :func:`next_turn` while two tenants always have calls waiting, one run
    ending (a random one) before each grant once the replica is full: (grants per tenant, the runs
    each held after every grant once full)."""
    rng = random.Random(seed)
    waiting = {"a": 1000, "b": 1000}
    running: collections.Counter[str] = collections.Counter()
    last_turn: dict[str, int] = {}
    granted: collections.Counter[str] = collections.Counter()
    held: list[dict[str, int]] = []
    for turn in range(grants):
        if sum(running.values()) >= caps.max_runs:
            running[rng.choice(sorted(running.elements()))] -= 1
        tenant = next_turn(waiting, running, last_turn, caps, weights)
        running[tenant] += 1
        last_turn[tenant] = turn
        granted[tenant] += 1
        if sum(running.values()) == caps.max_runs:
            held.append(dict(+running))
    return granted, held


def test_two_tenants_of_weights_3_and_1_that_keep_calls_waiting_hold_runs_3_to_1():
    caps = RunCaps(max_runs=8, max_runs_per_tenant=8)
    granted, held = granted_while_both_wait({"a": 3.0, "b": 1.0}, caps, 4000)
    assert held and all(h == {"a": 6, "b": 2} for h in held)  # from the moment the replica fills, and ever after
    assert 2.7 < granted["a"] / granted["b"] < 3.3
    granted, held = granted_while_both_wait({"b": 3.0}, caps, 4000, seed=1)  # "a" has no record: weighs 1
    assert held and all(h == {"a": 2, "b": 6} for h in held)


def test_the_first_slots_go_by_weight_too():
    caps = RunCaps(max_runs=4, max_runs_per_tenant=4)
    running: collections.Counter[str] = collections.Counter()
    last_turn: dict[str, int] = {}
    for turn in range(4):
        tenant = next_turn({"a": 9, "b": 9}, running, last_turn, caps, {"a": 3.0})
        running[tenant] += 1
        last_turn[tenant] = turn
    assert running == {"a": 3, "b": 1}
    assert next_turn({"a": 9, "b": 9}, running, last_turn, caps, {"a": 3.0}) is None


def test_a_heavy_tenant_is_still_held_to_its_own_cap():
    weights = {"a": 1000.0}
    assert next_turn({"a": 30, "b": 1}, {"a": 4}, {}, CAPS, weights) == "b"
    assert next_turn({"a": 30}, {"a": 4}, {}, CAPS, weights) is None
    assert next_turn({"a": 30, "b": 30}, {"a": 4, "b": 4}, {}, CAPS, weights) is None  # the replica's cap
    granted, held = granted_while_both_wait(weights, CAPS, 1000)
    assert held and all(h == {"a": 4, "b": 4} for h in held)


def test_a_tenant_alone_takes_every_slot_up_to_its_cap_whatever_its_weight():
    for weight in (0.01, 1.0, 1000.0):
        running: collections.Counter[str] = collections.Counter()
        while (tenant := next_turn({"b": 30}, running, {}, CAPS, {"a": 1000.0, "b": weight})) is not None:
            running[tenant] += 1
        assert running == {"b": CAPS.max_runs_per_tenant}
        alone = RunCaps(max_runs=8, max_runs_per_tenant=8)
        running.clear()
        while (tenant := next_turn({"b": 30}, running, {}, alone, {"b": weight})) is not None:
            running[tenant] += 1
        assert running == {"b": 8}


def test_equal_weights_choose_exactly_as_no_weights():
    rng = random.Random(0)
    tenants = ["a", "b", "c", "default"]
    for _ in range(2000):
        waiting = {t: rng.randrange(3) for t in tenants}
        running = {t: rng.randrange(5) for t in tenants if rng.random() < 0.7}
        last_turn = {t: rng.randrange(20) for t in tenants if rng.random() < 0.7}
        chosen = next_turn(waiting, running, last_turn, CAPS)
        assert next_turn(waiting, running, last_turn, CAPS, {}) == chosen
        assert next_turn(waiting, running, last_turn, CAPS, {t: 1.0 for t in tenants}) == chosen
        assert next_turn(waiting, running, last_turn, CAPS, {t: 2.5 for t in tenants}) == chosen


class Work:
    """Calls that each hold a slot until released, recording the order in which they started."""

    def __init__(self, turns: RunTurns) -> None:
        self.turns = turns
        self.started: list[str] = []
        self.release = asyncio.Event()

    async def call(self, tenant: str, release: asyncio.Event | None = None) -> str:
        async with self.turns.slot(tenant):
            self.started.append(tenant)
            await (release or self.release).wait()
        return tenant


async def until(check) -> None:
    for _ in range(200):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the slots did not reach the expected state")


async def test_forty_calls_of_one_tenant_run_four_at_a_time_and_another_tenant_goes_next():
    turns = RunTurns(RunCaps(max_runs=4, max_runs_per_tenant=4, queue_timeout_s=10.0))
    work = Work(turns)
    mallory = [asyncio.create_task(work.call("mallory")) for _ in range(40)]
    await until(lambda: len(work.started) == 4)
    alice = asyncio.create_task(work.call("alice"))  # mallory holds every slot and has 36 waiting
    await until(lambda: "alice" in turns.queues)
    assert turns.running == {"mallory": 4} and len(turns.queues["mallory"]) == 36
    work.release.set()
    assert await asyncio.gather(*mallory, alice) == ["mallory"] * 40 + ["alice"]
    assert turns.peak == 4
    assert work.started.index("alice") == 4  # the first slot that freed, not the 37th
    assert not turns.running and not turns.queues


async def test_one_tenant_never_holds_more_than_its_share_of_the_replica():
    turns = RunTurns(CAPS)
    work = Work(turns)
    calls = [asyncio.create_task(work.call(t)) for t in ["mallory"] * 20 + ["alice"] * 2]
    await until(lambda: len(work.started) == 6)
    await asyncio.sleep(0.05)  # nothing else may start: mallory is at its cap, alice has no more
    assert turns.running == {"mallory": 4, "alice": 2} and len(work.started) == 6
    work.release.set()
    await asyncio.gather(*calls)
    assert turns.peak == 6 and not turns.running


async def test_a_call_that_waits_too_long_is_answered_busy_and_holds_nothing():
    turns = RunTurns(RunCaps(max_runs=1, max_runs_per_tenant=1, queue_timeout_s=0.2))
    work = Work(turns)
    holder = asyncio.create_task(work.call("mallory"))
    await until(lambda: work.started)
    with pytest.raises(SandboxBusy, match="no run slot freed within 0.2 s .* the code was not run"):
        await work.call("mallory")
    assert turns.running == {"mallory": 1} and not turns.queues
    work.release.set()
    await holder
    assert not turns.running
    assert await asyncio.wait_for(work.call("alice"), 5) == "alice"  # the slot was given back


async def test_a_cancelled_waiter_leaves_no_trace():
    turns = RunTurns(RunCaps(max_runs=1, max_runs_per_tenant=1, queue_timeout_s=10.0))
    work = Work(turns)
    holder = asyncio.create_task(work.call("alice"))
    waiter = asyncio.create_task(work.call("mallory"))
    await until(lambda: "mallory" in turns.queues)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not turns.queues and turns.running == {"alice": 1}
    work.release.set()
    await holder
    assert not turns.running and work.started == ["alice"]


async def test_the_slots_that_free_go_by_the_weights_read():
    reads = 0

    async def weights() -> dict[str, float]:
        nonlocal reads
        reads += 1
        return {"alice": 3.0, "bob": 1.0}

    turns = RunTurns(RunCaps(max_runs=4, max_runs_per_tenant=4, queue_timeout_s=10.0), weights)
    work = Work(turns)
    blocker = asyncio.Event()
    held = [asyncio.create_task(work.call("carol", blocker)) for _ in range(4)]
    await until(lambda: len(work.started) == 4 and reads == 1)
    calls = [asyncio.create_task(work.call(t)) for t in ["bob", "alice"] * 6]
    await until(lambda: sum(len(q) for q in turns.queues.values()) == 12)
    blocker.set()
    await until(lambda: len(work.started) == 8)
    assert turns.running == {"alice": 3, "bob": 1} and reads == 1  # read once: within WEIGHTS_EVERY_S
    work.release.set()
    await asyncio.gather(*held, *calls)
    assert not turns.running and not turns.queues


async def test_the_weights_are_read_again_after_a_while_and_a_failed_read_keeps_the_last():
    answers: list[dict[str, float] | Exception] = [{"alice": 3.0}, OSError("bucket unreadable"), {"alice": 2.0}]

    async def weights() -> dict[str, float]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    turns = RunTurns(RunCaps(max_runs=1, max_runs_per_tenant=1, queue_timeout_s=10.0), weights)
    work = Work(turns)
    work.release.set()
    await work.call("alice")
    await until(lambda: turns.weights == {"alice": 3.0})
    await work.call("alice")
    assert len(answers) == 2  # not read again so soon
    turns.weights_at -= WEIGHTS_EVERY_S
    await work.call("alice")
    await until(lambda: len(answers) == 1 and turns.reading.done())
    assert turns.weights == {"alice": 3.0}  # the failed read kept the last weights
    turns.weights_at -= WEIGHTS_EVERY_S
    await work.call("alice")
    await until(lambda: turns.weights == {"alice": 2.0})


def test_the_tenant_of_a_call_is_its_jobs_first_part():
    call = ToolCall(job="alice.reverse-0a1b2c", call_id="c", tool="builtin.python", arguments="{}")
    assert tenant_of_call(encode(call)) == "alice"
    assert tenant_of_call(encode(ToolCall(job="", call_id="c", tool="python"))) == ""
    assert tenant_of_call(b"not json") == ""
