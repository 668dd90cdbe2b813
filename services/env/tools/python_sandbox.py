"""The ``python`` tool's sandbox: run a model's code in a locked-down child process.

How (no containers; after the field note in DESIGN.md): the env starts a small launcher
(this file, run as ``python -I -S python_sandbox.py``, in a new session). The launcher
unshares a new network and PID namespace and sets rlimits; its child, PID 1 of the new
namespace, drops to an unprivileged user, enters a fresh temporary directory and starts
``python -I -c CODE`` with an empty environment, then reaps orphans until the code exits.
The env reads stdout / stderr with a cap, enforces a wall-clock timeout, and deletes the
directory afterwards.

What it guarantees when the env runs as root (the embedded stack, the tests here):

- no network: a new, empty network namespace (not even loopback is up), so every connect
  fails, to 127.0.0.1 as to the internet;
- bounded resources: address space (``memory_mb``: allocations past it raise MemoryError),
  CPU seconds per process (``cpu_s``, default ``ceil(timeout_s)``: SIGXCPU), file size
  (``file_size_mb``), open files, processes of the sandbox user (``processes``: a fork bomb
  stops there), no core dumps;
- bounded time: after ``timeout_s`` of wall clock the run is killed (sleeps, blocked reads
  and busy loops alike);
- nothing outlives the run: when the code's main process ends or is killed, the kernel kills
  every process left in its PID namespace (children that called ``setsid`` included), and
  they are reaped there, leaving no zombies behind;
- bounded output: each stream keeps ``output_bytes`` (then a visible truncation marker); a
  run that writes more than ``flood_bytes`` in all is killed;
- the code runs as ``nobody`` (not root) with an empty environment, ``-I`` (no user site,
  no ``PYTHON*`` variables), stdin at /dev/null, and cwd a fresh empty directory (mode 0700)
  that is deleted afterwards; it cannot write to files it does not own unless they are
  world-writable.

What it does NOT guarantee:

- reads: the code can read every world-readable file (/etc, the installed Python, the
  project's source) and see the machine's processes in /proc (no mount namespace);
- world-writable places (/tmp, /dev/shm) stay writable, within the file-size limit, and
  what it writes there is not cleaned up;
- the process limit counts every process of the sandbox user on the machine, so concurrent
  runs share it;
- CPU time is limited per process: a run with several busy processes uses several cores
  until the wall-clock timeout;
- the interpreter is the first of (the env's own, /usr/bin/python3, /usr/local/bin/python3)
  that the sandbox user may execute: the env virtualenv's packages may be missing;
- kernel exploits and side channels: this is not a VM, a seccomp filter or a cgroup.

Without root: no user switch and no process limit, and namespaces only where unshare() is
permitted; the output notes each protection that is missing. Without a PID namespace only
the process group is killed, so a child that called ``setsid`` can outlive the run.

This module imports only the standard library: its ``__main__`` is the launcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import pwd
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field

CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
LAUNCHER_FAILED = 125
SANDBOX_USER = "nobody"
NOBODY_ID = 65534


class SandboxError(RuntimeError):
    """The sandbox itself could not run the code (not a failure of the code)."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use."""

    timeout_s: float = 5.0  # wall clock
    cpu_s: int = 0  # CPU seconds per process; 0 = ceil(timeout_s)
    memory_mb: int = 512  # address space
    file_size_mb: int = 16
    open_files: int = 64
    processes: int = 64  # of the sandbox user, on the whole machine
    output_bytes: int = 16_384  # kept per stream
    flood_bytes: int = 8 << 20  # written in all, before the run is killed
    max_code_bytes: int = 100_000  # the code travels as one argv string


@dataclass
class SandboxRun:
    """What happened to one run of code."""

    stdout: str
    stderr: str
    exit_code: int | None  # None when the process was killed by a signal
    killed: str = ""  # why it was stopped; "" when it ended by itself
    notes: list[str] = field(default_factory=list)
    workdir: str = ""  # the (now deleted) working directory

    @property
    def outcome(self) -> str:
        return f"killed: {self.killed}" if self.killed else f"exit code {self.exit_code}"

    def render(self) -> str:
        """The run as the model reads it: stdout, stderr, then what happened."""
        parts = [self.stdout.rstrip("\n")] if self.stdout else []
        if self.stderr:
            parts.append(f"[stderr]\n{self.stderr.rstrip(chr(10))}")
        parts.append(f"[{self.outcome}]")
        parts += [f"[note: {note}]" for note in self.notes]
        return "\n".join(parts)


# --- the env's side ---------------------------------------------------------------------------


async def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxRun:
    """Run ``code`` in the sandbox and report its output and fate; never blocks the event loop."""
    if len(code.encode()) > limits.max_code_bytes:
        raise SandboxError(f"code is {len(code.encode())} bytes; the limit is {limits.max_code_bytes}")
    user = _sandbox_user() if os.geteuid() == 0 else None
    workdir = tempfile.mkdtemp(prefix="marlaas-python-")
    try:
        if user is not None:
            os.chown(workdir, *user)
        return await _run_in(workdir, code, limits, user)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


