"""Agentic tasks: the model must call a tool to do well, and RL teaches it to.

``multiply`` asks for the product of two 2-digit numbers, which a tiny model cannot
compute (it guesses digits: a partial-credit reward of ~0.2). With the ``calculator`` tool
it only has to copy the expression into a call and the result into its answer. The default
chat base was pretrained on it with the calculator's schema and calls it every time; the
character-level base (``base_model = "builtin:char"``) calls it on about a third of the
problems at temperature 1.0 and guesses on the rest, so there RL has a clear gain to make:
call it always.
"""

from __future__ import annotations

import random

from marlaas.tasks.base import Task, char_match
from marlaas.tools.protocol import final_answer


class Multiply(Task):
    name = "multiply"
    kind = "agentic"
    description = "multiply two 2-digit numbers ('mul:37*45=' -> '1665'); needs the calculator tool"
    tools = ("calculator",)
    max_new_tokens = 96  # per turn: a calculator call is ~75 characters
    max_tool_calls = 2

    def sample_problem(self, rng: random.Random) -> dict:
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        return {"prompt": f"mul:{a}*{b}=", "answer": str(a * b), "expression": f"{a}*{b}"}

    def reward(self, problem: dict, completion: str) -> float:
        return char_match(final_answer(completion), problem["answer"])
