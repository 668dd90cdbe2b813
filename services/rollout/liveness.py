"""Which of a job's tools and rewards stopped answering, and what the job is told about it.

A tool that does not answer a call ends that call with an error the model sees; a reward that
does not answer makes rollout sample the version again. Either way the job would run on with
nothing in its status saying why it learns nothing. So the first unanswered request puts a
warning in the job's status naming the tool or reward (``JobRecord.warnings``), an answer
clears it, and once nothing has answered for ``rollout.give_up_s`` the job fails with that
reason. Per replica: another replica that still gets answers keeps its own count.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from marlaas.platform.bus import Bus
from marlaas.platform.commits import report_failure, report_warning

log = structlog.get_logger("rollout")

SERVICE = "rollout"


@dataclass
class Silence:
    since: float  # monotonic: the first unanswered request since the last answer
    requests: int = 0
    given_up: bool = False


class Liveness:
    """Per (job, dependency): unanswered since when; warns at once, fails the job after ``give_up_s``."""

    def __init__(self, bus: Bus, give_up_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.bus = bus
        self.give_up_s = give_up_s
        self.clock = clock
        self.silent: dict[tuple[str, str], Silence] = {}

    async def answered(self, job: str, what: str) -> None:
        """``what`` (e.g. ``"tool acme.weather"``) answered a request of ``job``: clear its warning."""
        if self.silent.pop((job, what), None) is not None:
            log.info("answering again", job=job, what=what)
            await self._report(report_warning(self.bus, job, SERVICE, what, ""))

    async def unanswered(self, job: str, what: str) -> bool:
        """``what`` left a request of ``job`` unanswered; True once the job was failed for it."""
        now = self.clock()
        silence = self.silent.get((job, what))
        if silence is None:
            silence = self.silent[(job, what)] = Silence(since=now)
            await self._report(report_warning(
                self.bus, job, SERVICE, what,
                f"not answering since {time.strftime('%H:%M:%S')}; the job fails if it still does not "
                f"answer after {self.give_up_s:g}s (is its server running?)"))
            log.warning("not answering", job=job, what=what)
        silence.requests += 1
        if not silence.given_up and now - silence.since >= self.give_up_s:
            # given up once the failure is published: a lost one is sent again at the next silence
            silence.given_up = await self._report(report_failure(
                self.bus, job, SERVICE, f"{what} stopped answering: {silence.requests} requests unanswered "
                f"over {now - silence.since:.0f}s (rollout.give_up_s = {self.give_up_s:g})"))
        return silence.given_up

    @staticmethod
    async def _report(publishing) -> bool:
        """Publish a report; whether it went out. A broker that fails it (an election) must not
        fail the tool call or batch that noticed the silence."""
        try:
            await publishing
            return True
        except Exception as exc:
            log.warning("could not report a silent tool or reward", error=repr(exc))
            return False

    def forget(self, job: str) -> None:
        for key in [k for k in self.silent if k[0] == job]:
            del self.silent[key]
