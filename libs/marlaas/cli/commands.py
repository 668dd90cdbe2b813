"""``marlaas``: up, down, info, tasks, submit, list, status, watch, cancel, delete, pull, samples,
report, bench (and the operator's ``tenant`` and ``usage``).

Job commands go through the HTTP API with the SDK (``marlaas.Client.from_env``: the
gateway and the default tenant's token of the stack under the home dir, or
``MARLAAS_URL`` / ``MARLAAS_TOKEN``). Every command takes ``--json`` for scripts; errors
print ``{"error"}`` and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import tomllib
from pathlib import Path

import msgspec

from marlaas.platform.config import ConfigError, load_config

DOWN_WAIT_S = 180.0  # `down`: how long the stack may take to drain and stop


def _print_json(obj) -> None:
    print(json.dumps(msgspec.to_builtins(obj)))


def _fail(message: str, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"error": message}))
    else:
        print(f"error: {message}", file=sys.stderr)
    return 2


# --- commands -------------------------------------------------------------------------------


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def _launcher_pid(config) -> int | None:
    """The pid of the ``marlaas up`` running the stack under the home dir, if one runs."""
    from marlaas.sdk import discovery

    state = discovery.read_state(config.home_dir / "run")
    return state.pid if state is not None and discovery.alive(state.pid) else None


def _up_detached(args, config) -> int:
    """``up -d``: the same launcher as a background process of its own (its output in
    ``logs/up.log``); return once the stack accepts jobs, with what ``up`` prints."""
    import subprocess

    from marlaas.platform.store import make_private_dirs
    from marlaas.sdk import discovery

    if (pid := _launcher_pid(config)) is not None:
        return _fail(f"a stack is already running under {config.home_dir} (pid {pid}): "
                     "`marlaas down` stops it", args.json)
    make_private_dirs(config.home_dir / "logs")
    log = config.home_dir / "logs" / "up.log"
    argv = [sys.executable, "-m", "marlaas.cli", "--home", str(config.home_dir)]
    argv += ["--config", args.config] if args.config else []
    argv += ["up", "--json", "--nats-cluster", str(args.nats_cluster)]
    argv += ["--replicas", args.replicas] if args.replicas else []
    with open(log, "w") as out:
        launcher = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # a terminal's Ctrl-C or hangup: not ours
    if not args.json:
        print(f"starting the stack in the background (pid {launcher.pid}, output in {log})...",
              file=sys.stderr)
    try:  # python and torch imports come before the launcher says it is starting
        discovery.wait_until_ready(config.home_dir / "run", appear_s=120)
        deadline = time.monotonic() + 30
        while not (info := next((line for line in log.read_text().splitlines() if line.startswith("{")), None)):
            if launcher.poll() is not None or time.monotonic() > deadline:
                raise discovery.StackNotReady("the launcher stopped before saying it was up")
            time.sleep(0.2)
    except discovery.StackNotReady as exc:
        if launcher.poll() is None:
            launcher.terminate()  # half-started: stop it rather than leave it
            launcher.wait(timeout=120)
        tail = "\n".join(log.read_text().splitlines()[-15:])
        return _fail(f"{exc}; the launcher's last lines ({log}):\n{tail}", args.json)
    if args.json:
        print(info)
    else:
        up = json.loads(info)
        print(f"marlaas is up (pid {launcher.pid}): gateway {up['gateway_url']}, NATS {up['nats_url']}; "
              f"`marlaas down` stops it")
    return 0


def cmd_down(args, config) -> int:
    """Stop the stack that ``marlaas up`` (``-d`` or not) runs under the home dir, and wait for it."""
    pid = _launcher_pid(config)
    if pid is None:
        message = f"no stack is running under {config.home_dir}"
        if args.json:
            _print_json({"stopped": None, "detail": message})
        else:
            print(message)
        return 0
    from marlaas.sdk import discovery

    os.kill(pid, signal.SIGTERM)  # the launcher drains and stops every service, as on Ctrl-C
    deadline = time.monotonic() + DOWN_WAIT_S
    while discovery.alive(pid):
        if time.monotonic() > deadline:
            return _fail(f"the stack (pid {pid}) did not stop within {DOWN_WAIT_S:.0f} s: see "
                         f"{config.home_dir / 'logs'}; `kill -9 {pid}` ends it and its services", args.json)
        time.sleep(0.2)
    if args.json:
        _print_json({"stopped": pid})
    else:
        print(f"stopped the stack (pid {pid}) under {config.home_dir}")
    return 0


def cmd_info(args, config) -> int:
    """Where things are: the base model (for loading a pulled adapter with peft), the home dir,
    and the running stack's addresses."""
    from marlaas.platform import nats_access

    run = config.home_dir / "run"
    gateway, nats = run / "gateway.url", run / "nats.url"
    info = {"base_model": str(config.base_model_dir), "home": str(config.home_dir),
            "running": _launcher_pid(config) is not None,
            "gateway_url": gateway.read_text().strip() if gateway.exists() else None,
            "nats_url": nats_access.redact_url(nats.read_text().strip()) if nats.exists() else None}
    info["dashboard"] = f"{info['gateway_url']}/ui/" if info["gateway_url"] else None
    info["tinker_base_url"] = f"{info['gateway_url']}/tinker" if info["gateway_url"] else None  # docs/tinker.md
    if args.json:
        _print_json(info)
    else:
        for key, value in info.items():
            print(f"{key:12} {value}")
    return 0


