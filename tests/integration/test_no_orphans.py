"""No process left behind: `marlaas up` stopped by SIGTERM, a killed rollout's engine core, a
killed launcher's children."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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


def cli(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "marlaas.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.timeout(400)
@pytest.mark.stack
def test_up_detached_serves_at_once_and_down_stops_every_process(tmp_path):
    """`marlaas up -d` returns once the stack accepts jobs; `marlaas down` sends the launcher
    SIGTERM (what kill, systemd and docker stop send; handled like Ctrl-C) and returns once
    every process is gone."""
    (tmp_path / "config.toml").write_text("[gateway]\nport = 0\n")  # any free port
    env = {**os.environ, "MARLAAS_NATS_URL": "", "MARLAAS_URL": "", "MARLAAS_TOKEN": "",
           "MARLAAS_HOME": str(tmp_path), "MARLAAS_CONFIG": str(tmp_path / "config.toml")}
    up = cli(env, "up", "-d", "--json")
    assert up.returncode == 0, up.stdout + up.stderr
    info = json.loads(up.stdout)
    launcher = json.loads((tmp_path / "run" / "stack.json").read_text())["pid"]
    children = [c.pid for c in psutil.Process(launcher).children(recursive=True)]
    try:
        assert any("nats-server" in " ".join(psutil.Process(p).cmdline()) for p in children)
        submit = cli(env, "submit", "--task", "addition", "--steps", "1", "--json")  # at once
        assert submit.returncode == 0, submit.stdout + submit.stderr
        again = cli(env, "up", "-d")
        assert again.returncode == 2 and "already running" in again.stderr and "marlaas down" in again.stderr
        no_home = {k: v for k, v in env.items() if k != "MARLAAS_HOME"}
        where = json.loads(cli(no_home, "info", "--json", "--home", str(tmp_path)).stdout)  # options after too
        assert where["running"] and where["gateway_url"] == info["gateway_url"]
        assert (Path(where["base_model"]) / "config.json").is_file()
    finally:
        down = cli(env, "down", "--json", timeout=240)
    assert down.returncode == 0 and json.loads(down.stdout) == {"stopped": launcher}, down.stdout + down.stderr
    assert gone([launcher, *children], 30), "processes of the stack outlived `marlaas down`"
    assert not (tmp_path / "run" / "stack.json").exists()
    assert "no stack is running" in cli(env, "down").stdout  # nothing to stop is not an error


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
