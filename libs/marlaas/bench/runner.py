"""Run a workload under each chosen mode, one after another, on this machine.

Each mode gets a fresh embedded stack (same model, same services, only the schedule
settings differ), warmed with a short untimed job. Then for every number of jobs in
the workload's sweep, the jobs are submitted at once and timed from the first submit
to the last completion; the services' spans give every other figure
(``marlaas.bench.metrics``) and a sampler records each service's peak RSS and CPU seconds (its whole
process tree: rollout's includes its vLLM engine core). The ``inprocess`` mode runs
the single-user loop of ``benchmarks/inprocess_grpo.py`` on the same jobs one after
another instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from marlaas.bench.metrics import run_metrics, timeline
from marlaas.bench.workload import BASELINE_LOOP, WORKLOAD_DIR, Workload, job_settings, stack_settings
from marlaas.platform.bus import Bus
from marlaas.platform.config import load_config
from marlaas.platform.nats_client import BusClient
from marlaas.platform.telemetry import read_spans
from marlaas.stack.launcher import Stack

Progress = Callable[[str, int, int], None]  # (label, steps done, steps in all)
SPAN_FLUSH_S = 2.5  # rollout publishes engine intervals every 2 s: wait for the last ones


class ResourceSampler:
    """Peak resident memory and CPU time of each service's process tree, sampled in a thread.

    CPU time is counted per process from its first sample to its last (user + system), so
    ``cpu_s`` is what each service burnt during the run, not since it started: on a machine
    with fewer cores than busy processes it shows which service takes the cores. A vLLM
    engine core (a child named ``VLLM::...``) is counted apart, as ``"<service> engine"``:
    it runs the model on threads of its own, so whether it saturates them is the question.
    """

    def __init__(self, stack: Stack, every_s: float = 1.0) -> None:
        self.stack, self.every_s = stack, every_s
        self.peak_mib: dict[str, float] = {}
        self._cpu_first: dict[tuple[str, int], float] = {}
        self._cpu_last: dict[tuple[str, int], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def cpu_s(self) -> dict[str, float]:
        """CPU seconds each service's processes used between the first sample and the last."""
        used: dict[str, float] = {}
        for key, last in self._cpu_last.items():
            used[key[0]] = used.get(key[0], 0.0) + last - self._cpu_first[key]
        return {name: round(seconds, 2) for name, seconds in used.items()}

    def _sample(self) -> None:
        import psutil

        for name, proc in list(self.stack.procs.items()):
            try:
                root = psutil.Process(proc.pid)
                tree = [root, *root.children(recursive=True)]
                rss = 0
                for p in tree:
                    with p.oneshot():
                        rss += p.memory_info().rss
                        times = p.cpu_times()
                        part = f"{name} engine" if p is not root and p.name().startswith("VLLM::") else name
                    self._cpu_first.setdefault((part, p.pid), times.user + times.system)
                    self._cpu_last[(part, p.pid)] = times.user + times.system
            except psutil.Error:
                continue
            self.peak_mib[name] = max(self.peak_mib.get(name, 0.0), rss / 2**20)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def __enter__(self) -> ResourceSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


async def run_jobs(url: str, submissions: list[dict], label: str, progress: Progress | None,
                    timeout_s: float) -> tuple[list[dict], float, float]:
    client = await BusClient.connect(url)
    try:
        started = time.time()
        ids = list(await asyncio.gather(*(client.submit(s) for s in submissions)))
        total = sum(s["steps"] for s in submissions)
        deadline = time.monotonic() + timeout_s
        while True:
            views = [v for v in await client.status() if v.id in ids]
            if progress:
                progress(label, sum(v.steps for v in views), total)
            if all(v.state in ("completed", "failed", "cancelled") for v in views):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{label}: jobs not finished after {timeout_s:.0f}s")
            await asyncio.sleep(0.5)
        return [msgspec.to_builtins(v) for v in views], started, time.time()
    finally:
        await client.close()


async def _spans(url: str):
    await asyncio.sleep(SPAN_FLUSH_S)
    bus = await Bus.connect(url)
    try:
        return await read_spans(bus)
    finally:
        await bus.close()


@contextlib.contextmanager
def bench_stack(overrides: dict, max_jobs: int, base_model: str = ""):
    """A fresh embedded stack with ``overrides`` (a mode's settings and a workload's), in a
    temporary home that is removed afterwards."""
    home = Path(tempfile.mkdtemp(prefix="marlaas-bench-"))
    settings = {"home": str(home), "gateway.port": 0, "base_model": base_model or None, **overrides}
    # every mode may hold all jobs' announcements at once (sync needs it for its barrier), and
    # the engine all their adapters in one batch
    for key, default in (("rollout.concurrency", 16), ("rollout.max_loras", 16)):
        settings[key] = max(settings.get(key, default), max_jobs)
    try:
        with Stack(load_config(overrides=settings, env={})) as stack:
            yield stack
    finally:
        shutil.rmtree(home, ignore_errors=True)


