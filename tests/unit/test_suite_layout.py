"""The suite's own rules, read from its source (issue 47): a test file that starts a stack or an
engine of its own says why in one line (``own_stack("...")``), one that takes the session's
shared stack is marked so (tests/scheduling.py schedules its files as one unit), and the recorded
durations the scheduler reads are today's."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
# what starts a stack or an engine in a test: the launcher, rollout's engine, the chaos run and the
# in-process baseline, `marlaas up` / `marlaas bench` run as a process, `vllm serve`
STARTS_ONE = re.compile(r"(?<![\w.])Stack\(|PolicyEngine\(|run_chaos\(|run_inprocess\(|"
                        r"(?:marlaas\(|\"marlaas\.cli\", )\"(?:up|bench)\"|vllm\.entrypoints")
SHARED = "pytest.mark.shared_stack"


def own_stack_reasons(text: str) -> list[str]:
    """The reasons of the ``own_stack("...")`` marks in a file's code (read with ast: a mark
    inside a string, such as a child process's source, is none)."""
    return [call.args[0].value for call in ast.walk(ast.parse(text)) if isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute) and call.func.attr == "own_stack"
            and call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)]


def suite_files() -> dict[Path, str]:
    return {path: path.read_text() for path in sorted(TESTS.rglob("test_*.py"))}


def test_a_test_file_that_starts_its_own_stack_says_why():
    silent = []
    for path, text in suite_files().items():
        if STARTS_ONE.search(text) and SHARED not in text:
            reasons = own_stack_reasons(text)
            if not reasons or any(len(reason.split()) < 3 for reason in reasons):
                silent.append(str(path.relative_to(ROOT)))
    assert not silent, ("these start a stack or engine of their own without saying why: mark the module "
                        f"`pytest.mark.own_stack(\"why, in a line\")`, or take the `shared_stack` fixture: {silent}")


def test_a_file_on_the_shared_stack_takes_the_fixture_and_starts_none_of_its_own():
    for path, text in suite_files().items():
        if SHARED in text:
            assert "shared_stack" in text.replace(SHARED, "") or "tinker_stack import" in text, path
            assert not re.search(r"(?<![\w.])Stack\(", text) or own_stack_reasons(text), path


def test_the_recorded_durations_cover_most_of_todays_test_files():
    """A stale record (files renamed or added since) would schedule blind: past a fifth of the files
    unknown, `scripts/test-times.py record .test-results/junit.xml` after a `make test` renews it."""
    recorded = json.loads((TESTS / "durations.json").read_text())
    files = {str(path.relative_to(ROOT)) for path in suite_files()}
    known = files & set(recorded["files"])
    assert len(known) >= 0.8 * len(files), f"tests/durations.json knows {len(known)} of {len(files)} test files"
    assert sum(recorded["files"].values()) > 0 and recorded["wall_s"] > 0
