"""How the ratios of ``agentic-10`` move with the tools' latency: one workload, its modes, several latencies.

    python benchmarks/tool_latency.py [--workload agentic-10] [--latencies 0.5-1.5,1.5-4.5,3-9]
        [--modes async,sync,sequential] [--steps 4] [--out bench-results/tool-latency]

On a CPU, batching ten jobs' generation costs about ten times one job's: unlike on an
accelerator, concurrency buys no free arithmetic, so ``async`` gains over ``sequential`` and
``sync`` only what they leave idle, mostly their waits on tools. This sweeps the calculator's
injected latency (``LOW-HIGH``: each call answered after a uniform draw in seconds; a plain
number: a fixed delay) and runs every mode at each value, side by side in one run, on a
fresh stack per mode and value (``marlaas.bench.runner.run_mode``). Printed: steps/hour of
each mode, the ratios of ``async`` to the others and the workload's steps/hour targets met or
missed at each latency; written: ``tool-latency.json``, ``tool-latency.md`` and
``tool-latency.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import msgspec
from rich.console import Console

from marlaas.bench.progress import step_bars
from marlaas.bench.report import check_targets, markdown_table, ratios
from marlaas.bench.runner import run_mode
from marlaas.bench.workload import MODES, load_workload

TOOL = "calculator"


def parse_latency(text: str) -> float | list[float]:
    """``"0.5-1.5"`` -> [0.5, 1.5] (uniform); ``"2"`` -> 2.0 (fixed)."""
    low, sep, high = text.partition("-")
    try:
        return [float(low), float(high)] if sep else float(low)
    except ValueError:
        raise SystemExit(f"--latencies: {text!r} is not seconds (2) or a range (1.5-4.5)") from None


def label(latency: float | list[float]) -> str:
    return f"{latency[0]:g}-{latency[1]:g} s" if isinstance(latency, list) else f"{latency:g} s"


def sweep(args, console: Console) -> list[dict]:
    base = load_workload(args.workload)
    points = []
    with step_bars(console) as progress:
        for latency in args.latencies:
            env = {**base.config.get("env", {}), "tool_latency_s": {TOOL: latency}}
            workload = msgspec.structs.replace(base, steps=args.steps, config={**base.config, "env": env})
            runs = [{k: v for k, v in run.items() if k != "timeline"}  # per-job phases: not needed here
                    for mode in args.modes for run in run_mode(workload, mode, False, progress)]
            targets = {k: v for k, v in base.targets.items()  # the throughput ratios of the modes run
                       if k.startswith("steps_per_hour")
                       and all(m in args.modes for m in k.split(" ", 1)[1].split("/"))}
            points.append({"latency_s": latency, "runs": runs,
                           "ratios": [{"over": m, "jobs": n, "ratio": r} for m, n, r in ratios(runs)],
                           "targets": [{"target": c.target, "wanted": c.wanted, "measured": c.measured,
                                        "met": c.met} for c in check_targets(runs, targets)]})
    return points


def report(points: list[dict], args) -> str:
    parts = [f"# `{args.workload}` against the tools' latency", "",
             f"{args.steps} versions per job; modes {', '.join(args.modes)}; each latency and mode on a "
             f"fresh stack.", ""]
    parts += ["| tool latency | " + " | ".join(f"{m} steps/h" for m in args.modes) + " | "
              + " | ".join(f"async / {m}" for m in args.modes if m != "async") + " |",
              "|---|" + "---|" * (2 * len(args.modes) - 1)]
    for p in points:
        by_mode = {r["mode"]: r["steps_per_hour"] for r in p["runs"]}
        over = {r["over"]: r["ratio"] for r in p["ratios"]}
        parts.append(f"| {label(p['latency_s'])} | " + " | ".join(f"{by_mode.get(m, 0):.0f}" for m in args.modes)
                     + " | " + " | ".join(f"{over[m]:.2f}x" if m in over else "–"
                                          for m in args.modes if m != "async") + " |")
    parts.append("")
    for p in points:
        parts += [f"## {label(p['latency_s'])}", "", markdown_table(p["runs"]), ""]
        parts += [f"- {'met' if t['met'] else 'MISSED'}  {t['target']}: "
                  f"{t['measured'] if t['measured'] is None else format(t['measured'], '.2f')} "
                  f"(target >= {t['wanted']:g})" for t in p["targets"]] + [""]
    return "\n".join(parts)


def plot(points: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def mean(latency) -> float:
        return sum(latency) / 2 if isinstance(latency, list) else latency

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    modes = sorted({r["mode"] for p in points for r in p["runs"]})
    color = {mode: f"C{i}" for i, mode in enumerate(modes)}  # a ratio takes the colour of the mode it is over
    for mode in modes:
        xs = [(mean(p["latency_s"]), r["steps_per_hour"]) for p in points for r in p["runs"] if r["mode"] == mode]
        left.plot(*zip(*xs), marker="o", label=mode, color=color[mode])
    left.set_xlabel("tool latency (mean s per call)")
    left.set_ylabel("steps/hour")
    for other in sorted({r["over"] for p in points for r in p["ratios"]}):
        xs = [(mean(p["latency_s"]), r["ratio"]) for p in points for r in p["ratios"] if r["over"] == other]
        right.plot(*zip(*xs), marker="o", label=f"async / {other}", color=color[other])
    for t in {(t["target"], t["wanted"]) for p in points for t in p["targets"]}:
        right.axhline(t[1], color="grey", linestyle="--", linewidth=1)
        right.annotate(f"target {t[0].split(' ', 1)[1]}", (0, t[1]), xycoords=("axes fraction", "data"),
                       fontsize=8, color="grey", va="bottom")
    right.set_xlabel("tool latency (mean s per call)")
    right.set_ylabel("ratio of steps/hour")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = out / "tool-latency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="agentic-10")
    parser.add_argument("--latencies", default="0.5-1.5,1.5-4.5,3-9",
                        help="calculator latencies: LOW-HIGH (uniform) or S (fixed), comma-separated")
    parser.add_argument("--modes", default="async,sync,sequential")
    parser.add_argument("--steps", type=int, default=4, help="versions per job")
    parser.add_argument("--out", default="bench-results/tool-latency")
    parser.add_argument("--from-json", metavar="PATH", help="no runs: redo the report and plot of a saved run")
    args = parser.parse_args()
    args.latencies = [parse_latency(x) for x in args.latencies.split(",") if x]
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or "async" not in args.modes:
        raise SystemExit(f"--modes: {unknown or args.modes} — give async and any of {list(MODES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console(width=120)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        args.workload, args.steps, points = saved["workload"], saved["steps"], saved["points"]
        args.modes = list(dict.fromkeys(r["mode"] for r in points[0]["runs"]))
    else:
        points = sweep(args, console)
    (out / "tool-latency.json").write_text(json.dumps({"workload": args.workload, "steps": args.steps,
                                                        "points": points}, indent=1))
    text = report(points, args)
    (out / "tool-latency.md").write_text(text)
    console.print(text)
    console.print(f"plot: {plot(points, out)}")


if __name__ == "__main__":
    main()
