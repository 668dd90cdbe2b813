"""What a benchmark run measured, computed from the spans the services emit (pure functions).

Every schedule is measured the same way, from the same records: the services' phase
spans (``generate``, ``reward``, ``train``, ``commit``), rollout's ``engine`` busy
intervals and ``utilization`` totals (tool waits), and the jobs' records (TTFS, TPTS).

- ``engine_busy``: share of the run's wall time with at least one request in the engine;
- ``engine_requests``: the mean number of requests in the engine while it is busy (its batch);
- ``trainer_busy``: share with a GRPO step, a pipelined group's gradients (``accumulate``) or a
  commit running; ``idle``: neither;
- ``train_threads``: the torch thread counts the trainer's steps ran with;
- ``handoff_ms``: policy-committed -> the first generation with that version (announcement,
  adapter download and load), per version;
- ``ready_to_train_ms``: trajectory-ready -> the trainer starting on the batch (the broker,
  plus any wait for the trainer or, under ``sync``, for the round's barrier);
- ``overhead_ms``: per version, everything but generation (tool waits included) and the
  gradient step: handoff, reward, ready->train and the commit.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

from marlaas.platform.events import Span
from marlaas.platform.telemetry import UTILIZATION_JOB

Interval = tuple[float, float]


def covered(intervals: Iterable[Interval], start: float, end: float) -> float:
    """Seconds of [start, end] covered by the union of ``intervals``."""
    total, cursor = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, cursor), min(b, end)
        if b > a:
            total += b - a
            cursor = b
    return total


def fraction(intervals: Iterable[Interval], start: float, end: float) -> float:
    return covered(intervals, start, end) / (end - start) if end > start else 0.0


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _by_key(spans: Iterable[Span], phase: str) -> dict[tuple[str, int], Span]:
    return {(s.job, s.version): s for s in spans if s.phase == phase}


def _own_version(s: Span) -> bool:
    """Whether a generate span's batch was sampled by the version it trains (not sampled ahead, at
    bounded staleness: such a batch starts before its step's version exists, so there is no
    handoff to measure)."""
    return s.attrs.get("sampled_version", s.version) == s.version


def handoffs_ms(spans: Sequence[Span]) -> list[float]:
    """Per version: commit of v (its span is filed under v) -> rollout starting to generate with v."""
    commits = _by_key(spans, "commit")
    return [(s.start - commits[(s.job, s.version)].end) * 1000 for s in spans
            if s.phase == "generate" and (s.job, s.version) in commits and _own_version(s)]


def ready_to_train_ms(spans: Sequence[Span]) -> list[float]:
    """Per version: the batch's rewards done (then published) -> its train step starting (a
    pipelined batch: its last group's rewards -> the step, its groups' gradients already added)."""
    rewards = _by_key(spans, "reward")
    return [(s.start - rewards[(s.job, s.version)].end) * 1000 for s in spans
            if s.phase == "train" and (s.job, s.version) in rewards]


def overheads_ms(spans: Sequence[Span]) -> list[float]:
    """Per version v -> v+1: handoff + reward + ready->train + commit (milliseconds)."""
    by_phase = {phase: _by_key(spans, phase) for phase in ("generate", "reward", "train", "commit")}
    out = []
    for (job, v), train in by_phase["train"].items():
        generate, reward = by_phase["generate"].get((job, v)), by_phase["reward"].get((job, v))
        commit, announced = by_phase["commit"].get((job, v + 1)), by_phase["commit"].get((job, v))
        if generate is None or reward is None or commit is None or announced is None or not _own_version(generate):
            continue
        out.append(((generate.start - announced.end) + (reward.end - reward.start)
                    + (train.start - reward.end) + (commit.end - commit.start)) * 1000)
    return out


def phase_medians_ms(spans: Sequence[Span]) -> dict[str, float | None]:
    """Where a version's time goes: the median duration of each phase, and of the gaps between."""
    durations = {phase: [(s.end - s.start) * 1000 for s in spans if s.phase == phase]
                 for phase in ("generate", "reward", "train", "commit")}
    return {"handoff": percentile(handoffs_ms(spans), 0.5), **{
        phase: percentile(values, 0.5) for phase, values in durations.items()},
        "ready_to_train": percentile(ready_to_train_ms(spans), 0.5)}


def summarize(values: Sequence[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 0.5), "p90": percentile(values, 0.9), "n": len(values)}


