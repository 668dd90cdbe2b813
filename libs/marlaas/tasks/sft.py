"""Supervised fine-tuning on your conversations: the ``sft`` task.

A job names a JSONL dataset of conversations (an uploaded file, ``dataset = "file-..."``), one
a line, in the format transformers' chat templates take::

    {"messages": [
      {"role": "system", "content": "You look things up."},
      {"role": "user", "content": "What is the capital of Zarvex?"},
      {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "zorbleck_capital", "arguments": {"country": "Zarvex"}}}]},
      {"role": "tool", "content": "Quorrin"},
      {"role": "assistant", "content": "Quorrin"}]}

Roles are ``system`` (first only), ``user``, ``assistant`` and ``tool`` (a tool's result, after
an assistant turn that called one). The job's ``tools`` are described in the system turn as the
``agent`` task describes them, and every call a row makes must name one of them. The loss is on
the assistant's tokens only (its text and its tool calls, each turn up to its end-of-turn
token); the prompt, the system turn and tool results are context, never trained.

A step trains ``sft.batch_size`` rows: each epoch goes through every row once, in an order
drawn from the job's seed (``sft.epochs`` sets the steps; else the job's ``steps``). Every line
is checked when the task is built (at submission); an error names the file, the line and the fix.
"""

from __future__ import annotations

import random
from pathlib import Path

from marlaas.tasks.base import Task, TaskError, json_records

ROLES = ("system", "user", "assistant", "tool")
MAX_TOOL_CALLS_PER_TURN = 8


class Sft(Task):
    name = "sft"
    kind = "supervised"
    description = ("supervised fine-tuning on your conversations ({messages: [...]} a line, transformers' chat "
                   "format, tool calls included): the loss on the assistant's tokens only")
    needs_dataset = True
    has_reward = False

    def __init__(self, dataset: str | None = None, corpus: str | None = None) -> None:
        super().__init__(dataset, corpus)
        self.rows = load_conversations(Path(dataset).expanduser())

    def sample_problem(self, rng: random.Random) -> dict:
        return dict(rng.choice(self.rows))

    def reward(self, problem: dict, completion: str) -> float:
        raise TaskError("task 'sft' trains on your conversations: it has no reward")

    def longest_prompts(self) -> list[str]:
        return [conversation_text(row["messages"]) for row in self.rows]

    def rows_for_step(self, step: int, batch_size: int, seed: int) -> list[dict]:
        """The rows step ``step`` trains (0-based: the batch of version ``step``): each epoch is a
        permutation of the rows drawn from ``seed`` and the epoch, read ``batch_size`` at a time."""
        return [self.rows[i] for i in step_indices(len(self.rows), step, batch_size, seed)]

    def called_tools(self) -> list[tuple[int, str]]:
        """(line, tool name) of every call the rows make."""
        return [(row["_line"], call["function"]["name"]) for row in self.rows
                for m in row["messages"] for call in m.get("tool_calls") or []]


def step_indices(rows: int, step: int, batch_size: int, seed: int) -> list[int]:
    """The row indices of step ``step``: positions ``step * batch_size`` onwards of the sequence of
    epochs, each epoch a permutation of ``range(rows)`` from ``(seed, epoch)``."""
    indices = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, at = divmod(position, rows)
        order = list(range(rows))
        random.Random(f"{seed}:{epoch}").shuffle(order)
        indices.append(order[at])
    return indices


