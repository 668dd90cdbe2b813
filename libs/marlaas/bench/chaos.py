"""A chaos run: jobs train while services are SIGKILLed and restarted and the broker restarts.

Kills come from two sides: a chaos loop SIGKILLs a random service (trainer, rollout, env,
manager, each at least once; rollout less often: its vLLM engine takes tens of seconds to
come back) and restarts it, and the trainer kills itself at random
(``trainer.fault_crash_p``) right after
writing an adapter (not yet committed) or right after committing (not yet announced). The
broker is SIGKILLed and restarted on its port ``nats_restarts`` times. Afterwards:

- every job completed, and its announced versions are exactly 0..N, each with one adapter
  (a version committed twice would show two);
- the train spans pass the on-policy audit (no batch trained off-policy or from a stale
  adapter); a batch retrained because its first update died before its commit is counted;
- after garbage collection no orphaned object is left: each job keeps its last
  ``gc_keep_last`` versions, one attempt each, and the latest optimizer state.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

from marlaas.platform import subjects
from marlaas.platform.audit import audit_training
from marlaas.platform.bus import SAMPLED_BUCKET, VERSIONS_BUCKET, Bus
from marlaas.platform.config import load_config
from marlaas.platform.events import COMMITTED, POLICY
from marlaas.platform.nats_client import BusClient
from marlaas.platform.telemetry import read_spans
from marlaas.stack.launcher import Stack

VICTIMS = {"trainer": 4, "env": 2, "manager": 2, "rollout": 1}  # relative odds of each kill
TASKS = ("addition", "reverse", "repeat")
# how long the last garbage collection pass may take before leftovers count as problems: a
# manager killed during it gets the last announcement again after the broker's 30 s ack wait
GC_SETTLE_S = 60.0


async def _submit(url: str, jobs: int, steps: int, grpo: tuple[dict, ...]) -> list[str]:
    client = await BusClient.connect(url)
    try:
        return [await client.submit({"name": f"chaos-{i}", "task": TASKS[i % len(TASKS)], "steps": steps,
                                     "seed": i, "grpo": grpo[i % len(grpo)]}) for i in range(jobs)]
    finally:
        await client.close()


async def _states(url: str, ids: list[str]) -> dict[str, tuple[str, int]]:
    client = await BusClient.connect(url, timeout_s=5.0)
    try:
        return {v.id: (v.state, v.version) for v in await client.status() if v.id in ids}
    finally:
        await client.close()


async def _committed(url: str, ids: list[str]) -> int:
    """Versions the jobs have committed past their first, counted on the broker's POLICY stream:
    known while the manager is down or restarting (the jobs keep committing then)."""
    bus = await Bus.connect(url, timeout_s=5.0)
    try:
        info = await asyncio.wait_for(bus.js.stream_info("POLICY", subjects_filter=subjects.policy_committed()), 5.0)
        counts = info.state.subjects or {}
        return sum(max(0, counts.get(subjects.policy_committed(job), 0) - 1) for job in ids)
    finally:
        await bus.close()


async def _evidence(url: str, ids: list[str]):
    bus = await Bus.connect(url)
    try:
        spans = [s for s in await read_spans(bus) if s.job in ids]
        announced = [POLICY.decode(data) for data in await bus.read_all("POLICY", subjects.policy_committed())]
        return spans, [a for a in announced if a.job in ids]
    finally:
        await bus.close()


async def _stall_report(url: str, jobs: list[str], logs: Path, lines: int = 12) -> str:
    """Where each of ``jobs`` stands on the broker (committed version, step recorded as sampled,
    batches queued for the trainer) and the last lines rollout and the trainer logged about it."""
    bus = await Bus.connect(url, timeout_s=5.0)
    try:
        report = []
        for job in jobs:
            committed = await bus.kv_get(VERSIONS_BUCKET, job)
            sampled = await bus.kv_get(SAMPLED_BUCKET, job)
            queued = (await bus.js.stream_info("TRAJ", subjects_filter=subjects.trajectory_ready(job))).state.messages
            version = COMMITTED.decode(committed.value).version if committed else None
            report.append(f"stalled {job}: committed v{version}, sampled step "
                          f"{sampled.value.decode() if sampled else None}, {queued} batch messages queued")
            for service in ("rollout", "trainer"):
                log_file = logs / f"{service}.log"
                said = [line for line in log_file.read_text(errors="replace").splitlines() if job in line] \
                    if log_file.exists() else []
                report += [f"  {service}: {line[:300]}" for line in said[-lines:]]
        return "\n".join(report)
    finally:
        await bus.close()


def _orphans(store_root: Path, ids: list[str], keep_last: int) -> list[str]:
    """Objects garbage collection should have removed (file store layout: kind/job/vNNNNNN/attempt/...).
    A folder counts when it holds a file, a killed writer's temp file included."""
    def holding_files(folder: Path) -> list[Path]:
        return sorted(p for p in folder.glob("*") if any(f.is_file() for f in p.rglob("*")))

    problems = []
    for job in ids:
        adapters = holding_files(store_root / "adapters" / job)
        if len(adapters) > keep_last:
            problems.append(f"{job}: {len(adapters)} adapter versions kept, more than {keep_last}")
        problems += [f"{job}: {v.name} has {n} attempts" for v in adapters if (n := len(holding_files(v))) != 1]
        optimizers = holding_files(store_root / "optimizer" / job)
        if len(optimizers) != 1:
            problems.append(f"{job}: {len(optimizers)} optimizer states kept, not 1")
    return problems


