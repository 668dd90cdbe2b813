"""Per-tenant turns at a work queue (``marlaas.platform.tenant_turns.TenantQueues``) against a real
nats-server, on the TINKER stream the trainer and rollout read: a tenant's backlog does not hold
another's request, each tenant's requests keep their order, the bounds hold, a failed request is
delivered again, and the single consumer of before is retired."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from nats.js.api import AckPolicy, ConsumerConfig
from polling import eventually

from marlaas.platform import tenant_turns
from marlaas.platform.bus import Bus, Delivery
from marlaas.platform.tenant_turns import TenantQueues

pytestmark = pytest.mark.timeout(60)
SUBJECT = "marlaas.tinker.train"


@contextlib.asynccontextmanager
async def serving(queues: TenantQueues, handler):
    stop = asyncio.Event()
    task = asyncio.create_task(queues.run(handler, stop))
    try:
        yield task
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=5)


async def queue(bus: Bus, tenant: str, n: int, subject: str = SUBJECT) -> None:
    for i in range(n):
        await bus.publish(f"{subject}.{tenant}", f"{tenant}:{i}".encode(), msg_id=f"{subject}:{tenant}:{i}")


async def test_a_tenants_request_is_served_before_anothers_backlog_drains(bus):
    await queue(bus, "bob", 12)  # bob's twelve large forward_backwards came first
    served: list[str] = []

    async def handler(delivery: Delivery) -> None:
        served.append(delivery.data.decode())
        await asyncio.sleep(0.2)  # a request takes a while: the queue is read between requests

    queues = TenantQueues(bus, "TINKER", "trainer-tinker", SUBJECT, ack_wait_s=20, max_deliver=-1)
    async with serving(queues, handler):
        await eventually(lambda: served, timeout_s=10, what="bob's first request in hand")
        await queue(bus, "alice", 1)
        await eventually(lambda: len(served) == 13, timeout_s=30, what="every request served")
    assert "alice:0" in served[:3], served  # behind at most the one or two of bob's taken meanwhile
    assert [s for s in served if s.startswith("bob")] == [f"bob:{i}" for i in range(12)]  # bob's in order
    assert (await bus.js.stream_info("TINKER")).state.messages == 0  # every one acked


async def test_sampling_is_bounded_in_all_and_per_tenant(bus):
    await queue(bus, "bob", 10, "marlaas.tinker.sample")
    await queue(bus, "alice", 2, "marlaas.tinker.sample")
    in_hand: dict[str, int] = {}
    most = {"total": 0, "bob": 0, "alice": 0}
    served: list[str] = []

    async def handler(delivery: Delivery) -> None:
        tenant = delivery.data.decode().split(":")[0]
        in_hand[tenant] = in_hand.get(tenant, 0) + 1
        most[tenant] = max(most[tenant], in_hand[tenant])
        most["total"] = max(most["total"], sum(in_hand.values()))
        await asyncio.sleep(0.1)
        in_hand[tenant] -= 1
        served.append(delivery.data.decode())

    queues = TenantQueues(bus, "TINKER", "rollout-tinker", "marlaas.tinker.sample", ack_wait_s=20,
                          max_deliver=3, concurrency=3, per_tenant=2)
    async with serving(queues, handler):
        await eventually(lambda: len(served) == 12, timeout_s=30, what="every request served")
    assert most == {"total": 3, "bob": 2, "alice": 2}, most
    assert max(served.index("alice:0"), served.index("alice:1")) < served.index("bob:9"), served


async def test_a_failed_request_is_delivered_again(bus):
    await queue(bus, "bob", 1)
    attempts: list[int] = []

    async def handler(delivery: Delivery) -> None:
        attempts.append(delivery.num_delivered)
        if delivery.num_delivered == 1:
            raise RuntimeError("the trainer failed this once")

    queues = TenantQueues(bus, "TINKER", "trainer-tinker", SUBJECT, ack_wait_s=20, max_deliver=-1,
                          retry_delay_s=0.1)
    async with serving(queues, handler):
        await eventually(lambda: attempts == [1, 2], timeout_s=15, what="the request delivered again")


async def test_the_single_consumer_of_before_is_retired(bus):
    # a stack upgraded in place: the old consumer of every tenant's subjects overlaps each tenant's
    old = ConsumerConfig(durable_name="trainer-tinker", filter_subject=f"{SUBJECT}.>", ack_policy=AckPolicy.EXPLICIT)
    await bus.js.add_consumer("TINKER", old)
    await queue(bus, "alice", 1)
    served: list[str] = []

    async def handler(delivery: Delivery) -> None:
        served.append(delivery.data.decode())

    queues = TenantQueues(bus, "TINKER", "trainer-tinker", SUBJECT, ack_wait_s=20, max_deliver=-1)
    await queues.retire("trainer-tinker")
    await queues.retire("trainer-tinker")  # a second replica's retire finds it gone
    async with serving(queues, handler):
        await eventually(lambda: served == ["alice:0"], timeout_s=15, what="alice's request served")
    names = [info.name for info in await bus.js.consumers_info("TINKER")]
    assert "trainer-tinker" not in names and "trainer-tinker-alice" in names



async def test_a_tenant_whose_turn_finds_nothing_rests_while_another_is_served(bus, monkeypatch):
    """alice's only request is in another replica's hand: the stream still counts it, so she looks
    waiting, but her turn's fetch finds nothing. She rests while bob's requests are served, rather
    than costing the queue a fetch's wait every few of his (with no rest: one in four, six here).
    Her rest is made longer than the test, so the count does not hang on the machine's speed; it is
    read as bob's last request starts (after it, she is the only one left, and looks again)."""
    monkeypatch.setattr(tenant_turns, "REST_S", 60.0)
    await queue(bus, "alice", 1)
    other = TenantQueues(bus, "TINKER", "trainer-tinker", SUBJECT, ack_wait_s=20, max_deliver=-1)
    taken = await other._fetch("alice")  # another replica holds it, unacked
    assert [m.data for m in taken] == [b"alice:0"]
    await queue(bus, "bob", 24)
    served: list[str] = []
    empty_before_last: list[int] = []

    async def handler(delivery: Delivery) -> None:
        if delivery.data == b"bob:23":
            empty_before_last.append(queues.empty_turns["alice"])
        await asyncio.sleep(0.05)
        served.append(delivery.data.decode())

    queues = TenantQueues(bus, "TINKER", "trainer-tinker", SUBJECT, ack_wait_s=20, max_deliver=-1)
    async with serving(queues, handler):
        await eventually(lambda: len(served) == 24, timeout_s=30, what="bob's 24 requests")
    assert served == [f"bob:{i}" for i in range(24)]
    assert empty_before_last == [1], queues.empty_turns  # her first turn, then rest
    await taken[0].ack()
    for sub in other.subs.values():
        await sub.unsubscribe()


