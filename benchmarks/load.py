"""Load: many concurrent jobs to the end, twice, with every service's memory followed over time.

    python benchmarks/load.py [--jobs 32] [--steps 20] [--waves 2] [--out bench-results/load]

One stack; ``--jobs`` single-turn jobs (cycling ``addition``, ``reverse``, ``repeat``) are
submitted at once and run to completion, then the same again (``--waves``). A sampler
records the resident memory of each service's process tree (rollout's includes its vLLM
engine core) every second. A per-job leak would show as memory that grows from one wave to
the next: each service's memory after a wave (once its jobs are finished) is compared with
its memory after the first. Printed: jobs completed, steps/hour, and per service the peak
and after-wave RSS; written: ``load.json`` and ``load-rss.png`` (RSS over time, waves shaded).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from marlaas.bench.progress import step_bars
from marlaas.bench.runner import ResourceSampler, bench_stack, run_jobs, warm_up

TASKS = ("addition", "reverse", "repeat")
SETTLE_S = 5.0  # after a wave: let the services free what the finished jobs held


class RssSeries(ResourceSampler):
    """:class:`ResourceSampler` that also keeps every sample: ``(time, {service: MiB})``."""

    def __init__(self, stack, every_s: float = 1.0) -> None:
        super().__init__(stack, every_s)
        self.series: list[tuple[float, dict[str, float]]] = []

    def _sample(self) -> None:
        import psutil

        now = {}
        for name, proc in list(self.stack.procs.items()):
            try:
                root = psutil.Process(proc.pid)
                now[name] = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / 2**20
            except psutil.Error:
                continue
            self.peak_mib[name] = max(self.peak_mib.get(name, 0.0), now[name])
        self.series.append((time.time(), now))


def jobs_of(wave: int, n: int, steps: int) -> list[dict]:
    return [{"name": f"load{wave}-{i}", "task": TASKS[i % len(TASKS)], "seed": i, "steps": steps}
            for i in range(n)]


def plot(series, waves, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = series[0][0]
    fig, ax = plt.subplots(figsize=(10, 4))
    for name in sorted({n for _, sample in series for n in sample}):
        points = [(t - t0, s[name]) for t, s in series if name in s]
        ax.plot(*zip(*points), label=name)
    for i, (start, end) in enumerate(waves):
        ax.axvspan(start - t0, end - t0, alpha=0.1, color="tab:gray", label="a wave of jobs" if i == 0 else None)
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS (MiB, process tree)")
    ax.set_yscale("log")
    ax.set_title("memory of each service while waves of jobs run to completion")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    path = out / "load-rss.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--waves", type=int, default=2)
    parser.add_argument("--out", default="bench-results/load")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _interrupt)  # a stopped benchmark stops the stack it runs
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console()
    waves, after, completed, steps_per_hour = [], [], [], []
    with bench_stack({}, args.jobs) as stack, step_bars(console) as progress:
        warm_up(stack, [{"name": f"warm-{t}", "task": t, "seed": 99} for t in TASKS], "warm-up", progress)
        with RssSeries(stack) as rss:
            for wave in range(args.waves):
                views, start, end = asyncio.run(run_jobs(
                    stack.nats_url, jobs_of(wave, args.jobs, args.steps), f"wave {wave + 1}", progress, 3600.0))
                waves.append((start, end))
                completed.append(sum(v["state"] == "completed" for v in views))
                steps_per_hour.append(sum(v["steps"] for v in views) / (end - start) * 3600)
                time.sleep(SETTLE_S)
                rss._sample()
                after.append(dict(rss.series[-1][1]))
    services = sorted(after[0])
    growth = {name: after[-1][name] - after[0][name] for name in services if name in after[-1]}
    result = {"jobs": args.jobs, "steps": args.steps, "waves": args.waves, "completed": completed,
              "steps_per_hour": steps_per_hour, "peak_rss_mib": rss.peak_mib, "rss_after_wave_mib": after,
              "growth_mib_first_to_last_wave": growth}
    (out / "load.json").write_text(json.dumps(result, indent=1))
    path = plot(rss.series, waves, out)
    table = Table("service", "peak MiB", *[f"after wave {i + 1}" for i in range(len(after))], "growth")
    for name in services:
        table.add_row(name, f"{rss.peak_mib.get(name, 0):.0f}", *[f"{a.get(name, 0):.0f}" for a in after],
                      f"{growth.get(name, 0):+.0f}")
    console.print(table)
    console.print(f"completed per wave: {completed} of {args.jobs}; steps/hour per wave: "
                  f"{', '.join(f'{s:.0f}' for s in steps_per_hour)}; plot: {path}")


if __name__ == "__main__":
    main()
