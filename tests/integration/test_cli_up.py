"""`marlaas up`: the embedded stack starts as processes, answers the CLI (through the gateway, as
the default tenant) even when a command comes the moment `up` starts, and Ctrl-C stops it all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from marlaas.stack.launcher import SERVICES

pytestmark = [pytest.mark.stack,  # starts a vLLM engine: not in `make test-fast`
              pytest.mark.own_stack("`marlaas up` itself, stopped with ctrl-c")]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().split()[2] != "Z"


def watch_on_a_terminal(env: dict[str, str], timeout_s: float = 90) -> str:
    """Run `marlaas status --watch` under a pseudo-terminal until its live table shows, then Ctrl-C."""
    import pty
    import select

    main, child = pty.openpty()
    watch = subprocess.Popen([sys.executable, "-m", "marlaas.cli", "status", "--watch"], env=env,
                             stdin=child, stdout=child, stderr=child, close_fds=True)
    os.close(child)
    out, deadline = b"", time.monotonic() + timeout_s
    try:
        while b"tpts_s" not in out:
            assert time.monotonic() < deadline, f"no live table within {timeout_s:.0f}s: {out[-500:]!r}"
            if select.select([main], [], [], 0.5)[0]:
                out += os.read(main, 65536)
        watch.send_signal(signal.SIGINT)
        assert watch.wait(timeout=30) == 0
    finally:
        if watch.poll() is None:
            watch.kill()
        os.close(main)
    return out.decode(errors="replace")


@pytest.mark.timeout(400)
def test_up_serves_the_cli_and_ctrl_c_stops_every_process(tmp_path):
    config = tmp_path / "marlaas.toml"
    config.write_text("[gateway]\nport = 0\n")  # any free port: never collides with another stack
    env = {**os.environ, "MARLAAS_NATS_URL": "", "MARLAAS_URL": "", "MARLAAS_TOKEN": "",
           "MARLAAS_HOME": str(tmp_path), "MARLAAS_CONFIG": str(config)}
    up = subprocess.Popen([sys.executable, "-m", "marlaas.cli", "up", "--json"], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        # a new user's first two commands, at once: the submission waits for the stack, not a 503
        submit = subprocess.run([sys.executable, "-m", "marlaas.cli", "submit", "--task", "addition", "--steps", "1",
                                 "--json"], env=env, capture_output=True, text=True, timeout=300)
        assert submit.returncode == 0, submit.stdout + submit.stderr
        job = json.loads(submit.stdout)["id"]
        info = json.loads(up.stdout.readline())  # printed once every service is ready
        assert info["nats_url"].startswith("nats://127.0.0.1:")
        assert info["gateway_url"] == (tmp_path / "run" / "gateway.url").read_text().strip()
        assert info["gateway_url"].startswith("http://127.0.0.1:")
        status = subprocess.run([sys.executable, "-m", "marlaas.cli", "status", "--json"], env=env,
                                capture_output=True, text=True, timeout=60)
        assert [view["id"] for view in json.loads(status.stdout)["jobs"]] == [job]
        out = watch_on_a_terminal(env)
        assert "tpts_s" in out  # the live table rendered on a terminal; Ctrl-C ended it with code 0
        children = [int(p.name.rsplit("-", 1)[1]) for p in (tmp_path / "run" / "ready").iterdir()]
        assert len(children) == len(SERVICES) and all(alive(pid) for pid in children)
        env_pid = next(int(p.name.rsplit("-", 1)[1]) for p in (tmp_path / "run" / "ready").glob("env-*"))
        os.kill(env_pid, signal.SIGKILL)  # a crashed service is restarted by `up`
        deadline = time.monotonic() + 60
        while len(list((tmp_path / "run" / "ready").glob("env-*"))) < 2:
            assert time.monotonic() < deadline, "env was not restarted"
            time.sleep(0.2)
        children = [int(p.name.rsplit("-", 1)[1]) for p in (tmp_path / "run" / "ready").iterdir()]
        children = [pid for pid in children if pid != env_pid]
    finally:
        up.send_signal(signal.SIGINT)
        try:
            code = up.wait(timeout=120)
        except subprocess.TimeoutExpired:
            up.kill()  # its children die with it (parent-death signal); the test still fails
            raise
    assert code == 0
    assert not any(alive(pid) for pid in children)
    assert not (tmp_path / "run" / "nats.url").exists() and not (tmp_path / "run" / "gateway.url").exists()
    logs = {name: (tmp_path / "logs" / f"{name}.log").read_text() for name in SERVICES}
    assert all("stopped" in text for text in logs.values()), "a service did not drain and stop cleanly"
