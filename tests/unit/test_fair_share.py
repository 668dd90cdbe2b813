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


def test_held_requests_go_in_as_others_leave_and_tenants_converge_to_their_weights():
    import asyncio

    from services.rollout.fair_share import RunningShares

    async def scenario():
        gate, weights = RunningShares(4, linger_s=0.0), {"a": 1.0, "b": 3.0}
        a_in = [gate.ticket("a", 10) for _ in range(4)]
        for ticket in a_in:  # a alone fills the engine: never held
            await gate.enter(ticket, weights)
        b_tickets = [gate.ticket("b", 10) for _ in range(6)]
        a_more = [gate.ticket("a", 10) for _ in range(3)]
        b_in = [asyncio.create_task(gate.enter(t, weights)) for t in b_tickets]
        a_wait = [asyncio.create_task(gate.enter(t, weights)) for t in a_more]
        await asyncio.sleep(0)
        assert dict(gate.running) == {"a": 1, "b": 3}  # b's 3 of 4 at once: a's latest three preempted
        assert [t.preempted for t in a_in] == [False, True, True, True]
        gate.leave(a_in[0], weights)  # a's one leaves: its next goes in (a's share is 1)
        await asyncio.sleep(0)
        assert dict(gate.running) == {"a": 1, "b": 3} and a_in[1].place == "engine"  # the preempted first
        for task, ticket in zip(b_in[:3], b_tickets[:3], strict=True):  # b's leave: b's next (least running)
            assert task.done()
            gate.leave(ticket, weights)
        await asyncio.sleep(0)
        assert dict(gate.running) == {"a": 1, "b": 3} and sum(t.done() for t in b_in) == 6
        cancelled = a_wait[-1]
        cancelled.cancel()  # a held request given up leaves nothing behind
        await asyncio.gather(cancelled, return_exceptions=True)
        assert gate.waiting() == {"a": 4}  # a's two preempted and two more
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


def test_a_tenant_alone_has_no_bound_and_two_busy_tenants_split_the_bound_by_weight_max_min():
    from services.rollout.fair_share import running_quotas

    assert running_quotas({"m": 2048}, {"m"}, {}, bound=128) is None  # alone: the whole engine
    assert running_quotas({"m": 2048, "a": 72}, {"m", "a"}, {}, bound=0) is None  # bound off
    # the victim wants more than its half: half each, whatever the other's volume
    assert running_quotas({"m": 2048, "a": 72}, {"m", "a"}, {}, bound=128) == {"m": 64, "a": 64}
    assert running_quotas({"m": 20_000, "a": 72}, {"m", "a"}, {}, bound=128) == {"m": 64, "a": 64}
    # it wants less: it gets all it wants, the rest goes to the other (work-conserving up to the bound)
    assert running_quotas({"m": 2048, "a": 8}, {"m", "a"}, {}, bound=128) == {"m": 120, "a": 8}
    # between two versions (present, nothing in): still two busy, the other held to the bound
    assert running_quotas({"m": 2048}, {"m", "a"}, {}, bound=128) == {"m": 128, "a": 0}
    assert running_quotas({"m": 2048, "a": 200}, {"m", "a"}, {"m": 3.0, "a": 1.0}, bound=128) == {"m": 96, "a": 32}
    # three tenants: whole requests adding up to the bound, at least one each that wants any
    thirds = running_quotas({"x": 99, "y": 99, "z": 99}, {"x", "y", "z"}, {}, bound=128)
    assert sum(thirds.values()) == 128 and sorted(thirds.values()) == [42, 43, 43]
    assert running_quotas({"x": 99, "y": 1}, {"x", "y"}, {"x": 1000.0, "y": 1.0}, bound=4) == {"x": 3, "y": 1}


