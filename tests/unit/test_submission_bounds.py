"""Bounds on what one submission costs the manager (issue 35, F1, F8, the idempotency key): the
pure sizing functions, the job id a key gives, the cut of stored error texts, and which finished
jobs go; the manager refusing an oversized ``system`` before any tokenizer runs, and data over its
tenant's bounds before any of it is read (issue 48, M3)."""

from __future__ import annotations

import json

import msgspec
import pytest

from marlaas.platform import limits
from marlaas.platform.api import SubmitError, parse_submission
from marlaas.platform.config import load_config
from marlaas.platform.files import DataFiles, put_file
from marlaas.platform.store import FileStore
from marlaas.platform.tenants import TenantRecord
from marlaas.tasks import get_task
from services.manager import sizing, validation
from services.manager.lifecycle import oldest_beyond
from services.manager.service import Manager
from services.manager.validation import job_id


def words(texts: list[str]) -> list[int]:
    """A stand-in tokenizer's counts: one token per word (never more than a text's bytes + 1)."""
    return [len(text.split()) for text in texts]


def test_the_longest_vocabulary_entry_bounds_the_characters_of_a_token():
    assert sizing.max_token_chars(["a", "hello", "<|im_start|>"]) == 12
    assert sizing.max_token_chars([]) == 1


def test_a_system_prompt_longer_than_any_fitting_text_is_refused_by_its_length():
    assert sizing.system_refusal("x" * 5120, max_model_len=512, token_chars=10) == ""
    refusal = sizing.system_refusal("x" * 5121, max_model_len=512, token_chars=10)
    assert "system is 5121 characters: no more than 5120 can fit in rollout.max_model_len (512 tokens" in refusal


def test_the_first_prompt_too_long_to_fit_is_named_by_its_row():
    assert sizing.prompts_refusal(["short", "x" * 100], max_model_len=10, token_chars=10) == ""
    refusal = sizing.prompts_refusal(["short", "x" * 101, "y" * 500], max_model_len=10, token_chars=10)
    assert refusal.startswith("the prompt of dataset row 2 ") and "is 101 characters: no more than 100" in refusal


def test_the_count_is_the_system_and_the_longest_prompt():
    prompts = ["one two", "one two three four five", "one"]
    assert sizing.longest_prompt_tokens(words, "be brief", prompts, max_model_len=100, max_new_tokens=10) == 2 + 5


def test_counting_stops_once_no_prompt_left_can_be_longer():
    counted: list[str] = []

    def count(texts: list[str]) -> list[int]:
        counted.extend(texts)
        return [len(text) + 1 for text in texts]  # the most a text can have: its bytes + 1

    prompts = ["x" * 50] + ["y"] * (3 * sizing.BATCH)  # the rest are 1 byte: at most 2 tokens each
    assert sizing.longest_prompt_tokens(count, "", prompts, max_model_len=100, max_new_tokens=10) == 51
    assert len(counted) == sizing.BATCH  # the first batch only: after it, nothing left could exceed 51


def test_the_first_prompt_that_does_not_fit_is_named_and_counting_stops_there():
    calls = []

    def count(texts):
        calls.append(len(texts))
        return words(texts)

    prompts = ["a"] * 10 + [" ".join(["w"] * 95)] + ["b"] * 10
    with pytest.raises(SubmitError, match=r"the prompt of dataset row 11 .*\(97 tokens\) \+ grpo.max_new_tokens "
                                          r"\(10\) exceeds rollout.max_model_len \(100\)"):
        sizing.longest_prompt_tokens(count, "be brief", prompts, max_model_len=100, max_new_tokens=10)
    with pytest.raises(SubmitError, match=r"^system \(3 tokens\) \+ grpo.max_new_tokens \(98\) exceeds"):
        sizing.longest_prompt_tokens(count, "one two three", prompts, max_model_len=100, max_new_tokens=98)


