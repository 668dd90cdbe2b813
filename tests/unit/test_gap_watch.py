"""The trainer's decisions on an engine-vs-trainer logprob gap (services/trainer/gap_watch.py):
one job past the bound fails alone; several tenants at once, or a changed base, is a platform
fault (the base reloaded, once a window); the bound follows the engine's dtype unless set."""

from __future__ import annotations

import math

import pytest

from services.trainer.gap_watch import FP32_GAP, HALF_PRECISION_GAP, GapWatch, Verdict, gap_bound


def test_the_bound_follows_the_engine_dtype_unless_configured():
    assert gap_bound(0.0, "float32") == FP32_GAP
    assert gap_bound(0.0, "bfloat16") == gap_bound(0.0, "float16") == HALF_PRECISION_GAP
    assert gap_bound(0.05, "float32") == 0.05
    assert gap_bound(math.inf, "float32") == math.inf
    assert gap_bound(0.0, "float32", "cuda") == gap_bound(0.0, "float32", "npu") == HALF_PRECISION_GAP


@pytest.mark.parametrize("gap", [None, 0.0, 1e-6, FP32_GAP])
def test_within_the_bound_or_nothing_to_compare_trains(gap):
    watch = GapWatch(FP32_GAP)
    assert watch.judge(gap, "alice", now=0.0, base_changed=False) is Verdict.TRAIN
    assert not watch.seen


@pytest.mark.parametrize("gap", [2e-3, 8.0, math.nan, math.inf])
def test_one_tenant_past_the_bound_fails_its_job_each_time(gap):
    watch = GapWatch(FP32_GAP)
    assert [watch.judge(gap, "mallory", now=t, base_changed=False) for t in (0.0, 1.0, 2.0)] == [Verdict.FAIL_JOB] * 3


def test_a_changed_base_is_reloaded_whoever_found_it():
    watch = GapWatch(FP32_GAP)
    assert watch.judge(9.0, "alice", now=0.0, base_changed=True) is Verdict.RELOAD_BASE
    assert watch.judge(9.0, "alice", now=1.0, base_changed=True) is Verdict.RELOAD_BASE  # it changed again: again


def test_two_tenants_past_the_bound_in_a_window_reload_the_base_once_a_window():
    watch = GapWatch(FP32_GAP, window_s=120.0, platform_tenants=2)
    assert watch.judge(9.0, "alice", now=0.0, base_changed=False) is Verdict.FAIL_JOB
    assert watch.judge(9.0, "bob", now=10.0, base_changed=False) is Verdict.RELOAD_BASE
    # within the same window, the reload did not help: each job fails on its own
    assert watch.judge(9.0, "carol", now=20.0, base_changed=False) is Verdict.FAIL_JOB
    assert watch.judge(9.0, "alice", now=200.0, base_changed=False) is Verdict.FAIL_JOB  # alone in its window
    assert watch.judge(9.0, "bob", now=210.0, base_changed=False) is Verdict.RELOAD_BASE  # a new window


def test_one_tenants_many_jobs_are_not_a_platform_fault():
    """A hostile tenant with many bad jobs cannot make the trainer reload the shared base."""
    watch = GapWatch(FP32_GAP)
    assert {watch.judge(9.0, "mallory", now=float(t), base_changed=False) for t in range(20)} == {Verdict.FAIL_JOB}


def test_gaps_older_than_the_window_are_forgotten():
    watch = GapWatch(FP32_GAP, window_s=60.0)
    watch.judge(9.0, "alice", now=0.0, base_changed=False)
    assert watch.judge(9.0, "bob", now=61.0, base_changed=False) is Verdict.FAIL_JOB
    assert [tenant for _, tenant in watch.seen] == ["bob"]


def test_alerts_are_counted_on_metrics_by_alert_and_unknown_names_are_not_labels():
    """The gateway's ``marlaas_alerts_total``: each alert span counted under its name; a name no
    service raises is counted as ``other`` (a label's values stay bounded)."""
    from marlaas.platform.events import Span
    from services.gateway.metrics import StackMetrics

    metrics = StackMetrics()
    for alert in ("logprob_gap", "logprob_gap", "base_changed", "x" * 500):
        metrics.observe(Span(job="acme.j", service="trainer", phase="alert", version=0, start=1.0, end=1.0,
                             attrs={"alert": alert}))
    text = metrics.render([]).decode()
    assert 'marlaas_alerts_total{alert="logprob_gap"} 2.0' in text
    assert 'marlaas_alerts_total{alert="base_changed"} 1.0' in text
    assert 'marlaas_alerts_total{alert="other"} 1.0' in text
    assert 'phase="alert"' not in text  # an alert is no phase of work
