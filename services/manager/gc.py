"""Garbage collection of a job's stored objects: a pure plan and the shell that carries it out.

Every attempt at writing version v of a job writes under its own prefix
``<kind>/<job>/v<v:06d>/<attempt>/`` (``marlaas.platform.adapters.attempt_prefix``); the
compare-and-set on the ``versions`` entry decides which attempt *is* version v, and
the policy-committed announcement names its adapter. So everything else is either
history nobody needs or an orphan of a crashed or losing attempt. The plan deletes:

- adapters of versions older than the last ``keep_last`` committed ones, unless pinned;
- adapter attempts of a version ``<= latest`` that are not its committed attempt (orphans);
  when no announcement names a version's committed attempt, all its attempts are kept;
- optimizer states of every version ``<= latest`` except the latest committed one's
  (the ``versions`` entry's optimizer Blob: a resumed trainer needs it);
- trajectory batches of versions ``< latest``: trained, or off-policy and terminated;
- the samples kept for the tenant of versions ``marlaas.platform.samples.keeps_samples`` lets go
  (the last few in full, an evenly spaced few of the older ones, and pinned ones stay);
- with each of those, the unfinished files a killed writer left in its attempt (a file store's
  temp files: ``ObjectStore.interrupted_writes``).

Nothing of a version ``> latest`` is ever deleted (an attempt at it may be in flight),
nor any key the plan does not recognise. A finished job follows the same rule: its
last ``keep_last`` versions and pinned ones stay until its tenant deletes the job.

The manager runs a job's collection every few commits and at its last (:class:`JobCollections`),
and acknowledges a finished job's last announcement only once a pass succeeded
(:func:`acknowledge_collected`).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

import structlog

from marlaas.platform import subjects
from marlaas.platform.bus import JOBS_BUCKET, VERSIONS_BUCKET, Bus, Delivery
from marlaas.platform.events import COMMITTED, JOB_RECORD, POLICY
from marlaas.platform.samples import keeps_samples
from marlaas.platform.store import ObjectStore

log = structlog.get_logger("manager")
OBJECT_KINDS = ("adapters", "optimizer", "trajectories", "samples")
_VERSION = re.compile(r"^v(\d{6,})$")


@dataclass(frozen=True)
class StoredObject:
    """A parsed object key ``<kind>/<job>/v<version>/<attempt>/<file>``."""

    kind: str
    version: int
    attempt_prefix: str  # ``<kind>/<job>/v<version>/<attempt>``, without the trailing slash


def parse_key(key: str, job: str) -> StoredObject | None:
    """The key's kind, version and attempt prefix; None for a key not laid out by an attempt."""
    parts = key.split("/")
    if len(parts) < 5 or parts[0] not in OBJECT_KINDS or parts[1] != job or not parts[3]:
        return None
    match = _VERSION.match(parts[2])
    if match is None:
        return None
    return StoredObject(kind=parts[0], version=int(match.group(1)), attempt_prefix="/".join(parts[:4]))


def attempt_of(key: str) -> str:
    """The attempt prefix of an object key (its folder)."""
    return key.rsplit("/", 1)[0]


def plan_collection(job: str, keys: list[str], committed: dict[int, str], latest: int, keep_last: int,
                    pinned: set[int], latest_optimizer_key: str | None) -> list[str]:
    """The keys to delete among ``keys`` (every object under the job's prefixes, ``OBJECT_KINDS``).

    ``committed`` maps a version to its committed adapter attempt prefix (from the
    announcements and the ``versions`` entry); ``latest`` is the committed version;
    ``latest_optimizer_key`` is the ``versions`` entry's optimizer object, if any.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    kept_optimizer = attempt_of(latest_optimizer_key) if latest_optimizer_key else None
    doomed = []
    for key in keys:
        obj = parse_key(key, job)
        if obj is None or obj.version > latest:
            continue  # not ours to judge, or an attempt that may still be in flight
        if obj.kind == "adapters":
            winner = committed.get(obj.version)
            retained = obj.version > latest - keep_last or obj.version in pinned
            orphan = winner is not None and obj.attempt_prefix != winner
            delete = orphan or not retained
        elif obj.kind == "optimizer":
            delete = obj.version < latest or obj.attempt_prefix != kept_optimizer
        elif obj.kind == "samples":
            delete = not keeps_samples(obj.version, latest, pinned)
        else:  # trajectories: a batch sampled at an older version is trained or was terminated
            delete = obj.version < latest
        if delete:
            doomed.append(key)
    return doomed


async def committed_attempts(bus: Bus, store: ObjectStore, job: str) -> dict[int, str]:
    """Each announced version's committed adapter attempt prefix."""
    attempts = {}
    for data in await bus.read_all("POLICY", subjects.policy_committed(job)):
        event = POLICY.decode(data)
        attempts[event.version] = attempt_of(store.key_of(event.adapter.uri))
    return attempts


