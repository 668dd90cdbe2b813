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

pytestmark = pytest.mark.own_stack("kills launchers and services to find orphaned processes")


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
                          text=True, timeout=timeout, cwd=Path(__file__).resolve().parents[2])  # the README's cwd


def readme_tour() -> list[list[str]]:
    """The README's five-minute tour, one command per line (comments dropped)."""
    import shlex

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = text[text.index("## A five-minute tour"):].split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line.split("#", 1)[0]) for line in block.splitlines() if line.strip()]


@pytest.mark.timeout(400)
@pytest.mark.stack
def test_the_readme_tour_runs_as_typed_and_down_leaves_no_process(tmp_path):
    """The README's tour, command by command (JOB: the first job it submits): `up -d` returns
    once the stack accepts jobs, a submit right after it works, and `down` sends the launcher
    SIGTERM (as kill, systemd and docker stop do; handled like Ctrl-C) and returns once every
    process is gone."""
    (tmp_path / "config.toml").write_text("[gateway]\nport = 0\n")  # any free port
    env = {**os.environ, "MARLAAS_NATS_URL": "", "MARLAAS_URL": "", "MARLAAS_TOKEN": "",
           "MARLAAS_HOME": str(tmp_path), "MARLAAS_CONFIG": str(tmp_path / "config.toml")}
    tour = readme_tour()
    assert [words[:2] for words in tour][0] == [".venv/bin/marlaas", "up"] and tour[-1][1:] == ["down"]
    job, launcher, children, outputs = None, None, [], {}
    try:
        for words in tour:
            assert words[0] == ".venv/bin/marlaas", words
            args = [job if word == "JOB" else word for word in words[1:]]
            args = [str(tmp_path / arg) if arg.endswith("/") else arg for arg in args]  # adapter/ under tmp
            done = cli(env, *args, timeout=300)
            assert done.returncode == 0, (words, done.stdout + done.stderr)
            outputs[args[0]] = done.stdout
            if args[0] == "up":
                launcher = json.loads((tmp_path / "run" / "stack.json").read_text())["pid"]
                children = [c.pid for c in psutil.Process(launcher).children(recursive=True)]
                assert any("nats-server" in " ".join(psutil.Process(p).cmdline()) for p in children)
                again = cli(env, "up", "-d")
                assert again.returncode == 2 and "already running" in again.stderr
            if args[0] == "submit" and job is None:
                job = done.stdout.strip().split()[-1]  # the id it prints
            if args[0] == "info":  # options after the command too
                no_home = {k: v for k, v in env.items() if k != "MARLAAS_HOME"}
                where = json.loads(cli(no_home, "info", "--json", "--home", str(tmp_path)).stdout)
                assert where["running"] and where["dashboard"].endswith("/ui/")
                assert where["tinker_base_url"] == f"{where['gateway_url']}/tinker"  # docs/tinker.md
                assert (Path(where["base_model"]) / "config.json").is_file()
    finally:
        if launcher is not None and psutil.pid_exists(launcher):  # the tour failed before its `down`
            cli(env, "down", timeout=240)
    assert "completed at version 10/10" in outputs["watch"]
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
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
