"""The CLI's job table names what a job waits on (a tool or reward that stopped answering)."""

from __future__ import annotations

import io

from rich.console import Console

from marlaas.cli.commands import status_table
from marlaas.platform.http_api import JobInfo


def rendered(*views: JobInfo) -> str:
    out = io.StringIO()
    Console(file=out, width=200).print(status_table(views))
    return out.getvalue()


def test_the_table_names_a_silent_tool_or_reward_and_nothing_when_all_answer():
    base = dict(name="j", tenant="acme", task="reverse", state="running", reason="", version=3, steps=3,
                target_steps=10)
    silent = JobInfo(id="acme.j1", **base, warnings={"reward acme.score": "not answering since 12:00:01; ..."})
    fine = JobInfo(id="acme.j2", **base)
    text = rendered(silent, fine)
    line_1, line_2 = (next(line for line in text.splitlines() if job in line) for job in ("acme.j1", "acme.j2"))
    assert "[not answering: reward acme.score]" in line_1
    assert "not answering" not in line_2


def test_a_reason_in_brackets_is_shown_as_written_not_read_as_markup():
    failed = JobInfo(id="acme.j3", name="j", tenant="acme", task="agent", state="failed", version=1, steps=1,
                     target_steps=2, reason="env: reward [acme.score] returned [red]nan")
    assert "(env: reward [acme.score] returned [red]nan)" in " ".join(rendered(failed).split())
