"""GSM8K-style math word problems from a user's JSONL, with a robust final-answer verifier.

Each line is ``{"question": ..., "answer": ...}`` where ``answer`` is either a bare
number or GSM8K's worked solution ending in ``#### <number>``. The verifier reads
the completion's final answer from ``#### N``, ``\\boxed{N}``, ``answer is N`` or,
failing those, the last number written, and compares numerically.
"""

from __future__ import annotations

import random
import re
from fractions import Fraction
from pathlib import Path

from marlaas.tasks.base import Task, TaskError, json_records

# Possessive quantifiers (``*+``) and whitespace only after a sign: a completion is a model's
# output, and a pattern that can split one run of spaces between two ``\s*`` (or start inside
# it) takes quadratic time on a long run (tests/integration/test_regex_audit.py)
_NUMBER = r"(?:(?:-\$?|\$)\s*+)?\d[\d,]*+(?:\.\d+)?(?:/\d+)?"
_NUMBERS = re.compile(_NUMBER)
_MARKERS = (
    re.compile(r"####\s*+(" + _NUMBER + ")"),
    re.compile(r"\\boxed\{\s*+(" + _NUMBER + r")\s*+\}"),
    re.compile(r"answer\s*+(?:is|:)\s*+(" + _NUMBER + ")", re.IGNORECASE),
)


def parse_number(text: str) -> Fraction | None:
    """``'$1,234.50'`` -> 1234.5 as an exact Fraction; None if it is not a number."""
    cleaned = text.replace("$", "").replace(",", "").replace(" ", "").rstrip(".")
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def final_answer(completion: str) -> Fraction | None:
    """The number a completion commits to as its final answer."""
    for marker in _MARKERS:
        found = marker.findall(completion)
        if found:
            return parse_number(found[-1])
    numbers = _NUMBERS.findall(completion)
    return parse_number(numbers[-1]) if numbers else None


def reference_answer(answer: str) -> Fraction:
    value = final_answer(answer) if "####" in answer else parse_number(answer.strip())
    if value is None:
        raise TaskError(f"reference answer {answer!r} holds no number")
    return value


class Gsm8k(Task):
    name = "gsm8k"
    description = "GSM8K-style word problems from your JSONL ({question, answer}); needs a real model"
    max_new_tokens = 256
    needs_dataset = True

    def __init__(self, dataset: str | None = None, corpus: str | None = None) -> None:
        super().__init__(dataset, corpus)
        self.items = load_jsonl(Path(dataset))

    @staticmethod
    def prompt(item: dict) -> str:
        return f"Question: {item['question']}\nThink step by step, then end with '#### <number>'.\nAnswer:"

    def sample_problem(self, rng: random.Random) -> dict:
        item = rng.choice(self.items)
        return {"prompt": self.prompt(item), "answer": item["answer"]}

    def longest_prompts(self) -> list[str]:
        return [self.prompt(item) for item in self.items]

    def reward(self, problem: dict, completion: str) -> float:
        got = final_answer(completion)
        return float(got is not None and got == reference_answer(problem["answer"]))


def load_jsonl(path: Path) -> list[dict]:
    """Read and validate a GSM8K JSONL; errors name the file and line."""
    items = []
    for lineno, item in json_records(path, "dataset"):
        if not {"question", "answer"} <= item.keys():
            raise TaskError(f"{path}:{lineno}: each line needs 'question' and 'answer' fields")
        reference_answer(str(item["answer"]))  # fail at submit time, not mid-run
        items.append({"question": str(item["question"]), "answer": str(item["answer"])})
    if not items:
        raise TaskError(f"dataset {path} holds no problems")
    return items
