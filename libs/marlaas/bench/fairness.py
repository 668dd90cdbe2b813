# over 500 lines: one benchmark end to end (workload, pure share math, runs, report); the math could move out
"""``marlaas bench fairness``: do tenants' weights bound what one tenant can take from another?

Tenant A submits many jobs, tenant B (the *victim*) one job while its Tinker client samples in a
loop (through the gateway, with B's key) until that job is done. Three runs, each timed from the
first submit to the last commit:

- ``alone``: tenant B by itself (its job and its sampling loop), on the fair-share stack (a tenant
  alone gets everything either way);
- ``fair``: both tenants at once, with ``rollout.fair_share`` and ``trainer.fair_share`` on;
- ``fifo``: the same on a stack with both off (first come first served: today's baseline).

A workload may name fewer runs (``runs``), give a tenant a job of its own (``[tenants.NAME.job]``,
over ``[job]``: a hostile volume), let the others start first (``victim_after_s``: their requests
already fill the engine when the victim comes) and stop them once the victim's job is done
(``stop_with_victim``: they are cancelled, their leftover work ending with the run's stack, so a
run that stops them is its stack's last). ``benchmarks/workloads/fairness-hostile.toml`` is H5's.

The figures, from what the services recorded (spans and the USAGE stream's metering events):

- ``engine_share_vs_weight``: per tenant, its share of the engine's tokens (prefilled + generated)
  while *both* tenants had engine work in flight (a job's ``generate``, a Tinker sample), over its
  weight's share (weight / sum of weights); 1.0 = exactly its weight;
- ``trainer_share_vs_weight``: likewise for trainer seconds, while both had a batch waiting or
  training (a batch's rewards done -> its train step over; a Tinker training request);
- ``engine_share_vs_fair`` and ``trainer_share_vs_fair``: the same shares over each tenant's
  *weighted max-min fair* share (:func:`max_min_shares`): a tenant that asks for less than its
  weight's share is owed only what it asks for (B's rate while busy alone, over the run's rate
  while both were busy), and the rest goes to the others by weight. A work-conserving scheduler
  cannot do better than this, and a tenant with one job rarely fills half an engine that batches
  every request at once: the share over weight then measures B's demand, this one the scheduler;
- ``victim_tpts_vs_alone``: B's job's time per step (TPTS) in the run over B's alone;
- ``throughput_vs_fifo``: all jobs' versions per hour under fair share over FIFO's.

A metering event says only when its work ended: an engine event is spread over the span of its
job that it belongs to (the nearest ``generate`` or ``tinker_sample``), a trainer event over the
``train_s`` seconds before it. Counting an amount inside a window assumes the work went at an even
pace over its interval. The workload file (``benchmarks/workloads/fairness.toml``) is data: the
tenants, their weights and job counts, the job, the sampling loop, and the targets.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import threading
import time
import tomllib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

import msgspec

from marlaas.bench.report import TargetCheck
from marlaas.bench.workload import WORKLOAD_DIR, WorkloadError
from marlaas.platform.events import Span
from marlaas.platform.max_min import max_min_shares
from marlaas.platform.usage import tenant_of

Interval = tuple[float, float]
ENGINE_PHASES = ("generate", "tinker_sample")
# how each target of the workload file is read: a share within 1 +- the value, else a bound
TARGETS = {"engine_share_vs_weight": "within", "trainer_share_vs_weight": "within",
           "engine_share_vs_fair": "within", "trainer_share_vs_fair": "within",
           "victim_tpts_vs_alone": "at_most", "throughput_vs_fifo": "at_least"}
RUNS = ("alone", "fair", "fifo")
FAIR = {"rollout.fair_share": True, "trainer.fair_share": True}
FIFO = {"rollout.fair_share": False, "trainer.fair_share": False}


# --- the workload file ----------------------------------------------------------------------


class TenantLoad(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One tenant of the benchmark: its weight, how many of the job it submits at once, and what it
    changes in the workload's job (``grpo`` key by key: a hostile tenant's volume)."""

    weight: float = 1.0
    jobs: int = 1
    job: dict[str, Any] = {}


