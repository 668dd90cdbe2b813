"""Every way a tool call can fail becomes an observation, and the episode goes on.

Tools are served through the SDK on a real nats-server; the episode loop is driven by a
*scripted engine* (named as such: a real model cannot be steered into writing a given
broken call), which replays fixed turns as token ids and records the ids of every
request, so the test also sees that each turn re-enters with exactly the ids so far.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from marlaas.basemodel import builtin_model_dir
from marlaas.platform.events import TOOL, ToolResult, encode
from marlaas.tools import tool
from marlaas.tools.protocol import render_call
from marlaas.tools.serving import ToolError, serve_tools
from services.rollout.agent import ConversationFormat, EpisodeLimits, ToolBox, run_episode
from services.rollout.engine import Completion
from tests.models import tokenizer as tokenizer_of

TOKENIZER = tokenizer_of(builtin_model_dir())
FMT = ConversationFormat(TOKENIZER)
LIMITS = EpisodeLimits(max_new_tokens=96, max_tool_calls=3, max_observation_tokens=200, max_total_tokens=480,
                       tool_timeout_s=1.0)


class ScriptedEngine:
    """Replays ``turns`` (text) as the engine's sampled ids; a turn ending in a call stops there."""

    def __init__(self, turns: list[str]) -> None:
        self.turns = list(turns)
        self.requests: list[list[int]] = []

    async def generate(self, prompt_ids, *, max_tokens, temperature, lora, seed, stop=None,
                       ignore_eos=False) -> Completion:
        self.requests.append(list(prompt_ids))
        text = self.turns.pop(0)
        ids = TOKENIZER(text, add_special_tokens=False)["input_ids"]
        called = stop and any(text.endswith(s) for s in stop)
        ids = ids if called else ids + [TOKENIZER.eos_token_id]
        return Completion(ids, [-0.5] * len(ids), text, "stop", stop[0] if called else None)


@tool
def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


@tool
async def slow(seconds: float) -> str:
    """Sleep, then answer."""
    await asyncio.sleep(seconds)
    return "late"


@tool
def broken(x: int) -> str:
    """Always fails."""
    raise ToolError(f"cannot handle {x}")


@tool
def echo(text: str) -> str:
    """Say the text back."""
    return text


@tool
def binary() -> bytes:
    """Returns bytes, which are not text."""
    return b"\x00\x01"


@pytest.fixture
async def served(bus):
    tools = await serve_tools(bus, [add, slow, broken, binary, echo], "acme")

    async def garbage(data: bytes) -> bytes:  # a process that answers with something else entirely
        return b"\xff not a tool result"

    async def flood(data: bytes) -> bytes:  # a tenant's own process (not the SDK, which caps output)
        call = TOOL.decode(data)
        return encode(ToolResult(call_id=call.call_id, output="z" * 900_000))  # under the 1 MB payload

    await bus.serve("marlaas.tool.acme.garbage", "tool-acme", garbage)
    await bus.serve("marlaas.tool.acme.flood", "tool-acme", flood)
    yield bus
    await tools.stop()


async def episode_with(bus, call_text: str, tools=("acme.add", "acme.slow", "acme.broken", "acme.binary",
                                                      "acme.garbage", "acme.echo", "acme.flood"), limits=LIMITS):
    engine = ScriptedEngine([call_text, "done"])
    prompt = FMT.prompt_ids("q=", [])
    box = ToolBox("acme.job-1", list(tools), bus.request, limits.tool_timeout_s)
    episode = await run_episode(engine, FMT, prompt, tools=box, limits=limits, temperature=1.0, lora=None,
                                seed=lambda turn: turn)
    observation = TOKENIZER.decode(episode.segments[1].ids)
    # the chat template's turn switch around the response (<|im_end|>, the user turn, back to the
    # assistant) is the format's own: what is checked here is the response between them
    turn_end, turn_start = FMT.obs_head.removesuffix("<tool_response>"), FMT.obs_tail.removeprefix("</tool_response>")
    assert observation.startswith(turn_end) and observation.endswith(turn_start), observation
    observation = observation[len(turn_end):len(observation) - len(turn_start)]
    # the episode went on: a second turn, whose request held exactly the ids of everything before it
    assert episode.turns == 2 and episode.end_reason == "answer"
    assert engine.requests[1] == prompt + episode.segments[0].ids + episode.segments[1].ids
    return episode, observation


