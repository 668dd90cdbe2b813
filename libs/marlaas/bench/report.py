"""A benchmark's result as a markdown table, its mode-to-mode ratios, and its targets checked.

A target reads ``"<metric> <mode>[@<jobs>][/<other mode>[@<jobs>]]" = value``: a metric of one
mode (``engine_busy async``), or its ratio to another mode's (``steps_per_hour async/sequential``),
each taken from its run with ``<jobs>`` jobs (``@max`` or nothing: the other side's count if
given, else the mode's largest run). Metrics in seconds or
milliseconds (``..._ms``, ``..._s``) must stay at or under the value; every other metric
must reach it. Nested figures are dotted: ``handoff_ms.p50``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

COLUMNS = (("mode", "mode", "{}"), ("jobs", "jobs", "{}"), ("steps", "steps", "{}"),
           ("wall_s", "wall s", "{:.1f}"), ("steps_per_hour", "steps/h", "{:.0f}"),
           ("engine_busy", "engine busy", "{:.0%}"),
           ("engine_requests", "engine batch", "{:.0f}"), ("trainer_busy", "trainer busy", "{:.0%}"),
           ("idle", "idle", "{:.0%}"), ("cpu_load", "CPU load", "{:.0%}"), ("tokens_per_s", "tokens/s", "{:.0f}"),
           ("tool_wait_fraction", "tools pending", "{:.0%}"), ("ttfs_s", "TTFS s", "{:.1f}"),
           ("tpts_s", "TPTS s", "{:.2f}"), ("handoff_ms.p50", "commit→gen p50 ms", "{:.0f}"),
           ("ready_to_train_ms.p50", "ready→train p50 ms", "{:.0f}"),
           ("overhead_ms.p50", "overhead p50 ms", "{:.0f}"))


def figure(run: dict, metric: str):
    value = run
    for part in metric.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def cell(run: dict, metric: str, fmt: str) -> str:
    value = figure(run, metric)
    return "–" if value is None else fmt.format(value)


def markdown_table(runs: list[dict]) -> str:
    lines = ["| " + " | ".join(title for _, title, _ in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r, m, f) for m, _, f in COLUMNS) + " |" for r in runs]
    return "\n".join(lines)


def pick(runs: list[dict], mode: str, jobs: int | None) -> dict | None:
    """The run of ``mode`` with ``jobs`` jobs (default: its largest)."""
    candidates = [r for r in runs if r["mode"] == mode and (jobs is None or r["jobs"] == jobs)]
    return max(candidates, key=lambda r: r["jobs"]) if candidates else None


def ratios(runs: list[dict], metric: str = "steps_per_hour") -> list[tuple[str, int, float]]:
    """``async`` against every other mode, at each job count both ran: (other mode, jobs, ratio)."""
    out = []
    for base in (r for r in runs if r["mode"] == "async"):
        for other in runs:
            if other["mode"] != "async" and other["jobs"] == base["jobs"] and other.get(metric):
                out.append((other["mode"], base["jobs"], base[metric] / other[metric]))
    return out


def ceiling(runs: list[dict], jobs: int, ratio: float) -> str:
    """``ratio`` over the CPU load of ``async`` with ``jobs`` jobs ("–" when it was not measured)."""
    run = pick(runs, "async", jobs)
    load = run.get("cpu_load") if run else None
    return f"{ratio / load:.2f}x" if load else "–"


@dataclass(frozen=True)
class TargetCheck:
    target: str
    wanted: float
    measured: float | None
    upper_bound: bool

    @property
    def met(self) -> bool:
        if self.measured is None:
            return False
        return self.measured <= self.wanted if self.upper_bound else self.measured >= self.wanted

    def line(self) -> str:
        shown = "not measured" if self.measured is None else f"{self.measured:.3g}"
        sign = "<=" if self.upper_bound else ">="
        return f"{'met ' if self.met else 'MISSED'}  {self.target}: {shown} (target {sign} {self.wanted:g})"


def _side(text: str) -> tuple[str, int | None, bool]:
    """``mode[@N|@max]`` -> (mode, N, whether N was given)."""
    mode, _, jobs = text.partition("@")
    return mode, (None if jobs in ("", "max") else int(jobs)), bool(jobs)


def check_targets(runs: list[dict], targets: dict[str, float]) -> list[TargetCheck]:
    """Each target measured; a side without ``@N`` takes the other side's N, else the largest run."""
    checks = []
    for target, wanted in targets.items():
        metric, _, which = target.partition(" ")
        top, _, bottom = which.partition("/")
        mode, jobs, given = _side(top)
        other, other_jobs, other_given = _side(bottom) if bottom else ("", None, False)
        run = pick(runs, mode, jobs if given else other_jobs)
        value = figure(run, metric) if run else None
        if bottom and value is not None:
            base = pick(runs, other, other_jobs if other_given else run["jobs"])
            denominator = figure(base, metric) if base else None
            value = value / denominator if denominator else None
        upper = metric.split(".")[0].endswith(("_ms", "_s")) and not bottom
        checks.append(TargetCheck(target, wanted, value, upper))
    return checks


