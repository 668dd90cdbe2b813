"""Admission by KV-cache budget, FIFO, and the sequential schedule."""

import json

from marlaas.events import JobRecord, JobSpec, JobState
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
