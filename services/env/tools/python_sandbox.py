"""The ``python`` tool's sandbox: run a model's code under bubblewrap, one locked-down run each.

The code is untrusted (a policy a tenant steers writes it), so each run gets, with
``isolation = "bwrap"`` (the default; ``bwrap`` is the Debian package ``bubblewrap``):

- its own user, mount, PID, IPC, UTS and network namespaces (``bwrap --unshare-all
  --unshare-user``), and no user namespaces inside it (``--disable-userns``);
- a read-only root holding only ``/usr`` (and the ``/bin``, ``/lib`` links into it): no
  ``/etc``, ``/home``, ``/root``, ``/var``, ``/run``, ``/sys`` or project files; a fresh
  ``/proc`` that shows only the run's own processes; a minimal ``/dev``; a private,
  size-limited tmpfs at ``/tmp`` (the working directory) and ``/dev/shm``, gone with the run;
- when the env runs as root, its own host uid (``SANDBOX_UID_BASE`` + a slot held under a
  lock file, so no two live runs share one, across env processes too), no groups;
- ``no_new_privs`` (bwrap sets it: setuid binaries do not elevate), a new session (no
  terminal injection), an empty environment but ``PATH`` and ``LANG``, ``python -I``;
- a new, empty session keyring, and (as root) the uid's user keyrings emptied before the code
  starts, so no kernel key passes from one run to the next or from the env to a run
  (``sandbox_launcher.py`` says what exactly is isolated);
- per-run memory and process limits from a cgroup of its own (v1 ``memory`` + ``pids``, or
  v2 where the env's cgroup delegates both) when the env is root; otherwise the fallback:
  ``RLIMIT_AS`` per process plus ``RLIMIT_NPROC`` on the run's unique uid, which bounds a
  run's memory by ``memory_mb x processes``. Always: CPU seconds per process, file size, open
  files, no core dumps, a wall-clock timeout, output kept to ``output_bytes`` per stream and
  killed past ``flood_bytes``;
- nothing left after it: the PID namespace's init is killed first (the kernel kills the rest
  and bwrap reaps it), then the run's cgroup and every process of its uid are swept before
  the uid is handed to another run. ``--die-with-parent`` kills the run if the env dies.

What it does NOT guarantee: protection from kernel exploits and side channels (this is not a
VM, and there is no seccomp filter); reads of what ``/usr`` holds (world-readable system files
and packages); CPU share between concurrent runs (each may use a core until its limits).
Without root, all runs share the env's uid and get no per-run process or memory total (the
output notes it). How many runs go at once, per tenant and per replica, is decided before a
run starts (``sandbox_turns.py``). ``isolation = "none"`` (an operator's explicit choice) runs the code
directly: rlimits, a temp dir and an empty environment only, no namespaces.

The parts: this module (the env's side: bwrap's arguments, output capture, timeouts, the
report), ``sandbox_host.py`` (the run's uid slot and cgroups) and ``sandbox_launcher.py`` (the
process between the env and bwrap that joins the cgroups, sets the rlimits and drops to the uid).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from services.env.tools.sandbox_host import RunCgroups, SlotError, sweep_uid, uid_slot
from services.env.tools.sandbox_launcher import SANDBOX_PATH

Isolation = Literal["bwrap", "none"]
LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")  # run as a script: standard library only


class SandboxError(RuntimeError):
    """The sandbox itself could not run the code (not a failure of the code)."""


class SandboxUnavailable(SandboxError):
    """The configured isolation cannot be provided on this machine."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use."""

    timeout_s: float = 5.0  # wall clock
    cpu_s: int = 0  # CPU seconds per process; 0 = ceil(timeout_s)
    memory_mb: int = 512  # the run's total (cgroup); also each process's address space
    file_size_mb: int = 16
    tmpfs_mb: int = 32  # each of /tmp and /dev/shm (also counted in the run's memory)
    open_files: int = 64
    processes: int = 64  # the run's total (cgroup pids, else RLIMIT_NPROC of its own uid)
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
    uid: int | None = None  # the host uid the run had (None: the env's own)

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


def bwrap_path() -> str | None:
    """The bubblewrap binary on the env's PATH, or None where it is not installed."""
    return shutil.which("bwrap", path=os.environ.get("PATH", os.defpath))


