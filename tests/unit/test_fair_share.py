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


def test_running_requests_are_held_to_the_weighted_share_only_once_the_bound_is_reached():
    from services.rollout.fair_share import may_run

    weights = {"a": 1.0, "b": 1.0, "c": 2.0}
    assert may_run("a", {"a": 7}, {}, weights, bound=8)  # under the bound: anyone
    assert may_run("a", {"a": 8}, {}, weights, bound=8)  # alone past the bound: all of it is its share
    assert may_run("a", {"a": 20}, {}, weights, bound=8)
    assert not may_run("a", {"a": 6, "b": 2}, {}, weights, bound=8)  # a holds more than half
    assert may_run("b", {"a": 6, "b": 2}, {}, weights, bound=8)  # b is under its half
    assert not may_run("a", {"a": 3, "b": 1}, {"c": 4}, weights, bound=4)  # c waiting: a's share is 1
    assert may_run("c", {"a": 3, "b": 1}, {"c": 4}, weights, bound=4)  # c's is 2 of 4


def test_held_requests_go_in_as_others_leave_and_tenants_converge_to_their_weights():
    import asyncio

    from services.rollout.fair_share import RunningShares

    async def scenario():
        gate, weights = RunningShares(4), {"a": 1.0, "b": 3.0}
        for _ in range(4):  # a alone fills the engine: never held
            await gate.enter("a", weights)
        b_in = [asyncio.create_task(gate.enter("b", weights)) for _ in range(6)]
        a_more = [asyncio.create_task(gate.enter("a", weights)) for _ in range(3)]
        await asyncio.sleep(0)
        assert dict(gate.running) == {"a": 4, "b": 3}  # b under its 3 of 4 goes in; a's wait
        for _ in range(4):  # a's first four finish one by one: b (least running for its weight) first
            gate.leave("a", weights)
            await asyncio.sleep(0)
        assert gate.running["b"] == 3 and gate.running.get("a", 0) == 1
        assert sum(t.done() for t in b_in) == 3 and sum(t.done() for t in a_more) == 1
        cancelled = a_more[-1]
        cancelled.cancel()  # a held request given up leaves nothing behind
        await asyncio.gather(cancelled, return_exceptions=True)
        assert gate.waiting() == {"a": 1, "b": 3}
        return gate

    asyncio.run(scenario())


def test_a_higher_priority_job_goes_before_its_tenants_lower_ones_and_the_tenant_pays_the_same():
    from services.rollout.fair_share import RANKS, FairShare

    fair = FairShare()
    _, low1 = fair.admit("a", 100, 1.0, RANKS["low"])
    _, low2 = fair.admit("a", 100, 1.0, RANKS["low"])
    _, normal = fair.admit("a", 100, 1.0, RANKS["normal"])
    _, high = fair.admit("a", 100, 1.0, RANKS["high"])
    _, normal2 = fair.admit("a", 100, 1.0, RANKS["normal"])
    assert high < normal < low1 < low2  # high first, then normal, each before the low ones queued earlier
    assert normal <= normal2 < low1  # within a rank, arrival order (vLLM serves equal tags as they came)
    assert fair.finish["a"] == 500.0  # the tenant's clock moved by all five, whatever their ranks
    _, other = fair.admit("b", 100, 1.0)
    assert other == 0  # another tenant's first request is not put behind a's jumps
    plain = FairShare()
    assert [plain.admit("a", 100, 1.0)[1] for _ in range(3)] == [0, 100_000, 200_000]  # all normal: as before
