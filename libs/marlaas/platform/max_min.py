"""Weighted max-min fair shares (water-filling): one home for the rule that the rollout's running
bound (services/rollout/fair_share.py) applies and the fairness benchmark (marlaas.bench.fairness)
measures against."""

from __future__ import annotations

from collections.abc import Mapping


def max_min_shares(weights: Mapping[str, float], demand: Mapping[str, float | None],
                   total: float = 1.0) -> dict[str, float]:
    """Each tenant's weighted max-min share of ``total``: its ``demand`` (None: as much as it can
    get) is met if it is below its weighted share of what the others leave, and what it leaves
    goes to the rest by weight."""
    left, shares, open_ = float(total), {}, dict(weights)
    while open_:
        weight = sum(open_.values())
        capped = {t: d for t in open_ if (d := demand.get(t)) is not None and d < left * open_[t] / weight}
        if not capped:
            shares.update({t: left * w / weight for t, w in open_.items()})
            break
        for t, d in capped.items():
            shares[t] = d
            left -= d
            del open_[t]
    return shares
