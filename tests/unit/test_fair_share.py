"""Tenants' weighted shares of the engine's waiting queue (services/rollout/fair_share.py)."""

from __future__ import annotations

from services.rollout.fair_share import FairShare


def serve(waiting: list[tuple[int, int, str]], count: int) -> list[str]:
    """The tenants of the first ``count`` requests an engine of one slot serves: lowest priority
    first, then arrival, as vLLM's priority scheduler does."""
    return [tenant for _, _, tenant in sorted(waiting)[:count]]


def test_weights_divide_the_served_tokens_and_each_tenants_requests_keep_their_order():
    fair = FairShare()
    waiting = [(fair.admit("bob", 10, 1.0)[1], i, "bob") for i in range(40)]  # bob's came first
    waiting += [(fair.admit("alice", 10, 3.0)[1], 40 + i, "alice") for i in range(40)]
    served = serve(waiting, 40)
    assert served.count("alice") == 30 and served.count("bob") == 10
    assert sorted(waiting)[:2] == sorted(waiting[:1] + waiting[40:41])  # both start at the same time


def test_a_tenant_that_idled_starts_at_the_present_with_no_credit():
    fair = FairShare()
    requests = [fair.admit("alice", 100, 1.0)[0] for _ in range(5)]  # alice's tags 0, 100, ..., 400
    for request in requests[:3]:
        fair.done(request)  # three served: the present is alice's fourth start, 300
    _, priority = fair.admit("bob", 100, 1.0)  # bob never ran: he starts now, not at 0
    assert priority == 300 * 1000
    for request in requests[3:]:
        fair.done(request)
    assert fair.now() == 300  # bob's request, still in the engine, holds the present
