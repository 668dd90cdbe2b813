"""`make deploy-test`: the project's docker-compose.yml, run for real with podman, then torn down.

The images are built first (deploy/local/build-images.sh); this drives the deployment with
podman-compose and the project's own ``docker-compose.yml`` plus ``deploy/local/compose.local.yml``
(local images only) under the project name ``marlaas-deploy-test``:

1. ``up -d``, wait until the gateway's ``/readyz`` answers;
2. ``admin tenant add`` + two broker reloads, a single-turn and an agentic job submitted over the
   published HTTP port with the tenant's token, one of the agentic job's tools served from a
   process on this host through the published NATS port; the python tool is called in the
   ``sandbox`` container, whose environment must hold no platform secret;
3. ``--scale trainer=2 --scale rollout=2 --scale env=2`` while the jobs run; both trainers train;
4. a trainer and a rollout container killed mid-job: every job completes, versions exactly 0..N;
5. the ``ha`` profile: three NATS nodes, one killed mid-job, the job completes;
6. ``down -v``: no container, pod, volume or network of the project remains.

It prints one summary line. Whatever happens, the deployment is taken down (SIGINT and SIGTERM
included). Needs root, podman and podman-compose (``make deploy-test`` installs them).
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import nats

from marlaas.platform import nats_access
from marlaas.platform.events import ToolCall, encode
from marlaas.sdk.http import Client, MarlaasError

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "marlaas-deploy-test"
COMPOSE = [str(Path(sys.executable).parent / "podman-compose"), "-p", PROJECT,
           "-f", str(ROOT / "docker-compose.yml"), "-f", str(ROOT / "deploy/local/compose.local.yml")]
GATEWAY = "http://127.0.0.1:8470"
TOOL_LOG = "/tmp/marlaas-deploy-test-tool.log"
NATS_URL = "nats://127.0.0.1:4222"
STEPS = int(os.environ.get("DEPLOY_TEST_STEPS", "60"))  # versions 0..STEPS per job
SINGLE = {"task": "addition", "steps": STEPS}
AGENTIC = {"task": "multiply", "steps": STEPS, "tools": ["calculator", "python", "acme.weather"],
           "grpo": {"prompts_per_step": 2, "group_size": 4}}
T0 = time.monotonic()


class Failed(RuntimeError):
    """A check of the deployment failed; the message says which."""


def say(message: str) -> None:
    print(f"[deploy-test {time.monotonic() - T0:6.0f}s] {message}", flush=True)


def compose(*args: str, check: bool = True, timeout: float = 600, profiles: tuple[str, ...] = ()) -> str:
    cmd = COMPOSE + [a for p in profiles for a in ("--profile", p)] + list(args)
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise Failed(f"`podman-compose {' '.join(args)}` failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def podman(*args: str, check: bool = True) -> str:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=120)
    if check and done.returncode != 0:
        raise Failed(f"`podman {' '.join(args)}` failed: {done.stderr[-2000:]}")
    return done.stdout


def containers(service: str | None = None, running: bool = True) -> list[str]:
    """Names of the project's containers (of one service), oldest first."""
    filters = ["--filter", f"label=io.podman.compose.project={PROJECT}"]
    if service:
        filters += ["--filter", f"label=com.docker.compose.service={service}"]
    out = podman("ps", *([] if running else ["-a"]), *filters, "--format", "{{.Names}}")
    return sorted(out.split(), key=lambda name: (len(name), name))


def logs(name: str) -> str:
    done = subprocess.run(["podman", "logs", name], capture_output=True, text=True, timeout=60)
    return done.stdout + done.stderr


