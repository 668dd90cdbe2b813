"""tests/scheduling.py's decisions: units, their recorded times, the order and the pick."""

from __future__ import annotations

from tests.scheduling import (
    LONG_TEST_S,
    SHARED_UNIT,
    UNKNOWN_S,
    longest_first,
    pick,
    unit_of,
    unit_seconds,
    uses_shared_stack,
)

SHARED_FILE = "tests/integration/test_rl_loop.py"  # marked shared_stack
OWN_FILE = "tests/integration/test_chaos.py"  # starts its own


def test_the_shared_stacks_files_are_one_unit_and_every_other_file_its_own():
    assert uses_shared_stack(SHARED_FILE) and not uses_shared_stack(OWN_FILE)
    assert unit_of(f"{SHARED_FILE}::test_cli_json_shapes") == SHARED_UNIT
    assert unit_of("tests/ui/test_dashboard.py::test_alice_sees_her_job_and_its_curve_and_not_bobs") == SHARED_UNIT
    assert unit_of(f"{OWN_FILE}::test_x[1]") == OWN_FILE
    assert not uses_shared_stack("tests/no/such/file.py")


def test_a_units_time_is_its_files_recorded_time_and_a_new_file_counts_the_default():
    files = {SHARED_FILE: 100.0, "tests/ui/test_dashboard.py": 40.0, OWN_FILE: 300.0}
    assert unit_seconds(SHARED_UNIT, files) == 140.0  # the shared stack's files together
    assert unit_seconds(OWN_FILE, files) == 300.0
    assert unit_seconds("tests/unit/test_new.py", files) == UNKNOWN_S


def test_units_go_longest_first_and_stably():
    files = {"a.py": 5.0, "b.py": 500.0, "c.py": 5.0, "d.py": 50.0}
    order = longest_first(["a.py", "b.py", "c.py", "d.py", "new.py"], files)
    assert order == ["b.py", "d.py", "new.py", "a.py", "c.py"]


def test_behind_a_long_test_the_shortest_unit_waits_else_the_longest_goes():
    waiting = ["longest", "middle", "shortest"]
    assert pick(waiting, behind_s=0.0) == "longest"  # nothing held: the worker starts at once
    assert pick(waiting, behind_s=LONG_TEST_S - 1) == "longest"
    assert pick(waiting, behind_s=LONG_TEST_S) == "shortest"  # it waits out the long test
    assert pick(["only"], behind_s=600.0) == "only"
