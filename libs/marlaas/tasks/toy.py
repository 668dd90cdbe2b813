"""Three toy families the built-in tiny model learns from, each with a different answer length.

Rewards give partial credit (position-wise character agreement) so that a weak
policy already earns some reward and GRPO groups have variance to learn from.
"""

from __future__ import annotations

import random
import string

from marlaas.tasks.base import Task, char_match


class Addition(Task):
    name = "addition"
    description = "add two numbers below 100 ('37+45=' -> '82'); short answers"
    max_new_tokens = 4

    def sample_problem(self, rng: random.Random) -> dict:
        a, b = rng.randrange(100), rng.randrange(100)
        return {"prompt": f"{a}+{b}=", "answer": str(a + b)}

    def reward(self, problem: dict, completion: str) -> float:
        return char_match(completion.strip(), problem["answer"])


class Reverse(Task):
    name = "reverse"
    description = "reverse a word of 3-6 letters ('rev:abcd=' -> 'dcba'); medium answers"
    max_new_tokens = 8

    def sample_problem(self, rng: random.Random) -> dict:
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 6)))
        return {"prompt": f"rev:{word}=", "answer": word[::-1]}

    def reward(self, problem: dict, completion: str) -> float:
        return char_match(completion.strip(), problem["answer"])


class Repeat(Task):
    name = "repeat"
    description = "write a word of 3-6 letters twice ('dup:abc=' -> 'abcabc'); long answers"
    max_new_tokens = 14

    def sample_problem(self, rng: random.Random) -> dict:
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 6)))
        return {"prompt": f"dup:{word}=", "answer": word * 2}

    def reward(self, problem: dict, completion: str) -> float:
        return char_match(completion.strip(), problem["answer"])
