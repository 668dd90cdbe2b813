"""Benchmark workloads: data (TOML files in ``benchmarks/workloads/``), not code.

A workload names the jobs to run, the stack settings they run under, the schedules
(modes) to compare, and the targets to check, e.g.::

    description = "ten agentic jobs with injected tool latency"
    modes = ["async", "sync", "sequential"]
    quick_modes = ["async", "sequential"]  # optional: the modes of --quick
    steps = 10          # versions per job
    quick_steps = 4     # ... under --quick
    sweep = [1, 2, 4]   # optional: run with 1, 2 and 4 jobs (the job list is cycled)
    quick_sweep = [1, 2]

    [config.env]        # stack settings (any section of the config)
    tool_latency_s = {calculator = [0.5, 1.5]}

    [[jobs]]
    task = "multiply"
    count = 10
    [jobs.grpo]         # optional: any submission field
    max_new_tokens = 64

    [targets]           # printed as met / missed
    "steps_per_hour async/sequential" = 6.0
    "engine_busy async" = 0.85
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import msgspec

# each mode is a schedule of the same services: the stack settings that select it
MODES: dict[str, dict[str, Any]] = {
    "async": {"manager.schedule": "async"},
    "sync": {"manager.schedule": "sync"},
    "sequential": {"manager.schedule": "sequential"},
    "async-single-lora": {"manager.schedule": "async", "rollout.multi_lora": False},
    "sync-single-lora": {"manager.schedule": "sync", "rollout.multi_lora": False},
    "async-adaptive": {"manager.schedule": "async", "manager.admission": "adaptive"},
    # within one job: whole batches (generate, then train) against complete-group pipelining;
    # ``grpo.*`` keys are the jobs' settings, not the stack's (``job_settings``)
    "async-batch": {"manager.schedule": "async", "grpo.pipeline": "batch"},
    "async-groups": {"manager.schedule": "async", "grpo.pipeline": "groups"},
    # ... and the engine serving first the batches and groups closest to complete, against FIFO
    "async-groups-frontier": {"manager.schedule": "async", "grpo.pipeline": "groups", "rollout.dispatch": "frontier"},
    # bounded staleness: batches sampled up to 1 or 2 versions behind the one they train
    "async-stale1": {"manager.schedule": "async", "grpo.max_staleness": 1},
    "async-stale2": {"manager.schedule": "async", "grpo.max_staleness": 2},
}


def stack_settings(mode: str) -> dict[str, Any]:
    """The stack's settings of ``mode`` (dotted config keys)."""
    return {k: v for k, v in MODES[mode].items() if not k.startswith("grpo.")}


def job_settings(mode: str) -> dict[str, Any]:
    """The ``grpo`` settings ``mode`` gives every job it runs."""
    return {k.removeprefix("grpo."): v for k, v in MODES[mode].items() if k.startswith("grpo.")}
BASELINE_LOOP = "inprocess"  # not a schedule: the single-user loop of benchmarks/inprocess_grpo.py
WORKLOAD_DIR = Path(__file__).resolve().parents[3] / "benchmarks" / "workloads"


class WorkloadError(ValueError):
    """A workload file is missing or wrong; the message says what to fix."""


class JobTemplate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    task: str
    count: int = 1
    name: str = ""
    grpo: dict[str, Any] = {}
    lora: dict[str, Any] = {}


class Workload(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str = ""
    description: str = ""
    modes: list[str] = msgspec.field(default_factory=lambda: ["async", "sync", "sequential"])
    quick_modes: list[str] = []  # [] = modes
    steps: int = 10
    quick_steps: int = 0  # 0 = steps
    sweep: list[int] = []  # numbers of jobs; [] = the job list as written
    quick_sweep: list[int] = []
    jobs: list[JobTemplate]
    config: dict[str, dict[str, Any]] = {}
    targets: dict[str, float] = {}
    # each sweep point is run this many times with other job seeds (learning curves with a spread);
    # the run's figures are the means over them
    seeds: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.seeds <= 10:
            raise ValueError("seeds must be between 1 and 10")
        unknown = [m for m in [*self.modes, *self.quick_modes] if m not in MODES and m != BASELINE_LOOP]
        if unknown:
            raise ValueError(f"unknown modes {unknown}; choose from {[*MODES, BASELINE_LOOP]}")
        if not self.jobs or any(t.count < 1 for t in self.jobs):
            raise ValueError("a workload needs [[jobs]] entries with count >= 1")
        if self.steps < 1 or any(n < 1 for n in [*self.sweep, *self.quick_sweep]):
            raise ValueError("steps and every sweep point must be >= 1")

    def modes_to_run(self, quick: bool) -> list[str]:
        return (self.quick_modes or self.modes) if quick else self.modes

    def job_counts(self, quick: bool) -> list[int]:
        """The numbers of concurrent jobs to run (one run each)."""
        sweep = (self.quick_sweep or self.sweep) if quick else self.sweep
        return sweep or [sum(t.count for t in self.jobs)]

    def versions(self, quick: bool) -> int:
        return (self.quick_steps or self.steps) if quick else self.steps

    def submissions(self, n_jobs: int, quick: bool, label: str, seed: int = 0) -> list[dict]:
        """``n_jobs`` job submissions, cycling through the job list; seeded ``100 * seed`` + 0..n-1."""
        expanded = [t for t in self.jobs for _ in range(t.count)]
        out = []
        for i in range(n_jobs):
            t = expanded[i % len(expanded)]
            out.append({"name": f"{label}-{t.name or t.task}-{i}", "task": t.task, "seed": 100 * seed + i,
                        "steps": self.versions(quick), **({"grpo": t.grpo} if t.grpo else {}),
                        **({"lora": t.lora} if t.lora else {})})
        return out

    def one_of_each(self, label: str) -> list[dict]:
        """One submission per job template (a warm-up that meets every kind of job)."""
        firsts = [sum(t.count for t in self.jobs[:i]) for i in range(len(self.jobs))]
        everyone = self.submissions(sum(t.count for t in self.jobs), False, label)
        return [everyone[i] for i in firsts]

    def overrides(self) -> dict[str, Any]:
        """The stack settings as dotted keys (``env.tool_latency_s``)."""
        return {f"{section}.{key}": value for section, fields in self.config.items()
                for key, value in fields.items()}


def load_workload(name_or_path: str) -> Workload:
    """A workload by name (``benchmarks/workloads/<name>.toml``) or by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = WORKLOAD_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in WORKLOAD_DIR.glob("*.toml"))
        raise WorkloadError(f"no workload {name_or_path!r} ({path}); known: {', '.join(known) or 'none'}")
    try:
        raw = tomllib.loads(path.read_text())
        return msgspec.convert({"name": path.stem, **raw}, Workload)
    except (tomllib.TOMLDecodeError, msgspec.ValidationError, ValueError) as exc:
        raise WorkloadError(f"workload {path}: {exc}") from exc
