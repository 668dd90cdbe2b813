"""The fairness benchmark's figures (``marlaas.bench.fairness``) on hand-made spans and metering
events: the windows where every tenant was busy, the amounts inside them, the shares over weight,
the ratios between runs and the targets."""

from __future__ import annotations

import pytest

from marlaas.bench.fairness import (
    FairnessWorkload,
    Metered,
    Work,
    all_busy,
    amounts_in,
    check_fairness_targets,
    engine_demand,
    engine_work,
    fairness_figures,
    intersect,
    load_fairness_workload,
    share_vs_weight,
    shares,
    trainer_demand,
    trainer_work,
    union,
)
from marlaas.bench.workload import WorkloadError
from marlaas.platform.events import Span


def span(job: str, phase: str, start: float, end: float, version: int = 0, service: str = "rollout") -> Span:
    return Span(job=job, service=service, phase=phase, version=version, start=start, end=end)


def test_union_and_intersection_of_intervals():
    assert union([(3, 5), (0, 1), (4, 6), (1, 2), (7, 7)]) == [(0, 2), (3, 6)]
    assert intersect([(0, 2), (3, 6)], [(1, 4), (5, 10)]) == [(1, 2), (3, 4), (5, 6)]
    assert all_busy({"a": [(0, 10)], "b": [(2, 4), (6, 8)], "c": [(3, 7)]}) == [(3, 4), (6, 7)]
    assert all_busy({"a": [(0, 1)], "b": [(2, 3)]}) == []
    assert all_busy({"a": [(0, 1)], "b": []}) == []


def test_amounts_count_the_part_of_each_interval_inside_the_windows():
    work = [Work("a", 0, 10, 100.0), Work("b", 4, 6, 10.0), Work("b", 5, 5, 3.0), Work("b", 20, 20, 7.0)]
    # a: 2 of 10 s inside -> 20; b: its whole 2 s -> 10, the instant at 5 -> 3, the one at 20 outside
    assert amounts_in(work, [(4, 6)]) == pytest.approx({"a": 20.0, "b": 13.0})
    assert amounts_in(work, [(0, 1), (9, 10)]) == pytest.approx({"a": 20.0, "b": 0.0})


def test_shares_over_weight_are_one_at_the_weights_and_sum_to_the_tenants_at_equal_weights():
    assert share_vs_weight({"a": 75.0, "b": 25.0}, {"a": 3.0, "b": 1.0}) == pytest.approx({"a": 1.0, "b": 1.0})
    even = share_vs_weight({"a": 80.0, "b": 20.0}, {"a": 1.0, "b": 1.0})
    assert even == pytest.approx({"a": 1.6, "b": 0.4}) and sum(even.values()) == pytest.approx(2.0)
    assert share_vs_weight({"a": 10.0}, {"a": 1.0, "b": 1.0}) == pytest.approx({"a": 2.0, "b": 0.0})
    assert share_vs_weight({}, {"a": 1.0, "b": 1.0}) is None


def test_demand_is_the_engine_spans_and_a_batch_from_ready_to_trained():
    spans = [span("a.j1", "generate", 0, 4), span("b.tinker", "tinker_sample", 1, 2), span("a.j1", "reward", 4, 5),
             span("a.j1", "train", 7, 9, service="trainer"), span("b.j2", "accumulate", 3, 4, service="trainer"),
             span("b.j2", "reward", 3, 6), span("b.j2", "train", 6, 8, service="trainer"),
             span("b.tinker", "tinker_forward_backward", 10, 11, service="trainer"), span("a.j1", "commit", 9, 10)]
    assert engine_demand(spans) == {"a": [(0, 4)], "b": [(1, 2)]}
    # a's batch waited from its rewards (5) to its step's end; b's from its first group's gradients (3)
    assert trainer_demand(spans) == {"a": [(5, 9)], "b": [(3, 8), (10, 11)]}


def test_engine_tokens_are_spread_over_the_span_of_their_event_and_trainer_seconds_before_theirs():
    spans = [span("a.j1", "generate", 0, 4), span("a.j1", "generate", 6, 8), span("b.tinker", "tinker_sample", 1, 3)]
    metered = [Metered("a", "a.j1", "rollout", 4.01, 40, 0.0),  # just after its batch's generate
               Metered("a", "a.j1", "rollout", 8.02, 20, 0.0),
               Metered("b", "b.tinker", "rollout", 2.9, 30, 0.0),  # within its sample
               Metered("b", "b.other", "rollout", 5.0, 9, 0.0),  # no span: at its instant
               Metered("a", "a.j1", "trainer", 12.0, 0, 2.5),
               Metered("a", "a.j1", "rollout", 9.0, 0, 0.0)]  # no engine tokens: no work
    assert engine_work(metered, spans) == [Work("a", 0, 4, 40.0), Work("a", 6, 8, 20.0), Work("b", 1, 3, 30.0),
                                           Work("b", 5.0, 5.0, 9.0)]
    assert trainer_work(metered) == [Work("a", 9.5, 12.0, 2.5)]


