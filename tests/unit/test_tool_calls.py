"""Any model output and any tool output leaves the episode standing (issue 24, the episode half).

The parser is driven directly with the text a model could write; each case has one
defined outcome, documented in ``parse_call`` and docs/agentic.md.
"""

from __future__ import annotations

import time

import pytest

from marlaas.basemodel import builtin_model_dir, char_model_dir
from marlaas.tools.protocol import (
    CHARS_PER_TOKEN,
    MAX_CALL_CHARS,
    MAX_CALL_DEPTH,
    CallError,
    ParsedCall,
    parse_call,
    render_call,
)
from services.rollout.agent import ConversationFormat
from services.rollout.episode import Episode, settle_truncated, to_score
from tests.models import tokenizer as tokenizer_of

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@pytest.fixture(scope="module", params=["chat", "bare"])
def fmt(request):
    """Both renderings: the default chat base with its template, the character-level base bare."""
    model = builtin_model_dir() if request.param == "chat" else char_model_dir()
    return ConversationFormat(tokenizer_of(model), request.param)


def call_text(body: str) -> str:
    return f"{OPEN}{body}{CLOSE}"


# --- malformed calls: an error the model reads, never an exception ---------------------------


@pytest.mark.parametrize("depth", [MAX_CALL_DEPTH + 1, 1_200, 10_000])
def test_deep_nesting_is_a_call_error_not_a_recursion_error(depth):
    nested = "[" * depth + "]" * depth
    for body in (nested, f'{{"name":"calculator","arguments":{{"x":{nested}}}}}'):
        result = parse_call(call_text(body))
        assert isinstance(result, CallError) and f"more than {MAX_CALL_DEPTH} deep" in result.message


def test_nesting_within_the_bound_and_brackets_inside_strings_are_fine():
    inner = "[" * (MAX_CALL_DEPTH - 3) + "]" * (MAX_CALL_DEPTH - 3)
    ok = parse_call(call_text(f'{{"name":"t","arguments":{{"x":{inner}}}}}'))
    assert isinstance(ok, ParsedCall) and ok.name == "t"
    code = "[" * 5_000  # brackets in a string are text (code may hold any number of them)
    ok = parse_call(call_text(f'{{"name":"python","arguments":{{"code":"{code}"}}}}'))
    assert isinstance(ok, ParsedCall) and code in ok.arguments


@pytest.mark.parametrize("number", ["1" * 4_301, "9" * 20_000, "-" + "7" * 5_000, "1e400", "1" + "0" * 400 + "e99999"])
def test_numbers_no_parser_takes_are_call_errors(number):
    for body in (f'{{"name":"calculator","arguments":{{"x":{number}}}}}',
                 f'{{"name":"calculator","arguments":"{{\\"x\\":{number}}}"}}'):  # arguments as a JSON string
        result = parse_call(call_text(body))
        assert isinstance(result, CallError) and "not valid JSON" in result.message, result


def test_a_big_but_ordinary_integer_passes_through_exactly():
    result = parse_call(call_text('{"name":"calculator","arguments":{"x":' + "3" * 300 + "}}"))
    assert isinstance(result, ParsedCall) and result.arguments == '{"x": ' + "3" * 300 + "}"


def test_a_call_over_the_length_bound_is_refused_unread():
    body = '{"name":"python","arguments":{"code":"' + "x" * MAX_CALL_CHARS + '"}}'
    result = parse_call(call_text(body))
    assert isinstance(result, CallError) and f"at most {MAX_CALL_CHARS}" in result.message


@pytest.mark.parametrize("body", [
    "", "{", "null", "[]", '"x"', '{"name": 3}', '{"name":"a","arguments":"not json"}', "\udcff",
    '{"name":"a","arguments":"' + "[" * 2_000 + '"}', '{"a":"\\ud800"}', "{'name': 'a'}", "\x00" * 10,
])
def test_any_other_broken_call_is_a_call_error(body):
    assert isinstance(parse_call(call_text(body)), CallError)


# --- tags in odd places ----------------------------------------------------------------------


def test_an_open_tag_inside_a_json_string_is_string_content():
    code = "print('<tool_call>')"
    result = parse_call(call_text('{"name":"python","arguments":{"code":"' + code + '"}}'))
    assert result == ParsedCall("python", '{"code": "print(\'<tool_call>\')"}')


