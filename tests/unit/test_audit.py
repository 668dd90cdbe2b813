"""The on-policy audit counts a version's trainings by the commits they produced: a batch trained
again after a crash before its commit is one training, two committed trainings are a violation."""

from __future__ import annotations

from marlaas.platform.audit import audit_training
from marlaas.platform.events import Span


def train(version: int, attempt: str) -> Span:
    attrs = {"batch_id": "b", "attempt": attempt, "batch_version": version,
             "sampled_version": version, "adapter_version": version, "logprob_gap": 1e-6}
    return Span(job="j", service="trainer", phase="train", version=version, start=0.0, end=1.0, attrs=attrs)


def commit(version: int, attempt: str) -> Span:
    return Span(job="j", service="trainer", phase="commit", version=version + 1, start=1.0, end=2.0,
                attrs={"attempt": attempt})


def test_a_batch_retrained_after_a_crash_before_its_commit_is_trained_once():
    # attempt 1 died (killed trainer) between its train span and its commit; attempt 2 committed
    spans = [train(3, attempt="a1"), train(3, attempt="a2"), commit(3, attempt="a2")]
    assert audit_training(spans) == []


def test_two_committed_trainings_of_one_version_are_reported():
    spans = [train(3, attempt="a1"), commit(3, attempt="a1"), train(3, attempt="a2"), commit(3, attempt="a2")]
    assert audit_training(spans) == ["j v3: trained 2 times"]


def test_an_uncommitted_attempt_is_still_checked_for_on_policy_training():
    stale = train(3, attempt="a1")
    stale.attrs["adapter_version"] = 2
    spans = [stale, train(3, attempt="a2"), commit(3, attempt="a2")]
    assert audit_training(spans) == ["j v3: trained from other versions {'adapter_version': 2}"]


def test_a_batch_within_its_staleness_bound_passes_and_its_behaviour_gap_is_not_checked():
    stale = train(5, attempt="a1")
    stale.attrs.update(sampled_version=4, max_staleness=1, staleness=1.0, logprob_gap=0.3)
    assert audit_training([stale, commit(5, attempt="a1")]) == []


def test_a_batch_older_than_its_bound_fails_the_audit():
    stale = train(5, attempt="a1")
    stale.attrs.update(sampled_version=3, max_staleness=1, staleness=2.0)
    assert audit_training([stale, commit(5, attempt="a1")]) == [
        "j v5: trained from other versions {'sampled_version': 3} (max_staleness 1)"]


def test_a_strict_batch_sampled_by_another_version_fails_and_a_stale_gap_counts_at_staleness_0():
    early = train(5, attempt="a1")
    early.attrs.update(sampled_version=4)  # max_staleness 0 (absent): strictly on-policy
    off = train(6, attempt="a2")
    off.attrs.update(max_staleness=2, logprob_gap=0.3)  # sampled by the trained version: checked
    assert audit_training([early, commit(5, "a1"), off, commit(6, "a2")]) == [
        "j v5: trained from other versions {'sampled_version': 4}",
        "j v6: engine-vs-trainer logprob gap 0.3 > 0.0002"]