def run_metrics(spans: Sequence[Span], jobs: Sequence[dict], start: float, end: float) -> dict:
    """The figures of one run: ``jobs`` are its job views (as dicts), [start, end] its wall window."""
    ids = {j["id"] for j in jobs}
    mine = [s for s in spans if s.job in ids]
    util = [s for s in spans if s.job == UTILIZATION_JOB and s.end > start and s.start < end]
    engine = [(s.start, s.end) for s in util if s.phase == "engine"]
    trainer = [(s.start, s.end) for s in mine if s.phase in ("train", "commit", "accumulate")]
    wall = end - start
    steps = sum(j["steps"] for j in jobs)
    tokens = sum(float(s.attrs.get("tokens", 0)) for s in mine if s.phase == "generate")
    trains = [s for s in mine if s.phase == "train" and "tokens" in s.attrs]
    loss_tokens = sum(float(s.attrs["tokens"]) for s in trains)
    scored_tokens = sum(float(s.attrs.get("tokens_scored", s.attrs["tokens"])) for s in trains)
    totals = [s.attrs for s in util if s.phase == "utilization"]
    tools_pending = sum(float(t.get("tools_pending_s", 0)) for t in totals)
    busy_s = sum(float(t.get("engine_busy_s", 0)) for t in totals)
    request_s = sum(float(t.get("engine_request_s", 0)) for t in totals)
    ttfs = [j["ttfs_s"] for j in jobs if j.get("ttfs_s") is not None]
    tpts = [j["tpts_s"] for j in jobs if j.get("tpts_s") is not None]
    handoff, ready, overhead = handoffs_ms(mine), ready_to_train_ms(mine), overheads_ms(mine)
    return {
        "jobs": len(jobs),
        "completed": sum(j["state"] == "completed" for j in jobs),
        "steps": steps,
        "wall_s": wall,
        "steps_per_hour": steps / wall * 3600 if wall > 0 else 0.0,
        "engine_busy": fraction(engine, start, end),
        "engine_requests": request_s / busy_s if busy_s else None,
        "trainer_busy": fraction(trainer, start, end),
        "train_threads": sorted({int(s.attrs["threads"]) for s in trains if "threads" in s.attrs}),
        "idle": 1.0 - fraction(engine + trainer, start, end),
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "tool_wait_fraction": tools_pending / wall if wall > 0 else 0.0,
        # the share of trained tokens run through the model (the rest: groups of equal rewards)
        "scored_token_share": scored_tokens / loss_tokens if loss_tokens else None,
        "ttfs_s": statistics.mean(ttfs) if ttfs else None,
        "tpts_s": statistics.mean(tpts) if tpts else None,
        "handoff_ms": summarize(handoff),
        "ready_to_train_ms": summarize(ready),
        "overhead_ms": summarize(overhead),
        "phase_ms": phase_medians_ms(mine),
        "histograms": {"handoff_ms": handoff, "ready_to_train_ms": ready},
        "final_reward": {j["name"]: (j["rewards"][-1] if j["rewards"] else None) for j in jobs},
        # less noisy than one batch: the mean of the last three versions' batch rewards
        "mean_last_rewards": {j["name"]: (statistics.mean(j["rewards"][-3:]) if j["rewards"] else None)
                              for j in jobs},
        "curves": learning_curves(mine, jobs, start),
    }


def learning_curves(spans: Sequence[Span], jobs: Sequence[dict], start: float) -> dict[str, list[list[float]]]:
    """Per job, its batch reward at each trained version as [version, seconds since the run's start
    at that version's commit, reward]: what a reader plots against versions and against wall time."""
    committed = {(s.job, s.version): s.end for s in spans if s.phase == "commit"}
    curves = {}
    for j in jobs:
        points = []
        for version, reward in enumerate(j.get("rewards") or []):
            at = committed.get((j["id"], version + 1))  # the batch of version v makes v + 1
            if at is not None and reward is not None:
                points.append([version, round(at - start, 3), reward])
        curves[j["name"]] = points
    return curves


def timeline(spans: Sequence[Span], jobs: Sequence[dict], start: float) -> list[dict]:
    """Per job, its phases as (phase, start, end) relative to the run's start, for the Figure 3 plot."""
    names = {j["id"]: j["name"] for j in jobs}
    return [{"job": names[s.job], "phase": s.phase, "start": s.start - start, "end": s.end - start}
            for s in spans if s.job in names and s.phase in ("generate", "reward", "train", "commit")]
