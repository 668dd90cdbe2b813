"""``marlaas``: up, tasks, submit, status, cancel. Every command takes ``--json`` for scripts."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import tomllib
from pathlib import Path

import msgspec

from marlaas.config import ConfigError, load_config


def _print_json(obj) -> None:
    print(json.dumps(msgspec.to_builtins(obj)))


def _fail(message: str, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"error": message}))
    else:
        print(f"error: {message}", file=sys.stderr)
    return 2


# --- commands -------------------------------------------------------------------------------


def cmd_up(args, config) -> int:
    from rich.console import Console

    from marlaas.launcher import Stack

    console = Console(stderr=True)
    stack = Stack(config)
    with console.status("starting nats-server, manager, env, trainer, rollout (vLLM)..."):
        stack.start()
    info = {"nats_url": stack.nats_url, "home": str(stack.home), "store": stack.resolved.store_url}
    if args.json:
        _print_json(info)
    else:
        console.print(f"marlaas is up: NATS {info['nats_url']}, store {info['store']}, "
                      f"logs in {stack.home / 'logs'}. Crashed services are restarted; Ctrl-C stops it.")
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
    job: dict = {}
    if args.file:
        path = Path(args.file)
        if not path.is_file():
            raise ValueError(f"job file {path} does not exist")
        try:
            job = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"job file {path} is not valid TOML: {exc}") from exc
    for key in ("name", "task", "steps", "seed", "tenant", "dataset", "corpus", "reward"):
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
    job.setdefault("name", job["task"])
    for key in ("dataset", "corpus"):  # the manager runs elsewhere: send absolute paths (a flag's
        if job.get(key):  # relative to here, a job file's relative to that file)
            where = Path(args.file).parent if args.file and getattr(args, key) is None else Path.cwd()
            job[key] = str((where / Path(job[key]).expanduser()).resolve())
    return job


async def _with_client(config, fn):
    from marlaas.client import Client
    from marlaas.launcher import running_nats_url

    client = await Client.connect(running_nats_url(config))
    try:
        return await fn(client)
    finally:
        await client.close()


def cmd_submit(args, config) -> int:
    job = submission_from_args(args)
    job_id = asyncio.run(_with_client(config, lambda c: c.submit(job)))
    if args.json:
        _print_json({"id": job_id})
    else:
        print(job_id)
    return 0


def status_table(views):
    from rich.table import Table

    table = Table("id", "task", "state", "version", "reward first", "reward last", "ttfs_s", "tpts_s")
    for v in views:
        table.add_row(
            v.id, v.task, v.state + (f" ({v.reason})" if v.reason else ""),
            f"{v.version}/{v.target_steps}",
            f"{v.rewards[0]:.3f}" if v.rewards else "-", f"{v.rewards[-1]:.3f}" if v.rewards else "-",
            f"{v.ttfs_s:.1f}" if v.ttfs_s is not None else "-",
            f"{v.tpts_s:.2f}" if v.tpts_s is not None else "-",
        )
    return table


def cmd_status(args, config) -> int:
    from rich.console import Console
    from rich.live import Live

    async def once(client):
        return await client.status(args.job or "")

    if args.json:
        _print_json({"jobs": asyncio.run(_with_client(config, once))})
        return 0
    if not args.watch:
        Console().print(status_table(asyncio.run(_with_client(config, once))))
        return 0

    async def watch(client):
        with Live(status_table(await once(client)), refresh_per_second=2) as live:
            while True:
                await asyncio.sleep(1.0)
                live.update(status_table(await once(client)))

    try:
        asyncio.run(_with_client(config, watch))
    except KeyboardInterrupt:
        pass
    return 0


def cmd_cancel(args, config) -> int:
    state = asyncio.run(_with_client(config, lambda c: c.cancel(args.job)))
    if args.json:
        _print_json({"id": args.job, "state": state})
    else:
        print(f"{args.job} {state}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="marlaas", description=__doc__)
    parser.add_argument("--config", help="a TOML config file (default: $MARLAAS_CONFIG)")
    parser.add_argument("--home", help="state directory (default: $MARLAAS_HOME or ~/.marlaas)")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, fn, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(fn=fn)
        return p

    command("up", cmd_up, "start the embedded stack (nats-server + the four services)")
    command("tasks", cmd_tasks, "list the built-in tasks")
    p = command("submit", cmd_submit, "submit a job from a TOML file and/or flags; prints its id")
    p.add_argument("file", nargs="?", help="a TOML job file")
    p.add_argument("--task")
    p.add_argument("--steps", type=int)
    p.add_argument("--name")
    p.add_argument("--seed", type=int)
    p.add_argument("--tenant")
    p.add_argument("--dataset")
    p.add_argument("--corpus", help="a JSONL of passages (tasks that search your documents)")
    p.add_argument("--tool", action="append", metavar="NAME",
                   help="a tool the model may call (repeat it); built-ins bare, yours as TENANT.TOOL")
    p.add_argument("--reward", help="a reward function to use instead of the task's (TENANT.NAME or judge)")
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE",
                   help="override a setting, e.g. --set grpo.learning_rate=1e-3")
    p = command("status", cmd_status, "show jobs (all, or one)")
    p.add_argument("job", nargs="?")
    p.add_argument("--watch", action="store_true", help="live view until Ctrl-C")
    p = command("cancel", cmd_cancel, "cancel a job")
    p.add_argument("job")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    as_json = getattr(args, "json", False)
    try:
        config = load_config(args.config, overrides={"home": args.home})
        if args.command != "up":
            from marlaas.logs import setup_logging

            setup_logging("cli", config.log_format, "warning")
        return args.fn(args, config)
    except (ConfigError, ValueError, TimeoutError, RuntimeError, ConnectionError) as exc:
        return _fail(str(exc), as_json)


if __name__ == "__main__":
    sys.exit(main())