async def test_tenants_weights_divide_the_queues_time(bus):
    """alice of weight 3 (`marlaas tenant set alice --weight 3`) and bob of 1, both with requests
    always waiting, bob's twice as long as alice's: alice has the queue three quarters of the time."""
    from marlaas.platform.tenants import add_tenant, set_tenant

    for name in ("alice", "bob"):
        await add_tenant(bus, name)
    assert (await set_tenant(bus, "alice", weight=3)).weight == 3.0
    await queue(bus, "alice", 80)
    await queue(bus, "bob", 80)
    seconds = {"alice": 0.0, "bob": 0.0}

    async def handler(delivery: Delivery) -> None:
        tenant = delivery.data.decode().split(":")[0]
        took = 0.05 if tenant == "alice" else 0.1
        await asyncio.sleep(took)
        seconds[tenant] += took

    queues = TenantQueues(bus, "TINKER", "trainer-tinker", SUBJECT, ack_wait_s=20, max_deliver=-1)
    async with serving(queues, handler):
        await eventually(lambda: sum(seconds.values()) >= 3.0, timeout_s=30, what="3 s of requests served")
    share = seconds["alice"] / sum(seconds.values())
    assert abs(share - 0.75) <= 0.75 * 0.15, seconds  # within 15 % of its weight's share


