"""Three toy families the built-in tiny model learns from, each with a different answer length.

Rewards give partial credit so that a weak policy already earns some reward and GRPO groups
have variance to learn from: the word tasks position-wise character agreement, addition how
near the sum the answer is (a near miss earns more than a far one; only the sum earns 1.0).
"""

from __future__ import annotations

import abc
import random
import string

from marlaas.tasks.base import Task, char_match, numeric_closeness


class Addition(Task):
    name = "addition"
    description = "add two numbers below 100 ('37+45=' -> '82'); short answers"
    max_new_tokens = 4
    # an integer answer earns 1 - |answer - sum| / tolerance, nothing when off by `tolerance` or
    # more: the best constant guess ("99") earns 0.27 on average, the default base sampled at
    # T = 1 about 0.36-0.40 and greedily 0.46 (docs/basemodel.md, "Learning the toy tasks")
    tolerance = 30

    def sample_problem(self, rng: random.Random) -> dict:
        a, b = rng.randrange(100), rng.randrange(100)
        return {"prompt": f"{a}+{b}=", "answer": str(a + b)}

    def reward(self, problem: dict, completion: str) -> float:
        text = completion.strip()
        near = numeric_closeness(text, problem["answer"], self.tolerance)
        if near is not None:
            return near
        # not a plain integer ("14x", "146."): half the position-wise character credit (below 0.5)
        return 0.5 * char_match(text, problem["answer"])


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
