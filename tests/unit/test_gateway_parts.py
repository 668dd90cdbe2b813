"""The gateway's and the HTTP SDK's pure parts: bodies, error messages, event ids, SSE, archives."""

from __future__ import annotations

import io
import json
import re
import tarfile

import pytest

from marlaas.cli.report import step_times
from marlaas.platform.events import JobRecord, JobSpec, JobState
from marlaas.platform.http_api import VersionInfo
from marlaas.sdk.http import parse_sse
from services.gateway.event_stream import BadEventId, parse_event_id, sse
from services.gateway.reads import job_info, owned_job_id, queue_positions
from services.gateway.submission import SubmissionRefused, check_submission, parse_body
from services.gateway.views import adapter_archive, version_number


def record(job: str, state: JobState, submitted_at: float) -> JobRecord:
    tenant = job.split(".")[0]
    return JobRecord(spec=JobSpec(id=job, tenant=tenant, name="n", task="addition", steps=3,
                                  submitted_at=submitted_at), state=state)


def test_queue_positions_count_queued_jobs_of_every_tenant_in_submission_order():
    records = [record("b.x", JobState.QUEUED, 3.0), record("a.y", JobState.RUNNING, 1.0),
               record("a.z", JobState.QUEUED, 2.0), record("c.w", JobState.COMPLETED, 0.5)]
    assert queue_positions(records) == {"a.z": 1, "b.x": 2}
    assert job_info(records[0], 2).queue_position == 2
    assert job_info(records[1], 7).queue_position is None  # only a queued job has a position


@pytest.mark.parametrize("job, ok", [("alice.job-1a2b3c", True), ("bob.job-1a2b3c", False), ("alice", False),
                                     ("alice.>", False), ("alice.*", False), ("alice..x", False),
                                     ("alice.a.b", False), ("Alice.x", False)])
def test_only_well_formed_ids_of_the_tenant_are_looked_up(job, ok):
    assert owned_job_id("alice", job) is ok


def test_bodies_are_json_or_toml_and_the_tenant_is_the_token_s():
    assert parse_body(b'{"task": "addition", "steps": 2}', "application/json; charset=utf-8") == \
        {"task": "addition", "steps": 2}
    assert parse_body(b'task = "addition"\nsteps = 2\n', "application/toml") == {"task": "addition", "steps": 2}
    assert parse_body(b'{"task": "a", "steps": 1}', "") == {"task": "a", "steps": 1}  # no type: JSON
    assert check_submission({"task": "addition", "steps": 2}, "alice")["tenant"] == "alice"
    assert check_submission({"task": "addition", "steps": 2, "tenant": "alice"}, "alice")["tenant"] == "alice"
    with pytest.raises(SubmissionRefused, match="field 'tenant' is 'bob'") as refused:
        check_submission({"task": "addition", "steps": 2, "tenant": "bob"}, "alice")
    assert refused.value.status == 403


def test_server_paths_pass_only_inside_the_operators_directory(tmp_path):
    """``gateway.allow_server_paths_under``: off by default; on, an absolute path inside that
    directory is sent on resolved, and one that leaves it (``..``, a symlink) is refused like any."""
    allowed, outside = tmp_path / "shared", tmp_path / "private"
    allowed.mkdir(), outside.mkdir()
    (allowed / "escape").symlink_to(outside)
    job = {"task": "gsm8k", "steps": 2}
    assert check_submission({**job, "dataset": f"{allowed}/./math.jsonl"}, "alice", str(allowed))["dataset"] == \
        str(allowed / "math.jsonl")
    assert check_submission({**job, "dataset": "file-" + "a" * 32}, "alice")["dataset"] == "file-" + "a" * 32
    for path, under in [(f"{allowed}/math.jsonl", ""), (f"{allowed}/../private/x.jsonl", str(allowed)),
                        (f"{allowed}/escape/x.jsonl", str(allowed)), ("math.jsonl", str(allowed))]:
        with pytest.raises(SubmissionRefused, match=f"^field 'dataset': {re.escape(repr(path))} is not an "
                                                    "uploaded file; .* POST /v1/files"):
            check_submission({**job, "dataset": path}, "alice", under)