def test_shares_while_both_busy_leave_out_what_one_tenant_did_alone():
    """a generates for 10 s, b samples from 4 to 8 s; in that window a made 40 tokens (of its 100)
    and b 40: equal shares. Likewise one trainer second each while both had a batch waiting."""
    spans = [span("a.j1", "generate", 0, 10), span("b.tinker", "tinker_sample", 4, 8),
             span("a.j1", "reward", 10, 10.5), span("a.j1", "train", 11, 12, service="trainer"),
             span("b.j2", "reward", 10, 11), span("b.j2", "train", 12, 13, service="trainer"),
             span("a.j1", "reward", 11.5, 12, version=1), span("a.j1", "train", 13, 14, version=1, service="trainer")]
    metered = [Metered("a", "a.j1", "rollout", 10.0, 100, 0.0), Metered("b", "b.tinker", "rollout", 8.0, 40, 0.0),
               Metered("a", "a.j1", "trainer", 12.0, 0, 1.0), Metered("b", "b.j2", "trainer", 13.0, 0, 1.0),
               Metered("a", "a.j1", "trainer", 14.0, 0, 1.0)]
    found = shares(spans, metered, {"a": 1.0, "b": 1.0})
    assert found["engine_share_vs_weight"] == pytest.approx({"a": 1.0, "b": 1.0})
    assert found["engine_window_s"] == pytest.approx(4.0)
    # trainer: a has a batch waiting or in training 10.5-14, b 11-13: a's second step (13-14) is a's alone
    assert found["trainer_window_s"] == pytest.approx(2.0)
    assert found["trainer_share_vs_weight"] == pytest.approx({"a": 1.0, "b": 1.0})
    assert shares(spans, metered, {"a": 1.0, "b": 1.0, "c": 1.0})["engine_share_vs_weight"] is None


def test_the_runs_ratios_and_the_targets():
    alone = {"victim_tpts_s": 2.0, "steps_per_hour": 100.0}
    fair = {"victim_tpts_s": 3.0, "steps_per_hour": 950.0, "engine_share_vs_weight": {"a": 1.1, "b": 0.9},
            "trainer_share_vs_weight": {"a": 1.3, "b": 0.7}}
    fifo = {"victim_tpts_s": 8.0, "steps_per_hour": 1000.0, "engine_share_vs_weight": {"a": 1.8, "b": 0.2},
            "trainer_share_vs_weight": None}
    figures = fairness_figures(alone, fair, fifo)
    assert figures["victim_tpts_vs_alone"] == pytest.approx(1.5)
    assert figures["throughput_vs_fifo"] == pytest.approx(0.95)
    assert figures["fifo"]["victim_tpts_vs_alone"] == pytest.approx(4.0)
    checks = check_fairness_targets(figures, {"engine_share_vs_weight": 0.15, "trainer_share_vs_weight": 0.15,
                                              "victim_tpts_vs_alone": 1.4, "throughput_vs_fifo": 0.95})
    assert [(c.measured, c.met) for c in checks] == [(pytest.approx(0.1), True), (pytest.approx(0.3), False),
                                                     (pytest.approx(1.5), False), (pytest.approx(0.95), True)]
    assert check_fairness_targets(fairness_figures(alone, fifo, fifo), {"trainer_share_vs_weight": 0.15})[0].line() \
        .startswith("MISSED")


def test_the_workload_file_is_checked_where_it_is_read(tmp_path):
    shipped = load_fairness_workload("fairness")
    assert shipped.victim in shipped.tenants and shipped.versions(True) < shipped.versions(False)
    assert set(shipped.targets) == {"engine_share_vs_weight", "trainer_share_vs_weight", "engine_share_vs_fair",
                                    "trainer_share_vs_fair", "victim_tpts_vs_alone", "throughput_vs_fifo"}
    bad = tmp_path / "bad.toml"
    bad.write_text('kind = "fairness"\nvictim = "c"\n[tenants.a]\n[tenants.b]\n[job]\ntask = "addition"\n')
    with pytest.raises(WorkloadError, match="victim"):
        load_fairness_workload(str(bad))
    bad.write_text('kind = "fairness"\nvictim = "b"\n[tenants.a]\n[tenants.b]\n[job]\ntask = "addition"\n'
                   '[targets]\nfairness = 1.0\n')
    with pytest.raises(WorkloadError, match="unknown targets"):
        load_fairness_workload(str(bad))
    assert isinstance(shipped, FairnessWorkload)


