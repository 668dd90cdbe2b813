"""Fuzzing the tool-call reader and the episode loop with hypothesis (issue 35): random and
adversarial turns (unclosed strings, stray escapes, tags and brackets anywhere) never raise,
never stall, and always end as a call, a call error the model reads, or an answer.

The episode loop is driven by replayed turns (a real model cannot be steered into writing a
given text) and its tools answer from this process: the loop's own logic is under test here;
the bus and real tools are in tests/integration/test_agent_tools.py.
"""

from __future__ import annotations

import asyncio
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from replayed_turns import ReplayedTurns

from marlaas.basemodel import builtin_model_dir
from marlaas.platform.events import TOOL, ToolResult, encode
from marlaas.tools.protocol import CALL_CLOSE, CALL_OPEN, CallError, ParsedCall, json_depth, parse_call
from services.rollout.agent import ConversationFormat, EpisodeLimits, ToolBox, run_episode
from tests.models import tokenizer as tokenizer_of

PIECES = st.sampled_from(['"', "\\", "\\\"", "{", "}", "[", "]", ":", ",", "a", " ", "\n", "é", "1e999", "-",
                          CALL_OPEN, CALL_CLOSE, '{"name": "echo", "arguments": {"text": "', '"}}', "<think>"])
TURNS = st.one_of(
    st.text(max_size=300),
    st.lists(PIECES, max_size=80).map("".join),
    st.lists(PIECES, max_size=40).map(lambda parts: f'{CALL_OPEN}{"".join(parts)}{CALL_CLOSE}'),
    st.integers(0, 5_000).map(lambda n: f'{CALL_OPEN}{{"name": "echo", "arguments": {{"text": "{"x" * n}{CALL_CLOSE}'),
)


def reference_depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max((reference_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((reference_depth(v) for v in value), default=0)
    return 0


@settings(max_examples=400, deadline=None)
@given(TURNS)
def test_any_turn_is_a_call_a_call_error_or_an_answer(turn):
    outcome = parse_call(turn)
    assert outcome is None or isinstance(outcome, (ParsedCall, CallError))
    if CALL_CLOSE not in turn:
        assert outcome is None
    if isinstance(outcome, ParsedCall):
        assert isinstance(json.loads(outcome.arguments), dict)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet=st.sampled_from('ab"\\[]{} '), max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES)
def test_the_linear_scanner_measures_json_nesting_exactly(value):
    text = json.dumps(value)
    assert json_depth(text, 1_000) == reference_depth(value)


TOKENIZER = tokenizer_of(builtin_model_dir())
FMT = ConversationFormat(TOKENIZER)
LIMITS = EpisodeLimits(max_new_tokens=2_000, max_tool_calls=3, max_observation_tokens=64, max_total_tokens=4_000,
                       tool_timeout_s=1.0)


async def echo_tool(subject: str, data: bytes, timeout_s: float) -> bytes:
    call = TOOL.decode(data)
    return encode(ToolResult(call_id=call.call_id, output=json.loads(call.arguments).get("text", "")[:100]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(TURNS, min_size=1, max_size=4))
def test_the_episode_loop_survives_any_sequence_of_turns(turns):
    box = ToolBox("acme.job-1", ["acme.echo"], echo_tool, LIMITS.tool_timeout_s)
    episode = asyncio.run(run_episode(ReplayedTurns(TOKENIZER, turns), FMT, FMT.prompt_ids("q=", []), tools=box,
                                      limits=LIMITS, temperature=1.0, lora=None, seed=lambda turn: turn))
    assert episode.end_reason in ("answer", "length", "max_tool_calls", "context_full")
    assert episode.tool_calls == episode.tool_errors + episode.tool_successes <= LIMITS.max_tool_calls
    assert len(episode) <= LIMITS.max_total_tokens


def test_an_episode_is_sampled_by_one_adapter_version_from_its_first_token_to_its_last():
    """Bounded staleness serves several versions of a job over time: an episode's turns all go to
    the adapter its batch was given (rollout binds it once per batch, under the job's lock, and
    never deletes a version's files while a batch of it generates)."""
    version_4 = object()  # the LoRARequest of (job, v4)
    call = f'{CALL_OPEN}{{"name": "echo", "arguments": {{"text": "hi"}}}}{CALL_CLOSE}'
    engine = ReplayedTurns(TOKENIZER, [call, call, "the answer"])
    box = ToolBox("acme.job-1", ["acme.echo"], echo_tool, LIMITS.tool_timeout_s)
    episode = asyncio.run(run_episode(engine, FMT, FMT.prompt_ids("q=", []), tools=box, limits=LIMITS,
                                      temperature=1.0, lora=version_4, seed=lambda turn: turn))
    assert episode.tool_successes == 2 and len(engine.loras) == 3
    assert all(lora is version_4 for lora in engine.loras)
