"""Each version's rollouts, kept for their tenant to read (issue 50, "See the samples").

Rollout writes, once it has published a version's batch (or one GRPO group of it), a bounded
record of each group: the prompt as the model read it, each episode's turns (the model's, with
the tool call it wrote, and each tool's result), its answer, reward and GRPO advantage. The
gateway serves them (``GET /v1/jobs/{id}/samples``), the CLI prints them (``marlaas samples``),
the dashboard lists them. The texts are decoded from the sample's own ids, split where its loss
mask changes (the model's tokens are trained, a tool's are not), never re-read from the engine.

Layout: ``samples/<job>/v<version:06d>/kept/group-<group:05d>.json``, a
:class:`~marlaas.platform.http_api.SampleGroup` each. Keys are immutable and the folder is fixed,
so the first writer's record stays: a retried batch is dropped as a repeat by the broker or the
trainer, and its record as a repeat here, so what is kept is what was trained.

Bounds (``limits.MAX_SAMPLE_*``): the first groups of a version, the first episodes of a group
(advantages computed over the whole group first), each text cut in its middle, each episode's
turns, a group's characters. Retention (:func:`keeps_samples`): the last
``FULL_SAMPLE_VERSIONS`` versions, and at most ``OLDER_SAMPLE_VERSIONS`` older ones, evenly
spaced by a power of two that doubles as the job grows (so a version dropped is never one a
later spacing keeps); pinned versions stay. The manager's garbage collection deletes the rest
(``services/manager/gc.py``) and deleting a job deletes them all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec
import structlog

from marlaas.platform import limits
from marlaas.platform.events import Sample, TrajectoryBatch
from marlaas.platform.http_api import SampleEpisode, SampleGroup, SampleTurn
from marlaas.platform.store import ImmutableKeyError, ObjectStore
from marlaas.tools.protocol import RESPONSE_CLOSE, RESPONSE_OPEN, CallError, ParsedCall, parse_call

log = structlog.get_logger("marlaas.platform.samples")
KIND = "samples"
ATTEMPT = "kept"  # one fixed folder per version (gc.py's ``<kind>/<job>/v<version>/<attempt>/``)
_GROUP_DECODER = msgspec.json.Decoder(SampleGroup)
_encoder = msgspec.json.Encoder()

Decode = Callable[[list[int]], str]  # token ids -> text, special tokens skipped


def job_prefix(job: str) -> str:
    return f"{KIND}/{job}/"


def version_prefix(job: str, version: int) -> str:
    return f"{KIND}/{job}/v{version:06d}/"


def group_key(job: str, version: int, group: int) -> str:
    return f"{version_prefix(job, version)}{ATTEMPT}/group-{group:05d}.json"


# --- which versions stay ---------------------------------------------------------------------


def sample_stride(latest: int) -> int:
    """The spacing of the older versions kept when ``latest`` is the committed version: the
    smallest power of two that leaves at most ``OLDER_SAMPLE_VERSIONS`` of versions
    0 .. latest - FULL_SAMPLE_VERSIONS."""
    oldest_window = latest - limits.FULL_SAMPLE_VERSIONS  # the newest version outside the window
    stride = 1
    while oldest_window >= 0 and oldest_window // stride + 1 > limits.OLDER_SAMPLE_VERSIONS:
        stride *= 2
    return stride


def keeps_samples(version: int, latest: int, pinned: Iterable[int] = ()) -> bool:
    """Whether ``version``'s samples stay once ``latest`` is committed: one of the last
    ``FULL_SAMPLE_VERSIONS``, a multiple of :func:`sample_stride`, or pinned. As ``latest``
    grows the stride only doubles, so a version dropped is never kept again."""
    return (version > latest - limits.FULL_SAMPLE_VERSIONS or version % sample_stride(latest) == 0
            or version in set(pinned))


# --- what is kept of a batch -----------------------------------------------------------------


def group_advantages(rewards: list[float], scale_by_std: bool = True) -> list[float]:
    """One group's GRPO advantages, as ``services/trainer/grpo.py`` computes them (without
    torch): the reward minus the group's mean, over its std + 1e-4 unless ``scale_by_std`` is
    off; a group of equal rewards (one episode included) gets exactly 0."""
    if not rewards or all(r == rewards[0] for r in rewards):
        return [0.0] * len(rewards)
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
    return [(r - mean) / (std + 1e-4) if scale_by_std else r - mean for r in rewards]


def clip(text: str, limit: int = limits.MAX_SAMPLE_TEXT_CHARS) -> str:
    """``text`` cut to ``limit`` characters in its middle, saying how many were cut: a prompt's
    question and an answer's end are at their ends."""
    if len(text) <= limit:
        return text
    marker = f" [... {len(text) - limit} characters cut ...] "
    room = max(limit - len(marker), 0)
    head = (room + 1) // 2
    return text[:head] + marker + text[len(text) - (room - head):]


def segments(sample: Sample) -> list[tuple[bool, list[int]]]:
    """The sample's completion as runs of (the model's?, ids): its loss mask is 1 on the model's
    tokens and 0 on a tool's result."""
    runs: list[tuple[bool, list[int]]] = []
    for token, mask in zip(sample.completion_ids, sample.loss_mask, strict=True):
        if runs and runs[-1][0] == bool(mask):
            runs[-1][1].append(token)
        else:
            runs.append((bool(mask), [token]))
    return runs


def tool_result(text: str) -> str:
    """A tool's result as read from its observation: inside the response tags (whatever markup
    of the chat template is around them), else the text as it is."""
    start, end = text.find(RESPONSE_OPEN), text.rfind(RESPONSE_CLOSE)
    if start >= 0 and end > start:
        text = text[start + len(RESPONSE_OPEN):end]
    return text.strip()


