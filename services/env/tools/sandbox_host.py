"""What a sandbox run holds on the host while it lives: a uid of its own and its cgroups.

A uid is a slot whose lock file (``flock``) the env process holds, so no two live runs share one,
across env processes on one machine too, and a crashed env's slots free themselves. The cgroups
(v1 ``memory`` + ``pids``, or v2 where the env's cgroup delegates both) hold the run's memory and
process totals. Both are swept (every process SIGKILLed) before they are given up.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import time
from pathlib import Path

SANDBOX_UID_BASE = 1_500_000_000  # far above login users and the usual subuid ranges (100000+)
SANDBOX_UID_SLOTS = 65_536
SLOT_DIR = Path("/run/marlaas-sandbox")  # lock files: a slot's uid is live while its lock is held


class SlotError(RuntimeError):
    """No uid could be reserved for a run."""


@contextlib.contextmanager
def uid_slot():
    """A host uid no other live run has: a slot whose lock file this process holds (flock, so a
    crashed env's slots free themselves). Yields the uid."""
    SLOT_DIR.mkdir(mode=0o700, exist_ok=True)
    if SLOT_DIR.is_symlink() or SLOT_DIR.stat().st_uid != 0:
        raise SlotError(f"{SLOT_DIR} is not a directory owned by root")
    for slot in range(SANDBOX_UID_SLOTS):  # the lowest free slot: as many lock files as runs at once
        fd = os.open(SLOT_DIR / f"slot-{slot}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        uid = SANDBOX_UID_BASE + slot
        try:
            sweep_uid(uid)  # a run of a crashed env could linger under this uid
            yield uid
        finally:
            os.close(fd)
        return
    raise SlotError(f"all {SANDBOX_UID_SLOTS} sandbox uids are in use")


def sweep_uid(uid: int) -> int:
    """SIGKILL every process whose real, effective or saved uid is ``uid``; how many there were."""
    killed = 0
    for _ in range(50):
        found = []
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    fields = dict(line.split(b":", 1) for line in
                                  Path(f"/proc/{entry.name}/status").read_bytes().splitlines() if b":" in line)
                    zombie = fields.get(b"State", b"").split()[:1] == [b"Z"]  # dead already; its parent reaps it
                    if not zombie and str(uid).encode() in fields.get(b"Uid", b"").split()[:3]:
                        found.append(int(entry.name))
        if not found:
            return killed
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed = max(killed, len(found))
        time.sleep(0.02)
    return killed


class RunCgroups:
    """The run's own cgroup(s), holding its memory and process totals (v1 ``memory`` + ``pids``,
    or v2 where the env's cgroup delegates both); an empty set where neither is possible."""

    def __init__(self, dirs: list[Path], version: int) -> None:
        self.dirs = dirs
        self.version = version

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    @classmethod
    @contextlib.contextmanager
    def create(cls, uid: int, memory_mb: int, processes: int):
        groups = cls._make(f"marlaas-sandbox-{uid}", memory_mb << 20, processes)
        try:
            yield groups
        finally:
            groups.kill_all()
            for d in groups.dirs:
                with contextlib.suppress(OSError):
                    d.rmdir()

    @classmethod
    def _make(cls, name: str, memory: int, processes: int) -> RunCgroups:
        own = own_cgroups()
        if "memory" in own and "pids" in own:  # v1
            dirs = [Path("/sys/fs/cgroup/memory") / own["memory"].lstrip("/") / name,
                    Path("/sys/fs/cgroup/pids") / own["pids"].lstrip("/") / name]
            settings = [{"memory.limit_in_bytes": memory}, {"pids.max": processes}]
            with contextlib.suppress(OSError):
                return cls._write(dirs, settings, 1)
        if "" in own:  # v2: usable only where the env's cgroup already delegates memory and pids
            base = next((p for p in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
                         if (p / "cgroup.subtree_control").exists()), None)
            if base is not None:
                parent = base / own[""].lstrip("/")
                with contextlib.suppress(OSError):
                    if {"memory", "pids"} <= set((parent / "cgroup.subtree_control").read_text().split()):
                        return cls._write([parent / name], [{"memory.max": memory, "memory.swap.max": 0,
                                                             "pids.max": processes}], 2)
        return cls([], 0)

    @classmethod
    def _write(cls, dirs: list[Path], settings: list[dict], version: int) -> RunCgroups:
        made = []
        try:
            for d, values in zip(dirs, settings):
                d.mkdir(exist_ok=True)
                made.append(d)
                for key, value in values.items():
                    if key != "memory.swap.max" or (d / key).exists():
                        (d / key).write_text(str(value))
        except OSError:
            for d in made:
                with contextlib.suppress(OSError):
                    d.rmdir()
            raise
        return cls(dirs, version)

    def kill_all(self) -> None:
        """SIGKILL whatever is still in the run's cgroups, until they are empty."""
        for _ in range(100):
            pids = set()
            for procs in self.procs_files:
                with contextlib.suppress(OSError):
                    pids |= {int(p) for p in Path(procs).read_text().split()}
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)

    def oom_killed(self) -> bool:
        for d in self.dirs:
            for name in ("memory.oom_control", "memory.events"):
                with contextlib.suppress(OSError):
                    for line in (d / name).read_text().splitlines():
                        key, _, value = line.partition(" ")
                        if key == "oom_kill" and int(value) > 0:
                            return True
        return False


def own_cgroups() -> dict[str, str]:
    """This process's cgroup per v1 controller (and ``""`` for v2), from /proc/self/cgroup."""
    found = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(","):
                found[controller] = path
    return found