async def _run_in(workdir: str, code: str, limits: SandboxLimits,
                  user: tuple[int, int] | None) -> SandboxRun:
    loop = asyncio.get_running_loop()
    capture = _Capture(loop, limits)
    status_r, status_w = os.pipe()
    try:
        transport, _ = await loop.subprocess_exec(
            lambda: capture, sys.executable, "-I", "-S", os.path.abspath(__file__),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, pass_fds=(status_w,),
        )
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    status = _Status(status_r)
    launcher = transport.get_pid()
    capture.on_flood = lambda: _stop(status, launcher)
    params = {"code": code, "workdir": workdir, "status_fd": status_w, "user": user,
              "limits": asdict(limits), "pythons": _interpreters()}
    stdin = transport.get_pipe_transport(0)
    stdin.write(json.dumps(params).encode())
    stdin.close()
    killed = ""
    try:
        await asyncio.wait_for(asyncio.shield(capture.exited), limits.timeout_s)
    except TimeoutError:
        killed = f"wall-clock timeout after {limits.timeout_s:g} s"
    finally:  # also on cancellation: nothing of the run may outlive it
        if not capture.exited.done():
            _stop(status, launcher)
            await capture.exited
        if not status.read().get("pidns_isolated"):
            _kill_group(launcher)  # no PID namespace: the process group is the best handle left
        try:
            await asyncio.wait_for(asyncio.shield(capture.closed), 1.0)
        except TimeoutError:
            pass  # a child that escaped the group (setsid) without a PID namespace
        transport.close()
        report = status.close()
    if "error" in report:
        raise SandboxError(f"the sandbox could not start: {report['error']}")
    return _describe(capture, report, killed, limits, workdir, user)


def _describe(capture: _Capture, report: dict, killed: str, limits: SandboxLimits,
              workdir: str, user: tuple[int, int] | None) -> SandboxRun:
    returncode = report.get("returncode")
    if capture.flooded and not killed:
        killed = f"output over {limits.flood_bytes} bytes"
    elif returncode is None and not killed:
        killed = "the sandbox ended before the code did"
    elif returncode is not None and returncode < 0 and not killed:
        sig = -returncode
        if sig == signal.SIGXCPU:
            killed = f"CPU time limit ({_cpu_seconds(asdict(limits))} s)"
        elif sig == signal.SIGKILL:
            killed = "SIGKILL (CPU time hard limit, or out of memory)"
        else:
            killed = f"signal {signal.Signals(sig).name}"
    stderr = capture.text(2, "stderr")
    notes = []
    if "MemoryError" in stderr:
        notes.append(f"memory limit reached ({limits.memory_mb} MiB of address space)")
    for what in ("network", "pidns"):
        if report.get(what, "isolated") != "isolated":
            notes.append(f"{'processes' if what == 'pidns' else what} {report[what]}")
    if user is None:
        notes.append("not run as root: no user switch and no process limit")
    return SandboxRun(stdout=capture.text(1, "stdout"), stderr=stderr,
                      exit_code=returncode if returncode is not None and returncode >= 0 else None,
                      killed=killed, notes=notes, workdir=workdir)


class _Capture(asyncio.SubprocessProtocol):
    """Keeps the first ``output_bytes`` of each stream, counts the rest, sees exit and close."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limits: SandboxLimits) -> None:
        self.limits = limits
        self.kept = {1: bytearray(), 2: bytearray()}
        self.seen = {1: 0, 2: 0}
        self.exited = loop.create_future()
        self.closed = loop.create_future()
        self.flooded = False
        self.on_flood = None

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self.seen[fd] += len(data)
        room = self.limits.output_bytes - len(self.kept[fd])
        if room > 0:
            self.kept[fd] += data[:room]
        if not self.flooded and sum(self.seen.values()) > self.limits.flood_bytes:
            self.flooded = True
            if self.on_flood is not None:
                self.on_flood()

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def text(self, fd: int, name: str) -> str:
        text = self.kept[fd].decode("utf-8", errors="replace")
        dropped = self.seen[fd] - len(self.kept[fd])
        return f"{text}\n[... truncated: {dropped} more bytes of {name}]" if dropped else text


class _Status:
    """The launcher's reports: JSON lines on a pipe, read without blocking whenever needed."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self.buffer = b""
        self.report: dict = {}

    def read(self) -> dict:
        try:
            while chunk := os.read(self.fd, 65536):
                self.buffer += chunk
        except BlockingIOError:
            pass
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            with contextlib.suppress(json.JSONDecodeError):
                self.report.update(json.loads(line))
        return self.report

    def close(self) -> dict:
        report = self.read()
        os.close(self.fd)
        return report


