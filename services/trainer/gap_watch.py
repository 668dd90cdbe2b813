"""What the trainer does about an engine-vs-trainer logprob gap past its bound: pure decisions.

A batch sampled by the version it trains (staleness 0) carries the engine's logprob of every
sampled token; the trainer scores the same tokens under the same weights, and the mean absolute
difference (``logprob_gap``) is the one check that sees the weights rather than their labels
(``marlaas.platform.audit``). Past its bound, the engine and the trainer did not hold the same
policy, and a step on that batch would train off-policy. Who is at fault decides what follows:

- **the base changed** (its digest differs from the one taken at load, ``base_weights``): a
  platform fault whoever's batch found it. The base is loaded again and the batch put back, to
  be trained on the base every other tenant's engine uses.
- **several tenants at once** (``PLATFORM_TENANTS`` distinct tenants past the bound within
  ``WINDOW_S``): a fault of the platform's, not of each job (an engine serving wrong weights, a
  trainer whose state went wrong in a way the digest cannot see): the base is reloaded and the
  batch put back, once a window; past that, each job is failed on its own.
- **one job**: its batch is not trained and the job fails, saying why (retrying would compare the
  same logprobs again).

Every case raises an operator alert (a ``span`` of phase ``alert`` on the METRICS stream, counted
by the gateway's ``/metrics`` as ``marlaas_alerts_total``) and an error in the trainer's log.

Bound: the on-policy audit's tests hold fp32 engines to 2e-4 (measured agreement, 1e-6 a token);
the trainer acts at ``trainer.max_logprob_gap``, by default 5x that for an fp32 engine beside a
CPU trainer, so that a long sequence's rounding never fails a tenant's job, and 0.1 otherwise (a
half-precision engine: bf16 and fp32 disagree by ~1e-2 a token; a trainer on an accelerator: not
measured yet). What it must catch is orders of magnitude larger: a rewritten
base gave 8-12 a token (issue 48 H2), a stale adapter ~1e-3 after one step at lr 2e-3.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field

WINDOW_S = 120.0
PLATFORM_TENANTS = 2
FP32_GAP = 1e-3  # 5x the audit's 2e-4 (marlaas.platform.audit.MAX_LOGPROB_GAP)
HALF_PRECISION_GAP = 0.1


def gap_bound(configured: float, engine_dtype: str, trainer_device: str = "cpu") -> float:
    """The bound the trainer acts at: ``trainer.max_logprob_gap`` if set (> 0; inf turns the check
    off), else by the engine's dtype (see the module docstring). The fp32 bound is measured with both
    sides on CPUs; a trainer on an accelerator gets the half-precision bound until a run there
    measures its agreement (docs/gpu.md)."""
    if configured > 0:
        return configured
    fp32_on_cpus = engine_dtype in ("float32", "float") and trainer_device == "cpu"
    return FP32_GAP if fp32_on_cpus else HALF_PRECISION_GAP


class Verdict(enum.Enum):
    TRAIN = "train"  # within the bound (or nothing to compare): train and commit
    FAIL_JOB = "fail_job"  # this job's batch is off-policy: fail the job
    RELOAD_BASE = "reload_base"  # a platform fault: reload the base, put the batch back


@dataclass
class GapWatch:
    """The gaps past the bound seen lately, by tenant, and the last reload they caused."""

    bound: float
    window_s: float = WINDOW_S
    platform_tenants: int = PLATFORM_TENANTS
    seen: deque[tuple[float, str]] = field(default_factory=deque)  # (when, tenant), oldest first
    reloaded_at: float = -math.inf

    def over(self, gap: float | None) -> bool:
        """Whether ``gap`` (None: the batch had no engine logprobs to compare) is past the bound."""
        return gap is not None and not gap <= self.bound  # NaN is past it

    def judge(self, gap: float | None, tenant: str, now: float, base_changed: bool) -> Verdict:
        """What to do with a batch of ``tenant`` whose gap is ``gap`` (``base_changed``: the digest
        check's answer, asked only when the gap is past the bound)."""
        if not self.over(gap):
            return Verdict.TRAIN
        self.seen.append((now, tenant))
        while self.seen and self.seen[0][0] < now - self.window_s:
            self.seen.popleft()
        if base_changed:
            self.reloaded_at = now
            return Verdict.RELOAD_BASE
        several = len({t for _, t in self.seen}) >= self.platform_tenants
        if several and now - self.reloaded_at >= self.window_s:
            self.reloaded_at = now
            return Verdict.RELOAD_BASE
        return Verdict.FAIL_JOB