def _injected_crashes(log_file: Path) -> Counter[str]:
    """The trainer's own fault-injection crashes, by the point it died at (from its log)."""
    points: Counter[str] = Counter()
    if log_file.exists():
        for line in log_file.read_text(errors="replace").splitlines():
            if "fault injection" in line:
                points["committed, not announced" if "not announced" in line else "written, not committed"] += 1
    return points


def _victims(rng: random.Random):
    """Which service to kill next: each once first (in random order), then by the odds above."""
    first = list(VICTIMS)
    rng.shuffle(first)
    yield from first
    while True:
        yield rng.choices(list(VICTIMS), weights=list(VICTIMS.values()))[0]


def kill_gap(versions_left: int, kills_left: int) -> int:
    """Versions to wait between kills: two while there are versions to spare, fewer near the end
    (a run must still reach its kills before its jobs finish). The margins are wide because
    versions keep committing while a killed service restarts (progress is read off the broker,
    so a killed manager hides none of it, but a restarting rollout paces nothing)."""
    if versions_left >= 2 * kills_left + 12:
        return 2
    return 1 if versions_left >= kills_left + 10 else 0


def run_chaos(jobs: int = 4, steps: int = 12, min_kills: int = 20, nats_restarts: int = 2,
              crash_p: float = 0.08, seed: int = 0, timeout_s: float = 1500.0,
              on_event: Callable[[str], None] = print, home: Path | None = None,
              grpo: tuple[dict, ...] = ({},)) -> dict:
    """Run the chaos; return the counts and every problem found (an empty ``problems`` passes).

    A kill waits until the jobs have committed two more versions since the last one (fewer,
    and sooner, when the run nears its end short of ``min_kills``), so kills land all along the
    run rather than on services still starting. Job i gets ``grpo[i % len(grpo)]`` as its
    settings (e.g. the default pipelined groups for some, ``max_staleness`` for others).
    """
    rng = random.Random(seed)
    home = home or Path(tempfile.mkdtemp(prefix="marlaas-chaos-"))
    config = load_config(overrides={"home": str(home), "gateway.port": 0, "trainer.fault_crash_p": crash_p},
                         env={})
    kills: Counter[str] = Counter()
    victims = _victims(rng)
    trainer_log = home / "logs" / "trainer.log"
    started = time.monotonic()

    try:
        with Stack(config) as stack:
            ids = asyncio.run(_submit(stack.nats_url, jobs, steps, grpo))
            restarts_at = sorted(int(rng.uniform(0.2, 0.7) * jobs * steps) for _ in range(nats_restarts))
            last_kill_at, next_kill = 0, time.monotonic() + rng.uniform(1, 3)
            while True:
                stack.supervise()  # a service that died (an injected crash) comes back
                try:
                    progress = asyncio.run(_committed(stack.nats_url, ids))
                except Exception as exc:  # the broker is down right now
                    on_event(f"progress unavailable ({type(exc).__name__}); retrying")
                    time.sleep(1.0)
                    continue
                try:
                    states = asyncio.run(_states(stack.nats_url, ids))
                except Exception as exc:  # the manager is down or restarting: kills go on meanwhile
                    on_event(f"status unavailable ({type(exc).__name__})")
                    states = None
                if states and all(s in ("completed", "failed", "cancelled") for s, _ in states.values()):
                    break
                if time.monotonic() - started > timeout_s:
                    ended = ("completed", "failed", "cancelled")
                    unfinished = [j for j, (s, _) in (states or {}).items() if s not in ended]
                    with contextlib.suppress(Exception):  # what a stalled job left behind, for the log
                        on_event(asyncio.run(_stall_report(stack.nats_url, unfinished or ids, home / "logs")))
                    raise TimeoutError(f"chaos run not finished after {timeout_s:.0f}s: {states}")
                if restarts_at and progress >= restarts_at[0]:
                    restarts_at.pop(0)
                    stack.nats.stop(kill=True)
                    time.sleep(rng.uniform(0.5, 2.0))
                    stack.nats.start()
                    kills["nats-server"] += 1
                    on_event(f"nats-server killed and restarted at {progress} versions")
                elif (time.monotonic() >= next_kill
                      and (done := sum(kills.values()) - kills["nats-server"]
                           + sum(_injected_crashes(trainer_log).values())) < min_kills
                      and progress >= last_kill_at + kill_gap(jobs * steps - progress, min_kills - done)):
                    victim = next(victims)
                    stack.kill(victim)
                    stack.supervise()
                    kills[victim] += 1
                    last_kill_at = progress
                    on_event(f"killed {victim} at {progress} versions")
                    behind = kill_gap(jobs * steps - progress, min_kills - done - 1) < 2  # short of versions
                    next_kill = time.monotonic() + (rng.uniform(0.2, 1.0) if behind else rng.uniform(0.5, 3.0))
                time.sleep(0.3)
            # the last garbage collection pass runs in the background after the last commit, and
            # takes longer on a loaded machine: give it time to finish before the store is checked
            settle_by = time.monotonic() + GC_SETTLE_S
            while _orphans(home / "store", ids, config.manager.gc_keep_last) and time.monotonic() < settle_by:
                time.sleep(1.0)
            spans, announced = asyncio.run(_evidence(stack.nats_url, ids))
            states = asyncio.run(_states(stack.nats_url, ids))
        crashes = _injected_crashes(trainer_log)
        problems = [f"{job}: {state} at version {version}" for job, (state, version) in states.items()
                    if state != "completed" or version != steps]
        adapters_of: dict[tuple[str, int], set[str]] = defaultdict(set)
        for a in announced:
            adapters_of[(a.job, a.version)].add(a.adapter.sha256)
        for job in ids:
            versions = sorted({v for j, v in adapters_of if j == job})
            if versions != list(range(steps + 1)):
                problems.append(f"{job}: announced versions {versions}, not 0..{steps}")
        problems += [f"{job} v{v}: committed {len(shas)} different adapters" for (job, v), shas in
                     adapters_of.items() if len(shas) > 1]
        # A batch is trained again only when the trainer died before its commit: each trainer
        # death (a kill or an injected crash) may explain at most one repeat
        retrained = sum(n - 1 for n in Counter((s.job, s.version) for s in spans if s.phase == "train").values())
        trainer_deaths = kills["trainer"] + sum(crashes.values())
        if retrained > trainer_deaths:
            problems.append(f"{retrained} batches trained again, more than the {trainer_deaths} trainer deaths explain")
        problems += audit_training(spans)  # a retrained batch counts once: only its committed attempt
        problems += _orphans(home / "store", ids, config.manager.gc_keep_last)
        service_kills = sum(kills.values()) - kills["nats-server"] + sum(crashes.values())
        if service_kills < min_kills:
            problems.append(f"only {service_kills} service kills, fewer than {min_kills}")
        return {"jobs": jobs, "steps": steps, "kills": dict(kills), "injected_trainer_crashes": dict(crashes),
                "service_kills": service_kills, "nats_restarts": kills["nats-server"],
                "retrained_after_crash": retrained, "wall_s": round(time.monotonic() - started, 1),
                "problems": problems}
    finally:
        shutil.rmtree(home, ignore_errors=True)
