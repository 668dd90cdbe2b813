"""``marlaas samples``'s transcript (``marlaas.cli.transcript``): group by group, each episode's
reward, advantage, turns, calls and answer, readable as plain text."""

from __future__ import annotations

import pytest

from marlaas.cli.commands import build_parser
from marlaas.cli.transcript import transcript
from marlaas.platform.http_api import SampleEpisode, SampleGroup, SampleTurn, VersionSamples

pytestmark = pytest.mark.timeout(10)

AGENTIC = SampleEpisode(reward=1.0, advantage=0.866, completion="42\nthat is all", tokens=57, turns=[
    SampleTurn(role="model", text='I will compute it.\n<tool_call>...</tool_call>', tool="calculator",
               arguments='{"expression": "6*7"}'),
    SampleTurn(role="tool", text="42"),
    SampleTurn(role="model", text="<tool_call>oops</tool_call>", error="the call is not valid JSON"),
    SampleTurn(role="tool", text="error: the call is not valid JSON"),
], turns_cut=3)
WRONG = SampleEpisode(reward=0.0, advantage=-0.866, completion="41", tokens=2)


def samples(**changes) -> VersionSamples:
    fields = dict(job="acme.agent-1a2b3c", version=5, policy_version=5, batch_groups=4, versions=[0, 2, 4, 5],
                  groups=[SampleGroup(group=0, prompt="system\nUse the tools.\nuser\nWhat is 6 x 7?", size=3,
                                      reward_mean=0.333, episodes=[AGENTIC, WRONG], policy_version=5, batch_groups=4)])
    return VersionSamples(**{**fields, **changes})


def test_a_transcript_shows_each_group_its_prompt_and_each_episodes_turns_and_answer():
    text = transcript(samples())
    lines = text.splitlines()
    assert lines[0] == "acme.agent-1a2b3c version 5: 1 of 4 groups kept, 2 episodes"
    assert lines[1] == "versions with samples: 0, 2, 4, 5"
    assert "group 0: 2 of 3 episodes kept, mean reward 0.333" in lines
    assert "  prompt  | system" in lines and "          | What is 6 x 7?" in lines  # a text's lines stay aligned
    assert "  episode 1: reward 1.000, advantage +0.866, 57 tokens, 2 tool-calling turns" in lines
    assert "  episode 2: reward 0.000, advantage -0.866, 2 tokens" in lines
    assert '    call    | calculator {"expression": "6*7"}' in lines
    assert "    call    | (unreadable: the call is not valid JSON)" in lines
    assert "    tool    | 42" in lines and "    (3 more turns not kept)" in lines
    assert "    answer  | 42" in lines and "            | that is all" in lines
    assert text.index("episode 1") < text.index("calculator") < text.index("episode 2")


def test_a_stale_batch_says_which_version_sampled_it_and_a_whole_batch_says_so():
    assert "version 5, sampled by version 4: 1 of 4 groups kept" in transcript(samples(policy_version=4))
    assert "version 5: 1 group, 2 episodes" in transcript(samples(batch_groups=1))


def test_the_command_takes_a_job_and_an_optional_version():
    args = build_parser().parse_args(["samples", "acme.agent-1a2b3c", "--version", "3", "--json"])
    assert (args.job, args.version, args.json) == ("acme.agent-1a2b3c", 3, True)
    assert build_parser().parse_args(["samples", "acme.agent-1a2b3c"]).version is None


def test_control_characters_in_model_and_tool_output_never_reach_the_terminal():
    """Model and tool output are untrusted: an escape sequence (clear the screen, a hyperlink, a
    bell) is printed as U+FFFD, never raw; tabs and line breaks stay."""
    hostile = SampleEpisode(reward=0.0, advantage=0.0, tokens=3, completion="\x1b[2J\x1b]8;;http://x\x07a\tb\x9bc",
                            turns=[SampleTurn(role="tool", text="\x1b[31mred\r\nok")])
    text = transcript(samples(groups=[SampleGroup(group=0, prompt="p\x1b[8m", size=1, reward_mean=0.0,
                                                  episodes=[hostile])]))
    assert not any(ord(c) < 0x20 and c not in "\n\t" or 0x7f <= ord(c) < 0xa0 for c in text)
    assert "\ufffd[2J\ufffd]8;;http://x\ufffda\tb\ufffdc" in text and "\ufffd[31mred" in text
