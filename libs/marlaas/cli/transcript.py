"""``marlaas samples``: a version's kept rollouts as a transcript to read in a terminal.

Group by group: the prompt, then each episode with its reward and GRPO advantage, its turns
(the model's, with the call it wrote, and each tool's result) and its answer. Plain text, each
text's lines indented under its label, so it reads the same in a terminal, a pipe or a file.
"""

from __future__ import annotations

from marlaas.platform.http_api import SampleEpisode, SampleGroup, SampleTurn, VersionSamples

LABEL_WIDTH = 8  # "answer" and "prompt" fit, with the separator after them


def counted(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


# C0 and C1 control characters but tab (newlines split lines first): model and tool output is
# untrusted, and an escape sequence printed raw could rewrite the terminal (hide lines, set links)
CONTROLS = {c: "\ufffd" for c in [*range(0x00, 0x09), *range(0x0b, 0x20), 0x7f, *range(0x80, 0xa0)]}


def block(label: str, text: str, indent: str) -> list[str]:
    """``text`` under ``label``: the label on its first line, the others aligned after it; control
    characters shown as U+FFFD."""
    lines = [line.translate(CONTROLS) for line in text.splitlines()] or [""]
    gap = " " * LABEL_WIDTH
    return [f"{indent}{label:<{LABEL_WIDTH}}| {lines[0]}", *(f"{indent}{gap}| {line}" for line in lines[1:])]


def turn_lines(turn: SampleTurn, indent: str) -> list[str]:
    """A turn before the answer: the model's (and the call it wrote, or why it could not be read),
    or a tool's result."""
    if turn.role == "tool":
        return block("tool", turn.text, indent)
    lines = block("model", turn.text, indent)
    if turn.tool:
        lines += block("call", f"{turn.tool} {turn.arguments}", indent)
    elif turn.error:
        lines += block("call", f"(unreadable: {turn.error})", indent)
    return lines


def episode_lines(number: int, episode: SampleEpisode) -> list[str]:
    """One episode: its header with reward and advantage, its turns, its answer."""
    head = (f"  episode {number}: reward {episode.reward:.3f}, advantage {episode.advantage:+.3f}, "
            f"{counted(episode.tokens, 'token')}")
    if episode.turns:
        head += f", {counted(sum(t.role == 'model' for t in episode.turns), 'tool-calling turn')}"
    lines = [head]
    for turn in episode.turns:
        lines += turn_lines(turn, "    ")
    if episode.turns_cut:
        lines.append(f"    ({counted(episode.turns_cut, 'more turn')} not kept)")
    return lines + block("answer", episode.completion, "    ")


def group_lines(group: SampleGroup) -> list[str]:
    """One GRPO group: its prompt and its episodes."""
    kept = len(group.episodes)
    count = counted(group.size, "episode") if kept == group.size else f"{kept} of {counted(group.size, 'episode')} kept"
    lines = [f"group {group.group}: {count}, mean reward {group.reward_mean:.3f}", *block("prompt", group.prompt, "  ")]
    for number, episode in enumerate(group.episodes, 1):
        lines += episode_lines(number, episode)
    return lines


def transcript(samples: VersionSamples) -> str:
    """The whole version: a header (what version sampled it, what is shown of the batch, which
    versions have samples), then each group."""
    stale = samples.policy_version not in (-1, samples.version)
    sampled_by = f", sampled by version {samples.policy_version}" if stale else ""
    shown = len(samples.groups)
    groups = (counted(shown, "group") if shown >= samples.batch_groups
              else f"{shown} of {counted(samples.batch_groups, 'group')} kept")
    lines = [f"{samples.job} version {samples.version}{sampled_by}: {groups}, "
             f"{counted(sum(len(g.episodes) for g in samples.groups), 'episode')}",
             f"versions with samples: {', '.join(map(str, samples.versions))}"]
    for group in samples.groups:
        lines += ["", *group_lines(group)]
    return "\n".join(lines)
