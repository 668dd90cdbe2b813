"""A multi-turn episode as typed segments (token in, token out), and the batch's episode metrics.

An episode is its prompt ids, then alternating *sampled* segments (the ids the engine
produced for one turn, with the engine's logprobs; trained, loss mask 1) and
*observation* segments (a tool's result, tokenized here; never trained: loss mask 0,
logprob 0). The ids of the next turn's request are exactly the ids so far: nothing the
model generated is ever decoded and re-tokenized. ``to_sample`` checks that ids, mask
and logprobs line up before the batch leaves rollout.

An episode of a job cancelled or failed meanwhile ends as ``stopped`` at its next turn; it is
never scored (its batch is not published), only metered (:func:`episodes_usage`).

A reward judges only the model's own final turn (``final_turn_ids``), never a tool's output,
whatever the chat template. An episode that did not end with an answer (``length``,
``max_tool_calls``, ``context_full``, ``read_timeout``) is *truncated*; the job's
``grpo.truncated`` says what happens to it (:func:`settle_truncated`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from marlaas.platform.events import Sample
from marlaas.platform.usage import UsageCounters

SegmentKind = Literal["sampled", "observation"]
END_REASONS = ("answer", "length", "max_tool_calls", "context_full", "read_timeout")
TRUNCATED_REASONS = ("length", "max_tool_calls", "context_full", "read_timeout")


@dataclass(frozen=True)
class Segment:
    kind: SegmentKind
    ids: list[int]
    logprobs: list[float]

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.logprobs):
            raise ValueError(f"{self.kind} segment: {len(self.ids)} ids but {len(self.logprobs)} logprobs")


@dataclass
class Episode:
    """One trajectory of one prompt: what the model wrote, what the tools answered, and how it ended."""

    prompt_ids: list[int]
    segments: list[Segment] = field(default_factory=list)
    end_reason: str = ""
    tool_calls: int = 0  # calls the model made (well-formed or not)
    tool_errors: int = 0  # calls answered with an error (bad JSON, unknown tool, timeout, tool failure)
    tool_successes: int = 0
    tool_wait_s: float = 0.0
    cached_tokens: list[int] = field(default_factory=list)  # prefix-cache hits of each turn after the first
    in_engine: int = 0  # the prompt tokens of the turn in the engine now (0 between turns)

    def __len__(self) -> int:
        return len(self.prompt_ids) + sum(len(s.ids) for s in self.segments)

    @property
    def ids(self) -> list[int]:
        """Every id so far: the next turn's prompt."""
        out = list(self.prompt_ids)
        for segment in self.segments:
            out += segment.ids
        return out

    @property
    def turns(self) -> int:
        return sum(s.kind == "sampled" for s in self.segments)

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens of its engine requests: each turn's request carries every id before it;
        a turn still in the engine (or cut off there, when its batch failed) counts as sent."""
        total, length = self.in_engine, len(self.prompt_ids)
        for segment in self.segments:
            total += length if segment.kind == "sampled" else 0
            length += len(segment.ids)
        return total

    @property
    def started(self) -> bool:
        """Whether it sent the engine a request (an episode of a stopped job may not have)."""
        return bool(self.segments or self.in_engine)

    @property
    def truncated(self) -> bool:
        """Whether the episode stopped before the model answered (out of tokens, calls or context)."""
        return self.end_reason in TRUNCATED_REASONS

    @property
    def final_turn_ids(self) -> list[int]:
        """The ids of the model's last turn: all a reward sees (no tool output, no template markup)."""
        sampled = [s for s in self.segments if s.kind == "sampled"]
        return list(sampled[-1].ids) if sampled else []

    def add_turn(self, ids: list[int], logprobs: list[float]) -> None:
        self.segments.append(Segment("sampled", list(ids), list(logprobs)))

    def add_observation(self, ids: list[int]) -> None:
        self.segments.append(Segment("observation", list(ids), [0.0] * len(ids)))

    def to_sample(self, group: int, reward: float, text: str = "") -> Sample:
        """The trainer's view: completion ids after the prompt, with mask and logprobs aligned."""
        completion, mask, logprobs = [], [], []
        for segment in self.segments:
            completion += segment.ids
            mask += [int(segment.kind == "sampled")] * len(segment.ids)
            logprobs += segment.logprobs
        assert len(completion) == len(mask) == len(logprobs), "episode segments out of line"
        return Sample(group=group, prompt_ids=list(self.prompt_ids), completion_ids=completion,
                      logprobs=logprobs, loss_mask=mask, reward=reward, text=text)


def to_score(episodes: list[Episode], mode: str) -> list[bool]:
    """Which episodes the reward judges: all of them under ``"train"``; under ``"zero"`` and
    ``"drop"`` only those that ended with an answer (the others' scores are settled without it)."""
    return [mode == "train" or not e.truncated for e in episodes]


def settle_truncated(episodes: list[Episode], scores: list[float | None], mode: str) -> list[float | None]:
    """Each episode's reward under the job's ``grpo.truncated``; None means left out of the batch.

    ``scores`` holds the reward's judgement of each episode ``to_score`` picked (None for the
    rest). ``"train"``: every episode keeps its score. ``"zero"``: a truncated episode gets 0.
    ``"drop"``: a truncated episode is left out of the batch (DAPO's overlong filtering: its tokens
    are not trained on and it does not move its group's baseline). Its group keeps the group
    number; the trainer normalizes each group over the members it has (a group of one, or of
    equal rewards, gets advantage 0).
    """
    if mode not in ("train", "zero", "drop"):
        raise ValueError(f"grpo.truncated must be 'train', 'zero' or 'drop', not {mode!r}")
    out: list[float | None] = []
    for episode, score in zip(episodes, scores, strict=True):
        if mode == "train" or not episode.truncated:
            if score is None:
                raise ValueError(f"episode ending by {episode.end_reason!r} was not scored")
            out.append(score)
        else:
            out.append(0.0 if mode == "zero" else None)
    return out


def episodes_usage(episodes: list[Episode]) -> UsageCounters:
    """What ``episodes`` used, finished or not: the engine's prefilled and generated tokens, the
    tool calls the model made and the seconds they were waited on (metering,
    ``marlaas.platform.usage``). An episode cut off half-way counts what it did: its finished
    turns, and the prompt of the turn that was in the engine (whose sampled tokens the engine
    does not report); one that never sent a request counts nothing."""
    return UsageCounters(
        prefill_tokens=sum(e.prefill_tokens for e in episodes),
        generated_tokens=sum(len(s.ids) for e in episodes for s in e.segments if s.kind == "sampled"),
        episodes=sum(e.started for e in episodes), tool_calls=sum(e.tool_calls for e in episodes),
        tool_s=sum(e.tool_wait_s for e in episodes))


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Per-batch agent metrics (means per episode, shares of episodes), slash-namespaced."""
    n = max(len(episodes), 1)
    cached = [c for e in episodes for c in e.cached_tokens]
    metrics = {
        "episode/turns": sum(e.turns for e in episodes) / n,
        "tool/calls": sum(e.tool_calls for e in episodes) / n,
        "tool/errors": sum(e.tool_errors for e in episodes) / n,
        "tool/success_rate": sum(e.tool_successes > 0 for e in episodes) / n,
        "tool/wait_s": sum(e.tool_wait_s for e in episodes) / n,
        "episode/cached_tokens": sum(cached) / len(cached) if cached else 0.0,
    }
    for reason in END_REASONS:
        metrics[f"episode/end_{reason}"] = float(sum(e.end_reason == reason for e in episodes))
    return metrics
