"""The on-policy audit: what each trained batch was sampled and trained from, read back from spans.

The trainer checks a batch's version against the committed one before it trains;
this audit does not re-read that check. It compares facts recorded where they live:
the version in the batch's event, the adapter version rollout says the engine served
(``sampled_version``), the version of the adapter in the trainer's memory when it
stepped (``adapter_version``), and the engine-vs-trainer ``logprob_gap`` (mean
|log p_trainer - log p_engine| over the batch's trained tokens). The gap is the one
signal that sees weights rather than labels: an engine serving stale or another job's
weights under the right name (vllm#47724, #42125) shows up there and nowhere else.

Bounded staleness (``grpo.max_staleness`` = k, recorded on each train span as ``max_staleness``):
a batch trains step s but may be sampled by a version b with s - k <= b <= s; the span records
its ``staleness`` s - b. The adapter it was trained from must still be s. The logprob gap is a
check of weights only where the sampler is the trained version (staleness 0): a stale batch's gap
is the behaviour gap, large by design, and is not checked.

A batch is trained again when the trainer died (or failed) after the step and before its
commit: that attempt's update was never committed, so it is not a second training. Each
``train`` span carries the name of its ``attempt`` (unique, drawn at random: a delivery count
repeats after a broker restart), and so does the ``commit`` span of the version it produced;
only a training whose commit landed counts towards "trained once".
"""

from __future__ import annotations

from collections import Counter

from marlaas.platform.events import Span

# fp32 on both sides agrees to ~1e-6 per token here; one optimizer step of lr 2e-3 moves it ~1e-3
MAX_LOGPROB_GAP = 2e-4


def audit_training(spans: list[Span], max_logprob_gap: float = MAX_LOGPROB_GAP) -> list[str]:
    """Every violation of strict on-policy training found in the ``train`` spans, as readable lines:
    a version whose committed update was trained more than once, any attempt (committed or not)
    trained from another version than its batch's, and any engine-vs-trainer gap too large."""
    problems = []
    train = [s for s in spans if s.phase == "train"]
    committed = {s.attrs["attempt"] for s in spans if s.phase == "commit" and "attempt" in s.attrs}
    took_effect = [s for s in train if s.attrs.get("attempt") in committed]
    for (job, version), count in Counter((s.job, s.version) for s in took_effect).items():
        if count > 1:
            problems.append(f"{job} v{version}: trained {count} times")
    for s in train:
        recorded = {name: s.attrs.get(name) for name in ("batch_version", "sampled_version", "adapter_version")}
        bound = s.attrs.get("max_staleness", 0)
        sampled = recorded.pop("sampled_version")
        wrong = {name: value for name, value in recorded.items() if value != s.version}
        if not isinstance(sampled, (int, float)) or not s.version - bound <= sampled <= s.version:
            wrong["sampled_version"] = sampled
        if wrong:
            problems.append(f"{s.job} v{s.version}: trained from other versions {wrong}"
                            + (f" (max_staleness {bound})" if bound else ""))
        if sampled != s.version:
            continue  # a stale batch: its gap is the behaviour gap (see above)
        gap = s.attrs.get("logprob_gap")
        if not isinstance(gap, float) or not gap <= max_logprob_gap:
            problems.append(f"{s.job} v{s.version}: engine-vs-trainer logprob gap {gap} > {max_logprob_gap}")
    return problems


def gaps_by_version(spans: list[Span], job: str) -> dict[int, float]:
    """The engine-vs-trainer logprob gap of each trained version of ``job``."""
    return {s.version: float(s.attrs["logprob_gap"]) for s in spans
            if s.phase == "train" and s.job == job and "logprob_gap" in s.attrs}
