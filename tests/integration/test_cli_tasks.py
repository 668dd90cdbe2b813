"""`marlaas tasks --json`, run as a user runs it (the CLI in its own process), lists each built-in
task with its kind."""

from __future__ import annotations

from marlaas.tasks import get_task


def test_the_agentic_tasks_are_listed_as_agentic():
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "marlaas.cli", "tasks", "--json"], capture_output=True,
                          text=True, timeout=120)
    kinds = {t["name"]: t["kind"] for t in json.loads(done.stdout)["tasks"]}
    assert kinds["multiply"] == kinds["search-qa"] == "agentic"
    assert kinds["addition"] == "single-turn"
    multiply = get_task("multiply")
    assert multiply.tools == ("calculator",)
    problem = multiply.problems(1, seed=3)[0]
    assert problem["answer"] == str(eval(problem["expression"]))  # noqa: S307 (the test's own arithmetic)
    from marlaas.tools.protocol import observation_text, render_call

    called = render_call("calculator", {"expression": problem["expression"]}) + observation_text(problem["answer"])
    assert multiply.reward(problem, called + problem["answer"]) == 1.0
    assert multiply.reward(problem, "0") < 1.0
