"""The benchmark harness's pure parts: figures from spans, workloads, targets, the report and plots."""

from __future__ import annotations

import pytest

from marlaas.bench.chaos import kill_gap
from marlaas.bench.fairness import is_fairness_workload, load_fairness_workload
from marlaas.bench.metrics import covered, overheads_ms, percentile, run_metrics
from marlaas.bench.plots import write_plots
from marlaas.bench.report import check_targets, markdown_report, ratios
from marlaas.bench.runner import cpu_load
from marlaas.bench.workload import WORKLOAD_DIR, WorkloadError, load_workload
from marlaas.platform.events import Span
from marlaas.platform.telemetry import UTILIZATION_JOB


def span(job, phase, version, start, end, **attrs):
    return Span(job=job, service="x", phase=phase, version=version, start=start, end=end, attrs=attrs)


def one_version(job="j", t0=0.0):
    """v0 committed at t0; v0 sampled 0.1..1.1 (rewards to 1.2), trained 1.3..1.8, v1 committed 1.8..1.9."""
    return [span(job, "commit", 0, t0 - 0.1, t0), span(job, "generate", 0, t0 + 0.1, t0 + 1.1, tokens=100),
            span(job, "reward", 0, t0 + 1.1, t0 + 1.2), span(job, "train", 0, t0 + 1.3, t0 + 1.8),
            span(job, "commit", 1, t0 + 1.8, t0 + 1.9)]


def test_intervals_are_counted_once_where_they_overlap():
    assert covered([(0, 2), (1, 3), (5, 6)], 0, 10) == pytest.approx(4)
    assert covered([(-5, 1)], 0, 10) == pytest.approx(1)  # clipped to the window
    assert percentile([3, 1, 2], 0.5) == 2 and percentile([], 0.5) is None


def test_a_version_s_overhead_is_everything_but_generation_and_the_gradient_step():
    # handoff 0.1 + reward 0.1 + ready->train 0.1 + commit 0.1
    assert overheads_ms(one_version()) == [pytest.approx(400.0)]


def test_run_figures_from_spans_and_job_views():
    spans = [*one_version(), span(UTILIZATION_JOB, "engine", -1, 0.1, 1.1),
             span(UTILIZATION_JOB, "utilization", -1, 0.0, 1.0, tools_pending_s=0.5, engine_busy_s=0.5,
                  engine_request_s=1.0),
             span(UTILIZATION_JOB, "utilization", -1, 1.0, 2.0, engine_busy_s=0.5, engine_request_s=3.0),
             span("other-job", "train", 0, 0.0, 2.0)]  # not this run's: ignored
    jobs = [{"id": "j", "name": "a", "state": "completed", "steps": 1, "rewards": [0.5], "ttfs_s": 1.9,
             "tpts_s": None}]
    m = run_metrics(spans, jobs, start=0.0, end=2.0)
    assert m["steps_per_hour"] == pytest.approx(1800)
    assert m["engine_busy"] == pytest.approx(0.5)
    assert m["engine_requests"] == pytest.approx(4.0)  # 4 request-seconds over 1 busy second
    assert m["trainer_busy"] == pytest.approx(0.3)  # train 0.5 s + commit 0.1 s of 2 s
    assert m["idle"] == pytest.approx(0.2)
    assert m["tokens_per_s"] == pytest.approx(50)
    assert m["tool_wait_fraction"] == pytest.approx(0.25)
    assert m["handoff_ms"]["p50"] == pytest.approx(100) and m["ready_to_train_ms"]["p50"] == pytest.approx(100)
    assert m["final_reward"] == {"a": 0.5}
    assert m["scored_token_share"] is None  # no train span says how many tokens it had


def test_the_scored_token_share_counts_what_the_trainer_ran_through_the_model():
    spans = [span("j", "train", 0, 0.0, 1.0, tokens=300.0, tokens_scored=100.0, threads=2.0),
             span("j", "train", 1, 1.0, 2.0, tokens=100.0)]  # a trainer that skipped nothing
    jobs = [{"id": "j", "name": "a", "state": "completed", "steps": 2, "rewards": [0.5]}]
    m = run_metrics(spans, jobs, start=0.0, end=2.0)
    assert m["scored_token_share"] == pytest.approx(0.5)
    assert m["train_threads"] == [2]  # as the spans that say it


