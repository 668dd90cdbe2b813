"""`marlaas report JOB --tensorboard DIR`: a job's per-version figures, read back from the event
files with TensorBoard's own reader."""
from __future__ import annotations

from marlaas.cli.report import write_tensorboard
from marlaas.platform.http_api import EvalInfo, JobInfo, VersionInfo


def test_every_per_version_figure_lands_at_its_version(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job = JobInfo(id="acme.multiply-1", name="multiply", tenant="acme", task="multiply", state="completed",
                  reason="", version=3, steps=3, target_steps=3, rewards=[0.25, 0.5, 0.75],
                  metrics={"tool/success_share": [0.1, 0.6, 0.9]},
                  evals=[EvalInfo(version=0, score=0.2), EvalInfo(version=3, score=0.8)])
    versions = [VersionInfo(version=v, committed_at=1000.0 + 2.5 * v,
                            metrics={} if v == 0 else {"loss": 1.0 / v}) for v in range(4)]
    run_dir = write_tensorboard(job, versions, tmp_path)
    assert run_dir == tmp_path / job.id
    events = EventAccumulator(str(run_dir))
    events.Reload()

    def series(tag: str) -> list[tuple[int, float]]:
        return [(e.step, round(e.value, 6)) for e in events.Scalars(tag)]

    assert series("reward/mean") == [(0, 0.25), (1, 0.5), (2, 0.75)]
    assert series("tool/success_share") == [(0, 0.1), (1, 0.6), (2, 0.9)]
    assert series("eval/score") == [(0, 0.2), (3, 0.8)]
    assert series("version/loss") == [(1, 1.0), (2, 0.5), (3, round(1 / 3, 6))]
    assert series("time/step_s") == [(1, 2.5), (2, 2.5), (3, 2.5)]
    assert [e.wall_time for e in events.Scalars("reward/mean")] == [1000.0, 1002.5, 1005.0]  # commit times
