"""The generic agentic task: your prompts, your tools, a reward you pick.

A job names a JSONL dataset (an uploaded file, ``dataset = "file-..."``, or a path for the
platform's own jobs), the tools the model may call (``tools``, at least one: built-in or
your tenant's) and the reward (``reward``: a built-in matcher, ``exact``, ``contains`` or
``numeric`` (see :mod:`marlaas.tasks.matchers`), the LLM ``judge``, or your own
``"<tenant>.<name>"``); the task has no reward of its own. An optional ``system`` in the job
is the system prompt of every episode.

Each line of the dataset is one problem::

    {"prompt": "What is the capital of Peru?", "answer": "Lima"}
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                  {"role": "user", "content": "Capital of Peru?"}], "answers": ["Lima", "Lima, Peru"]}

``prompt`` (one user turn) or ``messages`` (a conversation: roles ``system`` (first only),
``user`` and ``assistant``, ending with a ``user`` turn); ``answer`` (a string or number) or
``answers`` (a list of them). Any other field is kept: the reward gets the row as written.
A row's own ``system`` message takes the place of the job's. Every line is checked when the
task is built (at submission), and an error names the file, the line and the fix.
"""

from __future__ import annotations

import random
from pathlib import Path

from marlaas.tasks.base import Task, TaskError, json_records

ROLES = ("system", "user", "assistant")


class Agent(Task):
    name = "agent"
    kind = "agentic"
    description = ("your prompts ({prompt | messages, answer | answers}), your tools (`tools`, at least one) "
                   "and a reward you name (`reward`: exact, contains, numeric, judge or <tenant>.<name>)")
    needs_dataset = True
    needs_tools = True
    has_reward = False
    max_new_tokens = 64  # per turn: a call or a short answer
    max_tool_calls = 3
    max_observation_tokens = 128

    def __init__(self, dataset: str | None = None, corpus: str | None = None) -> None:
        super().__init__(dataset, corpus)
        self.rows = load_rows(Path(dataset).expanduser())

    def sample_problem(self, rng: random.Random) -> dict:
        return dict(rng.choice(self.rows))

    def longest_prompts(self) -> list[str]:
        return [prompt_text(row) for row in self.rows]

    def reward(self, problem: dict, completion: str) -> float:
        raise TaskError("task 'agent' has no reward of its own: name one in the job, reward = 'exact', "
                        "'contains', 'numeric', 'judge' or '<tenant>.<name>'")


def prompt_text(row: dict) -> str:
    """A row's prompt as plain text (its conversation's contents, one per line)."""
    if "messages" in row:
        return "\n".join(m["content"] for m in row["messages"])
    return row["prompt"]


def load_rows(path: Path) -> list[dict]:
    """The rows of an agent dataset, each checked (see the module docstring)."""
    rows = []
    for lineno, row in json_records(path, "dataset"):
        problem = row_problem(row)
        if problem:
            raise TaskError(f"{path}:{lineno}: {problem}")
        rows.append(row)
    if not rows:
        raise TaskError(f'dataset {path} holds no rows: write one {{"prompt": ..., "answer": ...}} per line')
    return rows


def row_problem(row: dict) -> str:
    """What is wrong with one dataset row and how to fix it; "" when nothing is."""
    if ("prompt" in row) == ("messages" in row):
        return ('needs "prompt" (a string: one user turn) or "messages" (a conversation), exactly one of them'
                if "prompt" not in row else 'has both "prompt" and "messages": keep one')
    if "prompt" in row and not (isinstance(row["prompt"], str) and row["prompt"].strip()):
        return '"prompt" must be a non-empty string'
    if "messages" in row and (problem := messages_problem(row["messages"])):
        return problem
    if "answer" not in row and "answers" not in row:
        return 'needs "answer" (a string or number) or "answers" (a list of them): what the reward compares with'
    listed = row["answers"] if "answers" in row else [row["answer"]]
    if not isinstance(listed, list) or not listed or not all(
            isinstance(a, (str, int, float)) and not isinstance(a, bool) and str(a).strip() for a in listed):
        return ('"answers" must be a non-empty list of strings or numbers' if "answers" in row
                else '"answer" must be a non-empty string or a number')
    return ""


def messages_problem(messages) -> str:
    """What is wrong with a row's conversation; "" when nothing is."""
    if not isinstance(messages, list) or not messages:
        return '"messages" must be a non-empty list of {"role": ..., "content": ...}'
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            return f'messages[{i}] must be {{"role": ..., "content": ...}} and nothing else'
        if message["role"] not in ROLES:
            return (f'messages[{i}] has role {message["role"]!r}: use "user", "assistant" or "system" (tool '
                    "turns are the model's own, in its episodes)")
        if not isinstance(message["content"], str):
            return f"messages[{i}].content must be a string"
        if message["role"] == "system" and i:
            return f'messages[{i}] is a system message: only the first message may be one'
    if messages[-1]["role"] != "user":
        return "the conversation must end with a user message (the model answers it)"
    return ""
