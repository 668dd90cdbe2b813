"""The tool-call convention a model writes and reads (Qwen / Hermes tags), as pure functions.

The model calls a tool by writing ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
a turn stops at the closing tag (a stop string kept in the output). The result comes back
as ``<tool_response>...</tool_response>``. Calls are parsed from the decoded *sampled ids*
of a turn, never from vLLM's ``.text``. A tool's result is text from outside the model: before
it is tokenized, the protocol's own tags inside it are escaped so a result can never close its
response early and fake a turn (special tokens are split by the tokenizer; see the episode code).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
TAGS = (CALL_OPEN, CALL_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE)
TRUNCATED = "...[truncated]"


@dataclass(frozen=True)
class ParsedCall:
    """A well-formed call: the tool's name as written and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class CallError:
    """What was wrong with a call the model tried to write (shown to it as the observation)."""

    message: str


def render_call(name: str, arguments: dict) -> str:
    """The call text a model is taught to write (compact JSON: the tiny model pays per character)."""
    body = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
    return f"{CALL_OPEN}{body}{CALL_CLOSE}"


def parse_call(turn_text: str) -> ParsedCall | CallError | None:
    """The call that ends ``turn_text``, an error describing a broken one, or None (no call: an answer)."""
    if not turn_text.rstrip().endswith(CALL_CLOSE):
        return None
    start = turn_text.rfind(CALL_OPEN)
    if start < 0:
        return CallError(f"{CALL_CLOSE} without {CALL_OPEN}")
    body = turn_text[start + len(CALL_OPEN): turn_text.rstrip().rfind(CALL_CLOSE)].strip()
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        return CallError(f"tool call is not valid JSON ({exc.msg} at char {exc.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return CallError('tool call must be {"name": <tool>, "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return CallError("tool call arguments are a string that is not JSON")
    if not isinstance(arguments, dict):
        return CallError("tool call arguments must be a JSON object")
    return ParsedCall(call["name"], json.dumps(arguments))


def escape_result(text: str) -> str:
    """A tool's output with the protocol's tags defused (``<`` of each tag written as ``&lt;``)."""
    for tag in TAGS:
        text = text.replace(tag, "&lt;" + tag[1:])
    return text


def observation_text(result: str) -> str:
    """The observation appended after a call, for models that take the bare tags (the built-in base)."""
    return f"{RESPONSE_OPEN}{escape_result(result)}{RESPONSE_CLOSE}"


def final_answer(completion: str) -> str:
    """What the model answered after its last tool response (the whole completion if it called none)."""
    at = completion.rfind(RESPONSE_CLOSE)
    return (completion[at + len(RESPONSE_CLOSE):] if at >= 0 else completion).strip()
