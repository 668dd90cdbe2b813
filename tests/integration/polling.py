"""Polling for the integration tests: wait until something the services do has happened."""

from __future__ import annotations

import asyncio
import time


async def eventually(predicate, timeout_s: float = 30.0, what: str = ""):
    """Poll ``predicate`` (sync or async) until it is truthy; return its value."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        await asyncio.sleep(0.1)
