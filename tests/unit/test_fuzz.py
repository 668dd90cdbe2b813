"""Fuzzing every decoder at the system's edges with hypothesis: malformed bytes, wrong shapes and
unknown kinds end in the one documented error (naming what was wrong), never in a crash."""

from __future__ import annotations

import contextlib
import json

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marlaas.platform import api
from marlaas.platform.events import (
    BATCH,
    COMMITTED,
    JOB,
    JOB_RECORD,
    METRIC,
    POLICY,
    REWARD,
    TOOL,
    TRAJECTORY,
    Blob,
    EventDecodeError,
    PolicyCommitted,
    encode,
)

CODECS = [JOB, POLICY, TRAJECTORY, TOOL, REWARD, METRIC, BATCH, COMMITTED, JOB_RECORD]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)
KINDS = ["job.submitted", "job.state", "job.failure", "job.eval", "policy.committed", "trajectory.ready",
         "tool.call", "tool.result", "reward.request", "reward.result", "span", "no.such.kind"]
fast = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@fast
@given(st.binary(max_size=200))
def test_arbitrary_bytes_are_refused_by_every_decoder_with_a_named_error(data):
    for codec in CODECS:
        try:
            codec.decode(data)
        except EventDecodeError as exc:
            assert codec.name in str(exc)


@fast
@given(st.sampled_from(KINDS), st.dictionaries(st.text(max_size=12), json_values, max_size=6))
def test_events_of_every_kind_with_fuzzed_fields_decode_or_fail_cleanly(kind, fields):
    data = json.dumps({**fields, "kind": kind}).encode()
    for codec in CODECS:
        with contextlib.suppress(EventDecodeError):
            codec.decode(data)


@fast
@given(st.integers(min_value=2, max_value=10**6), st.dictionaries(st.text(max_size=8), json_values, max_size=3))
def test_a_newer_schema_s_extra_fields_are_read_by_old_readers(schema, extra):
    event = PolicyCommitted(job="t.j", version=3, adapter=Blob(uri="file:///a", sha256="0" * 64, size=1),
                            committed_at=1.0)
    tree = msgspec.to_builtins(event)
    tree.update({f"x_{k}": v for k, v in extra.items()}, schema=schema)
    assert POLICY.decode(json.dumps(tree).encode()).version == 3


@fast
@given(st.dictionaries(st.sampled_from(["task", "steps", "name", "seed", "tenant", "dataset", "tools", "reward",
                                        "eval_every", "grpo", "lora", "top_p", "bogus"]),
                       json_values, max_size=8))
def test_fuzzed_job_specs_parse_or_raise_a_submit_error(tree):
    try:
        request = api.parse_submission(tree)
    except api.SubmitError as exc:
        assert str(exc)
    else:
        assert isinstance(request.task, str) and isinstance(request.steps, int)


@fast
@given(json_values)
def test_any_json_value_as_a_submission_is_refused_or_parsed(value):
    with contextlib.suppress(api.SubmitError):
        api.parse_submission(value)


def test_the_decoders_accept_what_the_encoder_writes():
    event = PolicyCommitted(job="t.j", version=1, adapter=Blob(uri="file:///a", sha256="0" * 64, size=1),
                            committed_at=2.0)
    assert POLICY.decode(encode(event)) == event
