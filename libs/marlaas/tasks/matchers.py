"""The built-in answer matchers: rewards a job names bare (``reward = "contains"``), for any task.

Each is a pure function ``(row, completion) -> float`` in {0.0, 1.0}. ``row`` is the problem
(a dataset row: ``answer``, a string or number, or ``answers``, a list of them); the
completion is the model's final turn. What is compared is the model's *answer text*
(:func:`answer_text`): the text after its last tool response, ``<think>`` blocks and a chat
template's leftover role line dropped. The env service serves them on
``marlaas.reward.builtin.<name>`` beside the LLM ``judge``.

- ``exact``: the answer, normalized as SQuAD does (lower case, no punctuation, no articles,
  single spaces), equals a normalized reference.
- ``contains``: a normalized reference appears in the normalized answer as whole words
  (``"Lima"`` in ``"The capital is Lima."``; not ``"Lim"``).
- ``numeric``: the number the answer commits to (``#### N``, ``\\boxed{N}``, ``answer is N``,
  else the last number written) equals a reference's number exactly (``1,234.50`` = ``1234.5``);
  a reference that is no number is an error naming it.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from marlaas.tasks.base import TaskError
from marlaas.tasks.gsm8k import final_answer as final_number
from marlaas.tasks.gsm8k import parse_number
from marlaas.tasks.search_qa import normalize_answer
from marlaas.tools.protocol import final_answer, without_thinking

_ROLE_LINE = re.compile(r"^\s*assistant\s*\n")  # what a chat template leaves once special tokens are skipped

Matcher = Callable[[dict, str], float]


def answer_text(completion: str) -> str:
    """What the model answered: after its last tool response, without ``<think>`` blocks or a role line."""
    return _ROLE_LINE.sub("", without_thinking(final_answer(completion))).strip()


def references(row: dict) -> list[str]:
    """A row's accepted answers as strings: ``answers`` (a list) or ``answer``; a TaskError if none."""
    found = row.get("answers") if row.get("answers") is not None else row.get("answer")
    found = found if isinstance(found, list) else [found]
    if not found or not all(isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in found):
        raise TaskError('the row needs "answer" (a string or number) or "answers" (a non-empty list of them)')
    return [str(a) for a in found]


def exact(row: dict, completion: str) -> float:
    """1.0 when the normalized answer equals a normalized reference."""
    answer = normalize_answer(answer_text(completion))
    return float(any(answer == normalize_answer(r) for r in references(row)))


def contains(row: dict, completion: str) -> float:
    """1.0 when a normalized reference appears in the normalized answer as whole words."""
    answer = f" {normalize_answer(answer_text(completion))} "
    return float(any(f" {normalize_answer(r)} " in answer for r in references(row) if normalize_answer(r)))


def numeric(row: dict, completion: str) -> float:
    """1.0 when the number the answer commits to equals a reference's number."""
    wanted = []
    for reference in references(row):
        value = parse_number(reference.strip())
        if value is None:
            raise TaskError(f"reward 'numeric': the reference answer {reference!r} is not a number; "
                            "use 'exact' or 'contains' for text answers")
        wanted.append(value)
    got = final_number(answer_text(completion))
    return float(got is not None and got in wanted)


MATCHERS: dict[str, Matcher] = {"exact": exact, "contains": contains, "numeric": numeric}
