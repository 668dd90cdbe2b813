"""The garbage-collection plan: which of a job's objects no committed version needs."""

from __future__ import annotations

import pytest

from marlaas.platform.samples import group_key, keeps_samples
from services.manager.gc import parse_key, plan_collection

JOB = "acme.add-1a2b3c"
pytestmark = pytest.mark.timeout(10)


def attempt(kind: str, version: int, name: str) -> str:
    return f"{kind}/{JOB}/v{version:06d}/{name}"


def adapter_keys(version: int, name: str) -> list[str]:
    prefix = attempt("adapters", version, name)
    return [f"{prefix}/adapter_config.json", f"{prefix}/adapter_model.safetensors"]


def optimizer_key(version: int, name: str) -> str:
    return attempt("optimizer", version, name) + "/adamw.pt"


def batch_key(version: int, name: str) -> str:
    return attempt("trajectories", version, name) + "/batch.json"


def committed_up_to(latest: int) -> dict[int, str]:
    return {v: attempt("adapters", v, f"win{v}") for v in range(latest + 1)}


def plan(keys, latest, keep_last=3, pinned=(), committed=None, optimizer=None):
    committed = committed_up_to(latest) if committed is None else committed
    return set(plan_collection(JOB, keys, committed, latest, keep_last, set(pinned), optimizer))


def test_adapters_older_than_the_last_k_versions_go():
    keys = [k for v in range(6) for k in adapter_keys(v, f"win{v}")]
    doomed = plan(keys, latest=5, keep_last=3)
    assert doomed == {k for v in (0, 1, 2) for k in adapter_keys(v, f"win{v}")}


def test_pinned_versions_keep_their_committed_adapter():
    keys = [k for v in range(6) for k in adapter_keys(v, f"win{v}")]
    doomed = plan(keys, latest=5, keep_last=1, pinned={0, 3})
    assert doomed == {k for v in (1, 2, 4) for k in adapter_keys(v, f"win{v}")}


def test_losing_attempts_are_orphans_at_any_version_up_to_latest():
    keys = [*adapter_keys(1, "lost1"), *adapter_keys(4, "win4"), *adapter_keys(4, "lost4"),
            *adapter_keys(5, "win5"), *adapter_keys(5, "lost5")]
    doomed = plan(keys, latest=5, keep_last=3, pinned={1})
    assert doomed == {*adapter_keys(1, "lost1"), *adapter_keys(4, "lost4"), *adapter_keys(5, "lost5")}


def test_an_old_versions_orphans_go_with_it():
    keys = [*adapter_keys(0, "win0"), *adapter_keys(0, "crashed")]
    assert plan(keys, latest=4, keep_last=2) == set(keys)


def test_nothing_of_a_version_above_latest_is_touched():
    keys = [*adapter_keys(6, "inflight"), *adapter_keys(7, "other"), optimizer_key(6, "inflight"),
            batch_key(6, "inflight"), batch_key(9, "x")]
    assert plan(keys, latest=5, keep_last=1) == set()


def test_only_the_latest_committed_optimizer_state_stays():
    latest = optimizer_key(5, "win5")
    keys = [optimizer_key(3, "win3"), optimizer_key(4, "win4"), latest, optimizer_key(5, "lost5")]
    assert plan(keys, latest=5, optimizer=latest) == {optimizer_key(3, "win3"), optimizer_key(4, "win4"),
                                                       optimizer_key(5, "lost5")}


def test_without_a_committed_optimizer_every_state_up_to_latest_goes():
    keys = [optimizer_key(0, "crashed"), optimizer_key(1, "inflight")]
    assert plan(keys, latest=0, optimizer=None) == {optimizer_key(0, "crashed")}


def test_trajectory_batches_older_than_latest_go():
    keys = [batch_key(3, "a"), batch_key(4, "b"), batch_key(5, "c"), batch_key(5, "d")]
    assert plan(keys, latest=5) == {batch_key(3, "a"), batch_key(4, "b")}


def test_kept_samples_go_as_their_retention_lets_them_and_pinned_ones_stay():
    keys = [group_key(JOB, v, g) for v in range(201) for g in (0, 1)]
    doomed = plan(keys, latest=200, pinned={3})
    assert doomed == {group_key(JOB, v, g) for v in range(201) for g in (0, 1) if not keeps_samples(v, 200, {3})}
    assert group_key(JOB, 3, 0) not in doomed and group_key(JOB, 200, 1) not in doomed
    assert plan([group_key(JOB, 300, 0)], latest=200) == set()  # sampled ahead (bounded staleness)


def test_a_version_without_a_known_committed_attempt_keeps_all_its_attempts():
    keys = [*adapter_keys(4, "a"), *adapter_keys(4, "b"), *adapter_keys(5, "win5")]
    committed = {5: attempt("adapters", 5, "win5")}  # version 4's announcement was never read
    assert plan(keys, latest=5, committed=committed) == set()


def test_unrecognised_keys_and_other_jobs_are_left_alone():
    keys = [f"adapters/{JOB}/notes.txt", f"adapters/{JOB}/vX/a/f", f"adapters/{JOB}x/v000000/a/f",
            "adapters/other.job/v000000/a/f", f"scratch/{JOB}/v000000/a/f"]
    assert plan(keys, latest=9, keep_last=1) == set()
    assert parse_key(f"adapters/{JOB}/v000002/abc/adapter_config.json", JOB).version == 2


def test_keep_last_must_be_positive():
    with pytest.raises(ValueError, match="keep_last"):
        plan([], latest=0, keep_last=0)
