"""The chat base's ``response_template``: transformers' ``parse_response`` turns the model's output back
into an assistant message (content and OpenAI-style tool calls), through transformers alone."""

from __future__ import annotations

import json
import time

import pytest

from marlaas.basemodel import builtin_model_dir
from tests.models import tokenizer as tokenizer_of

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city for the next days.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]},
}}
CLOCK = {"type": "function", "function": {
    "name": "local_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}
TOOLS = [WEATHER, CLOCK]


def _call(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _conversation(call_content: str, calls: list[dict]) -> list[dict]:
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Will it rain in Paris this week?"},
        {"role": "assistant", "content": call_content, "tool_calls": calls},
        *({"role": "tool", "content": f"result {i}"} for i in range(len(calls))),
        {"role": "assistant", "content": "No: sunny for 3 days in Paris."},
    ]


@pytest.fixture(scope="module")
def tok():
    return tokenizer_of(builtin_model_dir())


def _prompt(tok, messages: list[dict]) -> str:
    return tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)


def test_the_template_is_saved_in_tokenizer_config_and_loaded(tok):
    config = json.loads((builtin_model_dir() / "tokenizer_config.json").read_text())
    assert tok.response_template == config["response_template"]
    assert config["response_template"]["start_anchor"] == "<|im_start|>assistant\n"


def test_a_tool_call_parses_to_an_openai_style_message_with_dict_arguments(tok):
    prompt = _prompt(tok, _conversation("", [])[:2])
    assert prompt.endswith("<|im_start|>user\nWill it rain in Paris this week?<|im_end|>\n<|im_start|>assistant\n")
    output = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call><|im_end|>'
    expected = {"role": "assistant", "content": "",
                "tool_calls": [_call("get_weather", {"city": "Paris", "days": 3})]}
    assert tok.parse_response(output, prefix=prompt) == expected
    # token ids in, as a trainer holds them (special tokens kept by the decode)
    ids = tok.encode(output, add_special_tokens=False)
    assert tok.parse_response(ids, prefix=tok.encode(prompt, add_special_tokens=False)) == expected
    # a turn stopped at the closing tag (rollout's stop string), without the end of turn
    assert tok.parse_response(output.removesuffix("<|im_end|>"), prefix=prompt) == expected
    # compact JSON, as marlaas.tools.protocol.render_call writes it, and text before the call
    compact = 'Checking.<tool_call>{"name":"get_weather","arguments":{"city":"Paris","days":3}}</tool_call><|im_end|>'
    assert tok.parse_response(compact, prefix=prompt) == {**expected, "content": "Checking."}
    # text between or after calls (which the template never writes) is kept, joined, not lost
    two = ('A<tool_call>{"name": "local_time", "arguments": {}}</tool_call>\n'
           '<tool_call>{"name": "local_time", "arguments": {"city": "Oslo"}}</tool_call>B<|im_end|>')
    assert tok.parse_response(two, prefix=prompt) == {
        "role": "assistant", "content": "A\nB",
        "tool_calls": [_call("local_time", {}), _call("local_time", {"city": "Oslo"})]}
    # with tools=, an argument the model wrote as a string is cast to its schema's type
    stringly = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": "3"}}</tool_call>'
    assert tok.parse_response(stringly, prefix=prompt)["tool_calls"][0]["function"]["arguments"]["days"] == "3"
    assert tok.parse_response(stringly, prefix=prompt, tools=TOOLS) == expected


def test_a_plain_answer_parses_to_content_only(tok):
    prompt = _prompt(tok, _conversation("", [_call("get_weather", {"city": "Paris"})])[:4])
    assert prompt.endswith("<tool_response>result 0</tool_response><|im_end|>\n<|im_start|>assistant\n")
    output = "No: sunny for 3 days in Paris.<|im_end|>"
    expected = {"role": "assistant", "content": "No: sunny for 3 days in Paris."}
    assert tok.parse_response(output, prefix=prompt) == expected
    assert tok.parse_response(tok.encode(output, add_special_tokens=False), prefix=prompt) == expected
    assert tok.parse_response("No: sunny for 3 days in Paris.", prefix="") == expected  # cut before the eos


@pytest.mark.parametrize(("call_content", "calls"), [
    ("", [_call("get_weather", {"city": "Paris", "days": 3})]),
    ("  Let me look that up.\n", [_call("get_weather", {"city": "Paris", "days": 3})]),
    ("Two lookups.", [_call("get_weather", {"city": "Paris", "days": 3}),
                      _call("local_time", {"city": "Paris, \"FR\" <tool_response> ☃", "nested": [1.5, None, True,
                                                                                           {"k": []}]})]),
])
def test_each_assistant_turn_of_a_rendered_conversation_parses_back_to_its_message(tok, call_content, calls):
    messages = _conversation(call_content, calls)
    rendered = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert turns == [2, 3 + len(calls)]
    generated = []
    for i in turns:
        prompt = _prompt(tok, messages[:i])
        through = tok.apply_chat_template(messages[: i + 1], tools=TOOLS, tokenize=False)
        assert through.startswith(prompt) and rendered.startswith(through)
        text = through[len(prompt):]  # the assistant turn as the model writes it, "<|im_end|>\n" included
        generated.append(text)
        assert tok.parse_response(text, prefix=prompt) == messages[i]
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.parse_response(ids, prefix=tok.encode(prompt, add_special_tokens=False)) == messages[i]
        # streamed a character at a time: the parser holds back partial delimiters and ends the same
        parser = tok.get_response_parser(prefix=prompt)
        for char in text:
            parser.feed(char)
        assert parser.finalize()[0] == messages[i]
    if call_content == "":
        assert generated == ['<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
                             "</tool_call><|im_end|>\n",
                             "No: sunny for 3 days in Paris.<|im_end|>\n"]


def test_a_malformed_call_raises_value_error(tok):
    with pytest.raises(ValueError, match="json"):
        tok.parse_response('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', prefix="")


def test_parsing_stays_linear_on_adversarial_output(tok):
    # long runs of near-delimiters, whitespace and an unclosed call: a pattern that backtracked
    # catastrophically would take far longer than the bound (measured: well under 1s)
    junk = ("<|im_end|" + " \n\t" * 50 + "</tool_call" + "<|im_start|>assistant" + "{[\"\\") * 2000
    started = time.perf_counter()
    parsed = tok.parse_response(junk + "<|im_end|>" + " " * 100_000, prefix="")
    assert parsed == {"role": "assistant", "content": junk}
    with pytest.raises(ValueError):
        tok.parse_response("<tool_call>" + junk, prefix="")
    assert time.perf_counter() - started < 10
