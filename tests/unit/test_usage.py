"""Metering's pure parts: the ledger's fold (exactly once by stream sequence, one record per
tenant, UTC day and job), the summaries, and what an episode counts."""

from __future__ import annotations

import datetime

from marlaas.platform.events import Sample, TrajectoryBatch
from marlaas.platform.usage import (
    USAGE,
    UsageCounters,
    UsageReported,
    day_of,
    encode,
    key_of,
    record_key,
    summarize,
    tinker_job,
)
from services.manager.usage import fold
from services.rollout.episode import Episode, episodes_usage
from services.trainer.service import batch_usage

DAY1 = datetime.datetime(2026, 3, 1, 23, 59, 59, tzinfo=datetime.UTC).timestamp()
DAY2 = DAY1 + 2.0  # two seconds later: the next UTC day


def event(job: str = "acme.j1-ab", at: float = DAY1, **counters) -> UsageReported:
    return UsageReported(tenant=job.partition(".")[0], job=job, service="rollout",
                         counters=UsageCounters(**counters), at=at)


def test_a_record_adds_each_event_once_by_its_stream_sequence():
    record = fold(None, event(generated_tokens=10, prefill_tokens=3), seq=5)
    assert record.counters.generated_tokens == 10 and record.events == 1 and record.last_seq == 5
    record = fold(record, event(generated_tokens=7, train_s=0.5), seq=9)
    assert (record.counters.generated_tokens, record.counters.train_s, record.events) == (17, 0.5, 2)
    # a redelivery (or a restarted manager reading the same event again) changes nothing
    assert fold(record, event(generated_tokens=7, train_s=0.5), seq=9) is None
    assert fold(record, event(generated_tokens=10), seq=5) is None
    assert fold(record, event(generated_tokens=1), seq=10).counters.generated_tokens == 18


def test_an_event_goes_to_one_record_per_tenant_day_and_job():
    assert day_of(DAY1) == "2026-03-01" and day_of(DAY2) == "2026-03-02"
    assert key_of(event(at=DAY1)) == "acme.2026-03-01.j1-ab"
    assert key_of(event(at=DAY2)) == "acme.2026-03-02.j1-ab"
    assert key_of(event(job="acme.j2-cd")) != key_of(event())
    assert key_of(event(job="other.j1-ab")).startswith("other.")  # a tenant's keys: one filter reads them
    assert record_key("acme", "2026-03-01", tinker_job("acme")) == "acme.2026-03-01.tinker"
    assert record_key("acme", "2026-03-01", "acme.a.b c") == "acme.2026-03-01.a_b_c"  # never a new token
    assert fold(None, event(at=DAY2), seq=1).day == "2026-03-02"


def test_summaries_by_job_day_and_tenant():
    records = [fold(None, event("acme.j1-ab", DAY1, generated_tokens=5), 1),
               fold(None, event("acme.j1-ab", DAY2, generated_tokens=7), 2),
               fold(None, event("acme.j2-cd", DAY2, tool_calls=2), 3),
               fold(None, event("other.j9-ef", DAY1, train_tokens=4), 4)]
    report = summarize(records, by_tenant=True)
    assert report.total == UsageCounters(generated_tokens=12, tool_calls=2, train_tokens=4)
    assert {r.key: r.counters.generated_tokens for r in report.by_job} == {
        "acme.j1-ab": 12, "acme.j2-cd": 0, "other.j9-ef": 0}
    assert [r.key for r in report.by_day] == ["2026-03-01", "2026-03-02"]
    assert {r.key: r.counters.train_tokens for r in report.by_tenant} == {"acme": 0, "other": 4}
    assert summarize(records).by_tenant == []


def test_the_event_round_trips_and_an_old_reader_takes_new_fields():
    sent = event(generated_tokens=3, tool_s=0.25)
    assert USAGE.decode(encode(sent)) == sent
    newer = encode(sent).replace(b'"tool_s":0.25', b'"tool_s":0.25,"gpu_s":1.5')
    assert USAGE.decode(newer) == sent


def test_an_episode_counts_each_turns_prompt_and_its_sampled_tokens():
    episode = Episode(prompt_ids=[1, 2, 3])
    episode.add_turn([4, 5], [0.0, 0.0])  # request 1 read 3 prompt tokens
    episode.add_observation([6, 7, 8])
    episode.add_turn([9], [0.0])  # request 2 read 3 + 2 + 3 = 8
    episode.tool_calls, episode.tool_wait_s = 1, 0.5
    single = Episode(prompt_ids=[1, 2])
    single.add_turn([3, 4, 5], [0.0] * 3)
    used = episodes_usage([episode, single])
    assert used == UsageCounters(prefill_tokens=3 + 8 + 2, generated_tokens=3 + 3, episodes=2, tool_calls=1,
                                 tool_s=0.5)


def test_a_trained_batch_counts_the_tokens_its_loss_masks_train():
    batch = TrajectoryBatch(samples=[
        Sample(group=0, prompt_ids=[1, 2], completion_ids=[3, 4, 5], logprobs=[0.0] * 3, loss_mask=[1, 1, 1],
               reward=1.0),
        Sample(group=0, prompt_ids=[1, 2], completion_ids=[3, 6, 7, 8], logprobs=[0.0] * 4, loss_mask=[1, 0, 0, 1],
               reward=0.0)])
    assert batch_usage(batch, 1.25) == UsageCounters(train_tokens=5, train_samples=2, train_s=1.25)