def test_past_the_budget_the_rest_are_sized_by_their_byte_bound_capped_at_the_limit():
    counted: list[str] = []

    def count(texts):
        counted.extend(texts)
        return [1] * len(texts)  # dense text: one token each, however long

    prompts = ["z" * 40] * (2 * sizing.BATCH)
    tokens = sizing.longest_prompt_tokens(count, "", prompts, max_model_len=1000, max_new_tokens=10,
                                          budget_chars=40 * sizing.BATCH)
    assert len(counted) == sizing.BATCH and tokens == 41  # the uncounted: at most 40 bytes + 1 tokens
    capped = sizing.longest_prompt_tokens(count, "", prompts, max_model_len=30, max_new_tokens=10,
                                          budget_chars=1)
    assert capped == 20  # a bound past the limit is taken as the limit, never refused unseen


def test_an_idempotency_key_gives_its_submission_one_job_id():
    assert job_id("acme", "reverse", "k1") == job_id("acme", "reverse", "k1")
    assert job_id("acme", "reverse", "k1") != job_id("acme", "reverse", "k2")
    assert job_id("acme", "reverse", "k1") != job_id("other", "reverse", "k1").replace("other.", "acme.")
    assert job_id("acme", "reverse") != job_id("acme", "reverse")  # no key: a new job each time
    assert job_id("acme", "reverse", "k1").startswith("acme.reverse-")


def test_stored_error_texts_are_cut_and_say_so():
    assert limits.cut("short") == "short"
    cut = limits.cut("e" * 1_000_000)
    assert len(cut) == limits.MAX_ERROR_CHARS and cut.endswith("more characters cut]")
    assert str(1_000_000 - limits.MAX_ERROR_CHARS) in cut


def test_the_oldest_finished_jobs_beyond_the_bound_go():
    finished = [(3.0, "a.c"), (1.0, "a.a"), (2.0, "a.b"), (4.0, "a.d")]
    assert oldest_beyond(finished, 2) == [(1.0, "a.a"), (2.0, "a.b")]
    assert oldest_beyond(finished, 4) == [] and oldest_beyond([], 1) == []


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    return Manager(None, FileStore(home / "store"), load_config(overrides={"home": str(home)}, env={}))


def test_a_huge_system_prompt_is_refused_before_any_tokenizer_runs(manager, tmp_path, monkeypatch):
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"question {i}", "answer": "x"}) + "\n" for i in range(150)))
    job = {"task": "agent", "steps": 2, "tenant": "acme", "dataset": str(dataset), "tools": ["acme.lookup"],
           "reward": "contains", "system": "s" * 900_000}

    def no_tokenizer(texts):
        raise AssertionError("tokenized an oversized submission")

    monkeypatch.setattr(manager.submissions, "count_tokens", no_tokenizer)
    bound = manager.config.rollout.max_model_len * manager.submissions.token_chars
    with pytest.raises(SubmitError, match=f"system is 900000 characters: no more than {bound} can fit"):
        manager.submissions.validate(parse_submission(job))
    dataset.write_text(json.dumps({"prompt": "p" * (bound + 1), "answer": "x"}) + "\n")
    with pytest.raises(SubmitError, match=f"dataset row 1 .* is {bound + 1} characters"):
        manager.submissions.validate(parse_submission({**job, "system": ""}))


def test_a_long_idempotency_key_is_refused(manager):
    job = {"task": "addition", "steps": 2, "tenant": "acme", "idempotency_key": "k" * 129}
    with pytest.raises(SubmitError, match="idempotency_key must be at most 128 characters"):
        manager.submissions.validate(parse_submission(job))


# --- the data a submission names (issue 48, M3) ------------------------------------------------------


def sized(field: str, rows: int, size: int, ref: str = "file-" + "a" * 32) -> validation.DataSize:
    return validation.DataSize(field, ref, rows, size)