async def collect_job(bus: Bus, store: ObjectStore, job: str, keep_last: int) -> int:
    """Delete the objects of ``job`` that :func:`plan_collection` names; return how many.

    The ``versions`` entry is read first, so a version committed while this runs is
    above ``latest`` and untouched. A job without a record or committed version
    (unknown, or being deleted) is left alone.
    """
    version_entry = await bus.kv_get(VERSIONS_BUCKET, job)
    record_entry = await bus.kv_get(JOBS_BUCKET, job)
    if version_entry is None or record_entry is None:
        return 0
    latest = COMMITTED.decode(version_entry.value)
    record = JOB_RECORD.decode(record_entry.value)
    committed = await committed_attempts(bus, store, job)
    committed = {v: p for v, p in committed.items() if v <= latest.version}
    committed[latest.version] = attempt_of(store.key_of(latest.adapter.uri))  # the authority
    optimizer_key = store.key_of(latest.optimizer.uri) if latest.optimizer else None
    keys = []
    for kind in OBJECT_KINDS:  # a killed writer's unfinished files go with their attempt
        keys += await asyncio.to_thread(store.collectable, f"{kind}/{job}/")
    doomed = plan_collection(job, keys, committed, latest.version, keep_last, set(record.pinned), optimizer_key)
    return await asyncio.to_thread(_delete, store, keys, doomed)


def _delete(store: ObjectStore, keys: list[str], doomed: list[str]) -> int:
    """Delete ``doomed``: a whole attempt by prefix (the file store then prunes its folder)."""
    by_attempt: dict[str, list[str]] = {}
    for key in keys:
        by_attempt.setdefault(attempt_of(key), []).append(key)
    doomed_set, deleted = set(doomed), 0
    for attempt, attempt_keys in by_attempt.items():
        gone = [key for key in attempt_keys if key in doomed_set]
        if gone and len(gone) == len(attempt_keys):
            deleted += store.delete_prefix(attempt + "/")
        else:
            for key in gone:
                store.delete(key)
            deleted += len(gone)
    return deleted


class JobCollections:
    """Each job's garbage collection passes, run in the background: passes of one job never overlap,
    and a commit during a pass earns one more pass after it."""

    def __init__(self, bus: Bus, store: ObjectStore, keep_last: int,
                 in_background: Callable[[Coroutine], asyncio.Task]) -> None:
        self.bus, self.store, self.keep_last = bus, store, keep_last
        self.in_background = in_background
        self._running: dict[str, asyncio.Task] = {}  # each job's running passes
        self._again: set[str] = set()  # ... and committed again meanwhile

    def request(self, job: str) -> asyncio.Task:
        """Collect ``job`` (after its running pass, if any); the task of its passes, True when the
        last one succeeded."""
        if job in self._running:
            self._again.add(job)  # one more pass once the running one ends
            return self._running[job]
        passes = self._running[job] = self.in_background(self._collect(job))
        return passes

    async def _collect(self, job: str) -> bool:
        """Delete the job's objects no version needs; return whether the last pass succeeded (a
        failure is logged; the next commit retries it)."""
        try:
            while True:
                self._again.discard(job)
                try:
                    deleted = await collect_job(self.bus, self.store, job, self.keep_last)
                    if deleted:
                        log.info("garbage collected", job=job, objects=deleted)
                    ok = True
                except Exception:
                    log.exception("garbage collection failed; the next commit retries it", job=job)
                    ok = False
                if job not in self._again:
                    return ok
        finally:
            del self._running[job]


async def acknowledge_collected(delivery: Delivery, job: str, passes: asyncio.Task) -> None:
    """Ack a finished job's last announcement once a garbage collection pass succeeded.

    No later commit retries a finished job's collection, so until then its announcement stays
    unacknowledged: a failed pass naks it, and a manager killed during the pass leaves it to
    be delivered again; either way it comes back and is collected again. The consumer goes on
    with other announcements meanwhile (a pass over a large bucket can take a listing's time),
    until its ``max_ack_pending`` (4) announcements wait unacknowledged at once.
    """
    try:
        async with delivery.keep_alive():
            ok = await asyncio.shield(passes)
        if ok:
            await delivery.ack()
        else:
            log.warning("the last garbage collection failed; retrying it", job=job,
                        attempt=delivery.num_delivered)
            await delivery.nak(min(delivery.num_delivered, 10))
    except Exception:  # the broker is gone: the unsettled announcement comes back after AckWait
        log.exception("could not settle the last announcement", job=job)
