"""Finding the local stack: what ``marlaas up`` leaves under ``<home>/run`` and how clients wait for it.

The launcher writes ``run/stack.json`` (``{"state": "starting" | "ready", "pid": ...}``) when it
begins to start the stack, rewrites it once every service is ready *and the gateway's
``/readyz`` answers* (the manager serves requests), and removes it when it stops. A client
started beside ``marlaas up &`` reads it to wait, bounded and saying so, instead of failing
with 503 while the vLLM engine loads.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from marlaas.platform.config import Config

STATE_FILE = "stack.json"
STARTING, READY = "starting", "ready"
APPEAR_S = 5.0  # how long a client waits for a `marlaas up` started at the same moment to say so
STARTUP_WAIT_S = 300.0  # a stack starting on a busy laptop CPU: the vLLM engine alone takes 20-60 s


class StackState(msgspec.Struct, frozen=True, kw_only=True):
    """What the launcher says of the stack it runs: ``state`` and the launcher's ``pid``."""

    state: str
    pid: int


class StackNotReady(RuntimeError):
    """No stack is starting or running under the home dir, or it did not get ready in time."""


def write_state(run_dir: Path, state: str) -> None:
    """Record ``state`` for this process's stack (atomically: readers never see half a file)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    partial = run_dir / f".{STATE_FILE}.{os.getpid()}"
    partial.write_bytes(msgspec.json.encode(StackState(state=state, pid=os.getpid())))
    partial.replace(run_dir / STATE_FILE)


def clear_state(run_dir: Path) -> None:
    """The stack stopped: remove its state, if it is this process's."""
    state = read_state(run_dir)
    if state is not None and state.pid == os.getpid():
        (run_dir / STATE_FILE).unlink(missing_ok=True)


def read_state(run_dir: Path) -> StackState | None:
    """The stack's recorded state, or None (no file, or not one the launcher wrote)."""
    try:
        return msgspec.json.decode((run_dir / STATE_FILE).read_bytes(), type=StackState)
    except (FileNotFoundError, msgspec.DecodeError):
        return None


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        pass
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:  # gone since kill(0)
        return False


def wait_until_ready(run_dir: Path, wait_s: float = STARTUP_WAIT_S, appear_s: float = APPEAR_S,
                     on_wait: Callable[[str], None] | None = None) -> None:
    """Return once the stack under ``run_dir`` is ready; wait while it starts (telling ``on_wait``
    once). A stack started at the same moment gets ``appear_s`` to say so. Raises
    :class:`StackNotReady` with what to do when none is starting or it is not ready in ``wait_s``."""
    start = time.monotonic()
    told = False
    while True:
        state = read_state(run_dir)
        waited = time.monotonic() - start
        if state is None and (run_dir / "gateway.url").exists():
            return  # a stack written before the state file existed, or a gateway run by hand
        if state is not None and state.state == READY and alive(state.pid):
            return
        if state is not None and not alive(state.pid):
            raise StackNotReady(f"the `marlaas up` under {run_dir.parent} (pid {state.pid}) exited without "
                                f"stopping cleanly: see {run_dir.parent / 'logs'}, then start it again")
        if state is None and waited >= min(appear_s, wait_s):
            raise StackNotReady(f"no stack is running under {run_dir.parent}: start one with `marlaas up`")
        if waited >= wait_s:
            raise StackNotReady(f"the stack under {run_dir.parent} is still starting after {wait_s:.0f}s: "
                                f"see {run_dir.parent / 'logs'}")
        if state is not None and not told and on_wait is not None:
            on_wait(f"the stack under {run_dir.parent} is starting (the vLLM engine loads); "
                    f"waiting up to {wait_s:.0f}s")
            told = True
        time.sleep(0.2)


DEFAULT_TOKEN_FILE = "default-tenant.token"


def default_tenant_token(config: Config) -> str | None:
    """The token of tenant ``default`` that ``marlaas up`` left under ``<home>/run``, if any."""
    token_file = config.home_dir / "run" / DEFAULT_TOKEN_FILE
    return token_file.read_text().strip() if token_file.exists() else None


def running_nats_url(config: Config) -> str:
    """The broker a CLI call should talk to: configured, or the one ``marlaas up`` started
    (that URL carries the services' credentials)."""
    if config.nats_url:
        return config.nats_url
    marker = config.home_dir / "run" / "nats.url"
    if not marker.exists():
        raise StackNotReady(f"no running marlaas under {config.home_dir}: start one with `marlaas up` "
                         "(or set MARLAAS_NATS_URL)")
    return marker.read_text().strip()
