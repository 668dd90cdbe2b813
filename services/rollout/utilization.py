"""How busy the engine is, and how much of that overlaps pending tool calls, as rollout sees it.

The engine counts as busy while at least one request of any job is in it; tools count as
pending while at least one call is out. The totals (seconds) accumulate between reads and
are published as a ``utilization`` span every few seconds, so benchmarks can tell whether
the engine kept generating while episodes waited on tools (invariant 5).
"""

from __future__ import annotations

import contextlib
import time


class Utilization:
    """Seconds with the engine busy, tools pending, and both at once, since the last :meth:`take`."""

    def __init__(self) -> None:
        self.engine_requests = 0
        self.tool_calls = 0
        self._at = time.monotonic()
        self._totals = {"engine_busy_s": 0.0, "tools_pending_s": 0.0, "engine_busy_while_tools_s": 0.0}

    def _advance(self) -> None:
        now = time.monotonic()
        elapsed, self._at = now - self._at, now
        if self.engine_requests:
            self._totals["engine_busy_s"] += elapsed
        if self.tool_calls:
            self._totals["tools_pending_s"] += elapsed
        if self.engine_requests and self.tool_calls:
            self._totals["engine_busy_while_tools_s"] += elapsed

    @contextlib.contextmanager
    def engine_request(self):
        self._advance()
        self.engine_requests += 1
        try:
            yield
        finally:
            self._advance()
            self.engine_requests -= 1

    @contextlib.contextmanager
    def tool_call(self):
        self._advance()
        self.tool_calls += 1
        try:
            yield
        finally:
            self._advance()
            self.tool_calls -= 1

    def take(self) -> dict[str, float]:
        """The totals since the last call (and reset them)."""
        self._advance()
        totals, self._totals = self._totals, dict.fromkeys(self._totals, 0.0)
        return totals