def cmd_up(args, config) -> int:
    from rich.console import Console

    from marlaas.stack.launcher import Stack, parse_replicas

    if args.detach:
        return _up_detached(args, config)

    console = Console(stderr=True)
    stack = Stack(config, replicas=parse_replicas(args.replicas or ""), nats_cluster=args.nats_cluster)

    signal.signal(signal.SIGTERM, _interrupt)  # `kill`, systemd and `docker stop` stop it like Ctrl-C
    broker = f"a {args.nats_cluster}-node nats-server cluster" if args.nats_cluster > 1 else "nats-server"
    with console.status(f"starting {broker}, {', '.join(stack.services)} (vLLM)..."):
        stack.start()
    info = stack.summary()  # addresses and paths, never a secret
    if args.json:
        _print_json(info)
    else:
        operator = info["operator_token_file"] or "gateway.operator_token"
        console.print(f"marlaas is up: gateway {info['gateway_url']}, NATS {info['nats_url']}, "
                      f"store {info['store']}, logs in {stack.home / 'logs'}; tenant default's token "
                      f"is in {info['default_token_file']}, the operator's (/metrics, /openapi.json) in "
                      f"{operator}. Crashed services are restarted; Ctrl-C stops it.")
    try:
        while True:
            stack.supervise()  # a crashed service comes back; the state it needs is in NATS
            time.sleep(1.0)
    except KeyboardInterrupt:
        console.print("stopping...")
    finally:
        stack.stop()
    return 0


def cmd_tasks(args, config) -> int:
    from marlaas.tasks import REGISTRY

    tasks = [{"name": t.name, "kind": t.kind, "description": t.description} for t in REGISTRY.values()]
    if args.json:
        _print_json({"tasks": tasks})
    else:
        for t in tasks:
            print(f"{t['name']:<10} {t['kind']:<12} {t['description']}")
    return 0


def submission_from_args(args) -> dict:
    """Merge a TOML job file with flags (flags win); ``--set grpo.learning_rate=1e-3`` style too."""
    from marlaas.platform.http_api import PATH_FIELDS, is_file_id
    from marlaas.sdk.http import BadRequest, read_job_file

    job: dict = {}
    if args.file:
        try:
            job = read_job_file(args.file)  # its data paths made absolute, relative to the file
        except BadRequest as exc:
            raise ValueError(str(exc)) from None
    for key in ("name", "task", "steps", "seed", "dataset", "corpus", "reward"):
        value = getattr(args, key)
        if value is not None:
            job[key] = value
    if args.tool:
        job["tools"] = list(args.tool)
    for assignment in args.set or []:
        key, sep, raw = assignment.partition("=")
        if not sep:
            raise ValueError(f"--set {assignment!r}: use SECTION.FIELD=VALUE, e.g. grpo.group_size=8")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        *parents, leaf = key.split(".")
        node = job
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    missing = [k for k in ("task", "steps") if k not in job]
    if missing:
        raise ValueError(f"missing {' and '.join(missing)}: give a job file or --task NAME --steps N")
    if getattr(args, "then", None):  # the follow-up, started from this job's last version when it completes
        try:
            job["then"] = read_job_file(args.then)
        except BadRequest as exc:
            raise ValueError(f"--then: {exc}") from None
    job.setdefault("name", job["task"])
    for key in PATH_FIELDS:  # local files, uploaded at submit: a job file's paths are relative to
        if isinstance(job.get(key), str) and not is_file_id(job[key]):  # it, flags' and --set's to here
            job[key] = str(Path(job[key]).expanduser().resolve())
    return job


