"""The ``python`` tool's sandbox, run for real: limits, isolation and cleanup."""

from __future__ import annotations

import asyncio
import os
import textwrap
import time
from pathlib import Path

import pytest

from services.env.tools import python_tool
from services.env.tools.python_sandbox import SandboxError, SandboxLimits, run_python
from services.env.tools.sandbox_turns import CALLING_TENANT, RunCaps, RunTurns

pytestmark = pytest.mark.timeout(60)

QUICK = SandboxLimits(timeout_s=2.0)
AS_ROOT = os.geteuid() == 0


def code(source: str) -> str:
    return textwrap.dedent(source).strip()


async def test_normal_code_prints_its_result():
    run = await run_python("print(sum(range(10)))", QUICK)
    assert (run.stdout, run.stderr, run.exit_code, run.killed) == ("45\n", "", 0, "")
    assert run.render().startswith("45\n[exit code 0]")


async def test_errors_and_exit_codes_are_reported():
    run = await run_python("import sys\nprint('partial')\nsys.exit(3)", QUICK)
    assert run.exit_code == 3 and run.stdout == "partial\n"
    failed = await run_python("1 / 0", QUICK)
    assert failed.exit_code == 1 and "ZeroDivisionError" in failed.stderr
    assert "[stderr]\nTraceback" in failed.render() and failed.render().endswith("[exit code 1]")


async def test_a_busy_loop_is_killed_by_the_cpu_limit():
    run = await run_python("while True: pass", SandboxLimits(timeout_s=5.0, cpu_s=1))
    assert run.killed == "CPU time limit (1 s)" and run.exit_code is None
    assert "[killed: CPU time limit (1 s)]" in run.render()


async def test_a_sleep_is_killed_by_the_wall_clock():
    started = time.monotonic()
    run = await run_python("import time\nprint('going to sleep', flush=True)\ntime.sleep(60)",
                           SandboxLimits(timeout_s=1.0))
    assert time.monotonic() - started < 4
    assert run.killed == "wall-clock timeout after 1 s"
    assert run.stdout == "going to sleep\n"  # output before the kill is kept
    assert run.render().endswith("[killed: wall-clock timeout after 1 s]")


async def test_allocating_too_much_memory_is_stopped():
    run = await run_python("block = bytearray(2 * 1024**3)\nprint('allocated')",
                           SandboxLimits(timeout_s=5.0, memory_mb=256))
    assert "allocated" not in run.stdout and "MemoryError" in run.stderr
    assert "memory limit reached (256 MiB" in run.render()


async def test_huge_output_is_truncated_with_a_marker():
    run = await run_python("print('x' * 100_000)", QUICK)
    assert run.exit_code == 0
    assert run.stdout.startswith("x" * QUICK.output_bytes)
    assert run.stdout.endswith(f"[... truncated: {100_001 - QUICK.output_bytes} more bytes of stdout]")


async def test_an_output_flood_is_killed():
    run = await run_python("while True: print('y' * 10_000)",
                           SandboxLimits(timeout_s=10.0, flood_bytes=1 << 20))
    assert run.killed == f"output over {1 << 20} bytes"


async def test_the_network_is_unreachable():
    run = await run_python(code("""
        import socket
        for address in [("127.0.0.1", 4222), ("1.1.1.1", 53)]:
            try:
                socket.create_connection(address, timeout=1).close()
                print("connected", address)
            except OSError as exc:
                print("refused", type(exc).__name__)
    """), QUICK)
    if any("network not isolated" in note for note in run.notes):
        pytest.skip("unshare(CLONE_NEWNET) is not permitted here")
    assert "connected" not in run.stdout and run.stdout.count("refused") == 2


async def test_the_environment_is_minimal_and_the_cwd_a_private_tmp_gone_afterwards():
    os.environ["MARLAAS_SANDBOX_SECRET"] = "do-not-leak"
    try:
        run = await run_python(code("""
            import os
            print(sorted(k for k in os.environ if k != "LC_CTYPE"))
            print(os.getcwd())
            print(os.listdir("."))
            open("scratch.txt", "w").write("mine")
            print(os.listdir("."))
        """), QUICK)
    finally:
        del os.environ["MARLAAS_SANDBOX_SECRET"]
    environ, cwd, before, after = run.stdout.splitlines()
    assert environ == "['LANG', 'PATH', 'PWD']"  # LC_CTYPE is set by Python itself (PEP 538)
    assert cwd == "/tmp"  # a tmpfs of the run's own mount namespace
    assert (before, after) == ("[]", "['scratch.txt']")
    again = await run_python("import os; print(os.listdir('.'))", QUICK)
    assert again.stdout == "[]\n"


