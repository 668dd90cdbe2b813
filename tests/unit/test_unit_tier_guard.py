"""tests/unit/conftest.py's guard holds: in a unit test, starting a process in any of the usual ways
fails with the rule and where the test belongs, and so does reading a model's weights."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM  # loaded before the guard runs, as in any module that uses it

from marlaas.basemodel import builtin_model_dir


@pytest.mark.parametrize("start", [
    lambda: subprocess.run(["true"]),
    lambda: subprocess.Popen([sys.executable, "-c", "pass"]),
    lambda: os.fork(),
    lambda: os.posix_spawn("/bin/true", ["true"], {}),
    lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
    lambda: multiprocessing.get_context("fork").Process(target=print).start(),
    lambda: asyncio.run(asyncio.create_subprocess_exec("true")),
], ids=["run", "popen", "fork", "posix_spawn", "mp-spawn", "mp-fork", "asyncio"])
def test_starting_a_process_fails_naming_the_rule(start):
    with pytest.raises(AssertionError, match="starts a process: move it to tests/integration"):
        start()


def test_reading_a_models_weights_fails_naming_the_rule():
    with pytest.raises(AssertionError, match="loads a model: move it to tests/integration"):
        AutoModelForCausalLM.from_pretrained(builtin_model_dir())
