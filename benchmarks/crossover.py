"""Where marlaas overtakes a user's own in-process GRPO loop: sweep completion length and tool latency.

    python benchmarks/crossover.py [--steps 4] [--lengths 16,64,256,480] [--latencies 0,0.5,2]
        [--jobs 3] [--out bench-results/crossover]

At each point the same jobs run four ways, side by side in one run: marlaas (``async``)
with one job, the in-process loop (``benchmarks/inprocess_grpo.py``) with that job, marlaas
with ``--jobs`` jobs at once, and the loop running those jobs one after another.

- completion length: single-turn ``repeat`` jobs whose every completion is exactly L tokens
  (``grpo.ignore_eos``; 2 prompts x 8 samples a step);
- tool latency: agentic ``multiply`` jobs whose calculator answers after S seconds.

Printed: steps/hour of each and the ratios marlaas / loop (above 1: marlaas is faster);
written: ``crossover.json`` and ``crossover.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from marlaas.bench.runner import bench_stack, load_inprocess_loop, measure, warm_up

LENGTH_TASK, LATENCY_TASK = "repeat", "multiply"


def length_jobs(n: int, length: int, steps: int) -> list[dict]:
    return [{"name": f"len{length}-{i}", "task": LENGTH_TASK, "seed": i, "steps": steps,
             "grpo": {"max_new_tokens": length, "ignore_eos": True, "prompts_per_step": 2}} for i in range(n)]


def latency_jobs(n: int, latency: float, steps: int) -> list[dict]:
    return [{"name": f"lat{latency:g}-{i}", "task": LATENCY_TASK, "seed": i, "steps": steps} for i in range(n)]


def point(stack, loop, jobs_of, n_jobs: int, value: float, steps: int, loop_kwargs: dict) -> list[dict]:
    """marlaas with 1 and ``n_jobs`` jobs, the loop with 1 and ``n_jobs`` jobs, at one sweep value."""
    rows = []
    for n in (1, n_jobs):
        subs = jobs_of(n, value, steps)
        ours = measure(stack, subs, f"marlaas-{n}")
        theirs = loop([s["task"] for s in subs], steps, progress=False, grpo=subs[0].get("grpo", {}),
                      **loop_kwargs)
        rows.append({"value": value, "jobs": n, "marlaas_steps_per_hour": ours["steps_per_hour"],
                     "loop_steps_per_hour": theirs["steps_per_hour"],
                     "ratio": ours["steps_per_hour"] / theirs["steps_per_hour"],
                     "marlaas_engine_busy": ours["engine_busy"], "loop_engine_busy": theirs["engine_busy"]})
    return rows


def sweep(args) -> dict:
    loop = load_inprocess_loop()
    result: dict = {"steps": args.steps, "jobs": args.jobs, "length": [], "latency": []}
    with bench_stack({}, args.jobs) as stack:
        warm_up(stack, length_jobs(1, 16, 2), "warm-up")
        for length in args.lengths:
            result["length"] += point(stack, loop, length_jobs, args.jobs, length, args.steps, {})
    for latency in args.latencies:
        with bench_stack({"env.tool_latency_s": {"calculator": latency}}, args.jobs) as stack:
            warm_up(stack, latency_jobs(1, latency, 2), "warm-up")
            result["latency"] += point(stack, loop, latency_jobs, args.jobs, latency, args.steps,
                                       {"tool_latency_s": latency})
    return result


def plot(result: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, xlabel in ((axes[0], "length", "completion length (tokens)"),
                            (axes[1], "latency", "tool latency (s per call)")):
        for n in sorted({r["jobs"] for r in result[key]}):
            points = [(r["value"], r["ratio"]) for r in result[key] if r["jobs"] == n]
            ax.plot(*zip(*points), marker="o", label=f"{n} job{'s' if n > 1 else ''}")
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("marlaas / in-process loop (steps/hour)")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_xscale("log", base=2)
    fig.tight_layout()
    path = out / "crossover.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="versions per job")
    parser.add_argument("--jobs", type=int, default=3, help="jobs at once (and the loop's jobs in a row)")
    parser.add_argument("--lengths", default="16,64,256,480", help="completion lengths (tokens)")
    parser.add_argument("--latencies", default="0,0.5,2", help="tool latencies (seconds per call)")
    parser.add_argument("--out", default="bench-results/crossover")
    args = parser.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    args.latencies = [float(x) for x in args.latencies.split(",") if x]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console(width=120)
    with console.status("sweeping completion length and tool latency (marlaas vs the in-process loop)..."):
        result = sweep(args)
    (out / "crossover.json").write_text(json.dumps(result, indent=1))
    table = Table("sweep", "value", "jobs", "marlaas steps/h", "loop steps/h", "marlaas / loop")
    for key, unit in (("length", " tok"), ("latency", " s")):
        for r in result[key]:
            table.add_row(key, f"{r['value']:g}{unit}", str(r["jobs"]), f"{r['marlaas_steps_per_hour']:.0f}",
                          f"{r['loop_steps_per_hour']:.0f}", f"{r['ratio']:.2f}x")
    console.print(table)
    console.print(f"plot: {plot(result, out)}")


if __name__ == "__main__":
    main()
