"""How busy the engine is, and how much of that overlaps pending tool calls, as rollout sees it.

The engine counts as busy while at least one request of any job is in it; tools count as
pending while at least one call is out. ``engine_request_s`` sums the requests in the engine
over time, so that over ``engine_busy_s`` it is the mean number in the engine while it works
(its batch: on a CPU, a step's fixed cost weighs less in a larger one). The totals (seconds)
accumulate between reads and are published as a ``utilization`` span every few seconds, so
benchmarks can tell whether the engine kept generating while episodes waited on tools
(invariant 5). The engine's busy
intervals themselves (wall-clock, gaps under ``MERGE_GAP_S`` merged) go out as ``engine``
spans, so a benchmark can tell when neither the engine nor the trainer was working.
"""

from __future__ import annotations

import contextlib
import time

MERGE_GAP_S = 0.005  # busy intervals closer than this are reported as one


class Utilization:
    """Seconds with the engine busy, tools pending, and both at once, since the last :meth:`take`."""

    def __init__(self) -> None:
        self.engine_requests = 0
        self.tool_calls = 0
        self._at = time.monotonic()
        self._totals = {"engine_busy_s": 0.0, "engine_request_s": 0.0, "tools_pending_s": 0.0,
                        "engine_busy_while_tools_s": 0.0}
        self._busy_since: float | None = None  # wall clock: when the engine last became busy
        self._intervals: list[tuple[float, float]] = []

    def _advance(self) -> None:
        now = time.monotonic()
        elapsed, self._at = now - self._at, now
        if self.engine_requests:
            self._totals["engine_busy_s"] += elapsed
            self._totals["engine_request_s"] += elapsed * self.engine_requests
        if self.tool_calls:
            self._totals["tools_pending_s"] += elapsed
        if self.engine_requests and self.tool_calls:
            self._totals["engine_busy_while_tools_s"] += elapsed

    @contextlib.contextmanager
    def engine_request(self):
        self._advance()
        if not self.engine_requests:
            self._busy_since = time.time()
        self.engine_requests += 1
        try:
            yield
        finally:
            self._advance()
            self.engine_requests -= 1
            if not self.engine_requests:
                self._close_interval(time.time())

    def _close_interval(self, now: float) -> None:
        start, self._busy_since = self._busy_since, None
        if self._intervals and start - self._intervals[-1][1] < MERGE_GAP_S:
            start = self._intervals.pop()[0]
        self._intervals.append((start, now))

    @contextlib.contextmanager
    def tool_call(self):
        self._advance()
        self.tool_calls += 1
        try:
            yield
        finally:
            self._advance()
            self.tool_calls -= 1

    def take_intervals(self) -> list[tuple[float, float]]:
        """The engine's busy intervals since the last call (an ongoing one is cut at now)."""
        if self._busy_since is not None:
            now = time.time()
            self._close_interval(now)
            self._busy_since = now
        intervals, self._intervals = self._intervals, []
        return intervals

    def take(self) -> dict[str, float]:
        """The totals since the last call (and reset them)."""
        self._advance()
        totals, self._totals = self._totals, dict.fromkeys(self._totals, 0.0)
        return totals