async def check_isolation(isolation: Isolation) -> None:
    """Raise :class:`SandboxUnavailable`, saying why and what to do, unless ``isolation`` works here."""
    if isolation == "none":
        return
    if bwrap_path() is None:
        raise SandboxUnavailable(
            "bubblewrap is not installed (no `bwrap` on PATH): install the Debian package "
            "`bubblewrap` (`make setup` does, as root), or set env.python_isolation = \"none\" "
            "to run the python tool without isolation")
    run = await run_python("print('ok')", SandboxLimits(timeout_s=10.0), isolation)
    if run.stdout != "ok\n" or run.exit_code != 0:
        raise SandboxUnavailable(f"bubblewrap cannot start a sandbox here: {run.render()[-600:]}")


async def run_python(code: str, limits: SandboxLimits = SandboxLimits(),
                     isolation: Isolation = "bwrap") -> SandboxRun:
    """Run ``code`` in the sandbox and report its output and fate; never blocks the event loop."""
    if len(code.encode()) > limits.max_code_bytes:
        raise SandboxError(f"code is {len(code.encode())} bytes; the limit is {limits.max_code_bytes}")
    bwrap = bwrap_path() if isolation == "bwrap" else None
    if isolation == "bwrap" and bwrap is None:
        raise SandboxUnavailable("bubblewrap (`bwrap`) is not installed")
    with contextlib.ExitStack() as cleanup:
        uid = cleanup.enter_context(_reserved_uid()) if os.geteuid() == 0 else None
        groups = (cleanup.enter_context(RunCgroups.create(uid, limits.memory_mb, limits.processes))
                  if uid is not None else None)
        workdir = None
        if bwrap is None:
            workdir = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="marlaas-python-"))
            if uid is not None:
                os.chown(workdir, uid, uid)
        python = _interpreter() if bwrap or uid is not None else sys.executable
        make_argv = ((lambda fd: _bwrap_argv(bwrap, python, code, limits, fd)) if bwrap
                     else (lambda fd: [python, "-I", "-c", code]))
        params = {"env_pid": os.getpid(), "uid": uid, "chdir": workdir, "rlimits": _rlimits(limits, uid, groups),
                  "cgroup_procs": groups.procs_files if groups else []}
        run = await _run(make_argv, params, limits, bwrap is not None, groups, uid)
        if uid is not None and (left := await asyncio.to_thread(sweep_uid, uid)):
            run.notes.append(f"{left} leftover process(es) of the run killed")
        return run


def _bwrap_argv(bwrap: str, python: str, code: str, limits: SandboxLimits, status_fd: int) -> list[str]:
    tmpfs = str(limits.tmpfs_mb << 20)
    argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/") / top
        if path.is_symlink():
            argv += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            argv += ["--ro-bind", str(path), str(path)]
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "1777", "--size", tmpfs, "--tmpfs", "/tmp",
             "--perms", "1777", "--size", tmpfs, "--tmpfs", "/dev/shm",
             "--remount-ro", "/", "--chdir", "/tmp", "--clearenv",
             "--setenv", "PATH", SANDBOX_PATH, "--setenv", "LANG", "C.UTF-8",
             "--json-status-fd", str(status_fd), "--", python, "-I", "-c", code]
    return argv


def _interpreter() -> str:
    """A Python under /usr (the only tree the sandbox sees): the env's own when it lives there."""
    own = os.path.realpath(sys.executable)
    for candidate in (own, "/usr/local/bin/python3", "/usr/bin/python3"):
        if candidate.startswith("/usr/") and os.access(candidate, os.X_OK):
            return candidate
    raise SandboxUnavailable("no python3 under /usr for the sandbox (looked for /usr/local/bin/python3 "
                             "and /usr/bin/python3)")


def _rlimits(limits: SandboxLimits, uid: int | None, groups: RunCgroups | None) -> dict[str, list[int]]:
    cpu_s = _cpu_seconds(limits)
    rlimits = {"RLIMIT_AS": [limits.memory_mb << 20] * 2,
               "RLIMIT_CPU": [cpu_s, cpu_s + 1],  # SIGXCPU at the soft limit, SIGKILL after
               "RLIMIT_FSIZE": [limits.file_size_mb << 20] * 2,
               "RLIMIT_NOFILE": [limits.open_files] * 2, "RLIMIT_CORE": [0, 0]}
    if uid is not None:  # the uid is the run's own, so this counts the run's processes only
        rlimits["RLIMIT_NPROC"] = [limits.processes] * 2
    return rlimits