def _client(config):
    """The HTTP SDK's client: ``MARLAAS_URL`` / ``MARLAAS_TOKEN``, else the stack under the home dir."""
    from marlaas.sdk import Client

    return Client.from_env(home=config.home_dir, on_wait=lambda message: print(message, file=sys.stderr))


def cmd_submit(args, config) -> int:
    job = submission_from_args(args)
    with _client(config) as client:
        job_id = client.submit(job)
    if args.json:
        _print_json({"id": job_id})
    else:
        print(job_id)
    return 0


TOOL_SUCCESS = "tool/success_rate"  # an agentic batch's share of episodes with a successful call
PIPE_WIDTH = 400  # piped or redirected output: wide enough that no id or reason is cut or wrapped


def _console(**kwargs):
    """Rich's console for stdout; when stdout is not a terminal (a pipe, a file), one wide enough
    that a row stays one line (rich would otherwise lay the table out in 80 columns)."""
    from rich.console import Console

    return Console(**kwargs) if sys.stdout.isatty() else Console(width=PIPE_WIDTH, **kwargs)


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
    with _client(config) as client:
        jobs = client.jobs()
    if args.json:
        _print_json({"jobs": jobs})
    else:
        _console().print(status_table(jobs))
    return 0


def cmd_status(args, config) -> int:
    from rich.live import Live

    with _client(config) as client:
        def once():
            return [client.job(args.job)] if args.job else client.jobs()

        if args.json:
            _print_json({"jobs": once()})
        elif not args.watch:
            _console().print(status_table(once()))
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

    with _client(config) as client:
        info = client.job(args.job)
        try:
            if args.json:
                for event in client.events(args.job):
                    _print_json(event)
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


def cmd_cancel(args, config) -> int:
    with _client(config) as client:
        state = client.cancel(args.job)
    if args.json:
        _print_json({"id": args.job, "state": state})
    else:
        print(f"{args.job} {state}")
    return 0


def cmd_delete(args, config) -> int:
    with _client(config) as client:
        objects = client.delete(args.job)
    if args.json:
        _print_json({"id": args.job, "deleted": True, "deleted_objects": objects})
    else:
        print(f"{args.job} deleted ({objects} stored objects removed)")
    return 0


def cmd_pull(args, config) -> int:
    with _client(config) as client:
        version = args.version
        if args.job.startswith("tinker://"):  # a Tinker checkpoint (docs/tinker.md)
            path = client.download(args.job, args.out)
            if args.json:
                _print_json({"id": args.job, "path": str(path)})
            else:
                print(f"{args.job} -> {path} (a PEFT adapter directory)")
            return 0
        if version is None:
            versions = client.versions(args.job)
            if not versions:
                raise ValueError(f"job {args.job} has no committed version yet: pull it once it runs")
            version = versions[-1].version
        path = client.download(args.job, args.out, version)
    if args.json:
        _print_json({"id": args.job, "version": version, "path": str(path)})
    else:
        print(f"{args.job} version {version} -> {path} (a PEFT adapter directory)")
    return 0


def cmd_samples(args, config) -> int:
    from marlaas.cli.transcript import transcript

    with _client(config) as client:
        samples = client.samples(args.job, args.version)
    if args.json:
        _print_json(samples)
    else:
        print(transcript(samples))
    return 0


