"""``marlaas``: up, down, info, tasks, submit, list, status, watch, cancel, delete, pull, samples,
report, bench (and the operator's ``tenant`` and ``usage``).

Job commands go through the HTTP API with the SDK (``marlaas.Client.from_env``: the
gateway and the default tenant's token of the stack under the home dir, or
``MARLAAS_URL`` / ``MARLAAS_TOKEN``). Every command takes ``--json`` for scripts; errors
print ``{"error"}`` and exit with code 2.
"""

from __future__ import annotations

import argparse
import signal
import sys

from marlaas.cli.bench_command import cmd_bench
from marlaas.cli.job_commands import cmd_cancel, cmd_delete, cmd_pull, cmd_submit
from marlaas.cli.output import fail
from marlaas.cli.stack_commands import cmd_down, cmd_info, cmd_tasks, cmd_up
from marlaas.cli.view_commands import cmd_list, cmd_report, cmd_samples, cmd_status, cmd_watch
from marlaas.platform.config import ConfigError, load_config


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
        return fail(str(exc), as_json)


if __name__ == "__main__":
    sys.exit(main())
