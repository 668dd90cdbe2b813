"""What makes a unit test a unit test, enforced: it starts no process (no subprocess, fork,
multiprocessing child, vLLM engine core or stack) and loads no model's weights. A test that needs
one belongs in tests/integration; this guard fails it here with the reason, so the tier cannot
silently fill up with slow tests again (issue 47)."""

from __future__ import annotations

import _posixsubprocess
import multiprocessing.process
import os
import subprocess
import sys

import pytest


class NotAUnitTest(AssertionError):
    """Raised where a test under tests/unit starts a process or loads a model."""


def refuse(what: str):
    def refused(*args, **kwargs):
        raise NotAUnitTest(f"a test under tests/unit {what}: move it to tests/integration "
                           "(tests/unit starts no process and loads no model; docs/testing.md)")
    return refused


def model_loaders() -> list[tuple[object, str]]:
    """The class methods that read a model's weights from disk, where transformers is loaded (a
    test that never imports it pays nothing: its import alone takes seconds)."""
    if "transformers" not in sys.modules:
        return []
    from transformers.modeling_utils import PreTrainedModel
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    return [(PreTrainedModel, "from_pretrained"), (_BaseAutoModelClass, "from_pretrained")]


@pytest.fixture(autouse=True)
def starts_no_process_and_loads_no_model(monkeypatch):
    monkeypatch.setattr(_posixsubprocess, "fork_exec", refuse("starts a process"))  # multiprocessing's spawn
    monkeypatch.setattr(subprocess, "_fork_exec", refuse("starts a process"))  # subprocess's own name for it
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse("starts a process"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse("starts a process"))
    for owner, name in model_loaders():
        monkeypatch.setattr(owner, name, classmethod(refuse("loads a model")))
    yield
