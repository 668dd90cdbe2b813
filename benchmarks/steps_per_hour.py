"""Steps per hour for 1 job alone and for 3 concurrent jobs, side by side in one run.

    python benchmarks/steps_per_hour.py [--steps 20] [--sequential]

Both measurements use the same embedded stack (engine already warm). Also reported,
from the services' spans: the fraction of the wall time in which the engine was
generating for at least one job, and in which the trainer was training, and the median
time from a version's commit to the rollout generating with it (the per-version handoff:
announcement, adapter download, vLLM adapter load). With
``--sequential`` a second stack with the manager's ``sequential`` schedule (one job
at a time) runs the same 3 jobs, as the baseline the design is meant to beat.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from marlaas.bus import Bus
from marlaas.client import Client
from marlaas.config import load_config
from marlaas.launcher import Stack
from marlaas.telemetry import read_spans

TASKS = ("addition", "reverse", "repeat")


def busy_fraction(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Share of [start, end] covered by the union of ``intervals``."""
    covered, cursor = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, cursor), min(b, end)
        if b > a:
            covered += b - a
            cursor = b
    return covered / (end - start)


def handoff_ms(spans) -> float:
    """Median time from a version's commit to its first generation: announce + adapter load."""
    commits = {(s.job, s.version): s.end for s in spans if s.phase == "commit"}
    gaps = [s.start - commits[(s.job, s.version)] for s in spans
            if s.phase == "generate" and (s.job, s.version) in commits]
    return statistics.median(gaps) * 1000 if gaps else float("nan")


async def measure(url: str, n_jobs: int, steps: int, label: str) -> dict:
    client = await Client.connect(url)
    started = time.time()
    ids = await asyncio.gather(*(
        client.submit({"name": f"{label}-{i}", "task": TASKS[i % 3], "steps": steps, "seed": i})
        for i in range(n_jobs)
    ))
    views = await client.wait(list(ids), timeout_s=3600)
    ended = time.time()
    await client.close()
    bus = await Bus.connect(url)
    spans = [s for s in await read_spans(bus) if s.job in ids]
    await bus.close()
    wall = ended - started
    return {
        "setup": label, "jobs": n_jobs, "steps": sum(v.steps for v in views), "wall_s": wall,
        "steps_per_hour": sum(v.steps for v in views) / wall * 3600,
        "tpts_s": sum(v.tpts_s for v in views) / len(views),
        "engine_busy": busy_fraction([(s.start, s.end) for s in spans if s.phase == "generate"], started, ended),
        "trainer_busy": busy_fraction([(s.start, s.end) for s in spans if s.phase == "train"], started, ended),
        "handoff_ms": handoff_ms(spans),
    }


def run_stack(schedule: str, plans: list[tuple[int, str]], steps: int) -> list[dict]:
    home = Path(tempfile.mkdtemp(prefix="marlaas-bench-"))
    config = load_config(overrides={"home": str(home), "gateway.port": 0, "manager.schedule": schedule}, env={})
    try:
        with Stack(config) as stack:
            return [asyncio.run(measure(stack.nats_url, n, steps, label)) for n, label in plans]
    finally:
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="versions per job")
    parser.add_argument("--sequential", action="store_true", help="also run the sequential baseline")
    args = parser.parse_args()
    console = Console(width=120)
    with console.status("benchmarking (1 job, then 3 concurrent jobs)..."):
        rows = run_stack("async", [(1, "async-1"), (3, "async-3")], args.steps)
        if args.sequential:
            rows += run_stack("sequential", [(3, "sequential-3")], args.steps)
    table = Table("setup", "jobs", "steps", "wall_s", "steps/hour", "tpts_s", "engine busy", "trainer busy",
                  "commit->generate ms")
    for r in rows:
        table.add_row(r["setup"], str(r["jobs"]), str(r["steps"]), f"{r['wall_s']:.1f}",
                      f"{r['steps_per_hour']:.0f}", f"{r['tpts_s']:.2f}",
                      f"{r['engine_busy']:.0%}", f"{r['trainer_busy']:.0%}", f"{r['handoff_ms']:.0f}")
    console.print(table)
    by_setup = {r["setup"]: r["steps_per_hour"] for r in rows}
    for r in rows[1:]:
        console.print(f"{r['setup']}: {r['steps_per_hour'] / by_setup['async-1']:.2f}x the steps/hour "
                      "of 1 job alone")
    if "sequential-3" in by_setup:
        console.print(f"async-3: {by_setup['async-3'] / by_setup['sequential-3']:.2f}x the steps/hour of "
                      "the same 3 jobs run one after another (sequential)")


if __name__ == "__main__":
    main()