def runs():
    return [{"mode": "async", "jobs": 1, "steps_per_hour": 100.0, "engine_busy": 0.5, "handoff_ms": {"p50": 10.0}},
            {"mode": "async", "jobs": 3, "steps_per_hour": 240.0, "engine_busy": 0.9, "handoff_ms": {"p50": 30.0}},
            {"mode": "sequential", "jobs": 3, "steps_per_hour": 80.0, "engine_busy": 0.4},
            {"mode": "inprocess", "jobs": 1, "steps_per_hour": 110.0}]


def test_targets_read_ratios_and_bounds_from_the_named_runs():
    checks = {c.target: c for c in check_targets(runs(), {
        "steps_per_hour async/sequential": 2.0,  # largest async (3) against sequential at 3
        "steps_per_hour async@1/inprocess": 0.833,
        "steps_per_hour async@max/async@1": 1.0,
        "engine_busy async": 0.95,
        "handoff_ms.p50 async@1": 20.0,  # milliseconds: an upper bound
        "engine_busy sync": 0.5,  # never ran
    })}
    assert checks["steps_per_hour async/sequential"].measured == pytest.approx(3.0)
    assert checks["steps_per_hour async/sequential"].met
    assert checks["steps_per_hour async@1/inprocess"].measured == pytest.approx(100 / 110)
    assert checks["steps_per_hour async@max/async@1"].measured == pytest.approx(2.4)
    assert not checks["engine_busy async"].met  # 0.9 < 0.95
    assert checks["handoff_ms.p50 async@1"].met and checks["handoff_ms.p50 async@1"].upper_bound
    assert not checks["engine_busy sync"].met and "not measured" in checks["engine_busy sync"].line()
    assert ("sequential", 3, pytest.approx(3.0)) in ratios(runs())


def test_every_shipped_workload_loads_and_bad_ones_say_what_is_wrong(tmp_path):
    names = sorted(p.stem for p in WORKLOAD_DIR.glob("*.toml"))
    assert {"agentic-10", "mix", "sweep", "single-turn-3"} <= set(names)
    for name in names:
        if is_fairness_workload(name):  # run by its own runner, from its own loader
            assert len(load_fairness_workload(name).tenants) >= 2
            continue
        workload = load_workload(name)
        assert workload.submissions(workload.job_counts(quick=True)[-1], quick=True, label="x")
    assert load_workload("sweep").job_counts(quick=False) == [1, 2, 4, 8, 16, 32]
    agentic = load_workload("agentic-10")
    assert agentic.overrides() == {"env.tool_latency_s": {"calculator": [0.5, 1.5]}}
    assert [s["task"] for s in agentic.submissions(10, quick=False, label="a")] == ["multiply"] * 10
    assert [s["task"] for s in load_workload("mix").one_of_each("w")] == ["addition", "repeat", "multiply"]
    with pytest.raises(WorkloadError, match="known: .*agentic-10"):
        load_workload("no-such-workload")
    bad = tmp_path / "bad.toml"
    bad.write_text('modes = ["async", "turbo"]\n[[jobs]]\ntask = "addition"\n')
    with pytest.raises(WorkloadError, match="turbo"):
        load_workload(str(bad))


def test_the_report_and_plots_are_written(tmp_path):
    result = {"workload": "w", "description": "d", "quick": True, "steps_per_job": 3,
              "machine": {"cpus": 2, "platform": "linux"}, "runs": [
                  {**r, "timeline": [{"job": "a", "phase": "generate", "start": 0.0, "end": 1.0},
                                     {"job": "a", "phase": "train", "start": 1.0, "end": 1.5}],
                   "histograms": {"handoff_ms": [10.0, 12.0]}, "peak_rss_mib": {"rollout": 900.0}}
                  for r in runs()]}
    report = markdown_report(result, {"steps_per_hour async/sequential": 2.0})
    assert "| async | 3 |" in report and "met   steps_per_hour async/sequential: 3" in report
    assert "| rollout |" in report or "rollout" in report
    paths = write_plots(result, tmp_path)
    assert {p.name for p in paths} >= {"throughput.png", "latency.png", "event-latency.png", "timeline-async.png"}
    assert all(p.stat().st_size > 1000 for p in paths)


