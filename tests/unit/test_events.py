"""Wire contracts: every event round-trips through its stream's codec; bad bytes fail clearly."""

from __future__ import annotations

import json

import msgspec
import pytest

from marlaas.platform import events
from marlaas.platform.events import (
    BATCH,
    COMMITTED,
    JOB,
    JOB_RECORD,
    METRIC,
    POLICY,
    REWARD,
    SCHEMA_VERSION,
    TOOL,
    TRAJECTORY,
    Blob,
    Codec,
    CommittedVersion,
    Event,
    EventDecodeError,
    GrpoSettings,
    JobEvaluated,
    JobFailureReported,
    JobRecord,
    JobSpec,
    JobState,
    JobStateChanged,
    JobSubmitted,
    JobWarningReported,
    LoraSettings,
    PolicyCommitted,
    RewardItem,
    RewardRequest,
    RewardResult,
    Sample,
    Span,
    ToolCall,
    ToolResult,
    TrajectoryBatch,
    TrajectoryReady,
)
from marlaas.platform.usage import USAGE, USAGE_RECORD, UsageCounters, UsageRecord, UsageReported

SPEC = JobSpec(
    id="acme.add-1", tenant="acme", name="add-1", task="toy.add", steps=40, seed=7,
    dataset="/data/add.jsonl", grpo=GrpoSettings(group_size=4, learning_rate=1e-3),
    lora=LoraSettings(rank=4, alpha=8, target_modules=("q_proj", "v_proj")), submitted_at=100.5,
)
ADAPTER = Blob(uri="file:///store/acme.add-1/v3/adapter.safetensors", sha256="ab" * 32, size=4096)
BATCH_OF_TWO = TrajectoryBatch(samples=[
    Sample(group=0, prompt_ids=[1, 2, 3], completion_ids=[4, 5], logprobs=[-0.25, -1.5],
           loss_mask=[1, 1], reward=1.0, text="45"),
    Sample(group=0, prompt_ids=[1, 2, 3], completion_ids=[6], logprobs=[-3.0],
           loss_mask=[1], reward=0.0),
])

# (codec of the stream the value travels on, a representative value)
EXAMPLES = [
    (JOB, JobSubmitted(spec=SPEC)),
    (JOB, JobStateChanged(job=SPEC.id, state=JobState.RUNNING, reason="admitted", at=101.0)),
    (JOB, JobFailureReported(job=SPEC.id, service="trainer", reason="loss is nan", version=3)),
    (POLICY, PolicyCommitted(job=SPEC.id, version=3, adapter=ADAPTER, batch_id="b-0002",
                             metrics={"reward/mean": 0.5, "loss": -0.125}, committed_at=130.0)),
    (TRAJECTORY, TrajectoryReady(job=SPEC.id, version=2, batch_id="b-0002", batch=BATCH_OF_TWO,
                                 sampled_at=120.0)),
    (TRAJECTORY, TrajectoryReady(job=SPEC.id, version=2, batch_id="b-0003", batch_ref=ADAPTER)),
    (TOOL, ToolCall(job=SPEC.id, call_id="c-1", tool="calc.eval", arguments='{"expr": "2+2"}')),
    (TOOL, ToolResult(call_id="c-1", output="4")),
    (TOOL, ToolResult(call_id="c-2", error="division by zero")),
    (JOB, JobEvaluated(job=SPEC.id, version=4, score=0.75, problems=32, at=1.0)),
    (REWARD, RewardRequest(job=SPEC.id, task="toy.add", items=[
        RewardItem(problem={"question": "2+2", "answer": 4}, completion="4"),
    ])),
    (REWARD, RewardResult(rewards=[1.0, 0.0])),
    (METRIC, Span(job=SPEC.id, service="rollout", phase="generate", version=2, start=110.0,
                  end=110.35, attrs={"tokens": 128.0, "replica": "rollout-0"})),
    (BATCH, BATCH_OF_TWO),
    (COMMITTED, CommittedVersion(job=SPEC.id, version=3, adapter=ADAPTER, optimizer=ADAPTER,
                                 batch_id="b-0002", committed_at=130.0)),
    (JOB_RECORD, JobRecord(spec=SPEC, state=JobState.COMPLETED, version=40, rewards=[0.1, 0.4],
                           kv_cache_bytes=1 << 20, admitted_at=100.6, first_commit_at=105.0,
                           last_commit_at=180.0, finished_at=181.0)),
    (JOB, JobWarningReported(job=SPEC.id, service="rollout", key="tool acme.weather",
                             warning="not answering since 12:00:00", at=1.5)),
    (USAGE, UsageReported(tenant=SPEC.tenant, job=SPEC.id, service="trainer", at=131.0,
                          counters=UsageCounters(train_tokens=96, train_samples=2, train_s=0.25))),
    (USAGE_RECORD, UsageRecord(tenant=SPEC.tenant, day="2026-01-01", job=SPEC.id, events=3, last_seq=17,
                               counters=UsageCounters(generated_tokens=128, tool_calls=2, tool_s=0.5))),
]