def test_a_closing_tag_inside_code_ends_the_call_and_the_error_says_how_to_escape_it():
    # the engine stops at the first </tool_call>, which here sits inside the code string
    turn = OPEN + '{"name":"python","arguments":{"code":"print(\'' + CLOSE
    result = parse_call(turn)
    assert isinstance(result, CallError) and "<\\/tool_call>" in result.message
    escaped = parse_call(call_text('{"name":"python","arguments":{"code":"print(\'<\\/tool_call>\')"}}'))
    assert isinstance(escaped, ParsedCall) and "print('</tool_call>')" in escaped.arguments


def test_text_after_the_closing_tag_in_the_same_turn_is_ignored():
    call = render_call("calculator", {"expression": "2*3"})
    result = parse_call(call + "\n\nand then some")  # the token that completed the tag carried more
    assert result == ParsedCall("calculator", '{"expression": "2*3"}')


def test_two_calls_in_one_turn_run_the_first_and_tell_the_model():
    first, second = render_call("calculator", {"expression": "1+1"}), render_call("calculator", {"expression": "9*9"})
    result = parse_call(first + second)
    assert isinstance(result, ParsedCall) and result.arguments == '{"expression": "1+1"}'  # not the last
    assert "only the first call of a turn runs" in result.note


def test_a_second_open_tag_before_the_first_is_closed_is_an_error():
    turn = OPEN + '{"name":"a","arguments":{}}' + render_call("b", {})
    result = parse_call(turn)
    assert isinstance(result, CallError) and "make one call per turn" in result.message


def test_a_closing_tag_before_any_open_tag_is_an_error_and_an_unclosed_call_is_an_answer():
    assert "without <tool_call> before it" in parse_call('x</tool_call><tool_call>{"name":"a"}').message
    assert parse_call('<tool_call>{"name":"a"}') is None  # never closed: the model answered


# --- tool results of any size ----------------------------------------------------------------


def test_a_huge_result_is_cut_by_characters_before_it_is_tokenized(fmt):
    huge = "8" * 8_000_000  # the broker's largest message
    started = time.perf_counter()
    ids = fmt.observation_ids(huge, max_tokens=64)
    elapsed = time.perf_counter() - started
    text = fmt.tokenizer.decode(ids)
    assert text.endswith("...[truncated]" + fmt.obs_tail)
    assert len(ids) <= 64 + len(fmt.observation_ids("", max_tokens=64))
    assert elapsed < 0.05, f"cutting an 8 MB result took {elapsed:.3f}s: it was tokenized whole"


def test_a_result_cut_by_characters_is_marked_even_when_its_tokens_fit(fmt):
    # 16 characters per token is an upper bound: a result of many-character tokens may fit in tokens
    ids = fmt.observation_ids("9" * (64 * CHARS_PER_TOKEN + 1), max_tokens=64)
    assert fmt.tokenizer.decode(ids).endswith("...[truncated]" + fmt.obs_tail)
    short = fmt.tokenizer.decode(fmt.observation_ids("9" * 10, max_tokens=64))
    assert short == fmt.obs_head + "9999999999" + fmt.obs_tail


# --- truncated episodes: grpo.truncated ------------------------------------------------------


def episodes_of(*reasons: str) -> list[Episode]:
    out = []
    for reason in reasons:
        episode = Episode([1, 2])
        episode.add_turn([3, 4], [-0.1, -0.2])
        episode.end_reason = reason
        out.append(episode)
    return out


@pytest.mark.parametrize("mode, expected", [
    ("train", [0.9, 0.5, 0.25, 0.75]),
    ("zero", [0.9, 0.0, 0.0, 0.0]),
    ("drop", [0.9, None, None, None]),
])
def test_truncated_episodes_follow_the_jobs_setting(mode, expected):
    episodes = episodes_of("answer", "length", "max_tool_calls", "context_full")
    judged = [0.9, 0.5, 0.25, 0.75]
    picked = to_score(episodes, mode)
    assert picked == [True, True, True, True] if mode == "train" else [True, False, False, False]
    scores = [r if p else None for r, p in zip(judged, picked)]  # the reward sees only the picked ones
    assert settle_truncated(episodes, scores, mode) == expected


def test_an_unknown_truncated_mode_is_refused():
    with pytest.raises(ValueError, match="must be 'train', 'zero' or 'drop'"):
        settle_truncated(episodes_of("length"), [0.5], "keep")


def test_the_reward_sees_only_the_models_final_turn():
    episode = Episode([1])
    episode.add_turn([10, 11], [-0.1, -0.1])  # the call
    episode.add_observation([50, 51, 52])  # the tool's output and the template's markup
    episode.add_turn([12, 13], [-0.3, -0.3])  # the answer
    assert episode.final_turn_ids == [12, 13]
    assert Episode([1]).final_turn_ids == []