def model_turn(text: str) -> SampleTurn:
    """A turn of the model's before its answer, with the call it wrote (if any)."""
    call = parse_call(text)
    if isinstance(call, ParsedCall):
        return SampleTurn(role="model", text=clip(text), tool=call.name, arguments=clip(call.arguments))
    if isinstance(call, CallError):
        return SampleTurn(role="model", text=clip(text), error=clip(call.message))
    return SampleTurn(role="model", text=clip(text))


def episode_record(sample: Sample, advantage: float, decode: Decode) -> SampleEpisode:
    """What is kept of one sample: its turns (the first ``MAX_SAMPLE_TURNS``), its answer (the
    last run if it is the model's), reward and advantage, each text cut."""
    runs = segments(sample)
    completion = ""
    if runs and runs[-1][0]:
        completion = decode(runs.pop()[1]).strip()
    turns = [model_turn(decode(ids).strip()) if own else SampleTurn(role="tool", text=clip(tool_result(decode(ids))))
             for own, ids in runs[:limits.MAX_SAMPLE_TURNS]]
    return SampleEpisode(reward=sample.reward, advantage=advantage, completion=clip(completion), turns=turns,
                         tokens=len(sample.completion_ids), turns_cut=max(len(runs) - limits.MAX_SAMPLE_TURNS, 0))


def characters(episode: SampleEpisode) -> int:
    return len(episode.completion) + sum(len(t.text) + len(t.arguments) + len(t.error) for t in episode.turns)


def group_record(group: int, members: list[Sample], decode: Decode, *, scale_by_std: bool,
                 policy_version: int, batch_groups: int) -> SampleGroup:
    """One group's record: its advantages over all its members, then its first
    ``MAX_SAMPLE_EPISODES`` episodes, as many as fit in ``MAX_SAMPLE_GROUP_CHARS`` (one at least)."""
    rewards = [s.reward for s in members]
    advantages = group_advantages(rewards, scale_by_std)
    prompt = clip(decode(members[0].prompt_ids).strip()) if members else ""
    kept: list[SampleEpisode] = []
    budget = limits.MAX_SAMPLE_GROUP_CHARS - len(prompt)
    for sample, advantage in zip(members[:limits.MAX_SAMPLE_EPISODES], advantages):
        episode = episode_record(sample, advantage, decode)
        budget -= characters(episode)
        if kept and budget < 0:
            break
        kept.append(episode)
    return SampleGroup(group=group, prompt=prompt, episodes=kept, size=len(members),
                       reward_mean=sum(rewards) / len(rewards) if rewards else 0.0,
                       policy_version=policy_version, batch_groups=batch_groups)


def batch_records(batch: TrajectoryBatch, decode: Decode, *, scale_by_std: bool,
                  batch_groups: int) -> list[SampleGroup]:
    """The records of a batch's (or one published group's) groups numbered below
    ``MAX_SAMPLE_GROUPS``; empty for a batch that is not GRPO rollouts (``sft``)."""
    if batch.objective != "grpo":
        return []
    members: dict[int, list[Sample]] = {}
    for sample in batch.samples:
        if sample.group < limits.MAX_SAMPLE_GROUPS:
            members.setdefault(sample.group, []).append(sample)
    return [group_record(g, members[g], decode, scale_by_std=scale_by_std, policy_version=batch.policy_version,
                         batch_groups=batch_groups) for g in sorted(members)]


# --- the store -------------------------------------------------------------------------------


def write_samples(store: ObjectStore, job: str, version: int, batch: TrajectoryBatch, decode: Decode, *,
                  scale_by_std: bool, batch_groups: int) -> int:
    """Keep the records of ``batch`` (``version``'s, or one group of it); return how many groups
    were written. A group already kept stays as it is (the first writer's: what was trained)."""
    written = 0
    for record in batch_records(batch, decode, scale_by_std=scale_by_std, batch_groups=batch_groups):
        try:
            store.put_bytes(group_key(job, version, record.group), _encoder.encode(record))
            written += 1
        except ImmutableKeyError:
            pass
    return written


def version_of(key: str, job: str) -> int | None:
    """The version of a key under the job's samples, or None for a key not laid out here."""
    parts = key.split("/")
    if len(parts) != 5 or parts[:2] != [KIND, job] or parts[3] != ATTEMPT or not parts[2][1:].isdigit():
        return None
    return int(parts[2][1:])


def sampled_versions(store: ObjectStore, job: str) -> list[int]:
    """The versions of ``job`` whose samples are kept, oldest first."""
    return sorted({v for key in store.list(job_prefix(job)) if (v := version_of(key, job)) is not None})


def read_samples(store: ObjectStore, job: str, version: int) -> list[SampleGroup]:
    """``version``'s kept groups, in group order (at most ``MAX_SAMPLE_GROUPS``; a record past
    ``MAX_SAMPLE_FILE_BYTES`` or unreadable is skipped); empty when none are kept."""
    groups = []
    keys = [k for k in store.list(version_prefix(job, version)) if version_of(k, job) == version]
    for key in keys[:limits.MAX_SAMPLE_GROUPS]:
        data = store.get_bytes(key)
        if len(data) > limits.MAX_SAMPLE_FILE_BYTES:
            log.warning("a kept group record past its bound is skipped", job=job, key=key, size=len(data))
            continue
        try:
            groups.append(_GROUP_DECODER.decode(data))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:  # tolerated: the others are shown
            log.warning("an unreadable group record is skipped", job=job, key=key, error=str(exc))
    return sorted(groups, key=lambda g: g.group)
