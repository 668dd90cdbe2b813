"""A watchdog for a service's event loop: a warning, with the loop thread's stack, whenever the
loop has not run for longer than a bound.

Every service is one asyncio loop: a callback that holds it (a regex that backtracks, a
tokenizer run on megabytes, a synchronous file read) stops every job and tenant the service
serves. The watchdog cannot unblock the loop, but it says at once, and exactly where: a
thread beside the loop checks a timestamp the loop renews every ``every_s``, and when it is
older than ``bound_s`` logs ``event loop blocked`` with the loop thread's current stack (once
per blocked stretch, then ``event loop ran again`` with how long it was held).

Decision (:func:`blocked_for`) is a pure function; :class:`LoopWatchdog` is the thread and the
loop callback around it.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback

import structlog

log = structlog.get_logger("watchdog")

STACK_FRAMES = 40  # innermost frames of the loop thread's stack in a warning (enough to reach our own code)


def blocked_for(last_tick: float, now: float, bound_s: float) -> float:
    """How long the loop has been held past its last tick, or 0.0 when that is within ``bound_s``."""
    held = now - last_tick
    return held if held > bound_s else 0.0


class LoopWatchdog:
    """Watches ``loop`` from a daemon thread; :meth:`start` from inside the loop, :meth:`stop` to end."""

    def __init__(self, loop: asyncio.AbstractEventLoop, bound_s: float, service: str = "",
                 every_s: float | None = None) -> None:
        self.loop = loop
        self.bound_s = bound_s
        self.service = service
        self.every_s = every_s if every_s is not None else min(bound_s / 4, 0.25)
        self.last_tick = time.monotonic()
        self.reports = 0  # blocked stretches reported (tests read it)
        self._loop_thread = threading.get_ident()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> LoopWatchdog:
        self._loop_thread = threading.get_ident()
        self._tick()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        if self._handle is not None:
            self._handle.cancel()

    def _tick(self) -> None:
        self.last_tick = time.monotonic()
        if not self._done.is_set():
            self._handle = self.loop.call_later(self.every_s, self._tick)

    def _watch(self) -> None:
        reported_at = None  # the tick of the stretch already reported
        while not self._done.wait(self.every_s):
            tick = self.last_tick
            held = blocked_for(tick, time.monotonic(), self.bound_s)
            if held and reported_at != tick:
                reported_at = tick
                self.reports += 1
                log.warning("event loop blocked", service=self.service, held_s=round(held, 2),
                            bound_s=self.bound_s, stack=self._loop_stack())
            elif not held and reported_at is not None and reported_at != tick:
                log.info("event loop ran again", service=self.service,
                         held_s=round(tick - reported_at, 2))
                reported_at = None

    def _loop_stack(self) -> str:
        frame = sys._current_frames().get(self._loop_thread)
        if frame is None:
            return "(the loop's thread has ended)"
        return "".join(traceback.format_stack(frame)[-STACK_FRAMES:])
