"""``make demo``: the embedded stack, its jobs at once, live progress, a summary and plots.

Starts nats-server and the services under a fresh ``.marlaas/demo`` home on the built-in chat
base, and two tenant tool processes: ``examples/made_up_tools.py`` (two tools whose names and
words the base never saw in pretraining) and ``examples/tool_warm_start/tools.py`` (two tools
named as people name them, which the base does not call at all). Submits at the same moment:

- three built-in jobs (``addition``, ``reverse``, ``repeat``) and an ``agent`` job whose
  questions only one of the first two tools answers (40 versions each);
- the warm-start chain: an ``sft`` job on the project's 24 demonstrations whose ``then`` starts
  an ``agent`` RL job from its last version when it completes; and a one-version ``agent`` job
  of the plain base on the RL job's questions, to measure where the base starts.

Shows their progress live, then prints reward over the first and last five versions, the agents'
share of episodes with a successful tool call and their calls per tool, the time per step, and
saves two plots next to the logs: the reward curves, and the chain (the sft job's loss, then the
RL job's right-call share and reward).
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
# the warm-start chain (docs/agentic.md): a project whose tools the base does not call
WARM_START = Path(__file__).resolve().parents[3] / "examples" / "tool_warm_start"
WARM_TOOLS = ["default.zorbleck_capital", "default.qelvin_moons"]  # served as the job files name them
FINISHED = ("completed", "failed", "cancelled")


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def made_up_tools():
    """``examples/made_up_tools.py`` as a module: its dataset rows are the agent job's data."""
    spec = importlib.util.spec_from_file_location("made_up_tools", TOOLS_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def chain_jobs(prompts: str, demos: str) -> list[dict]:
    """The project's two job files (``sft.toml`` whose ``then`` is ``rl.toml``, tenant ``default``'s
    tools) over the uploaded data, and a one-version probe of the plain base on the RL questions."""
    from marlaas.sdk.http import read_job_file

    sft, rl = (read_job_file(WARM_START / name) for name in ("sft.toml", "rl.toml"))
    rl["dataset"], sft["dataset"] = prompts, demos
    return [{**rl, "name": "base-probe", "steps": 1}, {**sft, "then": rl}]


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
        timing = (f"{v.ttfs_s:.1f}" if v.ttfs_s is not None else "-",
                  f"{v.tpts_s:.2f}" if v.tpts_s is not None else "-")
        if not v.rewards:  # an sft job: its loss instead of a reward
            loss = v.metrics.get("loss", [])
            table.add_row(v.id, v.task, f"loss {loss[0]:.3f}" if loss else "-", f"loss {loss[-1]:.3f}" if loss else "-",
                          "-", "-", *timing)
            continue
        first, last = statistics.mean(v.rewards[:5]), statistics.mean(v.rewards[-5:])
        calls = f"{tool_success(v, True)} -> {tool_success(v, False)}" if v.metrics.get("tool/success_rate") else "-"
        table.add_row(v.id, v.task, f"{first:.3f}", f"{last:.3f}", f"{last - first:+.3f}", calls, *timing)
    return table


def plot_rewards(views, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for v in views:
        if len(v.rewards) < 2:
            continue  # the sft job (no reward) and the one-version probe
        ax.plot(range(len(v.rewards)), v.rewards, label=f"{v.task} ({v.id})", alpha=0.8)
    ax.set_xlabel("policy version (batch sampled at)")
    ax.set_ylabel("mean reward of the batch")
    ax.set_title("marlaas demo: one base model, one LoRA a job")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_chain(base, sft, rl, path: Path) -> Path:
    """The warm-start chain on one plot: the sft job's loss per step, then the RL job's
    right-call share and reward per version, the plain base's share as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.6))
    loss = sft.metrics.get("loss", [])
    ax.plot(range(len(loss)), loss, color="tab:gray", label="sft job: loss on the assistant's tokens")
    ax.set_xlabel("step of the chain (sft steps, then RL versions)")
    ax.set_ylabel("sft loss")
    right = ax.twinx()
    x = range(len(loss), len(loss) + len(rl.rewards))
    right.plot(x, rl.metrics.get("tool/success_rate", []), color="tab:blue", label="RL job: right-call share")
    right.plot(x, rl.rewards, color="tab:green", label="RL job: reward")
    if base is not None and base.metrics.get("tool/success_rate"):
        right.axhline(base.metrics["tool/success_rate"][0], color="tab:red", linestyle="--",
                      label="the base: right-call share")
    right.set_ylim(-0.02, 1)
    right.set_ylabel("share of episodes / reward")
    ax.axvline(len(loss) - 0.5, color="black", linewidth=0.8)
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2,
              fontsize=8)
    ax.set_title("a tool the base cannot call: SFT on 24 demonstrations, then RL from its last version")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


async def wait_for_tools(client: BusClient, names: list[str]) -> None:
    deadline = time.monotonic() + 60
    while any([await read_tool(client.bus, name) is None for name in names]):
        if time.monotonic() > deadline:
            raise SystemExit(f"a tool process never announced {names}: see its output above")
        await asyncio.sleep(0.2)


async def run_jobs(stack: Stack, steps: int, console: Console):
    client = await BusClient.connect(stack.nats_url)
    try:
        await wait_for_tools(client, AGENT_TOOLS + WARM_TOOLS)
        store = open_store(stack.resolved.store_url)
        rows = "".join(json.dumps(row) + "\n" for row in made_up_tools().dataset_rows()).encode()
        dataset = put_file(store, "acme", rows, "mutrol.jsonl").id
        prompts = put_file(store, "default", (WARM_START / "prompts.jsonl").read_bytes(), "prompts.jsonl").id
        demos = put_file(store, "default", (WARM_START / "demos.jsonl").read_bytes(), "demos.jsonl").id
        jobs = [{**job, "steps": steps} for job in [*DEMO_JOBS, {**AGENT_JOB, "dataset": dataset}]]
        jobs += chain_jobs(prompts, demos)
        started = time.time()
        ids = list(await asyncio.gather(*(client.submit(job) for job in jobs)))
        sft = ids[-1]
        with Live(console=console, refresh_per_second=2) as live:
            while True:  # the RL job joins the table when the sft job's ``then`` starts it
                views = [v for v in await client.status() if v.id in ids]
                live.update(progress_table(views, started))
                chained = next(v for v in views if v.id == sft)
                if chained.followed_by and chained.followed_by not in ids:
                    ids.append(chained.followed_by)
                pending = chained.state == "completed" and not chained.followed_by and not chained.reason
                if all(v.state in FINISHED for v in views) and not pending:
                    break
                await asyncio.sleep(1.0)
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
    warm_log = home / "warm_start_calls.log"
    processes = []
    try:
        for command, log in (([str(TOOLS_FILE), str(calls_log)], calls_log),
                             ([str(WARM_START / "tools.py"), str(warm_log), "default"], warm_log)):
            log.touch()
            processes.append(spawn([sys.executable, *command],  # dies with the demo, even killed
                                   env={"MARLAAS_NATS_URL": stack.nats_url, "PATH": "/usr/bin:/bin"}))
        views, elapsed = asyncio.run(run_jobs(stack, args.steps, console))
    finally:
        for process in processes:
            process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=30)
            if process.poll() is None:
                process.kill()
                process.wait()
        stack.stop()
    console.print()
    console.print(summary_table(views))
    calls = Counter(calls_log.read_text().split())
    console.print(f"the agent's calls by tool (the tenant's process): {dict(calls)}; "
                  "its questions need get_mutrol, which the base never saw")
    by_name = {v.name: v for v in views}
    base, sft, rl = by_name.get("base-probe"), by_name.get("tool-sft"), by_name.get("tool-rl")
    chain = None
    if sft is not None and rl is not None and rl.rewards:
        chain = plot_chain(base, sft, rl, home / "warm_start.png")
        share = rl.metrics.get("tool/success_rate", [])
        console.print(f"warm start: the base's right-call share {tool_success(base, True) if base else '-'}; after "
                      f"sft then RL {statistics.mean(share[-3:]):.2f} (last 3 versions); plot: {chain}")
    elif sft is not None:
        console.print(f"warm start: the RL job did not run ({sft.reason or sft.state})")
    plot = plot_rewards(views, home / "rewards.png")
    steps = sum(v.steps for v in views)
    console.print(f"{steps} steps in {elapsed:.0f}s ({steps / elapsed * 3600:.0f} steps/hour); "
                  f"reward curves: {plot}; logs: {home / 'logs'}")


if __name__ == "__main__":
    main()