def final_rewards(runs: list[dict]) -> dict[tuple[str, int], tuple[float, float, int]]:
    """(mode, jobs) -> (mean, sd, n) of the final rewards (``mean_last_rewards``) of every job of
    every seed of that run."""
    out = {}
    for r in runs:
        values = [v for seed in r.get("seeds", []) for v in (seed.get("mean_last_rewards") or {}).values()
                  if v is not None]
        if values:
            out[(r["mode"], r["jobs"])] = (statistics.mean(values), statistics.pstdev(values), len(values))
    return out


def same_reward_lines(learning: dict[tuple[str, int], tuple[float, float, int]],
                      baseline: str = "async-batch") -> list[str]:
    """Whether each mode reaches ``baseline``'s final reward within 2 sigma (the larger sd of the two;
    not judged on one sample a side)."""
    lines = []
    for (mode, jobs), (mean, sd, _) in learning.items():
        base = learning.get((baseline, jobs))
        if mode == baseline or base is None:
            continue
        if min(learning[(mode, jobs)][2], base[2]) < 2:
            lines.append(f"not judged  final reward {mode}@{jobs} against {baseline}: one sample each (run seeds)")
            continue
        sigma = max(sd, base[1])
        met = abs(mean - base[0]) <= 2 * sigma + 1e-9
        lines.append(f"{'met ' if met else 'MISSED'}  final reward {mode}@{jobs} within 2 sigma of {baseline}: "
                     f"{mean:.3f} vs {base[0]:.3f} (2 sigma = {2 * sigma:.3f})")
    return lines


def markdown_report(result: dict, targets: dict[str, float]) -> str:
    """The whole result as markdown: the table, the ratios, the targets, the peak RSS."""
    runs = result["runs"]
    parts = [f"# Benchmark `{result['workload']}`{' (quick)' if result['quick'] else ''}", "",
             result.get("description", ""), "", f"{result['steps_per_job']} versions per job; machine: "
             f"{result['machine']['cpus']} CPUs, {result['machine']['platform']}.", "", markdown_table(runs), ""]
    rows = ratios(runs)
    if rows:
        parts += ["| async steps/h over | jobs | ratio | with every core busy |", "|---|---|---|---|"]
        parts += [f"| {mode} | {jobs} | {ratio:.2f}x | {ceiling(runs, jobs, ratio)} |"
                  for mode, jobs, ratio in rows] + [""]
        parts += ["*With every core busy*: the ratio over `async`'s CPU load, i.e. what `async` would "
                  "reach doing the CPU work of this run with no core ever idle: a bound on what this "
                  "machine allows without making a step cheaper (one job alone cannot reach it: a "
                  "strictly on-policy job's phases never overlap).", ""]
    checks = check_targets(runs, targets)
    if checks:
        parts += ["Targets:", ""] + [f"- {c.line()}" for c in checks] + [""]
    learning = final_rewards(runs)
    if learning:
        parts += ["Final reward (each job's mean batch reward over its last three versions), over seeds and jobs:",
                  "", "| mode | jobs | mean | sd | n |", "|---|---|---|---|---|"]
        parts += [f"| {mode} | {jobs} | {mean:.3f} | {sd:.3f} | {n} |"
                  for (mode, jobs), (mean, sd, n) in learning.items()]
        baseline = "async-batch" if any(r["mode"] == "async-batch" for r in runs) else "async"
        parts += [""] + [f"- {line}" for line in same_reward_lines(learning, baseline)] + [""]
    phased = [r for r in runs if r.get("phase_ms")]
    if phased:
        keys = list(phased[0]["phase_ms"])
        parts += ["Where a version's time goes (medians, ms):", "",
                  "| mode | jobs | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
        parts += [f"| {r['mode']} | {r['jobs']} | " + " | ".join(cell(r["phase_ms"], k, "{:.0f}") for k in keys)
                  + " |" for r in phased] + [""]
    cpu = [r for r in runs if r.get("cpu_s") and r.get("steps")]
    if cpu:
        services = sorted({s for r in cpu for s in r["cpu_s"]})
        parts += ["CPU seconds per version (each service's process tree, a vLLM engine core apart):", "",
                  "| mode | jobs | " + " | ".join(services) + " | all |", "|---|---|" + "---|" * (len(services) + 1)]
        parts += [f"| {r['mode']} | {r['jobs']} | " + " | ".join(f"{r['cpu_s'].get(s, 0) / r['steps']:.2f}"
                                                          for s in services)
                  + f" | {sum(r['cpu_s'].values()) / r['steps']:.2f} |" for r in cpu] + [""]
    rss = [(r["mode"], r["jobs"], r.get("peak_rss_mib", {})) for r in runs if r.get("peak_rss_mib")]
    if rss:
        services = sorted({s for _, _, peaks in rss for s in peaks})
        parts += ["Peak RSS (MiB, each service's process tree):", "",
                  "| mode | jobs | " + " | ".join(services) + " |", "|---|---|" + "---|" * len(services)]
        parts += [f"| {mode} | {jobs} | " + " | ".join(f"{peaks.get(s, 0):.0f}" for s in services) + " |"
                  for mode, jobs, peaks in rss] + [""]
    return "\n".join(parts)