@pytest.mark.parametrize("tree, says", [
    ({"task": "addition", "steps": "x"}, "field 'steps': expected int, got str; give 'steps' a value"),
    ({"task": "addition", "steps": 2, "grpo": {"group_size": 1.5}}, "field 'grpo.group_size': expected int"),
    ({"task": "addition", "steps": 2, "lora": {"target_modules": [1]}}, r"field 'lora.target_modules\[0\]'"),
    ({"task": "addition"}, "missing required field 'steps'"),
    ({"task": "addition", "steps": 2, "sed": 1}, "unknown field 'sed'; known fields: .* correct its spelling"),
])
def test_submission_errors_name_the_field_and_the_fix(tree, says):
    with pytest.raises(SubmissionRefused, match=says):
        check_submission(tree, "alice")


DEEP_BODIES = {  # (body, Content-Type): each nests far past the gateway's limit
    "100k-deep JSON array": (b"[" * 100_000 + b"]" * 100_000, "application/json"),
    "5k nested JSON objects": (b'{"a": ' * 5_000 + b"1" + b"}" * 5_000, "application/json"),
    "40-deep JSON in a field": (b'{"task": "addition", "steps": 2, "tools": ' + b"[" * 40 + b"]" * 40 + b"}",
                                "application/json"),
    "100k-deep TOML array": (b"task = " + b"[" * 100_000 + b"]" * 100_000, "application/toml"),
    "5k nested TOML inline tables": (b"grpo = " + b"{a = " * 5_000 + b"1" + b"}" * 5_000, "application/toml"),
    "a 5k-deep TOML table header": (b"[" + b".".join([b"grpo"] * 5_000) + b"]\nx = 1\n", "application/toml"),
}


@pytest.mark.parametrize("body, content_type", DEEP_BODIES.values(), ids=DEEP_BODIES.keys())
def test_deeply_nested_bodies_are_refused_with_the_limit(body, content_type):
    with pytest.raises(SubmissionRefused, match=r"nested more than 32 levels deep .* a job needs 3") as refused:
        parse_body(body, content_type)
    assert refused.value.status == 400


def test_bodies_nested_up_to_the_limit_are_read():
    nested = b"[" * 31 + b"]" * 31  # 32 levels with the job's object
    assert parse_body(b'{"tools": ' + nested + b"}", "application/json")["tools"] == json.loads(nested)


def test_event_ids_round_trip_and_bad_ones_say_what_to_send():
    assert parse_event_id(None) == (0, 0) and parse_event_id("12-40") == (12, 40)
    for bad in ("12", "a-b", "-1-2", "1-2-3", "1" * 30 + "-1"):
        with pytest.raises(BadEventId, match="start over"):
            parse_event_id(bad)
    text = (b"retry: 2000\n\n" + sse("3-7", "job.state", {"state": "running"}) + b": keepalive\n\n"
            + sse("4-7", "policy.committed", {"version": 1}))
    events = list(parse_sse(iter(text.decode().split("\n"))))
    assert [(e.id, e.event, e.data) for e in events] == [("3-7", "job.state", {"state": "running"}),
                                                          ("4-7", "policy.committed", {"version": 1})]


def test_version_parameters_must_be_whole_numbers():
    assert version_number("3", "v") == 3
    for bad in ("-1", "1.5", "abc", "", " ", "9" * 30):
        with pytest.raises(Exception, match="whole number"):
            version_number(bad, "v")


@pytest.mark.parametrize("raw", ["\u0663", "\uff13", "\U0001d7d1", "1\u0662", " 3", "3\n", "+3", "3_0"])
def test_version_parameters_are_ascii_digits_only(raw):  # Arabic-Indic, fullwidth, math digits; signs, spaces
    with pytest.raises(Exception, match=f"whole number from 0 to 100000 .*, not {re.escape(repr(raw))}"):
        version_number(raw, "v")


@pytest.mark.parametrize("raw", ["\u0663-\u0664", "12-4\uff10"])
def test_event_ids_are_ascii_digits_only(raw):
    with pytest.raises(BadEventId, match="is not an id this API sent"):
        parse_event_id(raw)


