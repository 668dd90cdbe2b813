"""No process left behind: children that die with their parent, and whole process groups stopped.

Every process the embedded stack starts (nats-server, each service) runs in its own
session, so a Ctrl-C reaches only the launcher, and with a parent-death signal, so it
is told to stop (SIGTERM: a service drains) if the launcher dies, even by SIGKILL. A
service's own children (vLLM's EngineCore) share its process group: stopping or killing
a service takes its whole group with it, so a killed rollout leaves no engine behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import signal
import subprocess
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
SHUTDOWN_GRACE_S = 30.0  # a service's drain after SIGTERM: it exits anyway then, the launcher stops waiting
OVERDUE_EXIT_CODE = 3  # a service that did not finish stopping in its grace period


def die_with_parent() -> None:
    """``preexec_fn`` for a child: SIGTERM it when the process that started it dies (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(args: list[str], **kwargs) -> subprocess.Popen:
    """Start a child in its own session that dies with this process."""
    return subprocess.Popen(args, start_new_session=True, preexec_fn=die_with_parent, **kwargs)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_group(pgid: int, sig: int = signal.SIGKILL, wait_s: float = 10.0) -> None:
    """Signal every process of group ``pgid`` (a service and what it started) and wait until
    none is left."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
    deadline = time.monotonic() + wait_s
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if group_alive(pgid) and sig != signal.SIGKILL:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def end_own_group() -> None:
    """At a service's exit: SIGTERM whatever is left in its process group (a vLLM engine core
    its parent could not shut down, e.g. when the launcher died mid-load), but only when this
    process leads the group (started by the launcher, in its own session): in a shell's job
    the group is the user's pipeline, not ours."""
    if os.getpgrp() != os.getpid():
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(os.getpgrp(), signal.SIGTERM)


def exit_if_still_running_after(grace_s: float) -> None:
    """Told to stop: give this process ``grace_s`` to finish draining, then print every thread's
    stack (why it hangs) and exit anyway: SIGKILL its process group, itself included, when it
    leads one (a signal handler cannot be changed off the main thread). A drain that never
    ends (a broker gone mid-flush, say) must not leave a service behind when no one is left to
    SIGKILL it: the launcher that would have is the parent whose death told it to stop."""

    def overdue() -> None:
        time.sleep(grace_s)
        print(f"still stopping after {grace_s:g} s; exiting anyway. Every thread's stack:",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        if os.getpgrp() == os.getpid():  # started by the launcher: the group is ours (see end_own_group)
            os.killpg(os.getpgrp(), signal.SIGKILL)  # this process and whatever it started
        os._exit(OVERDUE_EXIT_CODE)

    threading.Thread(target=overdue, name="stop-deadline", daemon=True).start()
