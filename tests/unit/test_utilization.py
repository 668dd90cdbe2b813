"""Rollout's engine and tool accounting, on a clock the test moves."""

import pytest

from services.rollout import utilization
from services.rollout.utilization import Utilization


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(utilization.time, "monotonic", lambda: now[0])
    return now


def test_request_seconds_over_busy_seconds_is_the_mean_batch(clock):
    use = Utilization()
    with use.engine_request():
        clock[0] += 1.0  # one request for 1 s
        with use.engine_request(), use.engine_request():
            clock[0] += 2.0  # three for 2 s
        with use.tool_call():
            clock[0] += 1.0  # one, with a tool call out
    clock[0] += 5.0  # idle: counts for neither
    totals = use.take()
    assert totals["engine_busy_s"] == pytest.approx(4.0)
    assert totals["engine_request_s"] == pytest.approx(1.0 + 6.0 + 1.0)
    assert totals["tools_pending_s"] == pytest.approx(1.0)
    assert totals["engine_busy_while_tools_s"] == pytest.approx(1.0)
    assert use.take() == dict.fromkeys(totals, 0.0)  # reset by the read
