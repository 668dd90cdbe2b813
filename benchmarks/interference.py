"""Does sharing the system change what a job learns? A job alone against the same job among others.

    python benchmarks/interference.py [--task addition] [--others reverse,repeat] [--seeds 3]
        [--steps 20] [--out bench-results/interference]

For each seed, the job runs alone, then again (same seed: the same problems and sampling
seeds) beside one job of each ``--others`` task. The job's final reward (the mean of its
last three versions' batch rewards) is compared across seeds: if sharing the engine and the
trainer biased learning, the "among others" mean would sit outside the "alone" spread. Exact
equality is not expected: the engine's batches differ, and a different float rounding of a
logit can flip a sampled token, after which the two runs' trajectories diverge.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from marlaas.bench.runner import bench_stack, measure, warm_up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="addition")
    parser.add_argument("--others", default="reverse,repeat")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="bench-results/interference")
    args = parser.parse_args()
    others = [t for t in args.others.split(",") if t]
    rows = []
    console = Console(width=120)
    with console.status("alone, then among others, for every seed..."), bench_stack({}, 1 + len(others)) as stack:
        warm_up(stack, [{"name": "warm", "task": t, "seed": 99} for t in [args.task, *others]], "warm-up")
        for seed in range(args.seeds):
            me = {"name": f"{args.task}-s{seed}", "task": args.task, "seed": seed, "steps": args.steps}
            alone = measure(stack, [me], f"alone-{seed}")
            mixed = measure(stack, [me, *({"name": f"{t}-s{seed}", "task": t, "seed": seed, "steps": args.steps}
                                          for t in others)], f"among-{seed}")
            rows.append({"seed": seed, "alone": alone["mean_last_rewards"][me["name"]],
                         "among": mixed["mean_last_rewards"][me["name"]]})
    alone = [r["alone"] for r in rows]
    among = [r["among"] for r in rows]
    mean_alone, sd_alone = statistics.mean(alone), statistics.stdev(alone) if len(alone) > 1 else 0.0
    gap = abs(statistics.mean(among) - mean_alone)
    verdict = {"mean_alone": mean_alone, "sd_alone": sd_alone, "mean_among": statistics.mean(among),
               "gap_in_sd": gap / sd_alone if sd_alone else None, "within_2_sd": gap <= 2 * sd_alone}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "interference.json").write_text(json.dumps({"rows": rows, **verdict}, indent=1))
    table = Table("seed", f"{args.task} alone", f"among {', '.join(others)}")
    for r in rows:
        table.add_row(str(r["seed"]), f"{r['alone']:.3f}", f"{r['among']:.3f}")
    console.print(table)
    console.print(f"alone {mean_alone:.3f} ± {sd_alone:.3f}; among others {verdict['mean_among']:.3f}: "
                  f"{'within' if verdict['within_2_sd'] else 'OUTSIDE'} 2 standard deviations")


if __name__ == "__main__":
    main()
