"""The CLI's job table names what a job waits on (a tool or reward that stopped answering)."""

from __future__ import annotations

import io

from rich.console import Console

from marlaas.cli.view_commands import status_table
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


def test_the_table_shows_an_agentic_jobs_tool_success_beside_its_reward():
    base = dict(name="j", tenant="acme", state="running", reason="", version=2, steps=2, target_steps=10,
                rewards=[0.1, 0.4])
    agent = JobInfo(id="acme.agent", task="multiply", **base, metrics={"tool/success_rate": [0.25, 0.625]})
    plain = JobInfo(id="acme.plain", task="reverse", **base)
    text = rendered(agent, plain)
    row = next(line for line in text.splitlines() if "acme.agent" in line)
    assert "0.400 (tool ok 0.62)" in " ".join(row.split())
    assert "tool ok" not in next(line for line in text.splitlines() if "acme.plain" in line)


def test_a_reason_in_brackets_is_shown_as_written_not_read_as_markup():
    failed = JobInfo(id="acme.j3", name="j", tenant="acme", task="agent", state="failed", version=1, steps=1,
                     target_steps=2, reason="env: reward [acme.score] returned [red]nan")
    assert "(env: reward [acme.score] returned [red]nan)" in " ".join(rendered(failed).split())


def test_piped_output_keeps_each_job_on_one_line():
    from marlaas.cli.output import stdout_console

    reason = "env: reward acme.score failed: " + "a long explanation " * 8
    long = JobInfo(id="default.a-rather-long-job-name-0123456789", name="j", tenant="default", task="reverse",
                   state="failed", reason=reason, version=2, steps=2, target_steps=40)
    out = io.StringIO()
    stdout_console(file=out).print(status_table([long]))  # stdout under pytest is not a terminal
    rows = [line for line in out.getvalue().splitlines() if "default.a-rather" in line]
    assert len(rows) == 1 and long.id in rows[0] and reason.strip() in rows[0]


def test_watch_without_a_terminal_prints_a_plain_line_per_change():
    from marlaas.cli.view_commands import WatchProgress
    from marlaas.sdk.http import Event

    info = JobInfo(id="acme.j1", name="j", tenant="acme", task="reverse", state="running", reason="",
                   version=0, steps=0, target_steps=3)
    progress = WatchProgress(info)
    assert progress.line() == "acme.j1 running version 0/3 reward -"
    for version, at in ((1, 10.0), (2, 12.5)):
        progress.apply(Event(id=str(version), event="policy.committed",
                             data={"version": version, "committed_at": at, "metrics": {"reward/mean": 0.25 * version}}))
    assert progress.line() == "acme.j1 running version 2/3 reward 0.500 time/step 2.50s"
    progress.apply(Event(id="3", event="policy.committed",
                         data={"version": 3, "committed_at": 15.0,
                               "metrics": {"reward/mean": 1.0, "tool/success_rate": 0.75}}))
    assert progress.line() == "acme.j1 running version 3/3 reward 1.000 tool ok 0.75 time/step 2.50s"
    progress.apply(Event(id="9", event="job.state", data={"state": "completed"}))
    assert progress.line().startswith("acme.j1 completed version 3/3")