def test_chaos_spaces_its_kills_by_two_versions_until_the_run_would_end_short_of_them():
    assert kill_gap(versions_left=52, kills_left=20) == 2
    assert kill_gap(versions_left=30, kills_left=20) == 1  # a slow start: one version apart
    assert kill_gap(versions_left=10, kills_left=20) == 0  # the last ones by time alone


def test_cpu_load_and_the_every_core_busy_bound_in_the_report():
    assert cpu_load({"rollout": 30.0, "trainer": 10.0}, wall_s=40.0, cores=2) == 0.5
    assert cpu_load({"rollout": 1.0}, wall_s=0.0, cores=2) == 0.0
    result = {"workload": "w", "description": "d", "quick": True, "steps_per_job": 3,
              "machine": {"cpus": 2, "platform": "linux"},
              "runs": [{**r, "steps": 3 * r["jobs"], "cpu_s": {"rollout": 3.0, "trainer": 1.5},
                        "cpu_load": 0.5 if r["mode"] == "async" else 0.4} for r in runs()]}
    report = markdown_report(result, {})
    # async@3 240 steps/h over sequential@3 80: 3x, and 6x at async@3's CPU load of 0.5
    assert "| sequential | 3 | 3.00x | 6.00x |" in report
    assert "| async | 3 | 0.33 | 0.17 | 0.50 |" in report  # CPU seconds per version: rollout, trainer, all


def test_learning_curves_pair_each_versions_reward_with_its_commit_time():
    spans = [*one_version(), span("j", "accumulate", 1, 1.95, 1.97), span("j", "commit", 2, 2.4, 2.5)]
    jobs = [{"id": "j", "name": "a", "state": "completed", "steps": 2, "rewards": [0.5, 0.75], "ttfs_s": None,
             "tpts_s": None}]
    m = run_metrics(spans, jobs, start=0.0, end=2.5)
    assert m["curves"] == {"a": [[0, 1.9, 0.5], [1, 2.5, 0.75]]}
    assert m["trainer_busy"] == pytest.approx((0.5 + 0.1 + 0.02 + 0.1) / 2.5)  # a pipelined group's work counts


def test_seeds_are_averaged_and_kept_and_final_rewards_compared_within_two_sigma(tmp_path):
    from marlaas.bench.report import final_rewards, same_reward_lines
    from marlaas.bench.runner import mean_run

    def run(sph, reward):
        return {"jobs": 1, "steps_per_hour": sph, "wall_s": 3600 / sph, "mean_last_rewards": {"a": reward},
                "final_reward": {"a": reward}, "curves": {"a": [[0, 1.0, reward]]}, "completed": 1}

    batch = {"mode": "async-batch", **mean_run([run(100, 0.5), run(120, 0.6), run(110, 0.7)])}
    stale = {"mode": "async-stale1", **mean_run([run(200, 0.55), run(210, 0.65), run(190, 0.6)])}
    far = {"mode": "async-stale2", **mean_run([run(300, 0.1), run(310, 0.12)])}
    once = {"mode": "async-groups", **mean_run([run(300, 0.6)])}
    assert batch["steps_per_hour"] == pytest.approx(110) and len(batch["seeds"]) == 3 and batch["jobs"] == 1
    learning = final_rewards([batch, stale, far, once])
    assert learning[("async-batch", 1)][0] == pytest.approx(0.6)
    lines = same_reward_lines(learning)
    assert lines[0].startswith("met   final reward async-stale1@1 within 2 sigma of async-batch")
    assert lines[1].startswith("MISSED  final reward async-stale2@1")
    assert lines[2].startswith("not judged  final reward async-groups@1")
    result = {"workload": "w", "quick": False, "steps_per_job": 1, "runs": [batch, stale],
              "machine": {"cpus": 2, "platform": "p"}}
    assert "Final reward" in markdown_report(result, {})
    assert (tmp_path / "learning.png") in write_plots(result, tmp_path)
