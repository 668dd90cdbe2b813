"""The per-tenant turn at the Tinker work queues (``marlaas.platform.tenant_turns.next_turn``)."""

from __future__ import annotations

from marlaas.platform.tenant_turns import lifted, next_turn, waiting_by_tenant


def serve(waiting: dict[str, int], turns: int, **kw) -> list[str]:
    """The tenants served in ``turns`` turns, each turn's request done before the next."""
    waiting, order, last = dict(waiting), [], None
    for _ in range(turns):
        last = next_turn(waiting, last, **kw)
        if last is None:
            break
        order.append(last)
        waiting[last] -= 1
    return order


def test_nobody_waiting_is_no_turn():
    assert next_turn({}, None) is None
    assert next_turn({"alice": 0}, "alice") is None


def test_a_small_request_is_served_next_whatever_the_others_backlog():
    # bob's 12 large forward_backwards came first; alice's one comes right after bob's current one
    assert serve({"bob": 12, "alice": 1}, 3) == ["alice", "bob", "bob"]
    assert next_turn({"bob": 11, "alice": 1}, "bob") == "alice"


def test_tenants_take_turns_round_robin_in_name_order():
    assert serve({"carol": 2, "alice": 2, "bob": 3}, 7) == ["alice", "bob", "carol", "alice", "bob", "carol", "bob"]


def test_a_tenant_alone_is_served_back_to_back():
    assert serve({"bob": 3}, 5) == ["bob", "bob", "bob"]


def test_the_turn_after_a_tenant_gone_from_the_queue_goes_on_in_order():
    assert next_turn({"alice": 1, "carol": 1}, "bob") == "carol"
    assert next_turn({"alice": 1, "carol": 1}, "zed") == "alice"


def test_requests_in_hand_are_not_waiting_and_a_tenant_at_its_cap_is_skipped():
    # bob's 5 in the queue include the 2 being sampled: at his cap of 2, alice's turn it is
    assert next_turn({"bob": 5, "alice": 1}, "alice", in_hand={"bob": 2}, per_tenant=2) == "alice"
    assert next_turn({"bob": 5}, None, in_hand={"bob": 2}, per_tenant=2) is None
    assert next_turn({"bob": 5}, None, in_hand={"bob": 1}, per_tenant=2) == "bob"
    # every request of alice's in hand: none of hers is waiting
    assert next_turn({"alice": 2, "bob": 1}, "bob", in_hand={"alice": 2}) == "bob"


def test_the_tenant_with_the_least_weighted_time_goes_first_and_idling_earns_no_credit():
    assert next_turn({"alice": 5, "bob": 5}, None, virtual={"alice": 0.4, "bob": 0.1}) == "bob"
    assert next_turn({"alice": 5, "bob": 5}, "alice", virtual={"alice": 0.1, "bob": 0.1}) == "bob"  # a tie: turns
    # carol stopped waiting: forgotten; dave starts level with the least of those waiting, not at 0
    assert lifted({"alice": 3.0, "bob": 5.0, "carol": 0.5}, {"alice": 1, "bob": 2, "dave": 1}) == \
        {"alice": 3.0, "bob": 5.0, "dave": 3.0}
    assert lifted({}, {"alice": 1, "bob": 0}) == {"alice": 0.0}


def test_weights_divide_the_time_of_tenants_that_keep_requests_waiting():
    """alice (weight 3, requests of 0.1 s) and bob (weight 1, requests of 0.2 s), both backlogged:
    alice gets three quarters of the time, though bob's requests are twice as long."""
    weights, cost = {"alice": 3.0, "bob": 1.0}, {"alice": 0.1, "bob": 0.2}
    waiting, virtual, used, last = {"alice": 1000, "bob": 1000}, {}, {"alice": 0.0, "bob": 0.0}, None
    for _ in range(400):
        virtual = lifted(virtual, waiting)
        last = next_turn(waiting, last, virtual=virtual)
        virtual[last] += cost[last] / weights[last]
        used[last] += cost[last]
    assert abs(used["alice"] / (used["alice"] + used["bob"]) - 0.75) < 0.01, used


def test_messages_a_handler_holds_are_not_waiting_ones():
    # bob's 4 in the stream are the groups the trainer holds for his batch in progress: alice's turn
    assert next_turn({"bob": 4, "alice": 1}, None, virtual={"bob": 0.0, "alice": 9.0}, held={"bob": 4}) == "alice"
    assert next_turn({"bob": 4}, None, held={"bob": 4}) is None
    assert next_turn({"bob": 5}, None, held={"bob": 4}) == "bob"  # his fifth group is waiting


def test_a_paused_tenant_has_no_turn_and_the_others_go_on():
    assert next_turn({"bob": 3, "alice": 1}, None, virtual={"bob": 0.0, "alice": 5.0}, paused={"bob"}) == "alice"
    assert next_turn({"bob": 3}, None, paused={"bob"}) is None
    assert serve({"bob": 2, "alice": 2}, 4, paused=frozenset()) == ["alice", "bob", "alice", "bob"]


def test_waiting_counts_by_tenant_from_per_job_subjects():
    prefix = "marlaas.trajectory.ready."
    counts = {prefix + "alice.job-a": 2, prefix + "alice.job-b": 1, prefix + "bob.x-1": 4,
              prefix + "Not_A_Tenant.x": 9, "elsewhere.alice.job": 5}
    assert waiting_by_tenant(counts, prefix, nested=True) == {"alice": 3, "bob": 4}
    # one subject per tenant (the Tinker queues): the rest of the subject is the tenant
    assert waiting_by_tenant({"q.alice": 2, "q.bob.extra": 1}, "q.") == {"alice": 2}
