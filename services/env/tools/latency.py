"""Injected tool latency for benchmarks (``env.tool_latency_s``).

A table maps a tool name (bare ``search`` or qualified ``builtin.search``) to a fixed delay
in seconds or to ``[low, high]``, a uniform range sampled per call. The serving shell
sleeps that long (``asyncio.sleep``) before running the tool, so a slow tool delays only
its own calls.
"""

from __future__ import annotations

import random
from collections.abc import Mapping


class InjectedLatency:
    """``delay(qualified_name) -> seconds`` from a latency table; 0 for tools not in it."""

    def __init__(self, table: Mapping[str, float | list[float]], seed: int | None = None) -> None:
        self.table = dict(table)
        self.rng = random.Random(seed)

    def __call__(self, qualified: str) -> float:
        spec = self.table.get(qualified, self.table.get(qualified.partition(".")[2]))
        if spec is None:
            return 0.0
        if isinstance(spec, (int, float)):
            return float(spec)
        low, high = spec
        return self.rng.uniform(low, high)

    def __bool__(self) -> bool:
        return bool(self.table)