def wait_for(what: str, check, timeout_s: float, every_s: float = 2.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = check()
        except (httpx.HTTPError, MarlaasError, OSError) as exc:
            result, last = None, exc
        else:
            last = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise Failed(f"{what}: not within {timeout_s:.0f} s" + (f" (last error: {last})" if last else ""))
        time.sleep(every_s)


def ready() -> bool:
    return httpx.get(f"{GATEWAY}/readyz", timeout=5).status_code == 200


def add_tenant(name: str, admin: str, nodes: list[str], profiles: tuple[str, ...]) -> str:
    """The documented way: ``run --rm admin tenant add``, then HUP every node twice."""
    out = compose("run", "--rm", admin, "tenant", "add", name, "--json", profiles=profiles, timeout=180)
    token = json.loads(out.strip().splitlines()[-1])["token"]
    for _ in range(2):
        compose("kill", "-s", "HUP", *nodes, profiles=profiles)
        time.sleep(1)
    return token


def serve_tool(token: str) -> subprocess.Popen:
    """examples/weather_tool.py on this host, as tenant acme, through the published NATS port."""
    env = {**os.environ, "MARLAAS_NATS_URL": NATS_URL, "MARLAAS_TOKEN": token}
    log = open(TOOL_LOG, "w")  # noqa: SIM115 -- the tool's stdout: a file, not a pipe (a full pipe would stall it)
    return subprocess.Popen([sys.executable, str(ROOT / "examples/weather_tool.py")], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def submit(client: Client, job: dict, timeout_s: float = 120) -> str:
    """Submit; a tool announced a moment ago may not be listed yet (refused until it is)."""
    return wait_for(f"submit {job['task']}", lambda: client.submit(job), timeout_s)


async def call_python(nats_password: str, code: str) -> dict:
    """Call the built-in python tool as the services do (their NATS user, the published port)."""
    user, host = nats_access.SERVICES_USER, NATS_URL.removeprefix("nats://")
    conn = await nats.connect(f"nats://{user}:{nats_password}@{host}", connect_timeout=10)
    try:
        call = ToolCall(call_id="deploy-test", tool="builtin.python", job="acme.deploy-test",
                        arguments=json.dumps({"code": code}))
        reply = await conn.request("marlaas.tool.builtin.python", encode(call), timeout=60)
        return json.loads(reply.data)
    finally:
        await conn.close()


def check_sandbox(env: dict[str, str]) -> None:
    """The python tool runs in `sandbox`, as a uid of its own, and sees no platform secret."""
    import asyncio

    code = ("import os; print(os.getuid()); print(sorted(os.environ));"
            "print(open('/proc/1/cmdline','rb').read().replace(b'\\0',b' ').decode())")
    reply = asyncio.run(call_python(env["MARLAAS_NATS_PASSWORD"], code))
    out = reply.get("output", "")
    if reply.get("error") or "[exit code 0]" not in out:
        raise Failed(f"the python tool did not run: {reply}")
    uid = int(out.split()[0])
    if uid == 0:
        raise Failed(f"a python run had uid 0 in the sandbox container: {out}")
    secret_values = [env["MARLAAS_NATS_PASSWORD"], env["MARLAAS_OPERATOR_TOKEN"], env["MARLAAS_S3_SECRET_KEY"]]
    sandbox = containers("sandbox")[0]
    environ = podman("exec", sandbox, "sh", "-c", "cat /proc/1/environ | tr '\\0' '\\n'")
    leaked = [v for v in secret_values if v in out or v in environ]
    if leaked or "S3" in environ or "MARLAAS_OPERATOR" in environ:
        raise Failed("the sandbox container holds a platform secret in its environment")
    # env's container runs as the image's user (uid 1000) with the engine's default grants: there
    # bubblewrap cannot isolate a run, so env would refuse to serve python, never run it bare
    env_box = containers("env")[0]
    probe = ("import asyncio; from marlaas.platform.config import EnvConfig; "
             "from services.env.tools import checked_python_tool; "
             "print('served' if asyncio.run(checked_python_tool(EnvConfig())) else 'refused')")
    verdict = podman("exec", env_box, "python", "-c", probe).strip().splitlines()[-1]
    if verdict != "refused":
        raise Failed(f"env's container (uid 1000, no grants) would serve python: {verdict}")
    say(f"python tool: ran in {sandbox} as uid {uid}; its container's environment has no platform "
        f"secret; {env_box} (non-root) refuses to serve python itself")


def versions_of(client: Client, job: str) -> list[int]:
    return sorted(v.version for v in client.versions(job))


def wait_done(client: Client, jobs: list[str], timeout_s: float) -> None:
    def done():
        states = {j: client.job(j).state for j in jobs}
        bad = {j: s for j, s in states.items() if s in ("failed", "cancelled")}
        if bad:
            raise Failed(f"jobs ended badly: {bad}: " + "; ".join(client.job(j).reason or "" for j in bad))
        return all(s == "completed" for s in states.values())
    wait_for(f"jobs {jobs} complete", done, timeout_s, every_s=5)
    for job in jobs:
        got = versions_of(client, job)
        if got != list(range(STEPS + 1)):
            raise Failed(f"job {job}: versions {got}, expected exactly 0..{STEPS}")


def trained_by(name: str) -> int:
    return sum(1 for line in logs(name).splitlines() if '"event": "trained"' in line)


def progress(client: Client, jobs: list[str]) -> str:
    return ", ".join(f"{j}: v{client.job(j).version}" for j in jobs)


def single_node(env: dict[str, str], summary: dict) -> None:
    t = time.monotonic()
    compose("up", "-d", timeout=900)
    wait_for("the gateway's /readyz", ready, 600)
    summary["up_s"] = time.monotonic() - t
    say(f"up: /readyz answers after {summary['up_s']:.0f} s ({len(containers())} containers)")

    token = add_tenant("acme", "admin", ["nats"], profiles=("admin",))
    tool = serve_tool(token)
    try:
        with Client(GATEWAY, token) as client:
            check_sandbox(env)
            jobs = [submit(client, SINGLE), submit(client, AGENTIC)]
            say(f"tenant acme added; jobs {jobs} submitted; acme.weather served from this host")
            wait_for("the jobs start training", lambda: all(client.job(j).version >= 2 for j in jobs), 600)

            t = time.monotonic()
            for service in ("trainer", "rollout", "env"):  # podman-compose takes one --scale a call
                compose("up", "-d", "--scale", f"{service}=2", service, timeout=900)
            scaled = {s: len(containers(s)) for s in ("trainer", "rollout", "env")}
            if scaled != {"trainer": 2, "rollout": 2, "env": 2}:
                raise Failed(f"after --scale: {scaled}")
            trainers = containers("trainer")
            wait_for("both trainers train", lambda: all(trained_by(n) > 0 for n in trainers), 600)
            summary["scale_s"] = time.monotonic() - t
            say("scaled to 2 trainers, 2 rollouts, 2 envs; trained: "
                + ", ".join(f"{n} {trained_by(n)}" for n in trainers) + f"; {progress(client, jobs)}")

            victims = [containers("trainer")[0], containers("rollout")[0]]
            if all(client.job(j).state == "completed" for j in jobs):
                raise Failed("the jobs completed before the kill: raise DEPLOY_TEST_STEPS")
            for name in victims:
                podman("kill", name)
            say(f"killed {', '.join(victims)} mid-job ({progress(client, jobs)})")
            wait_done(client, jobs, 1200)
            summary["jobs"] = len(jobs)
            say(f"jobs {jobs} completed with versions exactly 0..{STEPS}")
    finally:
        tool.terminate()
        tool.wait(timeout=10)
    # the tool process was a tenant's, across the deployment's boundary: it must have served
    if tool.returncode not in (0, -signal.SIGTERM):
        raise Failed(f"the tool process failed: {Path(TOOL_LOG).read_text()[-2000:]}")


def high_availability(summary: dict) -> None:
    ha = ("ha",)
    services = ["manager-ha", "rollout-ha", "env-ha", "trainer-ha", "gateway-ha", "sandbox-ha"]
    nodes = ["nats-1", "nats-2", "nats-3"]
    t = time.monotonic()
    compose("up", "-d", *services, profiles=ha, timeout=900)
    wait_for("the HA gateway's /readyz", ready, 600)
    say(f"ha: up after {time.monotonic() - t:.0f} s ({len(containers())} containers)")
    token = add_tenant("acme", "admin-ha", nodes, profiles=ha)
    with Client(GATEWAY, token) as client:
        job = submit(client, SINGLE)
        wait_for("the HA job trains", lambda: client.job(job).version >= 3, 600)
        victim = containers("nats-2")[0]
        podman("kill", victim)
        say(f"ha: killed {victim} mid-job (v{client.job(job).version})")
        wait_done(client, [job], 1200)
    summary["ha_jobs"] = 1
    say(f"ha: job {job} completed with versions exactly 0..{STEPS} after losing a node")


def leftovers() -> list[str]:
    label = f"label=io.podman.compose.project={PROJECT}"
    found = podman("ps", "-a", "--filter", label, "--format", "container {{.Names}}").split("\n")
    found += podman("pod", "ps", "--filter", f"name={PROJECT}", "--format", "pod {{.Name}}").split("\n")
    found += [f"volume {v}" for v in podman("volume", "ls", "--format", "{{.Name}}").split()
              if v.startswith(PROJECT)]
    found += [f"network {n}" for n in podman("network", "ls", "--format", "{{.Name}}").split()
              if n.startswith(PROJECT)]
    return [f for f in found if f.strip()]


def teardown() -> float:
    t = time.monotonic()
    # podman-compose's down knows only the file's replicas: the ones `--scale` added go first
    # (else it cannot remove what they depend on). Docker Compose removes them itself.
    extra = [name for name in containers(running=False) if not name.endswith("_1")]
    if extra:
        podman("rm", "-f", "-t", "10", *extra, check=False)
    cmd = COMPOSE + ["--profile", "ha", "--profile", "admin", "down", "-v", "--remove-orphans"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if leftovers():
        errors = [line for line in done.stderr.splitlines() if "no container" not in line
                  and "no pod" not in line]
        say("down -v left something; its errors:\n" + "\n".join(errors[-20:]))
    return time.monotonic() - t


def dump_logs() -> None:
    for name in containers(running=False):
        tail = "\n".join(logs(name).splitlines()[-15:])
        print(f"----- {name} (last lines) -----\n{tail}", file=sys.stderr)


def main() -> int:
    def stop(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, stop)

    env = {"MARLAAS_NATS_PASSWORD": secrets.token_hex(24), "MARLAAS_OPERATOR_TOKEN": secrets.token_hex(24),
           "MARLAAS_S3_ACCESS_KEY": "deploytest", "MARLAAS_S3_SECRET_KEY": secrets.token_hex(20)}
    os.environ.update(env)
    # the documented way to derive the sandbox's password, run from the image
    os.environ["MARLAAS_SANDBOX_NATS_PASSWORD"] = podman(
        "run", "--rm", "-e", "MARLAAS_NATS_PASSWORD", "marlaas:latest", "tenant", "sandbox-password").strip()
    summary: dict = {}
    status = 1
    if leftovers():
        teardown()  # a run that was cut short
    try:
        single_node(env, summary)
        teardown()
        high_availability(summary)
        status = 0
    except (Failed, subprocess.TimeoutExpired) as exc:
        say(f"FAILED: {exc}")
        dump_logs()
    except KeyboardInterrupt as exc:
        say(f"interrupted ({exc}); taking the deployment down")
    finally:
        down_s = teardown()
        left = leftovers()
        if left:
            say(f"FAILED: left behind after down -v: {left}")
            status = 1
    if status == 0:
        print(f"deploy-test: passed in {time.monotonic() - T0:.0f} s: up in {summary['up_s']:.0f} s; "
              f"{summary['jobs']} jobs (single-turn, agentic with a tool served from the host) "
              f"through scale-out to 2 trainers/2 rollouts/2 envs ({summary['scale_s']:.0f} s, both "
              f"trainers trained) and the kill of a trainer and a rollout, versions exactly 0..{STEPS}; "
              f"ha: {summary['ha_jobs']} job through the loss of a NATS node; down -v in {down_s:.0f} s, "
              f"nothing left", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