@pytest.mark.skipif(not AS_ROOT, reason="the user switch needs root")
async def test_code_runs_unprivileged_and_cannot_write_outside():
    target = Path(__file__).parent / "sandbox-was-here.txt"
    run = await run_python(code(f"""
        import os
        print(os.getuid())
        open({str(target)!r}, "w").write("x")
    """), QUICK)
    assert int(run.stdout.split()[0]) == run.uid and run.uid >= 1_500_000_000
    assert "FileNotFoundError" in run.stderr and not target.exists()  # the repo is not even mounted


@pytest.mark.skipif(not AS_ROOT, reason="namespaces and the process limit need root")
async def test_children_die_with_the_run_even_after_setsid_and_forks_are_limited():
    run = await run_python(code("""
        import os, time
        r, w = os.pipe()
        if os.fork() == 0:
            os.setsid()  # leaves the process group
            os.write(w, open("/proc/self/stat").read().split()[0].encode())
            time.sleep(60)
            os._exit(0)
        print(os.read(r, 20).decode(), flush=True)
        forked = 0
        try:
            for _ in range(500):
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                forked += 1
        except OSError as exc:
            print("fork refused after", forked, exc.errno)
    """), SandboxLimits(timeout_s=5.0, processes=20))
    escaped_pid, refused = run.stdout.splitlines()
    assert refused.startswith("fork refused after") and int(refused.split()[3]) < 20
    assert run.exit_code == 0
    assert escaped_pid == "3"  # a PID of the run's own namespace (1: bwrap's init, 2: the code)
    assert processes_of(run.uid) == []  # killed and reaped, not a zombie


def processes_of(uid: int) -> list[int]:
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if f"Uid:\t{uid}\t" in status.read_text():
                found.append(int(status.parent.name))
        except OSError:
            pass
    return found


async def test_the_python_tool_renders_the_run_and_refuses_oversized_code():
    python = python_tool(QUICK)
    assert python.parameters["required"] == ["code"]
    assert await python.call('{"code": "print(6 * 7)"}') == "42\n[exit code 0]" + (
        "" if AS_ROOT else "\n[note: not run as root: runs share the env's uid, no per-run process limit]")
    with pytest.raises(SandboxError, match="the limit is 100000"):
        await run_python("#" * 100_001, QUICK)


async def test_runs_do_not_block_the_event_loop():
    started = time.monotonic()
    ticks = 0

    async def tick():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.05)
            ticks += 1

    ticker = asyncio.create_task(tick())
    runs = await asyncio.gather(*(run_python(f"import time; time.sleep(1); print({i})", QUICK)
                                  for i in range(4)))
    ticker.cancel()
    assert [r.stdout for r in runs] == [f"{i}\n" for i in range(4)]
    assert time.monotonic() - started < 3 and ticks >= 10


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The most of ``intervals`` (start, end) that overlap at one instant."""
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    at_once = most = 0
    for _, step in edges:  # an end sorts before a start at the same instant
        at_once += step
        most = max(most, at_once)
    return most


async def test_forty_runs_of_one_tenant_take_turns_and_another_tenant_still_runs():
    """Issue 35, F6: runs past the caps wait for a slot (and all complete); the runs themselves
    record when they ran, so what ran at once is seen from inside the sandbox, not assumed."""
    turns = RunTurns(RunCaps(max_runs=6, max_runs_per_tenant=4, queue_timeout_s=60.0))
    python = python_tool(QUICK, turns=turns)
    source = '{"code": "import time; s = time.time(); time.sleep(0.3); print(s, time.time())"}'

    async def call(tenant: str) -> tuple[float, float]:
        CALLING_TENANT.set(tenant)  # as the serving bus sets it: this task's own
        output = await python.call(source)
        start, end = output.splitlines()[0].split()
        return float(start), float(end)

    mallory = [asyncio.create_task(call("mallory")) for _ in range(40)]
    while turns.running["mallory"] < 4:
        await asyncio.sleep(0.01)
    alice = await call("alice")  # issued while mallory has 36 waiting
    mallorys = await asyncio.gather(*mallory)
    assert len(mallorys) == 40 and turns.peak <= 6 and not turns.running and not turns.queues
    assert most_at_once(mallorys) <= 4
    assert most_at_once(mallorys + [alice]) <= 6
    assert sum(start > alice[0] for start, _ in mallorys) >= 20  # alice did not wait behind the queue