def test_max_min_fair_shares_owe_a_tenant_no_more_than_it_asks_for():
    from marlaas.bench.fairness import max_min_shares, share_vs_fair, vs_fair

    assert max_min_shares({"a": 1, "b": 1}, {"a": None, "b": None}) == {"a": 0.5, "b": 0.5}
    assert max_min_shares({"a": 1, "b": 1}, {"a": None, "b": 0.2}) == pytest.approx({"a": 0.8, "b": 0.2})
    assert max_min_shares({"a": 1, "b": 1}, {"a": None, "b": 0.7}) == {"a": 0.5, "b": 0.5}  # asks more: its half
    assert max_min_shares({"a": 3, "b": 1, "c": 1}, {"a": None, "b": 0.1, "c": None}) == \
        pytest.approx({"a": 0.9 * 3 / 4, "b": 0.1, "c": 0.9 / 4})
    assert share_vs_fair({"a": 80, "b": 20}, {"a": 0.8, "b": 0.2}) == pytest.approx({"a": 1.0, "b": 1.0})
    # b used 30 tokens/s busy alone; in the run 100 tokens/s went while both were busy: b is owed 30 %
    run = {"engine_amounts": {"a": 700.0, "b": 300.0}, "engine_window_s": 10.0}
    assert vs_fair(run, {"engine_rate": 30.0}, "engine", {"a": 1, "b": 1}, "b") == pytest.approx({"a": 1.0, "b": 1.0})
    # owed its half (it asked for more), it got 30 %: 0.6 of its fair share
    assert vs_fair(run, {"engine_rate": 90.0}, "engine", {"a": 1, "b": 1}, "b") == pytest.approx({"a": 1.4, "b": 0.6})
    assert vs_fair({}, {"engine_rate": 90.0}, "engine", {"a": 1, "b": 1}, "b") is None


def test_the_hostile_volume_workload_gives_mallory_her_own_jobs_and_runs_alone_then_fair():
    """H5's workload: mallory's eight jobs of 256 samples x 128 tokens (ignore_eos) over the shared
    [job], alice's one small job submitted after mallory's fill the engine; no FIFO run, so its
    figures are None and the report says so."""
    hostile = load_fairness_workload("fairness-hostile")
    mallory, alice = hostile.job_of("mallory"), hostile.job_of("alice")
    assert mallory["grpo"] == {"prompts_per_step": 32, "group_size": 8, "max_new_tokens": 128, "ignore_eos": True}
    assert alice == {"task": "addition"} and hostile.tenants["mallory"].jobs == 8
    samples = mallory["grpo"]["prompts_per_step"] * mallory["grpo"]["group_size"]
    assert samples * 128 >= 30 * 64 * 4  # at least 30x the victim's tokens a version, per job
    assert hostile.runs == ("alone", "fair") and hostile.victim_after_s > 0 and hostile.stop_with_victim
    assert hostile.sampler.in_flight == 0 and hostile.targets == {"victim_tpts_vs_alone": 2.5}

    figures = fairness_figures({"victim_tpts_s": 0.5}, {"victim_tpts_s": 1.0, "steps_per_hour": 9.0,
                                                         "engine_share_vs_weight": None,
                                                         "trainer_share_vs_weight": None}, None)
    assert figures["victim_tpts_vs_alone"] == pytest.approx(2.0)
    assert figures["throughput_vs_fifo"] is None and figures["fifo"]["victim_tpts_vs_alone"] is None


def test_a_workload_names_the_runs_it_can_run(tmp_path):
    bad = tmp_path / "bad.toml"
    for runs in ('["fair"]', '["alone"]', '["alone", "fast"]'):
        bad.write_text(f'kind = "fairness"\nvictim = "b"\nruns = {runs}\n[tenants.a]\n[tenants.b]\n[job]\n'
                       'task = "addition"\n')
        with pytest.raises(WorkloadError, match="runs"):
            load_fairness_workload(str(bad))


def test_where_the_victims_versions_went_shows_the_wait_for_the_trainer():
    """Two versions of b's: generated 0.2 s, rewarded, then waited 1 s and 3 s for a trainer busy
    with another tenant's step; a's spans are left out."""
    from marlaas.bench.fairness import version_phases_ms

    spans = [span("b.j", "commit", 0.0, 0.1, version=0)]
    for v, start, wait in ((0, 0.2, 1.0), (1, 2.0, 3.0)):
        spans += [span("b.j", "generate", start, start + 0.2, version=v),
                  span("b.j", "reward", start + 0.2, start + 0.3, version=v),
                  span("b.j", "train", start + 0.3 + wait, start + 0.4 + wait, version=v, service="trainer"),
                  span("b.j", "commit", start + 0.4 + wait, start + 0.5 + wait, version=v + 1, service="trainer")]
    spans.append(span("a.j", "train", 0.5, 4.0, service="trainer"))
    phases = version_phases_ms(spans, "b.j")
    assert phases["ready_to_train"] == pytest.approx(2000.0) and phases["generate"] == pytest.approx(200.0)
    assert phases["train"] == pytest.approx(100.0) and phases["handoff"] == pytest.approx(200.0)  # 0.1 s, 0.3 s
    assert version_phases_ms(spans, "c.j")["generate"] is None
