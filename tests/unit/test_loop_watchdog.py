"""The event-loop watchdog every service runs (issue 35): a loop held past the bound is reported
once, with the stack of what holds it; a loop that only waits is never reported."""

from __future__ import annotations

import asyncio
import time

from structlog.testing import capture_logs

from marlaas.platform.loop_watchdog import LoopWatchdog, blocked_for


def test_blocked_for_is_zero_within_the_bound_and_the_time_held_past_it():
    assert blocked_for(last_tick=10.0, now=10.4, bound_s=0.5) == 0.0
    assert blocked_for(last_tick=10.0, now=11.5, bound_s=0.5) == 1.5


def hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # what a backtracking regex or a synchronous tokenizer call does to a loop


async def watched(body, bound_s: float = 0.2):
    watchdog = LoopWatchdog(asyncio.get_running_loop(), bound_s, "test", every_s=0.05).start()
    try:
        await body()
        await asyncio.sleep(0.3)  # the loop runs again: the watchdog sees it
    finally:
        watchdog.stop()
    return watchdog


def test_a_held_loop_is_reported_once_with_the_stack_that_holds_it():
    async def body():
        await asyncio.sleep(0.1)
        hold_the_loop(0.8)

    with capture_logs() as logs:
        watchdog = asyncio.run(watched(body))
    warnings = [e for e in logs if e["event"] == "event loop blocked"]
    assert watchdog.reports == 1 and len(warnings) == 1, logs
    assert "hold_the_loop" in warnings[0]["stack"] and warnings[0]["service"] == "test"
    assert warnings[0]["held_s"] >= 0.2
    assert any(e["event"] == "event loop ran again" for e in logs)


def test_a_loop_that_awaits_is_never_reported():
    async def body():
        await asyncio.sleep(0.8)
        await asyncio.to_thread(hold_the_loop, 0.5)  # CPU work off the loop, as the services do it

    with capture_logs() as logs:
        watchdog = asyncio.run(watched(body))
    assert watchdog.reports == 0, logs
