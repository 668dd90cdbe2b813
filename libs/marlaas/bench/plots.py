"""The benchmark's plots in the paper's style (PNG, matplotlib).

- ``throughput.png``: steps/hour, and engine / trainer busy fractions, versus number of jobs;
- ``latency.png``: TTFS and TPTS versus number of jobs (Figures 6-7);
- ``learning.png``: batch reward against versions and against wall time, per mode and seed;
- ``timeline-<mode>.png``: one run per mode, each job's rollout, reward, train and commit
  phases over time (Figure 3);
- ``event-latency.png``: histograms of commit -> generate and ready -> train per mode.
"""

from __future__ import annotations

from pathlib import Path

PHASE_COLORS = {"generate": "tab:blue", "reward": "tab:cyan", "train": "tab:orange", "commit": "tab:red"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _by_mode(runs: list[dict]) -> dict[str, list[dict]]:
    modes: dict[str, list[dict]] = {}
    for run in runs:
        modes.setdefault(run["mode"], []).append(run)
    return {m: sorted(rs, key=lambda r: r["jobs"]) for m, rs in modes.items()}


def _versus_jobs(ax, runs: list[dict], metric: str, title: str, ylabel: str) -> None:
    for mode, rs in _by_mode(runs).items():
        points = [(r["jobs"], r.get(metric)) for r in rs if r.get(metric) is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=mode)
    ax.set_title(title)
    ax.set_xlabel("concurrent jobs")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def throughput_plot(runs: list[dict], out: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    _versus_jobs(axes[0], runs, "steps_per_hour", "throughput", "steps / hour")
    _versus_jobs(axes[1], runs, "engine_busy", "engine busy", "fraction of wall time")
    _versus_jobs(axes[2], runs, "trainer_busy", "trainer busy", "fraction of wall time")
    for ax in axes[1:]:
        ax.set_ylim(0, 1.05)
    axes[0].legend()
    fig.tight_layout()
    path = out / "throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def latency_plot(runs: list[dict], out: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    _versus_jobs(axes[0], runs, "ttfs_s", "time to first step (TTFS)", "seconds")
    _versus_jobs(axes[1], runs, "tpts_s", "time per training step (TPTS)", "seconds")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend()
    fig.tight_layout()
    path = out / "latency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timeline_plot(run: dict, out: Path) -> Path:
    plt = _pyplot()
    jobs = sorted({p["job"] for p in run["timeline"]})
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(jobs) + 1.6))
    for row, job in enumerate(jobs):
        for phase, color in PHASE_COLORS.items():
            bars = [(p["start"], p["end"] - p["start"]) for p in run["timeline"]
                    if p["job"] == job and p["phase"] == phase]
            ax.broken_barh(bars, (row - 0.4, 0.8), color=color, label=phase if row == 0 else None)
    ax.set_yticks(range(len(jobs)), jobs)
    ax.set_xlabel("seconds since the first submit")
    ax.set_title(f"{run['mode']}, {run['jobs']} jobs: rollout (incl. tool waits), reward, train, commit")
    ax.legend(loc="upper right", ncols=4, fontsize=8)
    fig.tight_layout()
    path = out / f"timeline-{run['mode']}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def event_latency_plot(runs: list[dict], out: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in ((axes[0], "handoff_ms", "policy-committed → generating with it"),
                           (axes[1], "ready_to_train_ms", "trajectory-ready → train start")):
        for mode, rs in _by_mode(runs).items():
            values = [v for r in rs for v in r.get("histograms", {}).get(key, [])]
            if values:
                ax.hist(values, bins=30, alpha=0.5, label=mode)
        ax.set_title(title)
        ax.set_xlabel("milliseconds")
        ax.set_ylabel("versions")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend()
    fig.tight_layout()
    path = out / "event-latency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def learning_plot(runs: list[dict], out: Path) -> Path | None:
    """Each mode's batch reward against versions and against wall time, one thin line per job and
    seed (``curves``): what staleness costs in learning, and what it buys in time."""
    curved = [r for r in runs if any(seed.get("curves") for seed in r.get("seeds", []))]
    if not curved:
        return None
    plt = _pyplot()
    fig, (by_version, by_time) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (mode, rs) in enumerate(_by_mode(curved).items()):
        color, labelled = colors[k % len(colors)], False
        for run in rs:
            for seed in run["seeds"]:
                for points in (seed.get("curves") or {}).values():
                    if not points:
                        continue
                    versions, seconds, rewards = zip(*points)
                    label = None if labelled else f"{mode} ({len(run['seeds'])} seeds)"
                    by_version.plot(versions, rewards, color=color, alpha=0.6, label=label)
                    by_time.plot(seconds, rewards, color=color, alpha=0.6)
                    labelled = True
    by_version.set_xlabel("version")
    by_time.set_xlabel("seconds since the jobs were submitted")
    by_version.set_ylabel("batch reward")
    by_version.set_title("reward against versions")
    by_time.set_title("reward against wall time")
    by_version.legend()
    fig.tight_layout()
    path = out / "learning.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(result: dict, out: Path) -> list[Path]:
    """Every plot of ``result`` under ``out``; timelines use each mode's smallest multi-job run."""
    runs = [r for r in result["runs"] if r["mode"] != "inprocess" or r.get("steps_per_hour")]
    paths = [throughput_plot(runs, out), latency_plot(runs, out), event_latency_plot(runs, out)]
    if (learning := learning_plot(runs, out)) is not None:
        paths.append(learning)
    for rs in _by_mode(result["runs"]).values():
        shown = next((r for r in rs if r["jobs"] > 1 and r.get("timeline")), None) or \
            next((r for r in rs if r.get("timeline")), None)
        if shown:
            paths.append(timeline_plot(shown, out))
    return paths
