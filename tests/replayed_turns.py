"""Model turns replayed as the engine's sampled ids, for the episode loop's tests: a real model
cannot be steered into writing a given text (an unclosed string, a broken call), so the turn is
replayed, and the rest of the loop (parsing, tools over the bus, tokenizing) is the real one."""

from __future__ import annotations

from marlaas.tools.protocol import CALL_CLOSE
from services.rollout.engine import Completion


class ReplayedTurns:
    """Each ``generate`` answers the next of ``turns`` (then ``"done"``); a turn ending in the
    closing tag stopped there (the engine's stop string), and a turn longer than its budget is cut
    to ``max_tokens`` and ends as ``length``, as the engine does. ``requests`` holds the ids each
    turn was asked with."""

    def __init__(self, tokenizer, turns: list[str]) -> None:
        self.tokenizer = tokenizer
        self.turns = [*turns, "done"]
        self.requests: list[list[int]] = []
        self.loras: list[object] = []  # the adapter each turn was asked with

    async def generate(self, prompt_ids, *, max_tokens, temperature, lora, seed, stop=None,
                       ignore_eos=False) -> Completion:
        self.requests.append(list(prompt_ids))
        self.loras.append(lora)
        text = self.turns.pop(0) if self.turns else "done"
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        called = bool(stop) and text.endswith(CALL_CLOSE)
        ids = ids if called else ids + [self.tokenizer.eos_token_id]
        if len(ids) > max_tokens:
            ids = ids[:max_tokens]
            return Completion(ids, [-0.5] * len(ids), self.tokenizer.decode(ids), "length")
        return Completion(ids, [-0.5] * len(ids), text, "stop", CALL_CLOSE if called else None)
