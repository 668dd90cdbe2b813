"""The task API: a dataset of problems plus the reward that judges a completion.

A task is a small class; adding one never touches the services. ``problem`` dicts
carry at least ``prompt`` and ``answer`` and travel to the env service verbatim.
"""

from __future__ import annotations

import abc
import json
import random
import re
from pathlib import Path
from typing import ClassVar, Literal

from marlaas.platform.errors import TaskError  # re-exported: tasks raise it


class Task(abc.ABC):
    """A family of problems with a verifiable reward in [0, 1]."""

    name: ClassVar[str]
    kind: ClassVar[Literal["single-turn", "agentic", "supervised"]] = "single-turn"
    description: ClassVar[str]
    max_new_tokens: ClassVar[int] = 16  # a generation budget that fits the answers (per turn)
    needs_dataset: ClassVar[bool] = False
    needs_corpus: ClassVar[bool] = False  # a JSONL of passages the task's search tool reads
    needs_tools: ClassVar[bool] = False  # the job must name its tools (the task has none of its own)
    has_reward: ClassVar[bool] = True  # False: the job must name a reward (``reward = ...``)
    # agentic tasks: the tools the model may call (names as in a job spec), and per-episode limits
    tools: ClassVar[tuple[str, ...]] = ()
    max_tool_calls: ClassVar[int] = 5  # as the paper's search agent
    max_observation_tokens: ClassVar[int] = 64  # longer tool results are cut with a visible marker

    def __init__(self, dataset: str | None = None, corpus: str | None = None) -> None:
        if dataset and not self.needs_dataset:
            raise TaskError(f"task {self.name!r} is built in and takes no dataset; drop 'dataset'")
        if self.needs_dataset and not dataset:
            raise TaskError(f"task {self.name!r} needs 'dataset': a path to a JSONL file")
        if corpus and not self.needs_corpus:
            raise TaskError(f"task {self.name!r} takes no corpus; drop 'corpus'")
        if self.needs_corpus and not corpus:
            raise TaskError(f"task {self.name!r} needs 'corpus': a path to a JSONL file of passages")
        self.dataset = dataset
        self.corpus = corpus

    def tool_context(self) -> dict[str, str]:
        """What this task's tool calls carry besides the model's arguments (e.g. the job's corpus)."""
        return {}

    @abc.abstractmethod
    def sample_problem(self, rng: random.Random) -> dict:
        """One problem: ``{"prompt": str, "answer": str, ...}``."""

    @abc.abstractmethod
    def reward(self, problem: dict, completion: str) -> float:
        """Judge ``completion`` against ``problem``; a value in [0, 1]."""

    def max_episode_tokens(self, max_new_tokens: int) -> int:
        """Tokens an episode may add after its prompt: one turn, or for an agentic task every
        allowed call with its observation and a final answer (the KV-cache footprint's size)."""
        if self.kind != "agentic":
            return max_new_tokens
        observation = self.max_observation_tokens + 48  # the response tags around a result
        return (self.max_tool_calls + 1) * max_new_tokens + self.max_tool_calls * observation

    def longest_prompts(self) -> list[str]:
        """Prompts to size the KV cache by: a sample here; every prompt for a finite dataset."""
        return [p["prompt"] for p in self.problems(64, seed=0)]

    def problems(self, n: int, seed: int) -> list[dict]:
        """``n`` problems drawn deterministically from ``seed``."""
        rng = random.Random(seed)
        return [self.sample_problem(rng) for _ in range(n)]


def char_match(prediction: str, answer: str) -> float:
    """Position-wise character agreement over the longer string: 1.0 only for an exact match."""
    longest = max(len(prediction), len(answer))
    if longest == 0:
        return 1.0
    return sum(p == a for p, a in zip(prediction, answer)) / longest


_INTEGER = re.compile(r"0|[1-9][0-9]{0,17}")  # a plain non-negative integer, as an answer is written


def numeric_closeness(prediction: str, answer: str, tolerance: int) -> float | None:
    """Credit for an integer near the integer ``answer``: 1.0 only for the answer itself, falling
    linearly with the distance to 0 at ``tolerance`` away. None when ``prediction`` is not a plain
    non-negative integer (no sign, no leading zeros, no other characters)."""
    if not _INTEGER.fullmatch(prediction):
        return None
    return max(0.0, 1.0 - abs(int(prediction) - int(answer)) / tolerance)


def json_records(path: Path, what: str, error: type[Exception] = TaskError):
    """``(line number, object)`` for each non-blank line of a JSONL file; ``error`` (a
    :class:`TaskError` by default) names the file, the line and the fix."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist: give a path to a JSONL file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{what} {path} cannot be read ({exc}): give a readable UTF-8 JSONL file") from None
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{path}:{lineno}: not JSON ({exc.msg}); write one JSON object per line") from None
        if not isinstance(record, dict):
            raise error(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
        yield lineno, record
