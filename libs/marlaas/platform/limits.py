"""Bounds on text the platform stores from tenants' code and input (issue 35).

A tenant's reward, tool or request can fail with any text; what is kept of it (a job's failure
reason, a queued note, a Tinker future's error, a failure event on the JOBS stream) is read by
every listing, the dashboard and ``/metrics``, so it is cut to one bound here, saying how much
was cut.
"""

from __future__ import annotations

MAX_ERROR_CHARS = 2_000  # a failure reason, note or error text, as stored or published


def cut(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` kept to ``limit`` characters, saying how many were cut (so nobody takes it for whole)."""
    if len(text) <= limit:
        return text
    marker = f" ... [{len(text) - limit} more characters cut]"
    return text[:max(limit - len(marker), 0)] + marker