def test_the_adapter_archive_holds_the_two_peft_files_at_its_root():
    data = adapter_archive(b'{"r": 8}', b"weights", 1.0)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        assert {m.name: tar.extractfile(m).read() for m in tar.getmembers()} == {
            "adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"weights"}


def test_step_times_are_gaps_between_commits():
    versions = [VersionInfo(version=v, committed_at=t) for v, t in ((0, 10.0), (1, 12.0), (2, 12.5))]
    assert step_times(versions) == [(1, 2.0), (2, 0.5)]


def test_a_job_file_s_data_paths_are_sent_absolute(tmp_path):
    from marlaas.sdk.http import read_job_file

    (tmp_path / "job.toml").write_text('task = "gsm8k"\nsteps = 2\ndataset = "data/train.jsonl"\n')
    job = read_job_file(tmp_path / "job.toml")
    assert job == {"task": "gsm8k", "steps": 2, "dataset": str(tmp_path / "data" / "train.jsonl")}


def test_from_env_says_how_to_reach_a_stack(tmp_path, monkeypatch):
    from marlaas.sdk import Client, MarlaasError

    monkeypatch.delenv("MARLAAS_URL", raising=False)
    monkeypatch.delenv("MARLAAS_TOKEN", raising=False)
    with pytest.raises(MarlaasError, match="no stack is running.*marlaas up.*MARLAAS_URL"):
        Client.from_env(home=tmp_path, wait_s=0.5)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "gateway.url").write_text("http://127.0.0.1:1\n")
    (tmp_path / "run" / "default-tenant.token").write_text("mlt_default_x\n")
    with Client.from_env(home=tmp_path) as client:
        assert client.url == "http://127.0.0.1:1"
    monkeypatch.setenv("MARLAAS_URL", "http://example.invalid:9")
    monkeypatch.setenv("MARLAAS_TOKEN", "mlt_a_b")
    with Client.from_env(home=tmp_path / "nowhere") as client:
        assert client.url == "http://example.invalid:9"


def test_a_client_waits_for_a_stack_that_is_starting_and_says_so(tmp_path, monkeypatch):
    import threading

    from marlaas.sdk import Client, MarlaasError, discovery

    monkeypatch.delenv("MARLAAS_URL", raising=False)
    monkeypatch.delenv("MARLAAS_TOKEN", raising=False)
    run = tmp_path / "run"
    discovery.write_state(run, discovery.STARTING)  # this process plays `marlaas up`
    heard = []
    with pytest.raises(MarlaasError, match="still starting after 1s"):
        Client.from_env(home=tmp_path, wait_s=1, on_wait=heard.append)
    assert len(heard) == 1 and "starting" in heard[0]

    def get_ready() -> None:  # what the launcher does once every service and /readyz answer
        (run / "gateway.url").write_text("http://127.0.0.1:1\n")
        (run / "default-tenant.token").write_text("mlt_default_x\n")
        discovery.write_state(run, discovery.READY)

    timer = threading.Timer(0.6, get_ready)
    timer.start()
    with Client.from_env(home=tmp_path, wait_s=30) as client:
        assert client.url == "http://127.0.0.1:1"
    timer.join()
    discovery.clear_state(run)
    assert discovery.read_state(run) is None


def test_metrics_show_held_out_scores_without_naming_jobs():
    from prometheus_client import CollectorRegistry, generate_latest

    from marlaas.platform.events import EvalPoint, JobRecord, JobSpec
    from services.gateway.metrics import RecordFigures

    def record(job: str, evals: list[EvalPoint]) -> JobRecord:
        spec = JobSpec(id=job, tenant=job.split(".")[0], name="x", task="addition", steps=4)
        return JobRecord(spec=spec, evals=evals)

    figures = RecordFigures()
    figures.records = [record("acme.a-1", [EvalPoint(version=0, score=0.2), EvalPoint(version=4, score=0.85)]),
                       record("beta.b-1", [])]
    registry = CollectorRegistry()
    registry.register(figures)
    text = generate_latest(registry).decode()
    assert "marlaas_eval_score_count 1.0" in text and 'marlaas_eval_score_bucket{le="0.9"} 1.0' in text
    assert "acme" not in text and "beta" not in text
