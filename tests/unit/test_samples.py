"""Each version's kept rollouts (``marlaas.platform.samples``, the gateway's ``samples.py``): which
versions stay, what is kept of a batch and how it is bounded, advantages as the trainer's, and the
store's round trip."""

from __future__ import annotations

import pytest
import torch
from litestar.exceptions import HTTPException

from marlaas.platform import limits
from marlaas.platform.events import Sample, TrajectoryBatch
from marlaas.platform.samples import (
    batch_records,
    clip,
    episode_record,
    group_advantages,
    group_key,
    keeps_samples,
    read_samples,
    sample_stride,
    sampled_versions,
    write_samples,
)
from marlaas.platform.store import FileStore
from services.gateway.samples import chosen_samples_version
from services.trainer.grpo import group_advantages as trainer_advantages

JOB = "acme.agent-1a2b3c"
pytestmark = pytest.mark.timeout(30)


def decode(ids: list[int]) -> str:
    """A tokenizer of one character a token (ids are code points)."""
    return "".join(map(chr, ids))


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def sample(group: int, reward: float, *turns: tuple[bool, str], prompt: str = "What is 6 x 7?") -> Sample:
    """A sample whose completion is ``turns``: (the model's?, text) each."""
    completion = [i for _, text in turns for i in ids(text)]
    mask = [int(own) for own, text in turns for _ in text]
    return Sample(group=group, prompt_ids=ids(prompt), completion_ids=completion, logprobs=[0.0] * len(completion),
                  loss_mask=mask, reward=reward, text=decode(completion))


def kept(latest: int, pinned=()) -> set[int]:
    return {v for v in range(latest + 1) if keeps_samples(v, latest, pinned)}


# --- which versions stay -----------------------------------------------------------------------


def test_every_version_stays_while_the_job_is_young():
    young = limits.FULL_SAMPLE_VERSIONS + limits.OLDER_SAMPLE_VERSIONS - 1
    assert kept(young) == set(range(young + 1))


def test_the_last_versions_stay_and_a_bounded_few_older_ones_evenly_spaced():
    for latest in (100, 1000, limits.MAX_STEPS):
        stays = kept(latest)
        window = set(range(latest - limits.FULL_SAMPLE_VERSIONS + 1, latest + 1))
        older = sorted(stays - window)
        assert window <= stays
        assert len(older) <= limits.OLDER_SAMPLE_VERSIONS
        assert older[0] == 0 and len({b - a for a, b in zip(older, older[1:])}) == 1  # evenly spaced
        assert len(older) > limits.OLDER_SAMPLE_VERSIONS // 2  # the spacing is no coarser than it must be


def test_a_version_let_go_is_never_kept_again():
    """Garbage collection deletes what a pass lets go: a later pass must not want it back."""
    for latest in range(2100):
        assert kept(latest + 1) <= kept(latest) | {latest + 1}, latest
    assert sample_stride(2100) > sample_stride(100) > 1


def test_pinned_versions_keep_their_samples():
    assert 37 not in kept(1000) and 37 in kept(1000, pinned=[37])


# --- what is kept of a batch -------------------------------------------------------------------


@pytest.mark.parametrize("rewards", [[0.0, 1.0, 1.0, 0.5], [0.3] * 8, [1.0], [0.2, 0.9, 0.9, 0.9, 0.0, 0.1]])
@pytest.mark.parametrize("scale_by_std", [True, False])
def test_advantages_are_the_trainers(rewards, scale_by_std):
    theirs = trainer_advantages(torch.tensor(rewards), torch.zeros(len(rewards), dtype=torch.long), scale_by_std)
    assert group_advantages(rewards, scale_by_std) == pytest.approx(theirs.tolist(), abs=1e-5)


def test_a_long_text_is_cut_in_its_middle_saying_how_much():
    text = "Q: " + "x" * 5000 + " the question?"
    cut = clip(text, 200)
    assert len(cut) <= 200 and cut.startswith("Q: x") and cut.endswith("the question?")
    assert f"{len(text) - 200} characters cut" in cut
    assert clip("short", 200) == "short"


def test_an_agentic_episode_reads_as_its_turns_calls_results_and_answer():
    observation = "\nuser\n<tool_response>\n42\n</tool_response>\nassistant\n"  # a chat template's markup kept
    agentic = sample(0, 1.0, (True, 'Let me compute. <tool_call>{"name": "calculator", "arguments": '
                                    '{"expression": "6*7"}}</tool_call>'),
                     (False, observation), (True, "<tool_call>not json</tool_call>"), (False, observation),
                     (True, " 42 "))
    episode = episode_record(agentic, advantage=0.5, decode=decode)
    first, result, broken, _ = episode.turns
    assert (first.role, first.tool, first.arguments) == ("model", "calculator", '{"expression": "6*7"}')
    assert first.text.startswith("Let me compute.")
    assert (result.role, result.text) == ("tool", "42")
    assert broken.role == "model" and not broken.tool and broken.error
    assert (episode.completion, episode.reward, episode.advantage) == ("42", 1.0, 0.5)
    assert episode.tokens == len(agentic.completion_ids) and episode.turns_cut == 0


def test_a_single_turn_episode_is_its_answer_alone():
    episode = episode_record(sample(0, 0.25, (True, "cba")), advantage=-1.0, decode=decode)
    assert (episode.turns, episode.completion, episode.tokens) == ([], "cba", 3)


