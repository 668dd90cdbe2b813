"""How `make test` hands test files to its two xdist workers: longest first, from the durations a
real run recorded (tests/durations.json, written by `scripts/test-times.py record` from a run's
JUnit XML), the files of the shared stack as one unit (one worker, one stack), and a short file,
not a long one, queued behind a long test.

Why the last rule: an xdist worker runs a test only once it knows the next one (pytest's teardown
needs ``nextitem``), so a worker down to its last test is given more work before that test runs.
Behind a test of minutes (the chaos run, one test), a long file would wait for minutes while the
other worker idles at the end; a short one costs nothing. The decisions are the pure functions
below; :class:`DurationScheduling` is the thin shell xdist calls.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from xdist.scheduler import LoadFileScheduling

ROOT = Path(__file__).resolve().parents[1]
DURATIONS = ROOT / "tests" / "durations.json"
SHARED_UNIT = "shared-stack"  # the scope of every file marked `shared_stack`
SHARED_MARK = "pytest.mark.shared_stack"
UNKNOWN_S = 30.0  # a file no run has recorded yet (a new one): mid-table, neither first nor last
LONG_TEST_S = 60.0  # a test this long gets a short unit queued behind it, not the longest one


@functools.cache
def recorded() -> dict:
    """tests/durations.json: ``{"files": {path: seconds}, "tests": {nodeid: seconds}}`` (empty
    where the file is missing: every file then counts UNKNOWN_S)."""
    if not DURATIONS.exists():
        return {"files": {}, "tests": {}}
    return json.loads(DURATIONS.read_text())


@functools.cache
def uses_shared_stack(path: str) -> bool:
    """Whether a test file is marked ``shared_stack`` (its tests run on the session's one stack)."""
    file = ROOT / path
    return file.is_file() and SHARED_MARK in file.read_text()


def unit_of(nodeid: str) -> str:
    """The unit a test is scheduled in: its file, or the shared stack's unit."""
    path = nodeid.split("::", 1)[0]
    return SHARED_UNIT if uses_shared_stack(path) else path


def unit_seconds(unit: str, files: dict[str, float]) -> float:
    """What a unit took in the recorded run (a new file: UNKNOWN_S)."""
    if unit == SHARED_UNIT:
        return sum(s for path, s in files.items() if uses_shared_stack(path))
    return files.get(unit, UNKNOWN_S)


def longest_first(units: list[str], files: dict[str, float]) -> list[str]:
    """Units by recorded time, longest first (stable for equal times)."""
    return sorted(units, key=lambda unit: -unit_seconds(unit, files))


def pick(waiting: list[str], behind_s: float) -> str:
    """The unit to give a worker from ``waiting`` (longest first), where the test it still holds
    takes ``behind_s``: the longest, unless that test is long, then the shortest."""
    return waiting[-1] if behind_s >= LONG_TEST_S else waiting[0]


class DurationScheduling(LoadFileScheduling):
    """xdist's file scheduling with the units and picks above; the queue is in the collection's
    order, which tests/conftest.py sorts longest first (xdist's own reorder, most tests first, is off)."""

    def __init__(self, config, log=None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False  # the collection is in order already (conftest.py)

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)

    def _assign_work_unit(self, node) -> None:
        tests = recorded()["tests"]
        held = [nodeid for unit in self.assigned_work.get(node, {}).values()
                for nodeid, done in unit.items() if not done]
        behind_s = max((tests.get(nodeid, 0.0) for nodeid in held), default=0.0)
        unit = pick(list(self.workqueue), behind_s)
        self.workqueue.move_to_end(unit, last=False)  # xdist's own assignment takes the first unit
        super()._assign_work_unit(node)

    def _reschedule(self, node) -> None:
        # a unit at a time: more only once the worker is down to the test it holds (xdist's own
        # rule, at most two pending, would queue a second unit behind a long first test at the start)
        if not node.shutting_down and self.workqueue and self._pending_of(self.assigned_work[node]) > 1:
            return
        super()._reschedule(node)
