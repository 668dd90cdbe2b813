"""The sync schedule's rounds: released only when every running job is held, one barrier per round."""

from __future__ import annotations

import asyncio

from marlaas.platform.events import JobRecord, JobSpec, JobState
from services.rollout.rounds import SyncRounds, round_members


def test_a_round_waits_for_every_running_job_then_publishes_together():
    async def go():
        running = {"a", "b", "c"}
        rounds = SyncRounds(lambda: _value(running), limit=16, recheck_s=0.01)
        order: list[str] = []

        async def job(name: str, sample_s: float):
            async with rounds.member(name) as round_:
                order.append(f"start {name}")
                await asyncio.sleep(sample_s)
                await round_.sampled(name)
                order.append(f"publish {name}")
            return round_.number

        a = asyncio.create_task(job("a", 0.05))
        b = asyncio.create_task(job("b", 0.01))
        await asyncio.sleep(0.1)
        assert order == []  # c is running but not held yet: no round
        numbers = await asyncio.gather(a, b, job("c", 0.0))
        return order, numbers

    order, numbers = asyncio.run(go())
    assert numbers == [1, 1, 1]
    starts, publishes = order[:3], order[3:]
    assert sorted(starts) == ["start a", "start b", "start c"]  # all sampled before any published
    assert sorted(publishes) == ["publish a", "publish b", "publish c"]


def test_a_job_that_stops_running_or_fails_does_not_hold_up_the_round():
    async def go():
        running = {"a", "b"}
        rounds = SyncRounds(lambda: _value(running), limit=16, recheck_s=0.01)

        async def failing():
            async with rounds.member("b"):
                raise RuntimeError("sampling failed")

        async def ok():
            async with rounds.member("a") as round_:
                await asyncio.sleep(0.05)
                await round_.sampled("a")
            return round_.number

        a = asyncio.create_task(ok())
        b = asyncio.create_task(failing())
        first = await a  # b left its round by failing: a publishes alone
        assert isinstance((await asyncio.gather(b, return_exceptions=True))[0], RuntimeError)
        running.discard("b")  # b is no longer running: a's next round needs only a
        second = await asyncio.wait_for(ok(), 5)
        return first, second

    assert asyncio.run(go()) == (1, 2)


def test_the_limit_releases_a_round_when_more_jobs_run_than_can_be_held():
    async def go():
        rounds = SyncRounds(lambda: _value({"a", "b", "c"}), limit=2, recheck_s=0.01)

        async def job(name):
            async with rounds.member(name) as round_:
                await round_.sampled(name)
            return round_.number

        return await asyncio.wait_for(asyncio.gather(job("a"), job("b")), 5)

    assert asyncio.run(go()) == [1, 1]


def test_a_round_waits_for_jobs_being_admitted_but_not_for_a_job_queued_long_ago():
    def record(job: str, state: JobState, submitted_at: float) -> JobRecord:
        spec = JobSpec(id=f"t.{job}", tenant="t", name=job, task="addition", steps=2, submitted_at=submitted_at)
        return JobRecord(spec=spec, state=state)

    now = 1000.0
    records = [record("running", JobState.RUNNING, now - 600), record("fresh", JobState.QUEUED, now - 1),
               record("waiting-for-budget", JobState.QUEUED, now - 60), record("done", JobState.COMPLETED, now - 5)]
    assert round_members(records, now, admitting_s=10) == {"t.running", "t.fresh"}
    assert round_members(records, now + 10, admitting_s=10) == {"t.running"}  # it waits 10 s at most


async def _value(value):
    return set(value)
