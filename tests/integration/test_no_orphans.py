"""No process left behind: `marlaas up` stopped by SIGTERM, a killed rollout's engine core, a
killed launcher's children."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from marlaas.platform.config import load_config
from marlaas.stack.launcher import Stack


def engine_cores(parent_pgid: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            if "EngineCore" in (proc.info["name"] or "") + " ".join(proc.info["cmdline"] or []) \
                    and os.getpgid(proc.pid) == parent_pgid:
                found.append(proc)
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    return found


def gone(pids: list[int], timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.3)
    return False


@pytest.mark.timeout(400)
@pytest.mark.stack
def test_a_killed_rollout_takes_its_engine_core_with_it(tmp_path):
    config = load_config(overrides={"home": str(tmp_path), "gateway.port": 0}, env={})
    with Stack(config, services=("manager", "env", "trainer", "rollout")) as stack:
        rollout = stack.procs["rollout"].pid
        cores = engine_cores(rollout)
        assert cores, "the rollout's vLLM engine core was not found in its process group"
        stack.kill("rollout")
        assert gone([c.pid for c in cores], 30), "the engine core outlived its killed rollout"
        stack.restart("rollout")
        assert len(engine_cores(stack.procs["rollout"].pid)) == len(cores)  # one new, no extra


def up(tmp_path) -> tuple[subprocess.Popen, list[int]]:
    (tmp_path / "config.toml").write_text("[gateway]\nport = 0\n")  # any free port
    env = {**os.environ, "MARLAAS_NATS_URL": "", "MARLAAS_HOME": str(tmp_path),
           "MARLAAS_CONFIG": str(tmp_path / "config.toml")}
    proc = subprocess.Popen([sys.executable, "-m", "marlaas.cli", "up", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    json.loads(proc.stdout.readline())  # printed once every service is ready
    children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    assert any("nats-server" in " ".join(psutil.Process(p).cmdline()) for p in children)
    return proc, children


@pytest.mark.timeout(400)
@pytest.mark.stack
def test_sigterm_stops_the_whole_stack_like_ctrl_c(tmp_path):
    proc, children = up(tmp_path)
    proc.send_signal(signal.SIGTERM)  # what kill, systemd and docker stop send
    assert proc.wait(timeout=120) == 0
    assert gone(children, 30), "processes of the stack outlived `marlaas up`"


@pytest.mark.timeout(400)
@pytest.mark.stack
def test_a_killed_launcher_takes_its_children_with_it(tmp_path):
    proc, children = up(tmp_path)
    proc.kill()  # no chance to clean up: the children must notice on their own
    proc.wait()
    assert gone(children, 90), "processes of the stack outlived a killed `marlaas up`"


HANGING_SERVICE = """
import subprocess, threading
from marlaas.platform.processes import exit_if_still_running_after
child = subprocess.Popen(["sleep", "300"])  # in this process's group, like a vLLM engine core
print(child.pid, flush=True)
exit_if_still_running_after(1.0)  # what a service arms when told to stop
threading.Event().wait()  # a drain that never ends
"""


@pytest.mark.timeout(60)
def test_a_service_whose_drain_hangs_exits_after_its_grace_period_with_its_group():
    proc = subprocess.Popen([sys.executable, "-c", HANGING_SERVICE], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    child = int(proc.stdout.readline())
    assert proc.wait(timeout=30) == -signal.SIGKILL  # it leads its group: the group went, itself too
    assert "still stopping after 1 s; exiting anyway" in (stderr := proc.stderr.read())
    assert "threading.py" in stderr and "in wait" in stderr  # the stack of the hung thread, to see why
    assert gone([child], 10), "the hung service's child outlived it"