def _all_subclasses(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub} | _all_subclasses(sub)
    return found


def example_id(x) -> str:
    return getattr(x, "name", type(x).__name__)


@pytest.mark.parametrize(("codec", "value"), EXAMPLES, ids=example_id)
def test_round_trip_through_stream_codec(codec: Codec, value: msgspec.Struct):
    assert codec.decode(events.encode(value)) == value


def test_every_event_type_has_a_round_trip_example():
    covered = {type(value) for _, value in EXAMPLES}
    assert _all_subclasses(Event) <= covered


def test_events_carry_the_schema_version_and_their_tag():
    wire = json.loads(events.encode(ToolResult(call_id="c-1")))
    assert wire["schema"] == SCHEMA_VERSION
    assert wire["kind"] == "tool.result"


@pytest.mark.parametrize("data", [b"", b"{", b"\xff\xfe not json", b"[]", b"null", b"42"])
def test_malformed_bytes_raise_decode_error_naming_the_stream(data: bytes):
    with pytest.raises(EventDecodeError, match="malformed policy event"):
        POLICY.decode(data)


def test_truncated_bytes_raise_decode_error():
    data = events.encode(EXAMPLES[3][1])
    for cut in (1, len(data) // 2, len(data) - 1):
        with pytest.raises(EventDecodeError, match="malformed policy event .*truncated"):
            POLICY.decode(data[:cut])


def test_tag_of_another_stream_is_rejected():
    on_policy_stream = events.encode(PolicyCommitted(job="a.b", version=1, adapter=ADAPTER))
    clear = r"malformed job event .*policy\.committed.*\$\.kind"
    with pytest.raises(EventDecodeError, match=clear):
        JOB.decode(on_policy_stream)


def test_unknown_tag_is_rejected():
    with pytest.raises(EventDecodeError, match="malformed job event"):
        JOB.decode(b'{"kind": "job.exploded", "job": "a.b"}')


@pytest.mark.parametrize(("codec", "data", "where"), [
    (JOB, b'{"kind": "job.state", "job": 7, "state": "running"}', r"\$\.job"),
    (JOB, b'{"kind": "job.state", "job": "a.b", "state": "exploded"}', r"\$\.state"),
    (POLICY, b'{"kind": "policy.committed", "job": "a.b", "version": "3", '
             b'"adapter": {"uri": "file:///x", "sha256": "00"}}', r"\$\.version"),
    (POLICY, b'{"kind": "policy.committed", "job": "a.b", "version": 3}', "adapter"),
    (TRAJECTORY, b'{"kind": "trajectory.ready", "job": "a.b", "version": 1, "batch_id": "x", '
                 b'"batch": {"samples": [{"group": 0}]}}', r"\$\.batch\.samples\[0\]"),
])
def test_wrong_field_types_raise_decode_error_naming_stream_and_field(codec, data, where):
    with pytest.raises(EventDecodeError, match=f"malformed {codec.name} event") as info:
        codec.decode(data)
    assert info.match(where)


def test_reader_accepts_unknown_fields_from_a_newer_writer():
    newer = {
        "kind": "job.state", "schema": SCHEMA_VERSION + 1, "job": "a.b", "state": "failed",
        "reason": "oom", "priority": 3, "trace": {"span": "x"},
    }
    decoded = JOB.decode(json.dumps(newer).encode())
    assert decoded == JobStateChanged(job="a.b", state=JobState.FAILED, reason="oom",
                                      schema=SCHEMA_VERSION + 1)


def test_reader_accepts_unknown_fields_in_nested_structs():
    wire = json.loads(events.encode(JobSubmitted(spec=SPEC)))
    wire["spec"]["grpo"]["entropy_coef"] = 0.01
    wire["spec"]["deadline_s"] = 3600  # a field a newer writer added
    assert JOB.decode(json.dumps(wire).encode()) == JobSubmitted(spec=SPEC)


def test_job_record_ttfs_and_tpts():
    spec = JobSpec(id="acme.x", tenant="acme", name="x", task="toy.add", steps=10,
                   submitted_at=100.0)
    record = JobRecord(spec=spec, version=4, first_commit_at=112.5, last_commit_at=142.5)
    assert record.ttfs_s == pytest.approx(12.5)
    assert record.tpts_s == pytest.approx(10.0)  # 30 s over the 3 steps after the first
    assert record.steps_done == 4


def test_job_record_figures_are_none_before_they_exist():
    spec = JobSpec(id="acme.x", tenant="acme", name="x", task="toy.add", steps=10)
    queued = JobRecord(spec=spec)
    assert (queued.ttfs_s, queued.tpts_s, queued.steps_done) == (None, None, 0)
    one_step = JobRecord(spec=spec, version=1, first_commit_at=5.0, last_commit_at=5.0)
    assert one_step.tpts_s is None


def test_job_state_finished():
    assert {s for s in JobState if s.finished} == {
        JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED,
    }
