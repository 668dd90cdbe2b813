"""Metering a batch that never reaches the trainer (issue 48, M1): a job cancelled or failed while
its episodes generate once left no usage record, however long the engine had worked for it. Rollout
now reports its episodes' usage when their generation ends, however it ends (``metered``), and an
episode of a stopped job starts no more turns. The engine here is a fake that holds some requests
until they are cut off; the episode loop, the metering and the usage events are rollout's own."""

from __future__ import annotations

import asyncio
import json

import pytest
from replayed_turns import ReplayedTurns

from marlaas.basemodel import builtin_model_dir
from marlaas.platform.events import TOOL, ToolResult, encode
from marlaas.platform.usage import USAGE, UsageCounters
from marlaas.tools.protocol import CALL_CLOSE, CALL_OPEN
from services.rollout.agent import ConversationFormat, EpisodeLimits, ToolBox, run_episode
from services.rollout.engine import Completion
from services.rollout.episode import Episode, episodes_usage
from services.rollout.service import gather_or_cancel, metered
from tests.models import tokenizer as tokenizer_of

JOB = "mallory.quitter-1a2b3c"
SINGLE_TURN = EpisodeLimits(max_new_tokens=16, max_tool_calls=0, max_observation_tokens=64, max_total_tokens=256,
                            tool_timeout_s=1.0)


class Published:
    """The bus as ``report_usage`` uses it: what was published, decoded."""

    def __init__(self) -> None:
        self.usage: list[UsageCounters] = []

    async def publish(self, subject: str, data: bytes, msg_id: str | None = None) -> None:
        event = USAGE.decode(data)
        assert subject == f"marlaas.usage.{event.tenant}" and event.job == JOB
        self.usage.append(event.counters)


class HeldEngine:
    """Answers the first ``quick`` requests at once with ``tokens`` tokens each; holds every later
    one in the engine until it is cut off (its task cancelled), but request number ``fails``, which
    raises as a broken engine does."""

    def __init__(self, quick: int, tokens: int = 5, fails: int = 0) -> None:
        self.quick, self.tokens, self.fails = quick, tokens, fails
        self.asked = 0
        self.held = asyncio.Event()  # set once a request is held

    async def generate(self, prompt_ids, *, max_tokens, temperature, lora, seed, stop=None, ignore_eos=False,
                       **placement) -> Completion:
        self.asked += 1
        if self.asked == self.fails:
            raise RuntimeError("engine returned no completion")
        if self.asked > self.quick:
            self.held.set()
            await asyncio.Event().wait()  # never answers: only a cancellation ends it
        return Completion([7] * self.tokens, [-0.5] * self.tokens, "", "stop")


async def a_batch(engine, bus: Published, prompts: list[list[int]]) -> list[Episode]:
    """What rollout does for a batch's generation: every episode started into ``metered``'s list."""
    async with metered(bus, JOB) as started:
        async def episode(prompt_ids: list[int]) -> Episode:
            started.append(episode := Episode(prompt_ids))
            return await run_episode(engine, None, prompt_ids, tools=None, limits=SINGLE_TURN, temperature=1.0,
                                     lora=None, seed=lambda turn: turn, episode=episode)

        return await gather_or_cancel(*(episode(ids) for ids in prompts))


def test_a_batch_cut_off_half_way_reports_what_its_episodes_did():
    """The attack: a job cancelled (or failed) while its first batch generates. Two episodes were
    done, two were in the engine when the batch was cut off: all four are metered, the two done
    with their tokens, the two cut off with their prompts (the engine sent them; what they had
    sampled it does not report)."""
    async def scenario() -> Published:
        bus, engine = Published(), HeldEngine(quick=2)
        batch = asyncio.create_task(a_batch(engine, bus, [[1, 2, 3]] * 4))
        await engine.held.wait()
        await asyncio.sleep(0)  # the other held request reaches the engine too
        batch.cancel()
        await asyncio.gather(batch, return_exceptions=True)
        return bus

    bus = asyncio.run(scenario())
    assert bus.usage == [UsageCounters(prefill_tokens=4 * 3, generated_tokens=2 * 5, episodes=4)]


def test_a_failed_episode_cuts_its_batch_off_and_the_batch_is_metered():
    """A failed episode (the engine's error on the last request) fails the batch: the two held in
    the engine are cut off rather than left generating unmetered, and what each of the four did is
    reported (the failed request's prompt was sent too)."""
    async def scenario() -> Published:
        bus = Published()
        with pytest.raises(RuntimeError, match="no completion"):
            await a_batch(HeldEngine(quick=1, fails=4), bus, [[1, 2]] * 4)
        return bus

    bus = asyncio.run(scenario())
    assert bus.usage == [UsageCounters(prefill_tokens=4 * 2, generated_tokens=5, episodes=4)]


def test_a_finished_batch_reports_once_and_an_unstarted_episode_counts_nothing():
    async def scenario() -> Published:
        bus = Published()
        async with metered(bus, JOB) as started:
            started.append(Episode([1, 2]))  # never sent a request: its job stopped first
            started.append(episode := Episode([1, 2, 3]))
            await run_episode(HeldEngine(quick=1), None, [1, 2, 3], tools=None, limits=SINGLE_TURN,
                              temperature=1.0, lora=None, seed=lambda turn: turn, episode=episode)
        return bus

    assert asyncio.run(scenario()).usage == [UsageCounters(prefill_tokens=3, generated_tokens=5, episodes=1)]


TOKENIZER = tokenizer_of(builtin_model_dir())
FMT = ConversationFormat(TOKENIZER)
AGENT = EpisodeLimits(max_new_tokens=200, max_tool_calls=5, max_observation_tokens=64, max_total_tokens=2_000,
                      tool_timeout_s=1.0)


async def echo_tool(subject: str, data: bytes, timeout_s: float) -> bytes:
    call = TOOL.decode(data)
    return encode(ToolResult(call_id=call.call_id, output=json.loads(call.arguments).get("text", "")))


def test_an_episode_of_a_stopped_job_starts_no_more_turns():
    """Once its job is cancelled or failed an agent's episode ends at its next turn (the one in the
    engine finishes, and is metered), instead of calling tools and generating to its last."""
    call = f'{CALL_OPEN}{{"name": "echo", "arguments": {{"text": "hi"}}}}{CALL_CLOSE}'
    engine = ReplayedTurns(TOKENIZER, [call, call, call, "the answer"])
    stopped: set[str] = set()

    async def tool_then_cancel(subject: str, data: bytes, timeout_s: float) -> bytes:
        stopped.add(JOB)  # the job is cancelled while its first tool call runs
        return await echo_tool(subject, data, timeout_s)

    box = ToolBox(JOB, ["mallory.echo"], tool_then_cancel, AGENT.tool_timeout_s)
    episode = asyncio.run(run_episode(engine, FMT, FMT.prompt_ids("q=", []), tools=box, limits=AGENT,
                                      temperature=1.0, lora=None, seed=lambda turn: turn,
                                      stopped=lambda: JOB in stopped))
    assert episode.end_reason == "stopped" and len(engine.requests) == 1 and episode.tool_calls == 1
    used = episodes_usage([episode])
    assert used.prefill_tokens == len(engine.requests[0]) and used.generated_tokens == len(episode.segments[0].ids)
    assert used.episodes == used.tool_calls == 1 and used.tool_s > 0