def measure(stack: Stack, submissions: list[dict], label: str, progress: Progress | None = None,
            timeout_s: float = 3600.0) -> dict:
    """Submit ``submissions`` at once, wait for all, and return the run's figures."""
    with ResourceSampler(stack) as sampler:
        jobs, start, end = asyncio.run(run_jobs(stack.nats_url, submissions, label, progress, timeout_s))
    spans = asyncio.run(_spans(stack.nats_url))
    ids = {j["id"] for j in jobs}  # the run ends with its last commit, not the last poll
    end = max((s.end for s in spans if s.job in ids and s.phase == "commit"), default=end)
    figures = run_metrics(spans, jobs, start, end)
    cpu_s = sampler.cpu_s
    return {**figures, "peak_rss_mib": dict(sampler.peak_mib), "cpu_s": cpu_s,
            "cpu_load": cpu_load(cpu_s, figures["wall_s"]), "timeline": timeline(spans, jobs, start)}


def cpu_load(cpu_s: dict[str, float], wall_s: float, cores: int | None = None) -> float:
    """The services' CPU seconds over the run's core-seconds: 1.0 = every core busy all along."""
    cores = cores or os.cpu_count() or 1
    return sum(cpu_s.values()) / (wall_s * cores) if wall_s > 0 else 0.0


def warm_up(stack: Stack, submissions: list[dict], label: str, progress: Progress | None = None,
            steps: int = 3) -> None:
    """Short untimed jobs, one per kind of job at once: first-use costs (the engine's kernels
    for each batch shape, the trainer, adapter loads) are not measured."""
    asyncio.run(run_jobs(stack.nats_url, [{**s, "steps": steps} for s in submissions], label, progress, 1800.0))


def run_mode(workload: Workload, mode: str, quick: bool, progress: Progress | None = None,
             timeout_s: float = 3600.0, base_model: str = "") -> list[dict]:
    """Every sweep point of ``workload`` under schedule ``mode``, on one fresh stack."""
    counts = workload.job_counts(quick)
    runs = []
    settings = job_settings(mode)

    def with_mode(submissions: list[dict]) -> list[dict]:
        return [{**s, "grpo": {**s.get("grpo", {}), **settings}} if settings else s for s in submissions]

    with bench_stack({**workload.overrides(), **stack_settings(mode)}, max(counts), base_model) as stack:
        warm_up(stack, with_mode(workload.one_of_each(f"{mode}-warmup")), f"{mode} warm-up", progress)
        for n in counts:
            label = f"{mode}-{n}"
            repeats = [measure(stack, with_mode(workload.submissions(n, quick, f"{label}-s{seed}", seed)),
                               f"{label} seed {seed}" if workload.seeds > 1 else label, progress, timeout_s)
                       for seed in range(workload.seeds)]
            runs.append({"mode": mode, **mean_run(repeats)})
    return runs


def mean_run(repeats: list[dict]) -> dict:
    """One sweep point's figures over its seeds: each top-level number the mean, the rest the first
    seed's; ``seeds`` keeps each seed's throughput, rewards and learning curves."""
    if len(repeats) == 1:
        return {**repeats[0], "seeds": [_seed_figures(repeats[0])]}
    first = repeats[0]
    merged = {key: (statistics.mean(r[key] for r in repeats)
                    if isinstance(value, (int, float)) and not isinstance(value, bool)
                    and all(isinstance(r.get(key), (int, float)) for r in repeats) else value)
              for key, value in first.items()}
    merged["jobs"] = first["jobs"]
    return {**merged, "seeds": [_seed_figures(r) for r in repeats]}


def _seed_figures(run: dict) -> dict:
    return {key: run.get(key) for key in ("steps_per_hour", "wall_s", "final_reward", "mean_last_rewards",
                                          "curves")}


def load_inprocess_loop():
    """``run_inprocess`` from benchmarks/inprocess_grpo.py (a script of the repository, not the package)."""
    path = WORKLOAD_DIR.parent / "inprocess_grpo.py"
    spec = importlib.util.spec_from_file_location("inprocess_grpo", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run_inprocess


def run_baseline_loop(workload: Workload, quick: bool, progress: Progress | None = None) -> list[dict]:
    """The single-user loop, run for each sweep point's jobs one after another. It takes the
    first job's ``grpo`` settings for all, the engine settings (``rollout.*``) of the stack, and
    each tool's mean latency as a fixed delay."""
    run_inprocess = load_inprocess_loop()
    latency = workload.config.get("env", {}).get("tool_latency_s", {})
    delays = [d if isinstance(d, (int, float)) else sum(d) / 2 for d in latency.values()]
    engine = {k: v for k, v in workload.overrides().items() if k.startswith("rollout.")}
    runs = []
    for n in workload.job_counts(quick):
        label = f"{BASELINE_LOOP}-{n}"
        subs = workload.submissions(n, quick, label)
        if progress:
            progress(label, 0, sum(s["steps"] for s in subs))
        result = run_inprocess([s["task"] for s in subs], steps=workload.versions(quick),
                               grpo=subs[0].get("grpo", {}), tool_latency_s=max(delays, default=0.0),
                               overrides=engine, progress=False)
        if progress:
            progress(label, result["steps"], result["steps"])
        runs.append({**result, "mode": BASELINE_LOOP, "jobs": n})
    return runs


def run_benchmark(workload: Workload, modes: list[str], quick: bool,
                  progress: Progress | None = None, base_model: str = "") -> dict:
    """Every mode of ``modes`` in turn; the result document ``marlaas bench --json`` prints."""
    import platform

    runs = []
    for mode in modes:
        runs += run_baseline_loop(workload, quick, progress) if mode == BASELINE_LOOP else \
            run_mode(workload, mode, quick, progress, base_model=base_model)
    return {
        "workload": workload.name, "description": workload.description, "quick": quick,
        "steps_per_job": workload.versions(quick),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "runs": runs,
    }