def test_the_data_a_submission_names_is_bounded_by_its_tenants_rows_and_bytes():
    assert validation.data_refusal([sized("dataset", 20_000, 16 << 20)], "acme", 20_000, 16 << 20) == ""
    rows = validation.data_refusal([sized("dataset", 60_000, 1000)], "acme", 20_000, 16 << 20)
    assert rows.startswith("the data this submission names is 60,000 rows, above tenant acme's bound "
                           "(max_dataset_rows = 20,000): dataset file-aaaa")
    assert "a sample of its rows" in rows and "`marlaas tenant set acme --max-dataset-rows N`" in rows
    size = validation.data_refusal([sized("dataset", 10, 62_000_000)], "acme", 20_000, 16 << 20)
    assert "62,000,000 bytes, above tenant acme's bound (max_dataset_bytes = 16,777,216)" in size
    assert "--max-dataset-bytes N" in size and "then" not in size


def test_a_then_chain_counts_the_data_of_every_link():
    """Four links naming one 6,000-row file read it four times: 24,000 rows, past 20,000."""
    chain = [sized(field, 6_000, 1 << 20) for field in ("dataset", "then.dataset", "then.then.dataset",
                                                         "then.then.then.dataset")]
    assert validation.data_refusal(chain[:3], "acme", 20_000, 16 << 20) == ""
    refusal = validation.data_refusal(chain, "acme", 20_000, 16 << 20)
    assert "24,000 rows" in refusal and "then.then.then.dataset file-aaaa" in refusal
    assert "each link of a `then` chain reads its data again" in refusal and "fewer follow-ups" in refusal


def test_every_data_field_of_every_link_is_named():
    request = parse_submission({"task": "gsm8k", "steps": 2, "tenant": "acme", "dataset": "file-1",
                                "eval_dataset": "file-2", "eval_every": 1,
                                "then": {"task": "gsm8k", "steps": 2, "dataset": "file-1",
                                         "then": {"task": "search_qa", "steps": 2, "dataset": "file-3",
                                                  "corpus": "file-4"}}})
    chain = validation.submission_chain(request)
    assert [where for where, _ in chain] == ["", "then", "then.then"]
    assert validation.data_refs(chain) == [("dataset", "file-1"), ("eval_dataset", "file-2"),
                                           ("then.dataset", "file-1"), ("then.then.dataset", "file-3"),
                                           ("then.then.corpus", "file-4")]


def test_a_path_is_sized_by_its_bytes_and_counted_lines_only_within_the_bound(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"a": 1}\n\n{"a": 2}')  # a blank line, and a last line without its newline
    files = DataFiles(None, tmp_path / "cache", get_task)
    assert files.size("acme", str(data), count_within=1 << 20) == (3, data.stat().st_size)
    assert files.size("acme", str(data), count_within=4) == (0, data.stat().st_size)
    assert files.size("acme", str(tmp_path / "missing.jsonl"), count_within=1 << 20) is None


def test_a_dataset_over_the_tenants_bound_is_refused_before_it_is_read(manager, monkeypatch):
    """M3: four submits naming a 60,000-row, 62 MB upload once held the manager 16-27 s each. The
    upload's record says its rows and bytes; the submission is refused by them, its data unread."""
    rows = "".join(json.dumps({"question": f"What is {i} plus 1?", "answer": f"#### {i + 1}"}) + "\n"
                   for i in range(300))
    uploaded = put_file(manager.store, "acme", rows.encode(), "big.jsonl")
    tenant = TenantRecord(name="acme", token_sha256="", max_dataset_rows=1_000, max_dataset_bytes=1 << 20)
    link = {"task": "gsm8k", "steps": 2, "dataset": uploaded.id}
    job = {**link, "tenant": "acme"}

    def unread(*args):
        raise AssertionError("read the data of a submission over its tenant's bound")

    monkeypatch.setattr(manager.submissions.files, "task", unread)
    chained = {**job, "then": {**link, "then": {**link, "then": link}}}  # 4 links x 300 rows
    with pytest.raises(SubmitError, match=r"is 1,200 rows, above tenant acme's bound \(max_dataset_rows = 1,000\)"):
        manager.submissions.validate(parse_submission(chained), tenant)
    small = msgspec.structs.replace(tenant, max_dataset_bytes=uploaded.size - 1)
    with pytest.raises(SubmitError, match=rf"is {uploaded.size:,} bytes, above .*max_dataset_bytes"):
        manager.submissions.validate(parse_submission(job), small)
