"""The python sandbox's launcher: the process between the env and bwrap (standard library only).

Started as ``python -I -S sandbox_launcher.py`` in a new session, it reads its orders (JSON) on
stdin, joins the run's cgroups, sets its rlimits and becomes the run's uid. With bwrap it then
stays bwrap's parent as a child subreaper: bwrap exits as soon as the code does, without waiting
for its namespace's init, which ``--die-with-parent`` then kills; reparented here, it is reaped
here rather than left a zombie for the host's PID 1 (which in a container may never reap). It
dies with the env (parent-death signal). Without bwrap (isolation "none") it execs python.
Failures before that are reported as a JSON line on the status pipe.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys

LAUNCHER_FAILED = 125
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


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
