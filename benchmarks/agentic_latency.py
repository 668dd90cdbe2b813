"""Three agentic jobs with 1 s of injected latency per tool call: does the engine keep working?

    python benchmarks/agentic_latency.py [--steps 6] [--latency 1.0]

One embedded stack whose ``calculator`` answers every call after ``--latency`` seconds runs
the built-in ``multiply`` task (the model calls the calculator) as three jobs at once, then
the same three jobs one after another. Printed side by side: steps/hour of each schedule and
their ratio, the engine's busy fraction while tool calls are pending (from rollout's
utilization spans: time with a request in the engine and a call out, over time with a call
out), and tool-wait time per step. Figures are reported, not asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from marlaas.bus import Bus
from marlaas.client import Client
from marlaas.config import load_config
from marlaas.launcher import Stack
from marlaas.telemetry import UTILIZATION_JOB, read_spans


def job(i: int, steps: int) -> dict:
    return {"name": f"agent-{i}", "task": "multiply", "steps": steps, "seed": i}


async def utilization(url: str, since: float, until: float) -> dict[str, float]:
    bus = await Bus.connect(url)
    spans = [s for s in await read_spans(bus, UTILIZATION_JOB) if since <= s.end <= until + 3]
    await bus.close()
    keys = ("engine_busy_s", "tools_pending_s", "engine_busy_while_tools_s")
    return {k: sum(float(s.attrs.get(k, 0.0)) for s in spans) for k in keys}


async def measure(url: str, steps: int, together: bool) -> dict:
    client = await Client.connect(url)
    started = time.time()
    if together:
        ids = await asyncio.gather(*(client.submit(job(i, steps)) for i in range(3)))
        views = await client.wait(list(ids), timeout_s=3600)
    else:
        views = []
        for i in range(3):
            views += await client.wait([await client.submit(job(i, steps))], timeout_s=3600)
    ended = time.time()
    await client.close()
    await asyncio.sleep(2.5)  # the last utilization span
    use = await utilization(url, started, ended)
    total_steps = sum(v.steps for v in views)
    wall = ended - started
    return {
        "schedule": "3 at once" if together else "one after another", "steps": total_steps, "wall_s": wall,
        "steps_per_hour": total_steps / wall * 3600,
        "busy_while_tools": use["engine_busy_while_tools_s"] / use["tools_pending_s"] if use["tools_pending_s"] else 0.0,
        "engine_busy": use["engine_busy_s"] / wall,
        "tool_wait_per_step_s": use["tools_pending_s"] / total_steps,
        "calls_per_episode": sum(sum(v.metrics.get("tool/calls", [])) for v in views) / total_steps,
        "rewards": [round(v.rewards[-1], 3) for v in views],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="versions per job")
    parser.add_argument("--latency", type=float, default=1.0, help="seconds each calculator call takes")
    args = parser.parse_args()
    console = Console(width=140)
    home = Path(tempfile.mkdtemp(prefix="marlaas-agentic-"))
    config = load_config(overrides={"home": str(home), "gateway.port": 0, "rollout.block_size": 32,
                                    "env.tool_latency_s": {"calculator": args.latency}}, env={})
    try:
        with console.status("starting the stack..."), Stack(config) as stack:
            rows = []
            for together in (True, False):
                console.log(f"running 3 agentic jobs ({'at once' if together else 'one after another'})")
                rows.append(asyncio.run(measure(stack.nats_url, args.steps, together)))
    finally:
        shutil.rmtree(home, ignore_errors=True)
    table = Table("schedule", "steps", "wall s", "steps/hour", "engine busy while calls pending",
                  "engine busy", "tool wait per step s", "calls per episode", "final rewards")
    for r in rows:
        table.add_row(r["schedule"], str(r["steps"]), f"{r['wall_s']:.1f}", f"{r['steps_per_hour']:.0f}",
                      f"{r['busy_while_tools']:.0%}", f"{r['engine_busy']:.0%}", f"{r['tool_wait_per_step_s']:.2f}",
                      f"{r['calls_per_episode']:.2f}", str(r["rewards"]))
    console.print(table)
    console.print(f"3 agentic jobs at once: {rows[0]['steps_per_hour'] / rows[1]['steps_per_hour']:.2f}x the "
                  f"steps/hour of the same jobs one after another ({args.latency:g} s per tool call)")


if __name__ == "__main__":
    main()