def test_the_tenant_over_its_quota_is_preempted_and_the_least_served_goes_in_next():
    from services.rollout.fair_share import next_turn, preempted

    quotas = {"m": 64, "a": 64}
    assert preempted({"m": 1024, "a": 0}, quotas) == {"m": 960}  # mallory filled the engine alone
    assert preempted({"m": 64, "a": 64}, quotas) == {}
    assert preempted({"m": 1024}, None) == {}  # alone: never
    served = {"m": 5000.0, "a": 100.0}
    assert next_turn({"m": 900, "a": 8}, {"m": 60, "a": 60}, quotas, served) == "a"  # least served first
    assert next_turn({"m": 900, "a": 8}, {"m": 60, "a": 64}, quotas, served) == "m"  # a at its quota
    assert next_turn({"m": 900}, {"m": 64, "a": 64}, quotas, served) is None  # nobody under its quota
    assert next_turn({"m": 900}, {"m": 5000}, None, served) == "m"  # alone: no bound of ours


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_volume_does_not_decide_a_tenant_that_filled_the_engine_alone_is_cut_to_its_share():
    """H5: mallory's 2048 requests in an engine she had to herself; alice comes with 72: mallory's
    latest are taken out of the engine (their runs stopped, to run again) and alice's go in at once,
    so the engine runs 128, half each, while both are busy; alone again, mallory fills it again."""
    import asyncio

    from services.rollout.fair_share import RunningShares

    async def scenario():
        clock = Clock()
        gate, stopped = RunningShares(128, linger_s=5.0, clock=clock), []

        async def request(tenant: str, i: int):
            ticket = gate.ticket(tenant, 150)
            ticket.stop = lambda: stopped.append((tenant, i))
            await gate.enter(ticket, {})
            return ticket

        mallory = [await request("m", i) for i in range(2048)]
        assert gate.running == {"m": 2048} and not stopped  # alone: all of it
        alice = [asyncio.create_task(request("a", i)) for i in range(72)]
        await asyncio.sleep(0)
        assert gate.running == {"m": 64, "a": 64} and gate.waiting() == {"m": 1984, "a": 8}
        assert len(stopped) == 1984 and {t for t, _ in stopped} == {"m"}
        assert sorted(i for _, i in stopped) == list(range(64, 2048))  # the latest: the least done
        assert all(t.preempted for t in mallory[64:]) and not any(t.preempted for t in mallory[:64])
        for ticket in mallory[:10]:  # mallory's finish: her own go in again, the preempted first
            gate.leave(ticket, {})
        assert gate.running == {"m": 64, "a": 64} and [t.place for t in mallory[64:75]] == ["engine"] * 10 + ["held"]
        for task in alice[:64]:  # alice's finish: her held ones go in, then mallory takes what she leaves
            gate.leave(task.result(), {})
        await asyncio.sleep(0)
        assert gate.running == {"m": 120, "a": 8} and gate.waiting() == {"m": 1984 - 66}
        for task in alice[64:]:
            gate.leave(task.result(), {})
        assert gate.running == {"m": 128}  # alice between versions: mallory held to the bound...
        clock.now = 5.0
        gate.leave(mallory[10], {})  # ... until alice has been idle for linger_s: then all of it
        assert gate.running == {"m": 2048 - 11} and not gate.waiting()

    asyncio.run(scenario())


def test_a_preempted_request_goes_back_to_its_place_and_priorities_order_the_tenants_own():
    import asyncio

    from services.rollout.fair_share import RANKS, RunningShares

    async def scenario():
        gate = RunningShares(4)
        low = [gate.ticket("m", 10, RANKS["low"]) for _ in range(3)]
        high = gate.ticket("m", 10, RANKS["high"])
        for ticket in (*low, high):
            await gate.enter(ticket, {})
        bob = gate.ticket("b", 10)
        entering = asyncio.create_task(gate.enter(bob, {}))
        await asyncio.sleep(0)
        assert gate.running == {"m": 3, "b": 1}  # quotas 3 and 1 (bob wants one)
        assert low[2].preempted and not high.preempted  # the lowest priority, latest, went out
        late = gate.ticket("m", 10, RANKS["low"])
        waiting = asyncio.create_task(gate.enter(late, {}))
        gate.leave(bob, {})
        await asyncio.sleep(0)
        assert waiting.done() is False and entering.done()  # the preempted one went in again first
        assert low[2].place == "engine" and late.place == "held"
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert late.place == "" and not gate.waiting()  # given up: nothing left behind

    asyncio.run(scenario())


def test_the_running_bound_is_on_by_default():
    """A lone tenant is never bounded by it, so it costs nothing alone: on by default (H5)."""
    from marlaas.platform.config import RolloutConfig

    defaults = RolloutConfig()
    assert defaults.fair_share and defaults.fair_share_running > 0