def steps_for_epochs(rows: int, epochs: int, batch_size: int) -> int:
    """The steps that go ``epochs`` times through ``rows`` rows, ``batch_size`` a step (rounded up)."""
    return -(-rows * epochs // batch_size)


def conversation_text(messages: list[dict]) -> str:
    """A conversation's text, for sizing: its contents and its calls, one a line."""
    parts = []
    for m in messages:
        parts.append(m.get("content") or "")
        for call in m.get("tool_calls") or []:
            parts.append(f'{call["function"]["name"]} {call["function"]["arguments"]}')
    return "\n".join(parts)


def load_conversations(path: Path) -> list[dict]:
    """The rows of an SFT dataset, each checked (see the module docstring); each keeps its line
    number as ``_line``."""
    rows = []
    for lineno, row in json_records(path, "dataset"):
        problem = conversation_problem(row)
        if problem:
            raise TaskError(f"{path}:{lineno}: {problem}")
        rows.append({**row, "_line": lineno})
    if not rows:
        raise TaskError(f'dataset {path} holds no rows: write one {{"messages": [...]}} per line')
    return rows


def conversation_problem(row: dict) -> str:
    """What is wrong with one SFT row and how to fix it; "" when nothing is."""
    if set(row) != {"messages"}:
        extra = sorted(set(row) - {"messages"})
        return (f'unknown field(s) {extra}: a row is {{"messages": [...]}} and nothing else' if extra
                else 'needs "messages": the conversation, a list of {"role": ..., "content": ...}')
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        return '"messages" must be a non-empty list of {"role": ..., "content": ...}'
    for i, message in enumerate(messages):
        if problem := message_problem(i, message, messages[i - 1] if i else None):
            return problem
    if not any(m["role"] == "assistant" for m in messages):
        return "the conversation has no assistant turn: there is nothing to learn from it (add one)"
    if messages[-1]["role"] != "assistant":
        return ("the conversation must end with an assistant turn (what comes after the last one is never "
                "trained): drop the trailing turns or answer them")
    return ""


def message_problem(i: int, message, before: dict | None) -> str:
    """What is wrong with ``messages[i]``; "" when nothing is."""
    where = f"messages[{i}]"
    if not isinstance(message, dict) or "role" not in message:
        return f'{where} must be {{"role": ..., "content": ...}}'
    role = message["role"]
    allowed = {"role", "content", "tool_calls"} if role == "assistant" else {"role", "content"}
    if role == "tool":
        allowed |= {"name", "tool_call_id"}
    if role not in ROLES:
        return f'{where} has role {role!r}: use "system", "user", "assistant" or "tool"'
    if extra := sorted(set(message) - allowed):
        return f"{where} ({role}) has unknown field(s) {extra}; allowed: {sorted(allowed)}"
    content = message.get("content")
    if role == "assistant" and content is None and message.get("tool_calls"):
        content = ""
    if not isinstance(content, str):
        return f"{where}.content must be a string"
    if role == "system" and i:
        return f"{where} is a system message: only the first message may be one"
    if role == "tool" and (before is None or before["role"] not in ("assistant", "tool")
                           or (before["role"] == "assistant" and not before.get("tool_calls"))):
        return f"{where} is a tool result, but no assistant turn before it called a tool"
    if role == "assistant" and "tool_calls" in message:
        return tool_calls_problem(where, message["tool_calls"])
    if role == "assistant" and not content.strip():
        return f"{where} is an empty assistant turn: write its text or its tool_calls"
    return ""


def tool_calls_problem(where: str, calls) -> str:
    """What is wrong with an assistant turn's ``tool_calls``; "" when nothing is."""
    shape = ('[{"type": "function", "function": {"name": "<tool>", "arguments": {...}}}]')
    if not isinstance(calls, list) or not calls:
        return f"{where}.tool_calls must be a non-empty list: {shape}"
    if len(calls) > MAX_TOOL_CALLS_PER_TURN:
        return f"{where}.tool_calls has {len(calls)} calls: at most {MAX_TOOL_CALLS_PER_TURN} a turn"
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict) or (
                set(call) - {"type", "function", "id"}) or call.get("type", "function") != "function":
            return f"{at} must be {shape[1:-1]}"
        function = call["function"]
        if set(function) != {"name", "arguments"}:
            return f'{at}.function must have "name" and "arguments" and nothing else'
        if not isinstance(function["name"], str) or not function["name"]:
            return f"{at}.function.name must be the name of one of the job's tools"
        if not isinstance(function["arguments"], dict):
            return f"{at}.function.arguments must be a JSON object of the tool's arguments"
    return ""