def _cpu_seconds(limits: SandboxLimits) -> int:
    return limits.cpu_s or max(1, math.ceil(limits.timeout_s))


async def _run(make_argv, params: dict, limits: SandboxLimits, bwrapped: bool,
               groups: RunCgroups | None, uid: int | None) -> SandboxRun:
    loop = asyncio.get_running_loop()
    capture = _Capture(loop, limits)
    status_r, status_w = os.pipe()
    params = {**params, "status_fd": status_w, "argv": make_argv(status_w)}
    try:
        transport, _ = await loop.subprocess_exec(
            lambda: capture, sys.executable, "-I", "-S", str(LAUNCHER),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, pass_fds=(status_w,), env={},
        )
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    status = _Status(status_r)
    launcher = transport.get_pid()
    capture.on_flood = lambda: _stop(status, launcher)
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
            try:  # bwrap reaps its namespace's init and exits; if it does not, kill it too
                await asyncio.wait_for(asyncio.shield(capture.exited), 2.0)
            except TimeoutError:
                _kill_group(launcher)
                await capture.exited
        _kill_group(launcher)  # anything still in the run's session (isolation "none")
        if groups is not None:
            await asyncio.to_thread(groups.kill_all)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(capture.closed), 1.0)
        transport.close()
        report = status.close()
    if "error" in report:
        raise SandboxError(f"the sandbox could not start: {report['error']}")
    if bwrapped and "child-pid" not in report:
        raise SandboxError(f"bubblewrap could not start the sandbox: {capture.text(2, 'stderr')[-600:]}")
    returncode = transport.get_returncode()
    if bwrapped:  # bwrap reports a signal as 128 + its number, like a shell
        code = report.get("exit-code")
        returncode = 128 - code if code is not None and 128 < code <= 128 + 64 else code
    return _describe(capture, returncode, killed, limits, groups, uid)


def _describe(capture: _Capture, returncode: int | None, killed: str, limits: SandboxLimits,
              groups: RunCgroups | None, uid: int | None) -> SandboxRun:
    oom = groups is not None and groups.oom_killed()
    if capture.flooded and not killed:
        killed = f"output over {limits.flood_bytes} bytes"
    elif returncode is None and not killed:
        killed = "the sandbox ended before the code did"
    elif returncode is not None and returncode < 0 and not killed:
        sig = -returncode
        if sig == signal.SIGXCPU:
            killed = f"CPU time limit ({_cpu_seconds(limits)} s)"
        elif sig == signal.SIGKILL:
            killed = (f"out of memory (the run's {limits.memory_mb} MiB)" if oom
                      else "SIGKILL (CPU time hard limit, or out of memory)")
        else:
            killed = f"signal {signal.Signals(sig).name}"
    stderr = capture.text(2, "stderr")
    notes = []
    if "MemoryError" in stderr or oom:
        notes.append(f"memory limit reached ({limits.memory_mb} MiB)")
    if uid is None:
        notes.append("not run as root: runs share the env's uid, no per-run process limit")
    return SandboxRun(stdout=capture.text(1, "stdout"), stderr=stderr,
                      exit_code=returncode if returncode is not None and returncode >= 0 else None,
                      killed=killed, notes=notes, uid=uid)


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
    """Reports on a pipe (the launcher's errors, bwrap's ``--json-status-fd`` documents), one
    JSON object a line, read without blocking whenever needed."""

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
    """Kill the run: its PID namespace's init (the kernel kills the rest, and bwrap, still alive,
    reaps it and exits), or the launcher's process group before bwrap has started one."""
    init = status.read().get("child-pid")
    if init:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(init, signal.SIGKILL)
    else:
        _kill_group(launcher)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@contextlib.contextmanager
def _reserved_uid():
    try:
        with uid_slot() as uid:
            yield uid
    except SlotError as exc:
        raise SandboxError(str(exc)) from None