def test_an_episode_keeps_its_first_turns_and_counts_the_rest():
    turns = [(i % 2 == 0, f"turn {i}") for i in range(2 * limits.MAX_SAMPLE_TURNS + 1)]
    episode = episode_record(sample(0, 0.0, *turns), advantage=0.0, decode=decode)
    assert len(episode.turns) == limits.MAX_SAMPLE_TURNS and episode.turns[0].text == "turn 0"
    assert episode.turns_cut == limits.MAX_SAMPLE_TURNS
    assert episode.completion == f"turn {2 * limits.MAX_SAMPLE_TURNS}"


def test_a_batch_keeps_its_first_groups_and_episodes_with_advantages_over_whole_groups():
    groups, size = limits.MAX_SAMPLE_GROUPS + 3, limits.MAX_SAMPLE_EPISODES + 2
    batch = TrajectoryBatch(samples=[sample(g, float(j == size - 1), (True, f"answer {g}.{j}"))
                                     for g in range(groups) for j in range(size)], policy_version=4)
    records = batch_records(batch, decode, scale_by_std=True, batch_groups=groups)
    assert [r.group for r in records] == list(range(limits.MAX_SAMPLE_GROUPS))
    for record in records:
        assert record.size == size and len(record.episodes) == limits.MAX_SAMPLE_EPISODES
        assert record.reward_mean == pytest.approx(1 / size)
        assert record.prompt == "What is 6 x 7?" and (record.policy_version, record.batch_groups) == (4, groups)
        # every kept episode scored 0 in a group where one (not kept) scored 1: below the group's mean
        assert all(e.advantage < 0 for e in record.episodes)
        assert record.episodes[0].advantage == pytest.approx(group_advantages([0.0] * (size - 1) + [1.0])[0])


def test_a_groups_text_is_bounded_keeping_one_episode_at_least():
    huge = "y" * (10 * limits.MAX_SAMPLE_TEXT_CHARS)
    batch = TrajectoryBatch(samples=[sample(0, 0.0, *[(k % 2 == 0, huge) for k in range(2 * limits.MAX_SAMPLE_TURNS)],
                                            prompt=huge) for _ in range(limits.MAX_SAMPLE_EPISODES)])
    (record,) = batch_records(batch, decode, scale_by_std=True, batch_groups=1)
    texts = [record.prompt, *(t.text for e in record.episodes for t in e.turns),
             *(e.completion for e in record.episodes)]
    assert all(len(t) <= limits.MAX_SAMPLE_TEXT_CHARS for t in texts)
    assert 1 <= len(record.episodes) < limits.MAX_SAMPLE_EPISODES
    assert sum(map(len, texts)) <= limits.MAX_SAMPLE_GROUP_CHARS
    assert record.size == limits.MAX_SAMPLE_EPISODES


def test_a_supervised_batch_keeps_no_samples():
    batch = TrajectoryBatch(samples=[sample(0, 0.0, (True, "hi"))], objective="sft")
    assert batch_records(batch, decode, scale_by_std=True, batch_groups=1) == []


# --- the store ---------------------------------------------------------------------------------


def test_samples_round_trip_through_the_store_and_the_first_writer_stays(tmp_path):
    store = FileStore(tmp_path)
    first = TrajectoryBatch(samples=[sample(g, float(j), (True, f"v1 {g}.{j}")) for g in (1, 0) for j in (0, 1)])
    assert write_samples(store, JOB, 1, first, decode, scale_by_std=True, batch_groups=2) == 2
    assert write_samples(store, JOB, 3, first, decode, scale_by_std=True, batch_groups=2) == 2
    retried = TrajectoryBatch(samples=[sample(0, 1.0, (True, "a retry's other answer"))])
    assert write_samples(store, JOB, 1, retried, decode, scale_by_std=True, batch_groups=2) == 0
    store.put_bytes(f"samples/{JOB}x/v000002/kept/group-00000.json", b"{}")  # another job's folder
    assert sampled_versions(store, JOB) == [1, 3]
    groups = read_samples(store, JOB, 1)
    assert [g.group for g in groups] == [0, 1]
    assert [e.completion for e in groups[0].episodes] == ["v1 0.0", "v1 0.1"]
    assert [e.advantage for e in groups[0].episodes] == pytest.approx([-1.0, 1.0], abs=1e-3)
    assert read_samples(store, JOB, 2) == []
    assert group_key(JOB, 1, 0) in store.list(f"samples/{JOB}/")


def test_an_unreadable_or_oversized_record_is_skipped(tmp_path):
    store = FileStore(tmp_path)
    write_samples(store, JOB, 0, TrajectoryBatch(samples=[sample(0, 1.0, (True, "ok"))]), decode,
                  scale_by_std=True, batch_groups=3)
    store.put_bytes(group_key(JOB, 0, 1), b"not json")
    store.put_bytes(group_key(JOB, 0, 2), b" " * (limits.MAX_SAMPLE_FILE_BYTES + 1))
    assert [g.group for g in read_samples(store, JOB, 0)] == [0]


# --- the gateway's choice of version -----------------------------------------------------------


def test_the_newest_version_with_samples_unless_one_is_asked():
    assert chosen_samples_version(JOB, [0, 4, 9], None) == 9
    assert chosen_samples_version(JOB, [0, 4, 9], 4) == 4
    with pytest.raises(HTTPException) as missing:
        chosen_samples_version(JOB, [0, 4, 9], 5)
    assert missing.value.status_code == 404 and "versions 0, 4, 9" in missing.value.detail
    with pytest.raises(HTTPException) as none:
        chosen_samples_version(JOB, [], None)
    assert none.value.status_code == 404 and "no samples yet" in none.value.detail
