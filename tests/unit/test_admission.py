"""Admission by KV-cache budget, FIFO, the sequential schedule, and the adaptive policy."""

import json

import msgspec

from marlaas.platform.events import JobRecord, JobSpec, JobState
from services.manager.adaptive import SETTLE_MAX_S, AdaptiveAdmission
from services.manager.admission import job_footprint, kv_bytes_per_token, to_admit


def record(job: str, state: JobState, footprint: int, at: float) -> JobRecord:
    spec = JobSpec(id=job, tenant="t", name=job, task="addition", steps=1, submitted_at=at)
    return JobRecord(spec=spec, state=state, kv_cache_bytes=footprint)


def test_footprint_counts_keys_and_values_of_every_layer(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "hidden_size": 128, "head_dim": 32}))
    per_token = kv_bytes_per_token(tmp_path, "float32")
    assert per_token == 2 * 4 * 2 * 32 * 4
    assert job_footprint(8, 8, 10, 6, per_token) == 64 * 16 * per_token


def test_jobs_queue_when_the_budget_is_full_and_keep_fifo_order():
    records = [
        record("running", JobState.RUNNING, 60, 0.0),
        record("big", JobState.QUEUED, 50, 1.0),
        record("small", JobState.QUEUED, 10, 2.0),
    ]
    assert to_admit(records, budget_bytes=100, schedule="async") == []  # big waits; small may not overtake
    records[0] = record("running", JobState.COMPLETED, 60, 0.0)
    assert to_admit(records, budget_bytes=100, schedule="async") == ["big", "small"]


def test_sequential_schedule_admits_one_job_at_a_time():
    records = [record(f"j{i}", JobState.QUEUED, 1, float(i)) for i in range(3)]
    assert to_admit(records, budget_bytes=100, schedule="sequential") == ["j0"]
    records[0] = record("j0", JobState.RUNNING, 1, 0.0)
    assert to_admit(records, budget_bytes=100, schedule="sequential") == []


def test_a_limit_caps_what_fits():
    records = [record(f"j{i}", JobState.QUEUED, 10, float(i)) for i in range(3)]
    assert to_admit(records, budget_bytes=100, schedule="async", limit=1) == ["j0"]
    assert to_admit(records, budget_bytes=100, schedule="async", limit=0) == []


def running(job: str, version: int, tpts_s: float = 1.0) -> JobRecord:
    r = record(job, JobState.RUNNING, 10, 0.0)
    return msgspec.structs.replace(r, version=version, first_commit_at=100.0,
                                   last_commit_at=100.0 + tpts_s * max(version - 1, 0))


def test_adaptive_admits_while_the_engine_idles_one_settled_job_at_a_time():
    policy = AdaptiveAdmission(target_engine_busy=0.9)
    queued = [record("q", JobState.QUEUED, 10, 5.0)]
    assert policy.slots(queued, now=1000.0) == 1  # nothing runs: admit at once
    policy.admitted("a", now=1000.0)
    policy.observe_engine(1000.0, 1002.0, busy_s=1.0)  # half busy
    assert policy.slots([running("a", 1), *queued], now=1002.0) == 0  # a has not settled yet
    assert policy.slots([running("a", 2), *queued], now=1002.0) == 1  # settled, engine half idle
    policy.observe_engine(1002.0, 1012.0, busy_s=9.8)
    assert policy.slots([running("a", 5), *queued], now=1012.0) == 0  # saturated: admitting adds nothing
    assert policy.slots([running("a", 1), *queued], now=1000.0 + SETTLE_MAX_S) == 0  # settled by time, still busy


def test_adaptive_stops_when_a_running_job_is_slower_than_the_tpts_target():
    policy = AdaptiveAdmission(target_engine_busy=0.9, target_tpts_s=2.0)
    policy.observe_engine(0.0, 10.0, busy_s=1.0)  # mostly idle
    assert policy.slots([running("a", 4, tpts_s=1.5)], now=10.0) == 1
    assert policy.slots([running("a", 4, tpts_s=2.5)], now=10.0) == 0
    assert AdaptiveAdmission(0.9).slots([running("a", 4)], now=10.0) == 0  # no utilization seen yet


def test_adaptive_stops_while_the_trainers_are_saturated_counting_each_replica():
    policy = AdaptiveAdmission(target_engine_busy=0.9, target_trainer_busy=0.9)
    policy.observe_engine(0.0, 10.0, busy_s=1.0)  # the engine mostly idle
    assert policy.slots([running("a", 4)], now=10.0) == 1
    for t in range(10):  # one trainer updating back to back: the queue would only grow
        policy.observe_train(float(t), t + 0.95, replica="1")
    assert policy.trainer_busy(10.0) > 0.9
    assert policy.slots([running("a", 4)], now=10.0) == 0
    for t in range(0, 10, 2):  # a second replica, mostly idle: capacity to spare
        policy.observe_train(float(t), t + 0.5, replica="2")
    assert 0.5 < policy.trainer_busy(10.0) < 0.9
    assert policy.slots([running("a", 4)], now=10.0) == 1
    assert policy.trainer_busy(100.0) == 0.0  # nothing recent: idle