def _stop(status: _Status, launcher: int) -> None:
    """Kill the run: its PID namespace's init (the kernel kills the rest), else its process group."""
    init = status.read().get("init") if status.report.get("pidns_isolated") else None
    if init:
        with contextlib.suppress(ProcessLookupError):
            os.kill(init, signal.SIGKILL)  # the launcher stays alive to reap init, then exits
    else:
        _kill_group(launcher)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _sandbox_user() -> tuple[int, int]:
    try:
        entry = pwd.getpwnam(SANDBOX_USER)
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return NOBODY_ID, NOBODY_ID


def _interpreters() -> list[str]:
    candidates = [sys.executable, os.path.realpath(sys.executable),
                  "/usr/bin/python3", "/usr/local/bin/python3"]
    return list(dict.fromkeys(candidates))


# --- the launcher: runs in the child, before the code; standard library only -------------------
#
# launcher (root, new session) --unshare(NET, PID)--> fork: init (PID 1 of the new namespace;
# drops to the sandbox user) --> fork: the code (execve python -I -c CODE). init reaps every
# orphan and exits when the code does; the kernel then kills whatever is left in the namespace.
# The launcher waits for init and exits. Reports go to the env as JSON lines on ``status_fd``.


def _unshare(flag: int) -> str:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(flag) != 0:
        return f"not isolated: unshare() failed: {os.strerror(ctypes.get_errno())}"
    return "isolated"


def _set_limit(which: int, soft: int, hard: int | None = None) -> None:
    hard = soft if hard is None else hard
    _, current = resource.getrlimit(which)
    if current != resource.RLIM_INFINITY:  # an unprivileged process cannot raise its hard limit
        soft, hard = min(soft, current), min(hard, current)
    resource.setrlimit(which, (soft, hard))


def _set_limits(limits: dict, as_root: bool) -> None:
    """Limits for init and the code (the launcher is root and not bound by the process limit)."""
    cpu_s = _cpu_seconds(limits)
    _set_limit(resource.RLIMIT_AS, limits["memory_mb"] << 20)
    _set_limit(resource.RLIMIT_CPU, cpu_s, cpu_s + 1)  # SIGXCPU at the soft limit, SIGKILL after
    _set_limit(resource.RLIMIT_FSIZE, limits["file_size_mb"] << 20)
    _set_limit(resource.RLIMIT_NOFILE, limits["open_files"])
    _set_limit(resource.RLIMIT_CORE, 0)
    if as_root:  # counted per user: only meaningful once the run is someone else
        _set_limit(resource.RLIMIT_NPROC, limits["processes"])


def _cpu_seconds(limits: dict) -> int:
    return limits["cpu_s"] or max(1, math.ceil(limits["timeout_s"]))


def _report(fd: int, **fields) -> None:
    os.write(fd, (json.dumps(fields) + "\n").encode())  # one small write: atomic on a pipe


def _launch() -> None:
    params = json.loads(sys.stdin.buffer.read())
    fd = params["status_fd"]
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    try:
        network, pidns = _unshare(CLONE_NEWNET), _unshare(CLONE_NEWPID)
        _set_limits(params["limits"], as_root=params["user"] is not None)
    except Exception as exc:
        _report(fd, error=f"{type(exc).__name__}: {exc}")
        os._exit(LAUNCHER_FAILED)
    _report(fd, network=network, pidns=pidns, pidns_isolated=pidns == "isolated")
    init = os.fork()
    if init == 0:
        _run_init(params, fd)
    _report(fd, init=init)
    os.waitpid(init, 0)
    os._exit(0)


def _run_init(params: dict, fd: int) -> None:
    try:
        if params["user"] is not None:
            uid, gid = params["user"]
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            if os.getuid() != uid or os.geteuid() != uid:
                raise RuntimeError("could not drop privileges")
        os.umask(0o077)
        os.chdir(params["workdir"])
        python = next((p for p in params["pythons"] if os.access(p, os.X_OK)), None)
        if python is None:
            raise RuntimeError(f"the sandbox user may run none of {params['pythons']}")
        code = os.fork()
    except Exception as exc:
        _report(fd, error=f"{type(exc).__name__}: {exc}")
        os._exit(LAUNCHER_FAILED)
    if code == 0:
        os.close(fd)
        try:
            os.execve(python, [python, "-I", "-c", params["code"]], {})
        finally:
            os.write(2, f"sandbox: cannot run {python}\n".encode())
            os._exit(LAUNCHER_FAILED)
    _report(fd, python=python)
    while True:  # as PID 1, init inherits every orphan: reap them all until the code ends
        pid, wait_status = os.wait()
        if pid == code:
            _report(fd, returncode=os.waitstatus_to_exitcode(wait_status))
            os._exit(0)


if __name__ == "__main__":
    _launch()