@pytest.mark.timeout(60)
async def test_a_successful_call_returns_its_output(served):
    episode, observation = await episode_with(served, render_call("acme.add", {"a": 2, "b": 3}))
    assert observation == "<tool_response>5</tool_response>"
    assert episode.tool_successes == 1 and episode.tool_errors == 0


@pytest.mark.timeout(60)
async def test_a_tool_timeout_becomes_an_observation(served):
    episode, observation = await episode_with(served, render_call("acme.slow", {"seconds": 5}))
    assert "did not answer within 1s" in observation and episode.tool_errors == 1
    assert episode.tool_wait_s >= 1.0


@pytest.mark.timeout(60)
async def test_a_tool_error_becomes_an_observation(served):
    episode, observation = await episode_with(served, render_call("acme.broken", {"x": 7}))
    assert "error: cannot handle 7" in observation and episode.tool_errors == 1


@pytest.mark.timeout(60)
async def test_an_unknown_tool_becomes_an_observation(served):
    _, observation = await episode_with(served, render_call("weather", {"city": "x"}))
    assert "unknown tool 'weather'" in observation and "acme.add" in observation


@pytest.mark.timeout(60)
async def test_a_call_that_is_not_json_becomes_an_observation(served):
    _, observation = await episode_with(served, '<tool_call>{"name": "acme.add", "arguments": {a: 1}</tool_call>')
    assert "not valid JSON" in observation


@pytest.mark.timeout(60)
async def test_a_result_that_is_not_text_becomes_an_observation(served):
    _, observation = await episode_with(served, render_call("acme.binary", {}))
    assert "not text" in observation
    _, observation = await episode_with(served, render_call("acme.garbage", {}))
    assert "not a tool result" in observation


@pytest.mark.timeout(60)
async def test_the_call_limit_ends_an_episode_cleanly(served):
    call = render_call("acme.add", {"a": 1, "b": 1})
    engine = ScriptedEngine([call] * 4)
    box = ToolBox("acme.job-1", ["acme.add"], served.request, 1.0)
    episode = await run_episode(engine, FMT, FMT.prompt_ids("q=", []), tools=box, limits=LIMITS,
                                temperature=1.0, lora=None, seed=lambda turn: turn)
    assert episode.tool_calls == 3 and episode.end_reason == "max_tool_calls" and episode.turns == 4


@pytest.mark.timeout(90)
async def test_no_model_output_and_no_tool_output_breaks_an_episode_or_stalls_the_loop(served):
    """Each malformed output of issue 24 runs as a real episode (tools over NATS): the call ends
    as an observation the model reads, the episode goes on to its answer, and a ~1 MB result is
    cut before tokenizing, in a worker thread, while the event loop keeps ticking."""
    roomy = EpisodeLimits(max_new_tokens=96, max_tool_calls=3, max_observation_tokens=200,
                          max_total_tokens=20_000, tool_timeout_s=5.0)
    nested = "[" * 1_200 + "]" * 1_200
    cases = {  # the model's turn -> what its tool response says
        "deep nesting": ('<tool_call>{"name":"acme.add","arguments":{"a":' + nested + "}}</tool_call>",
                         "nests brackets more than 32 deep"),
        "huge integer": ('<tool_call>{"name":"acme.add","arguments":{"a":' + "9" * 4_301 + ',"b":1}}</tool_call>',
                         "not valid JSON"),
        "open tag in a string": (render_call("acme.echo", {"text": "say <tool_call> twice"}),
                                 "say &lt;tool_call> twice"),
        "closing tag in code": ('<tool_call>{"name":"acme.echo","arguments":{"text":"print(\'</tool_call>',
                                "write it as <\\/tool_call>"),
        "text after the tag": (render_call("acme.add", {"a": 2, "b": 3}) + "\nand more", "<tool_response>5<"),
        "two calls": (render_call("acme.add", {"a": 1, "b": 1}) + render_call("acme.add", {"a": 4, "b": 4}),
                      "only the first call of a turn runs"),
    }
    for name, (turn, says) in cases.items():
        episode, observation = await episode_with(served, turn, limits=roomy)
        assert says in observation, (name, observation[:300])
    _, observation = await episode_with(served, cases["two calls"][0], limits=roomy)
    assert "\n2</tool_response>" in observation and "8" not in observation  # the first call ran, only it

    longest_gap = 0.0

    async def ticker(stop: asyncio.Event) -> None:
        nonlocal longest_gap
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            longest_gap, last = max(longest_gap, now - last), now

    stop = asyncio.Event()
    ticking = asyncio.create_task(ticker(stop))
    episode, observation = await episode_with(served, render_call("acme.flood", {}), limits=roomy)
    stop.set()
    await ticking
    assert observation.endswith("...[truncated]</tool_response>")
    assert len(episode.segments[1].ids) <= 200 + len(FMT.observation_ids("", 200))  # the budget and the frame
    assert longest_gap < 0.5, f"the event loop stalled {longest_gap:.2f}s on a 900 kB tool result"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("length", [40, 1_000, 30_000])
