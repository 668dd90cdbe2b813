"""``marlaas report JOB``: a job's curves as PNG files, from what the HTTP API returns.

Reward per version (the mean reward of the batch trained at version i, as ``rewards[i]``),
the held-out score per version when the job evaluates, and the time each training step
took (between consecutive commits).
"""

from __future__ import annotations

from pathlib import Path

from marlaas.platform.http_api import JobInfo, VersionInfo


def step_times(versions: list[VersionInfo]) -> list[tuple[int, float]]:
    """(version, seconds since the previous commit) for each version after the first."""
    return [(b.version, b.committed_at - a.committed_at) for a, b in zip(versions, versions[1:])
            if b.committed_at and a.committed_at]


def write_report(job: JobInfo, versions: list[VersionInfo], out_dir: Path) -> list[Path]:
    """Write the job's plots into ``out_dir``; return their paths (the eval plot only if it evaluates)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out_dir.mkdir(parents=True, exist_ok=True)
    title = f"{job.id} ({job.task}, {job.state}, version {job.version}/{job.target_steps})"
    plots = [("rewards.png", "mean reward of the batch", "version trained from",
              list(range(len(job.rewards))), job.rewards)]
    if job.evals:
        plots.append(("evals.png", "held-out score (greedy)", "version",
                      [e.version for e in job.evals], [e.score for e in job.evals]))
    times = step_times(versions)
    plots.append(("step_time.png", "seconds per training step", "version committed",
                  [v for v, _ in times], [s for _, s in times]))
    written = []
    for name, ylabel, xlabel, xs, ys in plots:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(xs, ys, marker="o" if len(xs) < 50 else None, linewidth=1.5)
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # versions are whole numbers
        if not xs:
            ax.text(0.5, 0.5, "no data yet", transform=ax.transAxes, ha="center", va="center")
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def write_tensorboard(job: JobInfo, versions: list[VersionInfo], log_dir: Path) -> Path:
    """Write the job's per-version figures as TensorBoard event files under ``log_dir/<job id>``
    (``tensorboard --logdir log_dir`` shows them beside other runs): ``reward/mean`` and every
    per-version agent figure (``tool/*``, ``episode/*``) at step i for version i, ``eval/score``
    at the versions evaluated, each version's own batch figures (``version/...``: loss, ...) and
    ``time/step_s``, with each version's commit time as the wall time."""
    from torch.utils.tensorboard import SummaryWriter

    run_dir = log_dir / job.id
    committed = {v.version: v.committed_at for v in versions if v.committed_at}
    with SummaryWriter(log_dir=str(run_dir)) as writer:
        def scalar(tag: str, value: float, step: int) -> None:
            writer.add_scalar(tag, value, step, walltime=committed.get(step))

        for step, reward in enumerate(job.rewards):
            scalar("reward/mean", reward, step)
        for name, values in job.metrics.items():
            for step, value in enumerate(values):
                scalar(name, value, step)
        for score in job.evals:
            scalar("eval/score", score.score, score.version)
        for version in versions:
            for name, value in version.metrics.items():
                scalar(f"version/{name}", value, version.version)
        for step, seconds in step_times(versions):
            scalar("time/step_s", seconds, step)
        writer.add_text("job", f"{job.id}: task {job.task}, {job.state}, version {job.version}"
                               f"/{job.target_steps}")
    return run_dir
