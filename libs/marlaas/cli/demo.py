"""``make demo``: the embedded stack, four jobs at once, live progress, a summary.

Starts nats-server and the services under a fresh ``.marlaas/demo`` home on the built-in chat
base, and a tenant's own tool process (``examples/made_up_tools.py``: two tools whose names
and words the base never saw in pretraining). Submits three built-in jobs (``addition``,
``reverse``, ``repeat``) and an ``agent`` job whose questions only one of the two tools
answers (40 versions each) at the same moment, shows their progress live, then prints reward
over the first and last five versions, the agent's share of episodes with a successful tool
call and its calls per tool, and the time per step, and saves a reward-curve plot next to the logs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from marlaas.platform.config import load_config
from marlaas.platform.files import put_file
from marlaas.platform.nats_client import BusClient
from marlaas.platform.processes import spawn
from marlaas.platform.store import open_store
from marlaas.stack.launcher import Stack
from marlaas.tools.registry import read_tool

DEMO_JOBS = [
    {"name": "add", "task": "addition", "seed": 1},
    {"name": "rev", "task": "reverse", "seed": 2},
    {"name": "dup", "task": "repeat", "seed": 3},
]
# the tenant's own tools, in their own process; the agent job's questions need get_mutrol
TOOLS_FILE = Path(__file__).resolve().parents[3] / "examples" / "made_up_tools.py"
AGENT_TOOLS = ["acme.get_mutrol", "acme.tashom_lookup"]
AGENT_JOB = {"name": "agent", "task": "agent", "tenant": "acme", "seed": 4, "tools": AGENT_TOOLS,
             "reward": "contains", "system": "Use the tools when they help.",
             "grpo": {"max_new_tokens": 40, "prompts_per_step": 4}}


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def made_up_tools():
    """``examples/made_up_tools.py`` as a module: its dataset rows are the agent job's data."""
    spec = importlib.util.spec_from_file_location("made_up_tools", TOOLS_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tool_success(view, first: bool) -> str:
    shares = view.metrics.get("tool/success_rate", [])
    return f"{statistics.mean(shares[:5] if first else shares[-5:]):.2f}" if shares else "-"


def progress_table(views, started: float) -> Table:
    table = Table("job", "task", "state", "version", "reward (last)", "tpts_s",
                  title=f"marlaas demo - {time.time() - started:.0f}s")
    for v in views:
        table.add_row(v.id, v.task, v.state, f"{v.version}/{v.target_steps}",
                      f"{v.rewards[-1]:.3f}" if v.rewards else "-",
                      f"{v.tpts_s:.2f}" if v.tpts_s is not None else "-")
    return table


def summary_table(views) -> Table:
    table = Table("job", "task", "reward first 5", "reward last 5", "gain", "tool calls ok (first 5 -> last 5)",
                  "ttfs_s", "tpts_s", title="summary")
    for v in views:
        first, last = statistics.mean(v.rewards[:5]), statistics.mean(v.rewards[-5:])
        calls = f"{tool_success(v, True)} -> {tool_success(v, False)}" if v.metrics else "-"
        table.add_row(v.id, v.task, f"{first:.3f}", f"{last:.3f}", f"{last - first:+.3f}", calls,
                      f"{v.ttfs_s:.1f}", f"{v.tpts_s:.2f}")
    return table


def plot_rewards(views, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for v in views:
        ax.plot(range(len(v.rewards)), v.rewards, label=f"{v.task} ({v.id})", alpha=0.8)
    ax.set_xlabel("policy version (batch sampled at)")
    ax.set_ylabel("mean reward of the batch")
    ax.set_title("marlaas demo: four jobs, one base model, one LoRA each")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


async def run_jobs(stack: Stack, steps: int, console: Console):
    client = await BusClient.connect(stack.nats_url)
    try:
        deadline = time.monotonic() + 60
        while any([await read_tool(client.bus, name) is None for name in AGENT_TOOLS]):
            if time.monotonic() > deadline:
                raise SystemExit(f"the tool process never announced {AGENT_TOOLS}: see its output above")
            await asyncio.sleep(0.2)
        rows = "".join(json.dumps(row) + "\n" for row in made_up_tools().dataset_rows()).encode()
        dataset = put_file(open_store(stack.resolved.store_url), "acme", rows, "mutrol.jsonl").id
        jobs = [*DEMO_JOBS, {**AGENT_JOB, "dataset": dataset}]
        started = time.time()
        ids = await asyncio.gather(*(client.submit({**job, "steps": steps}) for job in jobs))
        with Live(console=console, refresh_per_second=2) as live:
            views = await client.wait(list(ids), timeout_s=3600,
                                      on_update=lambda vs: live.update(progress_table(vs, started)))
        return views, time.time() - started
    finally:
        await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m marlaas.cli.demo", description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--home", default=".marlaas/demo")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the demo like Ctrl-C: the stack goes down too
    console = Console(width=140)
    home = Path(args.home).resolve()
    shutil.rmtree(home, ignore_errors=True)
    # 32-token KV blocks: the agent's short episodes re-enter the engine from the prefix cache
    config = load_config(overrides={"home": str(home), "rollout.block_size": 32})
    calls_log = home / "tool_calls.log"
    with console.status("starting the embedded stack (nats-server, manager, env, trainer, vLLM rollout)..."):
        stack = Stack(config).start()
    tools = None
    try:
        calls_log.touch()
        tools = spawn([sys.executable, str(TOOLS_FILE), str(calls_log)],  # dies with the demo, even killed
                      env={"MARLAAS_NATS_URL": stack.nats_url, "PATH": "/usr/bin:/bin"})
        views, elapsed = asyncio.run(run_jobs(stack, args.steps, console))
    finally:
        if tools is not None:
            tools.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                tools.wait(timeout=30)
            if tools.poll() is None:
                tools.kill()
                tools.wait()
        stack.stop()
    console.print()
    console.print(summary_table(views))
    calls = Counter(calls_log.read_text().split())
    console.print(f"the agent's calls by tool (the tenant's process): {dict(calls)}; "
                  "its questions need get_mutrol, which the base never saw")
    plot = plot_rewards(views, home / "rewards.png")
    steps = sum(v.steps for v in views)
    console.print(f"{steps} steps in {elapsed:.0f}s ({steps / elapsed * 3600:.0f} steps/hour); "
                  f"reward curves: {plot}; logs: {home / 'logs'}")


if __name__ == "__main__":
    main()
