"""`marlaas bench` on the real stack: the sync barrier and the no-multi-LoRA ablation hold, and the
JSON, report and plots come out in the documented shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.own_stack("`marlaas bench` starts and stops a stack per mode itself")

WORKLOAD = """
description = "two addition jobs"
modes = ["sync", "async-single-lora"]
steps = 3
[[jobs]]
task = "addition"
count = 2
"""


def overlaps(a: list[dict], b: list[dict]) -> int:
    return sum(1 for x in a for y in b if x is not y and x["start"] < y["end"] and y["start"] < x["end"])


def marlaas(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "marlaas.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(600)
@pytest.mark.stack
def test_sync_rounds_and_single_lora_measured_side_by_side(tmp_path):
    workload = tmp_path / "two.toml"
    workload.write_text(WORKLOAD)
    out = tmp_path / "out"
    done = marlaas("bench", str(workload), "--out", str(out), "--json", timeout=560)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert [(r["mode"], r["jobs"], r["completed"]) for r in result["runs"]] == [
        ("sync", 2, 2), ("async-single-lora", 2, 2)]
    for run in result["runs"]:
        assert run["steps"] == 6 and run["steps_per_hour"] > 0
        for key in ("engine_busy", "trainer_busy", "idle"):
            assert 0.0 <= run[key] <= 1.0, (key, run[key])
        assert run["handoff_ms"]["n"] >= 4 and run["ready_to_train_ms"]["p50"] is not None
        assert {"rollout", "trainer", "manager", "env"} <= set(run["peak_rss_mib"])
    # sync trains while the engine idles: every core; async keeps one for the engine
    threads = {r["mode"]: r["train_threads"] for r in result["runs"]}
    cores = os.cpu_count()
    assert threads == {"sync": [cores], "async-single-lora": [max(1, cores - 1)]}
    assert {p.rsplit("/", 1)[-1] for p in result["plots"]} >= {"throughput.png", "timeline-sync.png"}
    assert "| sync | 2 |" in (out / "results.md").read_text()

    timelines = {r["mode"]: r["timeline"] for r in json.loads((out / "results.json").read_text())["runs"]}
    phases = {mode: {ph: [p for p in t if p["phase"] == ph] for ph in ("generate", "train")}
              for mode, t in timelines.items()}
    # sync: a global barrier between sampling and training, so no job trains while any samples
    assert overlaps(phases["sync"]["generate"], phases["sync"]["train"]) == 0
    # without multi-LoRA the engine holds one job's requests at a time: generations never overlap
    assert overlaps(phases["async-single-lora"]["generate"], phases["async-single-lora"]["generate"]) == 0
    # ... while async still overlaps one job's sampling with another's training
    assert overlaps(phases["async-single-lora"]["generate"], phases["async-single-lora"]["train"]) > 0


def test_bench_refuses_unknown_workloads_and_modes():
    done = marlaas("bench", "no-such-workload", "--json", timeout=60)
    assert done.returncode == 2 and "known:" in json.loads(done.stdout)["error"]
    done = marlaas("bench", "agentic-10", "--modes", "async,turbo", "--json", timeout=60)
    assert done.returncode == 2 and "turbo" in json.loads(done.stdout)["error"]
