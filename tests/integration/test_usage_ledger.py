"""Metering's ledger on a real nats-server: the USAGE stream folded into the ``usage`` bucket,
each event exactly once, through a redelivery of an event already applied, a manager stopped and
started again, and events of two tenants, two days and two jobs."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.js.api import ConsumerConfig

from marlaas.platform import subjects
from marlaas.platform.usage import UsageCounters, UsageReported, add, encode, read_usage, report_usage
from services.manager.usage import apply_usage, keep_ledger

pytestmark = pytest.mark.timeout(60)
DAY1, DAY2 = 1_772_409_600.0, 1_772_496_000.0  # 2026-03-02 and 2026-03-03, 00:00 UTC


async def publish(bus, job: str, at: float, **counters) -> UsageReported:
    event = UsageReported(tenant=job.partition(".")[0], job=job, service="rollout",
                          counters=UsageCounters(**counters), at=at)
    await bus.publish(subjects.usage(event.tenant), encode(event))
    return event


async def totals(bus, tenant: str = "") -> dict[tuple[str, str, str], UsageCounters]:
    return {(r.tenant, r.day, r.job): r.counters for r in await read_usage(bus, tenant)}


async def ledger_until(bus, done, timeout_s: float = 20.0) -> None:
    """Run the manager's ledger until ``done(records)``, then stop it as a manager stops."""
    stop = asyncio.Event()
    task = asyncio.create_task(keep_ledger(bus, stop))
    deadline = time.monotonic() + timeout_s
    try:
        while not done(await totals(bus)):
            assert time.monotonic() < deadline, await totals(bus)
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        await task


async def test_each_event_is_applied_once_across_a_redelivery_and_a_restart(bus):
    sent = [await publish(bus, "acme.j1-ab", DAY1, generated_tokens=10, prefill_tokens=4),
            await publish(bus, "acme.j1-ab", DAY1, train_tokens=10, train_s=0.5),
            await publish(bus, "acme.j1-ab", DAY2, generated_tokens=3),
            await publish(bus, "acme.j2-cd", DAY1, tool_calls=2, tool_s=0.25),
            await publish(bus, "other.j9-ef", DAY1, generated_tokens=99)]
    # a manager that stored the first event's record, then stopped before its ack: the event comes again
    sub = await bus.js.pull_subscribe(subjects.usage("*"), durable="manager-usage", stream="USAGE",
                                      config=ConsumerConfig(max_ack_pending=1, max_deliver=-1))  # the ledger's
    (first,) = await sub.fetch(1, timeout=5)
    assert await apply_usage(bus, sent[0], first.metadata.sequence.stream)
    await first.nak()
    await sub.unsubscribe()

    def expected(events: list[UsageReported]) -> dict:
        sums: dict = {}
        for e in events:
            key = (e.tenant, "2026-03-02" if e.at == DAY1 else "2026-03-03", e.job)
            sums[key] = add(sums.get(key, UsageCounters()), e.counters)
        return sums

    await ledger_until(bus, lambda found: found == expected(sent))
    assert (await totals(bus))[("acme", "2026-03-02", "acme.j1-ab")] == UsageCounters(
        generated_tokens=10, prefill_tokens=4, train_tokens=10, train_s=0.5)  # the first event once
    assert set(await totals(bus, "acme")) == {k for k in expected(sent) if k[0] == "acme"}

    # a manager started again folds only what came since, and an event applied already is refused
    sent.append(await publish(bus, "acme.j1-ab", DAY1, generated_tokens=1))
    await report_usage(bus, "trainer", "other.j9-ef", UsageCounters(train_samples=4))  # today: a new record
    await ledger_until(bus, lambda found: len(found) == 5 and found.get(("acme", "2026-03-02", "acme.j1-ab"),
                                                                        UsageCounters()).generated_tokens == 11)
    found = await totals(bus)
    assert found[("acme", "2026-03-02", "acme.j1-ab")].generated_tokens == 11
    assert sum(c.train_samples for (t, _, _), c in found.items() if t == "other") == 4
    assert not await apply_usage(bus, sent[1], 2)
    assert await totals(bus) == found
