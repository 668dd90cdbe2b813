"""Three toy families the built-in tiny model learns from, each with a different answer length.

Rewards give partial credit (position-wise character agreement) so that a weak
policy already earns some reward and GRPO groups have variance to learn from.
"""

from __future__ import annotations

import abc
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


class WordTask(Task):
    """A random word of 3-6 letters in, a transform of it out."""

    prefix: str

    @abc.abstractmethod
    def transform(self, word: str) -> str:
        """The answer for ``word``."""

    def sample_problem(self, rng: random.Random) -> dict:
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 6)))
        return {"prompt": f"{self.prefix}:{word}=", "answer": self.transform(word)}

    def reward(self, problem: dict, completion: str) -> float:
        return char_match(completion.strip(), problem["answer"])


class Reverse(WordTask):
    name = "reverse"
    description = "reverse a word of 3-6 letters ('rev:abcd=' -> 'dcba'); medium answers"
    max_new_tokens = 8
    prefix = "rev"

    def transform(self, word: str) -> str:
        return word[::-1]


class Repeat(WordTask):
    name = "repeat"
    description = "write a word of 3-6 letters twice ('dup:abc=' -> 'abcabc'); long answers"
    max_new_tokens = 14
    prefix = "dup"

    def transform(self, word: str) -> str:
        return word * 2
