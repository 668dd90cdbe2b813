"""The commands that show jobs: ``list``, ``status`` (``--watch``), ``watch``, ``samples`` and ``report``."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from marlaas.cli.job_commands import job_client
from marlaas.cli.output import print_json, stdout_console

TOOL_SUCCESS = "tool/success_rate"  # an agentic batch's share of episodes with a successful call


def status_table(views):
    """A rich table of jobs (``JobInfo``s)."""
    from rich.markup import escape
    from rich.table import Table

    table = Table("id", "task", "state", "version", "reward first", "reward last", "ttfs_s", "tpts_s")
    for v in views:
        state = v.state + (f" ({v.reason})" if v.reason else "")
        if v.queue_position is not None:
            state += f" #{v.queue_position}"
        if v.followed_by:
            state += f", then {v.followed_by}"
        if v.warnings:  # a tool or reward that stopped answering: named here, the detail in --json
            state += " [not answering: " + ", ".join(sorted(v.warnings)) + "]"
        table.add_row(  # a reason or warning is text, never rich markup ("[x]" would vanish)
            escape(v.id), escape(v.task), escape(state), f"{v.version}/{v.target_steps}",
            f"{v.rewards[0]:.3f}" if v.rewards else "-",
            # agentic jobs: beside the reward, the last batch's share of episodes with a successful call
            (f"{v.rewards[-1]:.3f}" if v.rewards else "-")
            + (f" (tool ok {shares[-1]:.2f})" if (shares := v.metrics.get(TOOL_SUCCESS)) else ""),
            f"{v.ttfs_s:.1f}" if v.ttfs_s is not None else "-",
            f"{v.tpts_s:.2f}" if v.tpts_s is not None else "-",
        )
    return table


def cmd_list(args, config) -> int:
    with job_client(config) as client:
        jobs = client.jobs()
    if args.json:
        print_json({"jobs": jobs})
    else:
        stdout_console().print(status_table(jobs))
    return 0


def cmd_status(args, config) -> int:
    from rich.live import Live

    with job_client(config) as client:
        def once():
            return [client.job(args.job)] if args.job else client.jobs()

        if args.json:
            print_json({"jobs": once()})
        elif not args.watch:
            stdout_console().print(status_table(once()))
        else:
            try:
                with Live(status_table(once()), refresh_per_second=2) as live:
                    while True:
                        time.sleep(1.0)
                        live.update(status_table(once()))
            except KeyboardInterrupt:
                pass
    return 0


class WatchProgress:
    """What ``marlaas watch`` shows, kept up to date from the job's events."""

    def __init__(self, info) -> None:
        self.info = info
        self.state, self.version, self.reward = info.state, info.version, (info.rewards or [None])[-1]
        self.tool_ok = (info.metrics.get(TOOL_SUCCESS) or [None])[-1]
        self.commits: dict[int, float] = {}  # version -> committed_at, versions >= 1

    def apply(self, event) -> None:
        data = event.data
        if event.event == "policy.committed":
            self.version = max(self.version, data["version"])
            self.reward = data.get("metrics", {}).get("reward/mean", self.reward)
            self.tool_ok = data.get("metrics", {}).get(TOOL_SUCCESS, self.tool_ok)
            if data["version"] >= 1:
                self.commits[data["version"]] = data.get("committed_at", 0.0)
        elif event.event == "job.state":
            self.state = data["state"]

    def step_s(self) -> float | None:
        """Time per step after the first (the definition of TPTS), from the commits seen."""
        if len(self.commits) >= 2:
            first, last = min(self.commits), max(self.commits)
            return (self.commits[last] - self.commits[first]) / (last - first)
        return self.info.tpts_s

    def render(self):
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        target, done = self.info.target_steps, max(self.version, 0)
        step = self.step_s()
        eta = step * (target - done) if step is not None and self.state == "running" else None
        grid = Table.grid(padding=(0, 2))
        grid.add_row(self.info.id, self.state, ProgressBar(total=target, completed=done, width=30),
                     f"version {done}/{target}")
        tool_ok = f"tool ok {self.tool_ok:.2f}" if self.tool_ok is not None else ""
        grid.add_row("last reward", (f"{self.reward:.3f}" if self.reward is not None else "-")
                     + (f"  {tool_ok}" if tool_ok else ""),
                     f"time/step {step:.2f}s" if step is not None else "time/step -",
                     f"ETA {eta:.0f}s" if eta is not None else "ETA -")
        return grid

    def line(self) -> str:
        """The same as one plain line, for output that is not a terminal."""
        step = self.step_s()
        reward = f"{self.reward:.3f}" if self.reward is not None else "-"
        return (f"{self.info.id} {self.state} version {max(self.version, 0)}/{self.info.target_steps} "
                f"reward {reward}" + (f" tool ok {self.tool_ok:.2f}" if self.tool_ok is not None else "")
                + (f" time/step {step:.2f}s" if step is not None else ""))


def cmd_watch(args, config) -> int:
    """Follow one job's progress live until it finishes (Ctrl-C leaves it running and exits 0)."""
    from rich.console import Console
    from rich.live import Live

    with job_client(config) as client:
        info = client.job(args.job)
        try:
            if args.json:
                for event in client.events(args.job):
                    print_json(event)
                    sys.stdout.flush()
                return 0
            progress = WatchProgress(info)
            if not sys.stdout.isatty():  # a pipe or a file: a line per change, not a live panel
                last = progress.line()
                print(last, flush=True)
                for event in client.events(args.job):
                    progress.apply(event)
                    if (now := progress.line()) != last:
                        print(now, flush=True)
                        last = now
            else:
                with Live(progress.render(), refresh_per_second=4, console=Console()) as live:
                    for event in client.events(args.job):
                        progress.apply(event)
                        live.update(progress.render())
        except KeyboardInterrupt:
            return 0
        final = client.job(args.job)
    print(f"{final.id} {final.state}" + (f" ({final.reason})" if final.reason else "")
          + f" at version {final.version}/{final.target_steps}")
    return 0


def cmd_samples(args, config) -> int:
    from marlaas.cli.transcript import transcript

    with job_client(config) as client:
        samples = client.samples(args.job, args.version)
    if args.json:
        print_json(samples)
    else:
        print(transcript(samples))
    return 0


def cmd_report(args, config) -> int:
    from marlaas.cli.report import write_report

    with job_client(config) as client:
        info, versions = client.job(args.job), client.versions(args.job)
    if args.tensorboard:
        from marlaas.cli.report import write_tensorboard

        run_dir = write_tensorboard(info, versions, Path(args.tensorboard))
        if args.json:
            print_json({"id": args.job, "tensorboard": str(run_dir)})
        else:
            print(f"{run_dir} (tensorboard --logdir {args.tensorboard})")
        return 0
    plots = write_report(info, versions, Path(args.out or f"report-{args.job}"))
    if args.json:
        print_json({"id": args.job, "plots": [str(p) for p in plots]})
    else:
        print("\n".join(str(p) for p in plots))
    return 0
