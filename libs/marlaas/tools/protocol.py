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

import msgspec
import structlog

log = structlog.get_logger("protocol")

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
TAGS = (CALL_OPEN, CALL_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE)
TRUNCATED = "...[truncated]"
MAX_CALL_CHARS = 32_768  # a call is read only up to this length (a turn is a few hundred tokens)
MAX_CALL_DEPTH = 32  # nested brackets of a call's JSON (a tool's arguments need a handful)
CHARS_PER_TOKEN = 16  # a result is cut to max_tokens * this many characters before it is tokenized


@dataclass(frozen=True)
class ParsedCall:
    """A well-formed call: the tool's name as written and its arguments as JSON text."""

    name: str
    arguments: str
    note: str = ""  # said to the model with the result (e.g. that a second call in its turn was ignored)


@dataclass(frozen=True)
class CallError:
    """What was wrong with a call the model tried to write (shown to it as the observation)."""

    message: str


def render_call(name: str, arguments: dict) -> str:
    """The call text a model is taught to write (compact JSON: the tiny model pays per character)."""
    body = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
    return f"{CALL_OPEN}{body}{CALL_CLOSE}"


def parse_call(turn_text: str) -> ParsedCall | CallError | None:
    """The call a turn makes, an error describing a broken one, or None (no call: an answer).

    One call per turn: the call is the text from the turn's first ``<tool_call>`` to the first
    ``</tool_call>`` (where the engine stopped). Never raises, whatever the text: a call that is
    too long, nests too deep, holds a number no parser takes or is not JSON is a :class:`CallError`.
    Outcomes of the edge cases (each has a test):

    - ``<tool_call>`` inside a JSON string of the call is string content (the *first* open tag
      starts the call).
    - ``</tool_call>`` inside the arguments (code that prints the tag) ends the call there, as
      it ends the turn: the call is cut JSON, and the error says to write the tag as
      ``<\\/tool_call>`` (JSON's escape for ``/``, which decodes to the same text).
    - Text after the closing tag in the same turn (the rest of the token that completed it) is
      ignored; if it starts another call, the first call runs and ``note`` tells the model
      that the rest of its turn was ignored.
    - A second ``<tool_call>`` before the first is closed makes the call malformed (an error
      saying to make one call per turn); the last one no longer silently wins.
    """
    close = turn_text.find(CALL_CLOSE)
    if close < 0:
        return None
    start = turn_text.find(CALL_OPEN, 0, close)
    if start < 0:
        return CallError(f"{CALL_CLOSE} without {CALL_OPEN} before it")
    body = turn_text[start + len(CALL_OPEN): close].strip()
    rest = turn_text[close + len(CALL_CLOSE):]
    note = (f"note: only the first call of a turn runs; the rest of your turn after {CALL_CLOSE} was "
            "ignored. Make one call per turn." if CALL_OPEN in rest else "")
    call = decode_json(body, "tool call")
    if isinstance(call, CallError):
        if CALL_OPEN in body:
            return CallError(f"{call.message}; a second {CALL_OPEN} began before {CALL_CLOSE} closed the "
                             "first: make one call per turn")
        # an open string: a closing tag inside the arguments ended the call
        if (body.count('"') - body.count('\\"')) % 2:
            return CallError(f"{call.message}; the call ended at the first {CALL_CLOSE}: inside a JSON "
                             f"string write it as <\\/tool_call>")
        return call
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return CallError('tool call must be {"name": <tool>, "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = decode_json(arguments, "tool call arguments (a string)")
        if isinstance(arguments, CallError):
            return arguments
    if not isinstance(arguments, dict):
        return CallError("tool call arguments must be a JSON object")
    return ParsedCall(call["name"], json.dumps(arguments), note)


def decode_json(text: str, what: str):
    """``text`` decoded as JSON, or a :class:`CallError` saying why not; never raises.

    Bounded before decoding: at most ``MAX_CALL_CHARS`` characters and ``MAX_CALL_DEPTH`` nested
    brackets (``json`` and ``msgspec`` both recurse: ~1,000 levels raise ``RecursionError``).
    msgspec refuses integers over Python's 4,300-digit limit and floats out of range with a
    ``DecodeError``; the catch-all below is for what no one foresaw: a model's output must never
    fail its batch.
    """
    if len(text) > MAX_CALL_CHARS:
        return CallError(f"{what} is {len(text)} characters; at most {MAX_CALL_CHARS} are read")
    if json_depth(text, MAX_CALL_DEPTH) > MAX_CALL_DEPTH:
        return CallError(f"{what} nests brackets more than {MAX_CALL_DEPTH} deep")
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        return CallError(f"{what} is not valid JSON ({exc})")
    except Exception as exc:  # noqa: BLE001 -- deliberately: no model output may raise out of an episode
        log.warning("unexpected error decoding a tool call", what=what, error=repr(exc)[:200])
        return CallError(f"{what} could not be decoded ({type(exc).__name__})")


def json_depth(text: str, limit: int) -> int:
    """How deep ``[`` / ``{`` nest in ``text`` outside JSON strings (counting stops past ``limit``).

    One pass over the characters, so linear in ``len(text)`` whatever the text: a string left
    open (a model's call cut mid-argument) just runs to the end. The regex this replaces
    backtracked exponentially on such a string and froze the rollout service's event loop
    (issue 35).
    """
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        elif char in "]}":
            depth -= 1
    return deepest


def cut_result(text: str, max_tokens: int) -> tuple[str, bool]:
    """``text`` cut to what ``max_tokens`` tokens could hold (``CHARS_PER_TOKEN`` each) before it
    is tokenized, and whether it was cut: a tool may send megabytes, of which a few hundred tokens
    are read."""
    limit = max_tokens * CHARS_PER_TOKEN
    return (text[:limit], True) if len(text) > limit else (text, False)


def escape_result(text: str) -> str:
    """A tool's output with the protocol's tags defused (``<`` of each tag written as ``&lt;``)."""
    for tag in TAGS:
        text = text.replace(tag, "&lt;" + tag[1:])
    return text


def observation_text(result: str) -> str:
    """The observation appended after a call, for models that take the bare tags (the built-in base)."""
    return f"{RESPONSE_OPEN}{escape_result(result)}{RESPONSE_CLOSE}"


def final_answer(completion: str) -> str:
    """What the model answered after its last tool response (the whole completion if it called none).

    Rollout sends a reward only the model's own final turn, so there this is the text as it
    is whatever the chat template; the cut matters for a reward handed a whole transcript.
    """
    at = completion.rfind(RESPONSE_CLOSE)
    return (completion[at + len(RESPONSE_CLOSE):] if at >= 0 else completion).strip()


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def without_thinking(text: str) -> str:
    """``text`` without its ``<think>...</think>`` blocks (each open tag closed by the next close
    tag; an open tag never closed stays as written).

    Two ``str.find`` calls a block, so linear in ``len(text)``: the regex ``<think>.*?</think>``
    rescans to the end of the text from every open tag that is never closed (quadratic on a
    model's output of repeated open tags).
    """
    kept, at = [], 0
    while (start := text.find(THINK_OPEN, at)) >= 0:
        end = text.find(THINK_CLOSE, start + len(THINK_OPEN))
        if end < 0:
            break
        kept.append(text[at:start])
        at = end + len(THINK_CLOSE)
    kept.append(text[at:])
    return "".join(kept)
