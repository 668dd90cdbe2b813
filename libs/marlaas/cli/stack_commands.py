"""The stack's commands: ``up`` (``-d``: in the background), ``down``, ``info`` and ``tasks``."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from marlaas.cli.output import fail, print_json

DOWN_WAIT_S = 180.0  # `down`: how long the stack may take to drain and stop


def interrupt(*_) -> None:
    """A SIGTERM handler: stop as on Ctrl-C."""
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
        return fail(f"a stack is already running under {config.home_dir} (pid {pid}): "
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
        return fail(f"{exc}; the launcher's last lines ({log}):\n{tail}", args.json)
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
            print_json({"stopped": None, "detail": message})
        else:
            print(message)
        return 0
    from marlaas.sdk import discovery

    os.kill(pid, signal.SIGTERM)  # the launcher drains and stops every service, as on Ctrl-C
    deadline = time.monotonic() + DOWN_WAIT_S
    while discovery.alive(pid):
        if time.monotonic() > deadline:
            return fail(f"the stack (pid {pid}) did not stop within {DOWN_WAIT_S:.0f} s: see "
                         f"{config.home_dir / 'logs'}; `kill -9 {pid}` ends it and its services", args.json)
        time.sleep(0.2)
    if args.json:
        print_json({"stopped": pid})
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
        print_json(info)
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

    signal.signal(signal.SIGTERM, interrupt)  # `kill`, systemd and `docker stop` stop it like Ctrl-C
    broker = f"a {args.nats_cluster}-node nats-server cluster" if args.nats_cluster > 1 else "nats-server"
    with console.status(f"starting {broker}, {', '.join(stack.services)} (vLLM)..."):
        stack.start()
    info = stack.summary()  # addresses and paths, never a secret
    if args.json:
        print_json(info)
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
        print_json({"tasks": tasks})
    else:
        for t in tasks:
            print(f"{t['name']:<10} {t['kind']:<12} {t['description']}")
    return 0
