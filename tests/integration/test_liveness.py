"""A job's tool or reward that stops answering: a warning in its status at once, its failure
after ``rollout.give_up_s``, the warning cleared when it answers again (rollout's Liveness and
the manager's record, over a real nats-server; the clock is the test's)."""

from __future__ import annotations

import pytest

from marlaas.platform.events import JOB, JobFailureReported, JobRecord, JobSpec, JobState, JobWarningReported
from services.manager.lifecycle import MAX_WARNINGS, with_warning
from services.rollout.liveness import Liveness

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def reports(bus):
    sub = await bus.nc.subscribe("marlaas.job.>")
    await bus.nc.flush()

    async def next_report():
        return JOB.decode((await sub.next_msg(timeout=2)).data)

    return sub, next_report


async def test_a_silent_tool_warns_at_once_fails_the_job_after_give_up_s_and_only_once(bus):
    clock = Clock()
    liveness = Liveness(bus, give_up_s=60, clock=clock)
    sub, next_report = await reports(bus)
    assert await liveness.unanswered("acme.j1", "tool acme.weather") is False
    warning = await next_report()
    assert isinstance(warning, JobWarningReported) and warning.job == "acme.j1"
    assert warning.key == "tool acme.weather" and "fails if it still does not answer after 60s" in warning.warning
    clock.now += 59
    assert await liveness.unanswered("acme.j1", "tool acme.weather") is False  # no second warning
    clock.now += 1
    assert await liveness.unanswered("acme.j1", "tool acme.weather") is True
    failure = await next_report()
    assert isinstance(failure, JobFailureReported) and failure.service == "rollout"
    assert failure.reason.startswith("tool acme.weather stopped answering: 3 requests unanswered over 60s")
    assert await liveness.unanswered("acme.j1", "tool acme.weather") is True
    with pytest.raises(TimeoutError):  # failed once
        await sub.next_msg(timeout=0.3)


async def test_an_answer_clears_the_warning_and_restarts_the_count(bus):
    clock = Clock()
    liveness = Liveness(bus, give_up_s=60, clock=clock)
    sub, next_report = await reports(bus)
    await liveness.unanswered("acme.j1", "reward acme.score")
    await next_report()
    await liveness.answered("acme.j1", "reward acme.score")
    cleared = await next_report()
    assert isinstance(cleared, JobWarningReported) and cleared.key == "reward acme.score" and cleared.warning == ""
    await liveness.answered("acme.j1", "reward acme.score")  # answering all along: nothing to say
    clock.now += 100
    assert await liveness.unanswered("acme.j1", "reward acme.score") is False  # a new silence
    assert isinstance(await next_report(), JobWarningReported)
    other = await liveness.unanswered("beta.j2", "reward acme.score")  # each job counts its own
    assert other is False and (await next_report()).job == "beta.j2"


def test_the_record_shows_each_warning_until_cleared_and_never_after_the_job_finished():
    record = JobRecord(spec=JobSpec(id="acme.j1", tenant="acme", name="j1", task="multiply", steps=2),
                       state=JobState.RUNNING)
    warn = JobWarningReported(job="acme.j1", service="rollout", key="tool acme.weather", warning="silent")
    record = with_warning(record, warn)
    assert record.warnings == {"tool acme.weather": "silent"}
    assert with_warning(record, warn) is None  # no change, no write
    cleared = with_warning(record, JobWarningReported(job="acme.j1", service="rollout",
                                                      key="tool acme.weather"))
    assert cleared.warnings == {}
    flood = record
    for i in range(MAX_WARNINGS + 10):  # bounded, whatever reports arrive
        flood = with_warning(flood, JobWarningReported(job="acme.j1", service="x", key=f"k{i}",
                                                       warning="w" * 10_000)) or flood
    assert len(flood.warnings) == MAX_WARNINGS and all(len(w) <= 500 for w in flood.warnings.values())
    done = JobRecord(spec=record.spec, state=JobState.FAILED)
    assert with_warning(done, warn) is None


async def test_a_report_the_broker_refuses_fails_no_call_and_the_give_up_is_sent_again(bus):
    clock = Clock()
    liveness = Liveness(bus, give_up_s=10, clock=clock)
    sub, next_report = await reports(bus)
    await liveness.unanswered("acme.j1", "tool acme.weather")
    await next_report()
    clock.now += 10
    await bus.nc.close()  # every publish fails now, as during an election
    assert await liveness.unanswered("acme.j1", "tool acme.weather") is False  # no exception, not given up
    assert ("acme.j1", "tool acme.weather") in liveness.silent