async def test_the_trainers_batches_by_tenant_turns_a_paused_tenant_waits_and_held_ones_stay_held(bus):
    """The TRAJ queue's subjects name jobs (``<tenant>.<name>``): a tenant's consumer takes all its
    jobs' batches; a paused tenant's wait untouched until it is resumed; a message the handler
    holds (a pipelined batch's group) is not taken again; the per-tenant consumers are retired
    when the queue goes back to one (``trainer.fair_share = false``)."""
    from marlaas.platform import subjects
    from marlaas.platform.tenants import add_tenant, set_tenant

    for name in ("alice", "bob"):
        await add_tenant(bus, name)
    await set_tenant(bus, "bob", paused=True)
    for job, n in (("alice.one-1", 2), ("alice.two-2", 1), ("bob.three-3", 2)):
        for i in range(n):
            await bus.publish(subjects.trajectory_ready(job), f"{job}:{i}".encode(), msg_id=f"{job}:{i}")
    served: list[str] = []
    holding: list[Delivery] = []

    async def handler(delivery: Delivery) -> None:
        served.append(delivery.data.decode())
        if delivery.data.decode() == "alice.two-2:0":  # held, as the trainer holds a group
            holding.append(delivery)
            delivery.defer()

    queues = TenantQueues(bus, "TRAJ", "trainer", subjects.TRAJECTORY_READY, nested=True, ack_wait_s=20,
                          max_deliver=-1, held=lambda: {"alice": len(holding)}, doorbell=True)
    async with serving(queues, handler):
        await eventually(lambda: len(served) == 3, timeout_s=15, what="alice's three batches")
        await asyncio.sleep(1.0)  # bob's wait while he is paused
        assert sorted(served) == ["alice.one-1:0", "alice.one-1:1", "alice.two-2:0"]
        assert (await set_tenant(bus, "bob", paused=False)).paused is False
        await eventually(lambda: len(served) == 5, timeout_s=15, what="bob's batches once resumed")
    assert served[3:] == ["bob.three-3:0", "bob.three-3:1"]  # in the order published; the held one not again
    await holding[0].ack()
    names = {info.name for info in await bus.js.consumers_info("TRAJ")}
    assert {"trainer-alice", "trainer-bob"} <= names
    await queues.retire_turns()
    assert not {info.name for info in await bus.js.consumers_info("TRAJ")} & {"trainer-alice", "trainer-bob"}


async def test_the_weights_broadcast_reaches_a_service_that_cannot_read_the_bucket(bus):
    """The manager broadcasts every tenant's weight (``broadcast_shares``); the sandbox, whose broker
    user reaches no JetStream, shares its python runs by what it heard (``SharesHeard``)."""
    from marlaas.platform.tenants import SharesHeard, add_tenant, broadcast_shares, set_tenant

    for name in ("alice", "bob"):
        await add_tenant(bus, name)
    await set_tenant(bus, "alice", weight=3)
    heard = SharesHeard()
    await heard.listen(bus)
    stop = asyncio.Event()
    task = asyncio.create_task(broadcast_shares(bus, stop, every_s=0.2))
    try:
        await eventually(lambda: heard.weights == {"alice": 3.0, "bob": 1.0}, timeout_s=10, what="the weights heard")
        await set_tenant(bus, "bob", weight=2)
        await eventually(lambda: heard.weights.get("bob") == 2.0, timeout_s=10, what="a change heard")
        assert await heard.read() == {"alice": 3.0, "bob": 2.0}
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=5)
