"""`marlaas bench fairness --quick` end to end on the real stack: two tenants through the gateway, the
victim's Tinker client sampling, three runs (alone, fair share, FIFO). The JSON carries every figure,
finite and positive, computed from what happened; no timing target is asserted (the machine is noisy)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.stack,
              pytest.mark.own_stack("`marlaas bench fairness` starts and stops its own stacks (alone, fair, FIFO)")]
FIGURES = ("engine_share_vs_weight", "trainer_share_vs_weight")


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_quick_fairness_bench_reports_shares_from_what_happened(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "marlaas.cli", "bench", "fairness", "--quick", "--json",
                           "--out", str(out)], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["weights"] == {"a": 1.0, "b": 1.0} and result["victim"] == "b"

    alone, fair, fifo = result["runs"]
    assert [r["run"] for r in result["runs"]] == ["alone", "fair", "fifo"]
    assert alone["jobs"] == {"b": 1} and alone["tinker_samples"] > 0  # tenant b alone: its job and its client
    assert positive(alone["engine_rate"]) and positive(alone["trainer_rate"])  # b's demand, busy alone
    for run in (fair, fifo):
        assert run["jobs"] == {"a": 8, "b": 1} and run["completed"] == 9
        assert run["steps"] == 9 * result["steps_per_job"]
        assert run["tinker_samples"] > 0  # b's client sampled while its job ran
        assert positive(run["engine_window_s"]) and positive(run["trainer_window_s"])
        assert run["engine_window_s"] <= run["wall_s"] and run["trainer_window_s"] <= run["wall_s"]
        for key in FIGURES:  # equal weights: the two shares over weight sum to the two tenants
            assert all(positive(v) for v in run[key].values()), (key, run[key])
            assert sum(run[key].values()) == pytest.approx(2.0), (key, run[key])

    fairness = result["fairness"]
    for key in FIGURES:
        assert fairness[key] == fair[key] and fairness["fifo"][key] == fifo[key]
    for key in ("engine_share_vs_fair", "trainer_share_vs_fair"):  # over the max-min fair shares
        for figures in (fairness[key], fairness["fifo"][key]):
            assert set(figures) == {"a", "b"} and all(positive(v) for v in figures.values()), (key, figures)
    assert fairness["victim_tpts_vs_alone"] == pytest.approx(fair["victim_tpts_s"] / alone["victim_tpts_s"])
    assert fairness["fifo"]["victim_tpts_vs_alone"] == pytest.approx(fifo["victim_tpts_s"] / alone["victim_tpts_s"])
    assert fairness["throughput_vs_fifo"] == pytest.approx(fair["steps_per_hour"] / fifo["steps_per_hour"])
    assert all(positive(v) for v in (fairness["victim_tpts_vs_alone"], fairness["throughput_vs_fifo"],
                                     fairness["fifo"]["victim_tpts_vs_alone"]))

    assert {t["target"].split()[0] for t in result["targets"]} == {
        "engine_share_vs_weight", "trainer_share_vs_weight", "engine_share_vs_fair", "trainer_share_vs_fair",
        "victim_tpts_vs_alone", "throughput_vs_fifo"}
    assert all(isinstance(t["met"], bool) for t in result["targets"])
    assert json.loads((out / "results.json").read_text())["fairness"] == fairness
    assert "| fair | a 8, b 1 |" in (out / "results.md").read_text()


def test_fairness_runs_its_own_runs_and_refuses_modes():
    done = subprocess.run([sys.executable, "-m", "marlaas.cli", "bench", "fairness", "--modes", "async", "--json"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--modes" in json.loads(done.stdout)["error"]
