"""The benchmark's resource sampler on a real process tree (tests/unit/test_bench.py has its pure parts)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil

from marlaas.bench.runner import ResourceSampler


def test_a_vllm_engine_core_s_cpu_is_counted_apart_from_its_service():
    """A real process tree: a service whose child renames itself as vLLM's engine core does
    (``VLLM::EngineCore``), each burning a second of CPU; the child's go to ``"<service> engine"``."""
    burn = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end: pass\ntime.sleep(60)\n"
    child = "import ctypes\nctypes.CDLL(None).prctl(15, b'VLLM::EngineCore', 0, 0, 0)\n" + burn  # PR_SET_NAME
    service = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {child!r}])\n" + burn
    proc = subprocess.Popen([sys.executable, "-c", service], start_new_session=True)
    try:
        service_proc = psutil.Process(proc.pid)
        with ResourceSampler(SimpleNamespace(procs={"rollout": proc}), every_s=0.1) as sampler:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # until both have burnt their second
                tree = [service_proc, *service_proc.children()]
                if len(tree) == 2 and all(sum(p.cpu_times()[:2]) >= 1.0 for p in tree):
                    break
                time.sleep(0.1)
        used = sampler.cpu_s
        assert set(used) == {"rollout", "rollout engine"}
        # each counted from its first sample (a tenth of a second after its start at most)
        assert 0.7 <= used["rollout engine"] <= 1.3 and 0.7 <= used["rollout"] <= 1.3, used
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