async def test_an_unclosed_string_of_any_length_is_read_in_linear_time_and_the_loop_runs_on(served, length):
    """Issue 35: a call whose argument string is never closed froze the rollout service (the
    bracket scan backtracked exponentially: 40 characters took hours). Now it is a call error
    the model reads, while the event loop keeps running (no watchdog report, no long gap)."""
    from marlaas.platform.loop_watchdog import LoopWatchdog

    roomy = EpisodeLimits(max_new_tokens=96, max_tool_calls=3, max_observation_tokens=200,
                          max_total_tokens=40_000, tool_timeout_s=5.0)
    turn = '<tool_call>{"name":"acme.echo","arguments":{"text":"' + "a" * length + "</tool_call>"
    watchdog = LoopWatchdog(asyncio.get_running_loop(), 0.5, "test", every_s=0.05).start()
    try:
        episode, observation = await episode_with(served, turn, limits=roomy)
    finally:
        watchdog.stop()
    assert "not valid JSON" in observation and "write it as <\\/tool_call>" in observation
    assert episode.tool_errors == 1 and watchdog.reports == 0


@pytest.mark.timeout(60)
async def test_a_turn_not_read_within_its_deadline_cuts_only_its_episode(served):
    """Reading a turn runs in a worker thread under ``read_deadline_s``: an episode whose turn
    is not read in time ends as ``read_timeout`` (a truncated episode), and the episode beside
    it goes on to its answer."""
    strict = EpisodeLimits(max_new_tokens=96, max_tool_calls=3, max_observation_tokens=200, max_total_tokens=480,
                           tool_timeout_s=1.0, read_deadline_s=0.0)
    box = ToolBox("acme.job-1", ["acme.add"], served.request, 1.0)
    call = render_call("acme.add", {"a": 2, "b": 3})
    cut, whole = await asyncio.gather(
        run_episode(ScriptedEngine([call, "done"]), FMT, FMT.prompt_ids("q=", []), tools=box, limits=strict,
                    temperature=1.0, lora=None, seed=lambda turn: turn),
        run_episode(ScriptedEngine([call, "done"]), FMT, FMT.prompt_ids("q=", []), tools=box, limits=LIMITS,
                    temperature=1.0, lora=None, seed=lambda turn: turn))
    assert cut.end_reason == "read_timeout" and cut.truncated and cut.turns == 1 and cut.tool_calls == 0
    assert whole.end_reason == "answer" and whole.tool_successes == 1 and whole.turns == 2


@pytest.mark.timeout(60)
async def test_an_episodes_usage_is_what_the_engine_was_asked_and_the_tool_took(served):
    from services.rollout.episode import episodes_usage

    engine = ScriptedEngine([render_call("acme.slow", {"seconds": 0.3}), "done"])
    prompt = FMT.prompt_ids("q=", [])
    box = ToolBox("acme.job-1", ["acme.slow"], served.request, LIMITS.tool_timeout_s)
    episode = await run_episode(engine, FMT, prompt, tools=box, limits=LIMITS, temperature=1.0, lora=None,
                                seed=lambda turn: turn)
    used = episodes_usage([episode])
    assert used.prefill_tokens == sum(len(ids) for ids in engine.requests)  # every request's prompt, as sent
    assert used.generated_tokens == sum(len(s.ids) for s in episode.segments if s.kind == "sampled")
    assert used.episodes == 1 and used.tool_calls == 1 and 0.3 <= used.tool_s < LIMITS.tool_timeout_s