def cmd_report(args, config) -> int:
    from marlaas.cli.report import write_report

    with _client(config) as client:
        info, versions = client.job(args.job), client.versions(args.job)
    if args.tensorboard:
        from marlaas.cli.report import write_tensorboard

        run_dir = write_tensorboard(info, versions, Path(args.tensorboard))
        if args.json:
            _print_json({"id": args.job, "tensorboard": str(run_dir)})
        else:
            print(f"{run_dir} (tensorboard --logdir {args.tensorboard})")
        return 0
    plots = write_report(info, versions, Path(args.out or f"report-{args.job}"))
    if args.json:
        _print_json({"id": args.job, "plots": [str(p) for p in plots]})
    else:
        print("\n".join(str(p) for p in plots))
    return 0


def cmd_bench(args, config) -> int:
    from rich.console import Console
    from rich.markdown import Markdown

    from marlaas.bench.fairness import bench_fairness, is_fairness_workload
    from marlaas.bench.plots import write_plots
    from marlaas.bench.progress import step_bars
    from marlaas.bench.report import check_targets, markdown_report
    from marlaas.bench.runner import run_benchmark
    from marlaas.bench.workload import BASELINE_LOOP, MODES, load_workload

    if is_fairness_workload(args.workload):  # tenants side by side, not schedules: a runner of its own
        signal.signal(signal.SIGTERM, _interrupt)
        return bench_fairness(args, config)
    workload = load_workload(args.workload)
    modes = args.modes.split(",") if args.modes else workload.modes_to_run(args.quick)
    unknown = [m for m in modes if m not in (*MODES, BASELINE_LOOP)]
    if unknown:
        raise ValueError(f"--modes: unknown {unknown}; choose from {', '.join([*MODES, BASELINE_LOOP])}")
    out = Path(args.out or f"bench-results/{workload.name}{'-quick' if args.quick else ''}")
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)  # a stopped benchmark stops the stack it runs
    console = Console(stderr=True)
    with step_bars(console) as progress:
        result = run_benchmark(workload, modes, args.quick, progress, base_model=config.base_model)
    (out / "results.json").write_bytes(msgspec.json.format(msgspec.json.encode(result)))
    report = markdown_report(result, workload.targets)
    (out / "results.md").write_text(report)
    plots = write_plots(result, out)
    if args.json:
        runs = [{k: v for k, v in r.items() if k not in ("timeline", "histograms")} for r in result["runs"]]
        checks = [{"target": c.target, "wanted": c.wanted, "measured": c.measured, "met": c.met}
                  for c in check_targets(result["runs"], workload.targets)]
        _print_json({**{k: v for k, v in result.items() if k != "runs"}, "runs": runs, "targets": checks,
                     "out": str(out), "plots": [str(p) for p in plots]})
    else:
        Console().print(Markdown(report))
        console.print(f"results, report and plots in {out}/")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="marlaas", description=__doc__)
    parser.add_argument("--config", help="a TOML config file (default: $MARLAAS_CONFIG)")
    parser.add_argument("--home", help="state directory (default: $MARLAAS_HOME or ~/.marlaas)")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, fn, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        # also after the command (`marlaas status --config x.toml`); absent, the one before it holds
        p.add_argument("--config", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        p.add_argument("--home", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        p.set_defaults(fn=fn)
        return p

    p = command("up", cmd_up, "start the embedded stack (nats-server + the services)")
    p.add_argument("-d", "--detach", action="store_true",
                   help="run it in the background; return once it accepts jobs (`marlaas down` stops it)")
    p.add_argument("--replicas", metavar="SERVICE=N,...",
                   help="run more than one process of a service, e.g. rollout=2,trainer=2,env=2")
    p.add_argument("--nats-cluster", type=int, default=1, choices=(1, 3, 5), metavar="N",
                   help="run the broker as a JetStream cluster of N nodes (3 or 5) on this machine, "
                        "every stream and bucket with 3 copies: any one node may fail (default: 1 server)")
    command("down", cmd_down, "stop the stack `marlaas up` runs (in the background or not), and wait")
    command("info", cmd_info, "where things are: the base model's directory, the home, the stack's addresses")
    command("tasks", cmd_tasks, "list the built-in tasks")
    p = command("submit", cmd_submit, "submit a job from a TOML file and/or flags; prints its id")
    p.add_argument("file", nargs="?", help="a TOML job file")
    p.add_argument("--task")
    p.add_argument("--steps", type=int)
    p.add_argument("--name")
    p.add_argument("--seed", type=int)
    p.add_argument("--dataset")
    p.add_argument("--corpus", help="a JSONL of passages (tasks that search your documents)")
    p.add_argument("--tool", action="append", metavar="NAME",
                   help="a tool the model may call (repeat it); built-ins bare, yours as TENANT.TOOL")
    p.add_argument("--reward", help="how answers are scored: a built-in matcher (exact, contains, numeric), "
                   "judge, or your own function (TENANT.NAME); the agent task needs one")
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE",
                   help="override a setting, e.g. --set grpo.learning_rate=1e-3")
    p.add_argument("--then", metavar="JOB.toml", help="a job file to submit when this job completes, starting "
                   "from its last version (e.g. an RL job after an sft job): the job's 'then' field")
    command("list", cmd_list, "list your jobs")
    p = command("status", cmd_status, "show your jobs (all, or one)")
    p.add_argument("job", nargs="?")
    p.add_argument("--watch", action="store_true", help="live table until Ctrl-C")
    p = command("watch", cmd_watch, "follow a job live (version, reward, time per step, ETA) until it ends")
    p.add_argument("job")
    p = command("cancel", cmd_cancel, "cancel a job")
    p.add_argument("job")
    p = command("delete", cmd_delete, "delete a job and all of it: record, versions, adapters, events")
    p.add_argument("job")
    p = command("pull", cmd_pull, "download a version's adapter as a PEFT directory")
    p.add_argument("job", help="a job id, or a Tinker checkpoint's tinker:// path")
    p.add_argument("--version", type=int, help="a committed version (default: the latest)")
    p.add_argument("--out", required=True, help="directory to unpack the adapter into")
    p = command("samples", cmd_samples, "print a version's rollouts: prompt, turns, tool calls, answer, "
                "reward and advantage, group by group")
    p.add_argument("job")
    p.add_argument("--version", type=int, help="a version whose samples are kept (default: the newest)")
    p = command("report", cmd_report, "plot a job's reward, eval score and time per step (PNG)")
    p.add_argument("job")
    p.add_argument("--out", help="directory for the plots (default: report-JOB)")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="write TensorBoard event files under DIR/JOB instead (tensorboard --logdir DIR)")
    p = command("bench", cmd_bench, "benchmark a workload under several schedules, side by side")
    p.add_argument("workload", help="a name in benchmarks/workloads (agentic-10, mix, sweep, ...) or a TOML path")
    p.add_argument("--modes", help="comma-separated: async,sync,sequential,async-single-lora,sync-single-lora,"
                   "async-adaptive,inprocess (default: the workload's)")
    p.add_argument("--quick", action="store_true", help="fewer versions and sweep points (minutes, not hours)")
    p.add_argument("--out", help="directory for results.json, results.md and the plots")
    # --- tenant administration: `marlaas tenant ...` from libs/marlaas/stack/admin.py, where it exists ---
    try:
        from marlaas.stack.admin import add_tenant_commands, add_usage_command
    except ModuleNotFoundError as exc:
        if exc.name != "marlaas.stack.admin":
            raise
    else:
        add_tenant_commands(sub)
        add_usage_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C means stop, even when a parent started us with SIGINT ignored (a shell's background
    # job): `up` must stop its stack on it, and `watch` must end
    signal.signal(signal.SIGINT, signal.default_int_handler)
    args = build_parser().parse_args(argv)
    as_json = getattr(args, "json", False)
    try:
        config = load_config(args.config, overrides={"home": args.home})
        if args.command != "up":
            from marlaas.platform.logs import setup_logging

            setup_logging("cli", config.log_format, "warning")
        return args.fn(args, config)
    except (ConfigError, ValueError, TimeoutError, RuntimeError, ConnectionError) as exc:
        return _fail(str(exc), as_json)


if __name__ == "__main__":
    sys.exit(main())