class SamplerLoad(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The victim's Tinker sampling loop, of the base model: ``in_flight`` requests at a time, each
    sent again when it is answered (0: no sampling loop, the victim's job alone)."""

    prompt_tokens: int = 24
    max_tokens: int = 16
    num_samples: int = 4
    in_flight: int = 1


class FairnessWorkload(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``benchmarks/workloads/fairness.toml``: ``kind = "fairness"`` marks it for this runner."""

    kind: Literal["fairness"]
    name: str = ""
    description: str = ""
    tenants: dict[str, TenantLoad]
    victim: str
    steps: int = 10  # versions per job
    quick_steps: int = 0  # ... under --quick (0 = steps)
    job: dict[str, Any]  # a submission: task, grpo, ...
    sampler: SamplerLoad = SamplerLoad()
    config: dict[str, dict[str, Any]] = {}
    targets: dict[str, float] = {}
    runs: tuple[str, ...] = RUNS  # which of the three to run
    victim_after_s: float = 0.0  # > 0: the others submit first, the victim this long after
    stop_with_victim: bool = False  # the others' jobs are cancelled once the victim's is done

    def __post_init__(self) -> None:
        from marlaas.platform.tenants import check_tenant_name, check_weight

        if len(self.tenants) < 2 or self.victim not in self.tenants:
            raise ValueError(f"name two or more [tenants.NAME], the victim ({self.victim!r}) one of them")
        for name, load in self.tenants.items():
            check_tenant_name(name)
            check_weight(load.weight)
            if load.jobs < 1:
                raise ValueError(f"tenants.{name}.jobs must be at least 1")
        if min(self.steps, self.quick_steps or self.steps) < 2:
            raise ValueError("steps must be at least 2 (time per step is measured from the second version)")
        if self.sampler.in_flight < 0:
            raise ValueError("sampler.in_flight must be 0 (no sampling loop) or more")
        if not set(self.runs) <= set(RUNS) or "alone" not in self.runs or len(self.runs) < 2:
            raise ValueError(f"runs: \"alone\" and one or both of \"fair\", \"fifo\" (got {list(self.runs)})")
        if self.victim_after_s < 0:
            raise ValueError("victim_after_s must be 0 or more")
        if "task" not in self.job:
            raise ValueError("[job] needs a task")
        unknown = set(self.targets) - set(TARGETS)
        if unknown:
            raise ValueError(f"unknown targets {sorted(unknown)}; choose from {sorted(TARGETS)}")

    def versions(self, quick: bool) -> int:
        return (self.quick_steps or self.steps) if quick else self.steps

    @property
    def weights(self) -> dict[str, float]:
        return {name: load.weight for name, load in self.tenants.items()}

    def overrides(self) -> dict[str, Any]:
        return {f"{section}.{key}": value for section, fields in self.config.items() for key, value in fields.items()}

    def job_of(self, tenant: str) -> dict[str, Any]:
        """The job ``tenant`` submits: ``[job]`` with the tenant's own changes (``grpo`` and ``lora``
        key by key)."""
        own = self.tenants[tenant].job
        return {**self.job, **own, **{k: {**self.job.get(k, {}), **own[k]} for k in ("grpo", "lora") if k in own}}


def _workload_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    return WORKLOAD_DIR / f"{name_or_path}.toml" if not path.suffix else path


def is_fairness_workload(name_or_path: str) -> bool:
    """Whether the workload file says ``kind = "fairness"`` (anything else is the schedules' runner's)."""
    path = _workload_path(name_or_path)
    try:
        return path.is_file() and tomllib.loads(path.read_text()).get("kind") == "fairness"
    except tomllib.TOMLDecodeError:
        return False  # the schedules' loader reports it


def load_fairness_workload(name_or_path: str) -> FairnessWorkload:
    path = _workload_path(name_or_path)
    try:
        return msgspec.convert({"name": path.stem, **tomllib.loads(path.read_text())}, FairnessWorkload)
    except (msgspec.ValidationError, ValueError) as exc:
        raise WorkloadError(f"workload {path}: {exc}") from exc


# --- the figures (pure) ---------------------------------------------------------------------


class Work(NamedTuple):
    """An amount of one resource (tokens, seconds) a tenant used, spread evenly over [start, end]."""

    tenant: str
    start: float
    end: float
    amount: float


class Metered(NamedTuple):
    """A metering event (``UsageReported``) as the figures need it."""

    tenant: str
    job: str
    service: str
    at: float
    engine_tokens: int
    train_s: float


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The intervals merged: sorted, none overlapping."""
    merged: list[Interval] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        elif b > a:
            merged.append((a, b))
    return merged


def intersect(xs: Sequence[Interval], ys: Sequence[Interval]) -> list[Interval]:
    """Where two merged interval lists overlap."""
    out = []
    for a, b in xs:
        for c, d in ys:
            lo, hi = max(a, c), min(b, d)
            if hi > lo:
                out.append((lo, hi))
    return union(out)


def all_busy(demand: dict[str, list[Interval]]) -> list[Interval]:
    """The times every tenant of ``demand`` had work in flight."""
    windows: list[Interval] | None = None
    for intervals in demand.values():
        windows = union(intervals) if windows is None else intersect(windows, union(intervals))
    return windows or []


def amounts_in(work: Iterable[Work], windows: Sequence[Interval]) -> dict[str, float]:
    """Each tenant's amount inside ``windows`` (an instant's amount counts whole if inside one)."""
    out: dict[str, float] = {}
    for w in work:
        if w.end > w.start:
            inside = sum(max(0.0, min(w.end, b) - max(w.start, a)) for a, b in windows) / (w.end - w.start)
        else:
            inside = float(any(a <= w.start <= b for a, b in windows))
        out[w.tenant] = out.get(w.tenant, 0.0) + w.amount * inside
    return out


def share_vs_weight(amounts: dict[str, float], weights: dict[str, float]) -> dict[str, float] | None:
    """Each tenant's share of the amounts over its weight's share: 1.0 = exactly its weight; None
    when nothing was used (no window where all were busy)."""
    total = sum(amounts.get(t, 0.0) for t in weights)
    if total <= 0:
        return None
    all_weights = sum(weights.values())
    return {t: (amounts.get(t, 0.0) / total) / (w / all_weights) for t, w in weights.items()}


def share_vs_fair(amounts: dict[str, float], fair: dict[str, float]) -> dict[str, float] | None:
    """Each tenant's share of the amounts over its max-min fair share (1.0 = exactly that)."""
    total = sum(amounts.get(t, 0.0) for t in fair)
    if total <= 0:
        return None
    return {t: (amounts.get(t, 0.0) / total) / f if f > 0 else None for t, f in fair.items()}


def busy_rate(work: Iterable[Work], busy: Sequence[Interval]) -> float | None:
    """The amount per second of a tenant's ``work`` while it was ``busy`` (its own demand windows)."""
    seconds = sum(b - a for a, b in busy)
    return sum(amounts_in(work, busy).values()) / seconds if seconds > 0 else None


def engine_demand(spans: Iterable[Span]) -> dict[str, list[Interval]]:
    """Per tenant, when it had requests in the engine (waiting or running)."""
    out: dict[str, list[Interval]] = {}
    for s in spans:
        if s.phase in ENGINE_PHASES:
            out.setdefault(tenant_of(s.job), []).append((s.start, s.end))
    return out


def trainer_demand(spans: Sequence[Span]) -> dict[str, list[Interval]]:
    """Per tenant, when it had a batch waiting for the trainer or in it: from a version's rewards
    done (or its first group's gradients, pipelined) to its train step's end; a Tinker training
    request while it ran."""
    ready: dict[tuple[str, int], float] = {}
    for s in spans:
        if s.phase in ("reward", "accumulate"):
            at = s.end if s.phase == "reward" else s.start
            ready[(s.job, s.version)] = min(at, ready.get((s.job, s.version), at))
    out: dict[str, list[Interval]] = {}
    for s in spans:
        if s.phase == "train":
            out.setdefault(tenant_of(s.job), []).append((min(s.start, ready.get((s.job, s.version), s.start)), s.end))
        elif s.service == "trainer" and s.phase.startswith("tinker_"):
            out.setdefault(tenant_of(s.job), []).append((s.start, s.end))
    return out


def engine_work(metered: Iterable[Metered], spans: Sequence[Span]) -> list[Work]:
    """Engine tokens, each event over the engine span of its job nearest to it (an event is
    published just after its batch's ``generate``, or within a pipelined one or a Tinker sample)."""
    by_job: dict[str, list[Span]] = {}
    for s in spans:
        if s.phase in ENGINE_PHASES:
            by_job.setdefault(s.job, []).append(s)
    work = []
    for m in metered:
        if m.service != "rollout" or not m.engine_tokens:
            continue
        near = min(by_job.get(m.job, []), key=lambda s: max(s.start - m.at, 0.0, m.at - s.end), default=None)
        start, end = (near.start, near.end) if near else (m.at, m.at)
        work.append(Work(m.tenant, start, end, float(m.engine_tokens)))
    return work


def trainer_work(metered: Iterable[Metered]) -> list[Work]:
    """Trainer seconds, each event over the seconds just before it."""
    return [Work(m.tenant, m.at - m.train_s, m.at, m.train_s) for m in metered if m.service == "trainer" and m.train_s]


def shares(spans: Sequence[Span], metered: Sequence[Metered], weights: dict[str, float]) -> dict:
    """Engine and trainer shares over weight while every tenant was busy, with the windows' seconds."""
    engine_windows = all_busy({t: engine_demand(spans).get(t, []) for t in weights})
    trainer_windows = all_busy({t: trainer_demand(spans).get(t, []) for t in weights})
    engine = amounts_in(engine_work(metered, spans), engine_windows)
    trainer = amounts_in(trainer_work(metered), trainer_windows)
    return {
        "engine_share_vs_weight": share_vs_weight(engine, weights),
        "trainer_share_vs_weight": share_vs_weight(trainer, weights),
        "engine_amounts": engine, "trainer_amounts": trainer,
        "engine_window_s": sum(b - a for a, b in engine_windows),
        "trainer_window_s": sum(b - a for a, b in trainer_windows),
    }


def version_phases_ms(spans: Sequence[Span], job: str) -> dict[str, float | None]:
    """Where ``job``'s versions went, the mean of each phase (ms): the handoff to rollout, its
    generation, rewards, the wait for the trainer (``ready_to_train``), the train step and the commit."""
    from marlaas.bench.metrics import handoffs_ms, ready_to_train_ms

    own = [s for s in spans if s.job == job]

    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    return {"handoff": mean(handoffs_ms(own)), **{
        phase: mean([(s.end - s.start) * 1000 for s in own if s.phase == phase]) for phase in ("generate", "reward")},
        "ready_to_train": mean(ready_to_train_ms(own)),
        **{phase: mean([(s.end - s.start) * 1000 for s in own if s.phase == phase]) for phase in ("train", "commit")}}


def alone_rates(spans: Sequence[Span], metered: Sequence[Metered], tenant: str) -> dict[str, float | None]:
    """A tenant's engine tokens and trainer seconds per second while it was busy alone: its demand."""
    return {"engine_rate": busy_rate([w for w in engine_work(metered, spans) if w.tenant == tenant],
                                     union(engine_demand(spans).get(tenant, []))),
            "trainer_rate": busy_rate([w for w in trainer_work(metered) if w.tenant == tenant],
                                      union(trainer_demand(spans).get(tenant, [])))}


def vs_fair(run: dict, alone: dict, kind: str, weights: dict[str, float], victim: str) -> dict[str, float] | None:
    """``run``'s ``kind`` ("engine", "trainer") shares over the max-min fair shares, the victim's
    demand being its rate alone over the run's rate while all were busy (the others': all they get)."""
    amounts, window = run.get(f"{kind}_amounts") or {}, run.get(f"{kind}_window_s") or 0.0
    rate = alone.get(f"{kind}_rate")
    if window <= 0 or not amounts or rate is None:
        return None
    capacity = sum(amounts.values()) / window
    demand: dict[str, float | None] = {t: None for t in weights}
    demand[victim] = min(1.0, rate / capacity) if capacity > 0 else None
    return share_vs_fair(amounts, max_min_shares(weights, demand))


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fairness_figures(alone: dict, fair: dict | None, fifo: dict | None, weights: dict[str, float] | None = None,
                     victim: str = "") -> dict:
    """The ``fairness`` document from the runs' figures (with ``weights`` and the ``victim``, the
    shares over the max-min fair ones too); a run left out gives None figures."""
    def contended(run: dict | None) -> dict:
        if run is None:
            return dict.fromkeys(("engine_share_vs_weight", "trainer_share_vs_weight", "victim_tpts_vs_alone",
                                  "engine_share_vs_fair", "trainer_share_vs_fair"))
        figures = {"engine_share_vs_weight": run["engine_share_vs_weight"],
                   "trainer_share_vs_weight": run["trainer_share_vs_weight"],
                   "victim_tpts_vs_alone": ratio(run["victim_tpts_s"], alone["victim_tpts_s"])}
        if weights and victim:
            figures.update({f"{kind}_share_vs_fair": vs_fair(run, alone, kind, weights, victim)
                            for kind in ("engine", "trainer")})
        return figures

    throughput = ratio(fair["steps_per_hour"], fifo["steps_per_hour"]) if fair and fifo else None
    return {**contended(fair), "throughput_vs_fifo": throughput, "fifo": contended(fifo)}


def check_fairness_targets(fairness: dict, targets: dict[str, float]) -> list[TargetCheck]:
    """Each target against the fair-share run: a share target holds if every tenant's share over its
    weight is within 1 +- the value (measured: the largest deviation)."""
    checks = []
    for key, wanted in targets.items():
        value = fairness.get(key)
        if TARGETS[key] == "within":
            found = [v for v in (value or {}).values() if v is not None]
            value = max(abs(v - 1.0) for v in found) if found else None
            owed = "fair share" if key.endswith("_fair") else "weight"
            checks.append(TargetCheck(f"{key} (largest |share/{owed} - 1|)", wanted, value, upper_bound=True))
        else:
            checks.append(TargetCheck(key, wanted, value, upper_bound=TARGETS[key] == "at_most"))
    return checks


# --- the runs (IO) --------------------------------------------------------------------------


async def _add_tenants(nats_url: str, workload: FairnessWorkload) -> dict[str, str]:
    """Each tenant added with its weight (what ``marlaas tenant add`` / ``set`` do); their tokens."""
    from marlaas.platform.bus import Bus
    from marlaas.platform.tenants import DEFAULT_MAX_JOBS, add_tenant, set_tenant

    bus = await Bus.connect(nats_url)
    try:
        tokens = {}
        for name, load in workload.tenants.items():
            _, tokens[name] = await add_tenant(bus, name, max_jobs=max(DEFAULT_MAX_JOBS, load.jobs))
            await set_tenant(bus, name, weight=load.weight)
        return tokens
    finally:
        await bus.close()


async def _records(nats_url: str) -> tuple[list[Span], list[Metered]]:
    """Every span and metering event recorded so far (after the last ones are flushed)."""
    from marlaas.bench.runner import SPAN_FLUSH_S
    from marlaas.platform import subjects
    from marlaas.platform.bus import Bus
    from marlaas.platform.telemetry import read_spans
    from marlaas.platform.usage import USAGE

    await asyncio.sleep(SPAN_FLUSH_S)
    bus = await Bus.connect(nats_url)
    try:
        spans = await read_spans(bus)
        events = [USAGE.decode(data) for data in await bus.read_all("USAGE", subjects.USAGE_STREAM)]
    finally:
        await bus.close()
    return spans, [Metered(e.tenant, e.job, e.service, e.at, e.counters.prefill_tokens + e.counters.generated_tokens,
                           e.counters.train_s) for e in events]


def _sample_loop(url: str, api_key: str, base_model: str, load: SamplerLoad, stop: threading.Event,
                 done: list) -> None:
    """The victim's Tinker client: sample the base model, ``load.in_flight`` requests at a time,
    until ``stop``; ``done`` gets each answer's time (or the error that ended the loop)."""
    import tinker
    from tinker import types

    prompt = types.ModelInput.from_ints(list(range(100, 100 + load.prompt_tokens)))
    params = types.SamplingParams(max_tokens=load.max_tokens, temperature=1.0)
    try:
        with tinker.ServiceClient(base_url=url, api_key=api_key) as service:
            sampler = service.create_sampling_client(base_model=base_model).result()
            pending = collections.deque(sampler.sample(prompt, load.num_samples, params)
                                        for _ in range(load.in_flight))
            while pending:
                pending.popleft().result()
                done.append(time.time())
                if not stop.is_set():
                    pending.append(sampler.sample(prompt, load.num_samples, params))
    except Exception as exc:  # re-raised by the run, after its jobs
        done.append(exc)


async def _wait(nats_url: str, ids: list[str], victim_job: str, stop_sampling: threading.Event, label: str,
                progress, steps: int, timeout_s: float, stop_others: bool = False) -> list[dict]:
    """Poll the jobs until all are finished; the sampling stops when the victim's job is (and with
    ``stop_others`` the other jobs are cancelled then)."""
    from marlaas.platform.nats_client import BusClient

    client = await BusClient.connect(nats_url)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            views = [v for v in await client.status() if v.id in ids]
            if progress:
                progress(label, sum(v.steps for v in views), steps * len(ids))
            finished = {v.id for v in views if v.state in ("completed", "failed", "cancelled")}
            if victim_job in finished:
                stop_sampling.set()
                if stop_others:
                    for job in set(ids) - finished:
                        await client.cancel(job)
            if len(finished) == len(ids):
                return [msgspec.to_builtins(v) for v in views]
            if time.monotonic() > deadline:
                raise TimeoutError(f"{label}: jobs not finished after {timeout_s:.0f}s")
            await asyncio.sleep(0.5)
    finally:
        await client.close()


def run_tenants(stack, workload: FairnessWorkload, tokens: dict[str, str], jobs: dict[str, int], sampling: bool,
                steps: int, label: str, progress=None, timeout_s: float = 3600.0, stop_others: bool = False) -> dict:
    """Submit ``jobs[tenant]`` jobs for each tenant (with its token, through the gateway), the victim's
    first (last, ``victim_after_s`` after the others, if that is set), its Tinker client sampling
    meanwhile if ``sampling``; wait for all (cancelling the others' once the victim's is done, with
    ``stop_others``); return the run's figures."""
    from marlaas.sdk import Client

    url = stack.gateway_url
    stop, samples = threading.Event(), []
    sampler = threading.Thread(target=_sample_loop, daemon=True, args=(
        f"{url}/tinker", f"tml-{tokens[workload.victim]}", stack.config.base_model or "builtin:chat",
        workload.sampler, stop, samples))
    others = [t for t in jobs if t != workload.victim]
    head_start = workload.victim_after_s if others else 0.0
    order = [*others, workload.victim] if head_start else [workload.victim, *others]
    started = time.time()
    ids: dict[str, list[str]] = {}
    try:
        for tenant in order:
            if tenant == workload.victim and head_start:
                time.sleep(head_start)  # the others' requests fill the engine first
            with Client(url, tokens[tenant]) as client:
                ids[tenant] = [client.submit({**workload.job_of(tenant), "name": f"{label}-{tenant}-{i}", "seed": i,
                                              "steps": steps}) for i in range(jobs[tenant])]
            if tenant == workload.victim and sampling and workload.sampler.in_flight:
                sampler.start()
        every = [i for tenant in order for i in ids[tenant]]
        views = asyncio.run(_wait(stack.nats_url, every, ids[workload.victim][0], stop, label, progress, steps,
                                  timeout_s, stop_others))
    finally:
        stop.set()
        if sampler.is_alive():
            sampler.join(timeout=120)
    failed = [s for s in samples if isinstance(s, Exception)]
    if failed:
        raise RuntimeError(f"{label}: the victim's Tinker sampling failed: {failed[0]!r}")
    spans, metered = asyncio.run(_records(stack.nats_url))
    answered = len(samples) * workload.sampler.num_samples
    return run_figures(spans, metered, views, started, workload, label, samples=answered)


def run_figures(spans: Sequence[Span], metered: Sequence[Metered], views: list[dict], started: float,
                workload: FairnessWorkload, label: str, samples: int = 0) -> dict:
    """One run's figures: its jobs' records and the Tinker work of its tenants within its time."""
    ids = {v["id"] for v in views}
    end = max((s.end for s in spans if s.job in ids and s.phase == "commit"), default=time.time())
    tinker_jobs = {f"{t}.tinker" for t in workload.tenants}

    def in_run(job: str, start: float, stop: float) -> bool:
        return job in ids or (job in tinker_jobs and start >= started and stop <= end)

    mine = [s for s in spans if in_run(s.job, s.start, s.end)]
    metered = [m for m in metered if in_run(m.job, m.at, m.at)]
    tenants = {v["tenant"] for v in views} | {tenant_of(m.job) for m in metered}
    weights = {t: w for t, w in workload.weights.items() if t in tenants}
    victim = next(v for v in views if v["tenant"] == workload.victim)
    steps, wall = sum(v["steps"] for v in views), end - started
    alone = alone_rates(mine, metered, workload.victim) if len(weights) == 1 else {}
    return {"run": label, "jobs": {t: sum(v["tenant"] == t for v in views) for t in weights}, **alone,
            "completed": sum(v["state"] == "completed" for v in views), "steps": steps, "wall_s": wall,
            "steps_per_hour": steps / wall * 3600 if wall > 0 else 0.0, "victim_tpts_s": victim["tpts_s"],
            "victim_phases_ms": version_phases_ms(mine, victim["id"]),
            "tinker_samples": samples, **(shares(mine, metered, weights) if len(weights) > 1 else {
                "engine_share_vs_weight": None, "trainer_share_vs_weight": None})}


def _stack_runs(workload: FairnessWorkload, settings: dict, runs: list[tuple[str, bool]], quick: bool,
                progress, base_model: str) -> list[dict]:
    """``runs`` (label, whether every tenant takes part) on one fresh stack with ``settings``, after
    an untimed warm-up (a short job of each tenant, the victim sampling, all run to the end):
    first-use costs are not measured. A contended run stops the others with the victim if the
    workload says so: it is the stack's last, so what they leave in flight measures nothing."""
    from marlaas.bench.runner import bench_stack

    everyone = {t: load.jobs for t, load in workload.tenants.items()}
    with bench_stack({**workload.overrides(), **settings}, sum(everyone.values()), base_model) as stack:
        tokens = asyncio.run(_add_tenants(stack.nats_url, workload))
        mode = "fair" if settings["rollout.fair_share"] else "fifo"
        run_tenants(stack, workload, tokens, dict.fromkeys(everyone, 1), True, 2, f"{mode} warm-up", progress)
        return [run_tenants(stack, workload, tokens, everyone if contended else {workload.victim: 1}, True,
                            workload.versions(quick), label, progress,
                            stop_others=contended and workload.stop_with_victim) for label, contended in runs]


def run_fairness(workload: FairnessWorkload, quick: bool, progress=None, base_model: str = "") -> dict:
    """The workload's runs (B alone and fair share on one stack, FIFO on another); the result document."""
    import platform

    on_fair = [(label, label == "fair") for label in ("alone", "fair") if label in workload.runs]
    runs = _stack_runs(workload, FAIR, on_fair, quick, progress, base_model)
    if "fifo" in workload.runs:
        runs += _stack_runs(workload, FIFO, [("fifo", True)], quick, progress, base_model)
    by_label = {r["run"]: r for r in runs}
    return {"workload": workload.name, "description": workload.description, "quick": quick,
            "steps_per_job": workload.versions(quick), "victim": workload.victim, "weights": workload.weights,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
            "fairness": fairness_figures(by_label["alone"], by_label.get("fair"), by_label.get("fifo"),
                                         workload.weights, workload.victim),
            "runs": runs}


# --- the report -----------------------------------------------------------------------------


def _fmt(value, pattern: str = "{:.2f}") -> str:
    return "–" if value is None else pattern.format(value)


def markdown_fairness(result: dict, checks: Sequence[TargetCheck]) -> str:
    """The result as markdown: one row per run, the ratios, the targets."""
    tenants = list(result["weights"])
    share_cols = [f"{kind} {t}" for kind in ("engine", "trainer") for t in tenants]
    parts = [f"# Benchmark `{result['workload']}`{' (quick)' if result['quick'] else ''}", "",
             result["description"], "",
             f"{result['steps_per_job']} versions per job; victim `{result['victim']}`; weights "
             + ", ".join(f"{t} {w:g}" for t, w in result["weights"].items())
             + f"; machine: {result['machine']['cpus']} CPUs, {result['machine']['platform']}.", "",
             "Shares are each tenant's share over its weight's (1.00 = its weight) while all were busy.", "",
             "| run | jobs | wall s | steps/h | victim TPTS s | Tinker samples | " + " | ".join(share_cols)
             + " | engine window s | trainer window s |", "|" + "---|" * (8 + len(share_cols))]
    for r in result["runs"]:
        shares_ = [_fmt((r[f"{kind}_share_vs_weight"] or {}).get(t)) for kind in ("engine", "trainer") for t in tenants]
        parts.append(f"| {r['run']} | {', '.join(f'{t} {n}' for t, n in r['jobs'].items())} | {r['wall_s']:.1f} | "
                     f"{r['steps_per_hour']:.0f} | {_fmt(r['victim_tpts_s'])} | {r['tinker_samples']} | "
                     + " | ".join(shares_) + f" | {_fmt(r.get('engine_window_s'), '{:.1f}')} | "
                     f"{_fmt(r.get('trainer_window_s'), '{:.1f}')} |")
    f = result["fairness"]
    tpts = {r["run"]: r["victim_tpts_s"] for r in result["runs"]}
    parts += ["", "- victim's time per version: " + ", ".join(f"{run} {_fmt(s)} s" for run, s in tpts.items()),
              f"- victim's TPTS against alone: fair share {_fmt(f['victim_tpts_vs_alone'])}x, "
              f"FIFO {_fmt(f['fifo']['victim_tpts_vs_alone'])}x",
              f"- throughput (all jobs' versions per hour), fair share over FIFO: {_fmt(f['throughput_vs_fifo'])}x"]
    for kind in ("engine", "trainer"):
        fair, fifo = f.get(f"{kind}_share_vs_fair") or {}, f["fifo"].get(f"{kind}_share_vs_fair") or {}
        parts.append(f"- {kind} share over the max-min fair share (the victim owed no more than it asks for alone): "
                     + ", ".join(f"{t} {_fmt(fair.get(t))} (FIFO {_fmt(fifo.get(t))})" for t in tenants))
    parts.append("")
    phases = list(result["runs"][0].get("victim_phases_ms") or {})
    if phases:
        parts += ["Where the victim's versions went (means, ms):", "",
                  "| run | " + " | ".join(phases) + " |", "|" + "---|" * (1 + len(phases))]
        parts += [f"| {r['run']} | " + " | ".join(_fmt((r.get("victim_phases_ms") or {}).get(p), "{:.0f}")
                                                for p in phases) + " |" for r in result["runs"]]
        parts.append("")
    if checks:
        parts += ["Targets (the fair-share run):", ""] + [f"- {c.line()}" for c in checks] + [""]
    return "\n".join(parts)


def bench_fairness(args, config) -> int:
    """``marlaas bench fairness``: run, write results.json and results.md, print the report (or JSON)."""
    from rich.console import Console
    from rich.markdown import Markdown

    from marlaas.bench.progress import step_bars

    if args.modes:
        raise ValueError("--modes: a fairness workload runs its own three runs (alone, fair, fifo); leave it out")
    workload = load_fairness_workload(args.workload)
    out = Path(args.out or f"bench-results/{workload.name}{'-quick' if args.quick else ''}")
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TINKER_TELEMETRY", "0")  # the tinker SDK would report to its vendor
    console = Console(stderr=True)
    with step_bars(console) as progress:
        result = run_fairness(workload, args.quick, progress, base_model=config.base_model)
    checks = check_fairness_targets(result["fairness"], workload.targets)
    result["targets"] = [{"target": c.target, "wanted": c.wanted, "measured": c.measured, "met": c.met}
                         for c in checks]
    (out / "results.json").write_bytes(msgspec.json.format(msgspec.json.encode(result)))
    report = markdown_fairness(result, checks)
    (out / "results.md").write_text(report)
    if args.json:
        print(json.dumps({**result, "out": str(out)}))
    else:
        Console().print(Markdown(report))
        console.print(f"results and report in {out}/")
    return 0
