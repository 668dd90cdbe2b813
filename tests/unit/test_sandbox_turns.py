"""Turns of python sandbox runs (issue 35, F6): the pure decision, then the slots around it with
stand-in work (an ``asyncio.Event`` a test releases), so what holds a slot when is exact."""

from __future__ import annotations

import asyncio

import pytest

from marlaas.platform.events import ToolCall, encode
from services.env.tools.sandbox_turns import RunCaps, RunTurns, SandboxBusy, next_turn, tenant_of_call

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


class Work:
    """Calls that each hold a slot until released, recording the order in which they started."""

    def __init__(self, turns: RunTurns) -> None:
        self.turns = turns
        self.started: list[str] = []
        self.release = asyncio.Event()

    async def call(self, tenant: str) -> str:
        async with self.turns.slot(tenant):
            self.started.append(tenant)
            await self.release.wait()
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


def test_the_tenant_of_a_call_is_its_jobs_first_part():
    call = ToolCall(job="alice.reverse-0a1b2c", call_id="c", tool="builtin.python", arguments="{}")
    assert tenant_of_call(encode(call)) == "alice"
    assert tenant_of_call(encode(ToolCall(job="", call_id="c", tool="python"))) == ""
    assert tenant_of_call(b"not json") == ""
