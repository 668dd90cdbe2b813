"""The python sandbox's launcher: the process between the env and bwrap (standard library only).

Started as ``python -I -S sandbox_launcher.py`` in a new session, it reads its orders (JSON) on
stdin, joins the run's cgroups, sets its rlimits and becomes the run's uid. With bwrap it then
stays bwrap's parent as a child subreaper: bwrap exits as soon as the code does, without waiting
for its namespace's init, which ``--die-with-parent`` then kills; reparented here, it is reaped
here rather than left a zombie for the host's PID 1 (which in a container may never reap). It
dies with the env (parent-death signal). Without bwrap (isolation "none") it execs python.
Failures before that are reported as a JSON line on the status pipe.

Kernel keys: the run starts in a new, empty session keyring of its own (joined here, after the
uid drop, so the run's uid owns it). Without that it would share the env's session keyring
(inherited across fork, exec and setuid, and writable by whoever possesses it, whatever its
uid), so one run's keys would be read by the next, and the env's by every run. The user and
user-session keyrings are the uid's: under bwrap they belong to the run's own user namespace
(Linux 5.3+), gone with it; as root the run's uid is its own while it lives, and both are
cleared here before its code starts, so nothing a former holder of the uid left there is
found. What is NOT isolated: without root every run shares the env's uid, so concurrent runs
may read each other's keys by their serial numbers (as they may each other's processes), and
with isolation "none" also the env user's own user keyring. Where keyctl is denied (a
seccomp policy, a kernel without keys), the run cannot use keys at all, which is as good.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import signal
import sys

LAUNCHER_FAILED = 125
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
KEYCTL_SYSCALL = {"x86_64": 250, "aarch64": 219, "riscv64": 219, "i686": 288, "armv7l": 311}
KEYCTL_JOIN_SESSION_KEYRING = 1
KEYCTL_CLEAR = 7
KEY_SPEC_USER_KEYRING = -4
KEY_SPEC_USER_SESSION_KEYRING = -5


def _report(fd: int, **fields) -> None:
    os.write(fd, (json.dumps(fields) + "\n").encode())  # one small write: atomic on a pipe


def _launch() -> None:
    """Join the run's cgroups, set its rlimits, become its uid, then run bwrap as a child and reap
    (or, isolation "none", exec python)."""
    params = json.loads(sys.stdin.buffer.read())
    fd = params["status_fd"]
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        for procs in params["cgroup_procs"]:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        for name, (soft, hard) in params["rlimits"].items():
            which = getattr(resource, name)
            _, current = resource.getrlimit(which)
            if current != resource.RLIM_INFINITY:  # an unprivileged process cannot raise its hard limit
                soft, hard = min(soft, current), min(hard, current)
            resource.setrlimit(which, (soft, hard))
        if params["uid"] is not None:
            uid = params["uid"]
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            if os.getresuid() != (uid, uid, uid):
                raise RuntimeError("could not drop privileges")
        _fresh_keyrings(own_uid=params["uid"] is not None)
        if params["chdir"]:
            os.chdir(params["chdir"])
        os.umask(0o077)
        argv = params["argv"]
        bwrapped = "--json-status-fd" in argv
        os.set_inheritable(fd, bwrapped)  # bwrap's; never the code's
        env = {} if bwrapped else {"PATH": SANDBOX_PATH, "LANG": "C.UTF-8"}
        if not bwrapped:
            os.execve(argv[0], argv, env)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setresuid, which clears it
        if os.getppid() != params["env_pid"]:
            raise RuntimeError("the env exited")
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        bwrap = os.fork()
    except Exception as exc:
        _report(fd, error=f"{type(exc).__name__}: {exc}")
        os._exit(LAUNCHER_FAILED)
    if bwrap == 0:
        try:
            os.execve(argv[0], argv, env)
        finally:
            os._exit(LAUNCHER_FAILED)
    os.close(fd)
    _reap_all(bwrap)



def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def _fresh_keyrings(own_uid: bool) -> None:
    """Join a new anonymous session keyring; with ``own_uid`` (the run's uid is its own) also
    empty the uid's user and user-session keyrings (see the module docstring for what this
    isolates). Raises where keys exist but cannot be isolated."""
    machine = os.uname().machine
    if machine not in KEYCTL_SYSCALL:
        raise RuntimeError(f"no keyctl syscall number known for {machine}: cannot give the run a "
                           f"keyring of its own (add it to KEYCTL_SYSCALL in {__file__})")
    libc = ctypes.CDLL(None, use_errno=True)
    keyctl = KEYCTL_SYSCALL[machine]
    calls = [(KEYCTL_JOIN_SESSION_KEYRING, None)]
    if own_uid:
        calls += [(KEYCTL_CLEAR, KEY_SPEC_USER_KEYRING), (KEYCTL_CLEAR, KEY_SPEC_USER_SESSION_KEYRING)]
    for operation, argument in calls:
        if libc.syscall(ctypes.c_long(keyctl), ctypes.c_long(operation),
                        ctypes.c_void_p(None) if argument is None else ctypes.c_long(argument)) == -1:
            err = ctypes.get_errno()
            if err in (errno.ENOSYS, errno.EPERM):  # no keys for anyone here, the run included
                return
            raise OSError(err, f"keyctl({operation}) failed: {os.strerror(err)}")


def _reap_all(bwrap: int) -> None:
    """Reap bwrap and, as the subreaper, its namespace's init once bwrap exits (bwrap does not
    wait for it: it is killed by ``--die-with-parent`` and would otherwise be left a zombie for
    the host's PID 1); exit with bwrap's status when no child is left."""
    code = LAUNCHER_FAILED
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(code)
        if pid == bwrap:
            code = os.waitstatus_to_exitcode(status) % 256


if __name__ == "__main__":
    _launch()
