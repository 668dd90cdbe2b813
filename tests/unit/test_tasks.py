"""Built-in tasks: deterministic problems, partial-credit rewards, the GSM8K verifier."""

import json

import pytest

from marlaas.platform.events import RewardItem, RewardRequest
from marlaas.tasks import REGISTRY, TaskError, get_task
from marlaas.tasks.base import char_match
from marlaas.tasks.gsm8k import final_answer
from services.env.rewards import RewardBook


def test_problems_are_reproducible_from_the_seed():
    task = get_task("reverse")
    assert task.problems(5, seed=3) == task.problems(5, seed=3)
    assert task.problems(5, seed=3) != task.problems(5, seed=4)


@pytest.mark.parametrize("name", ["addition", "reverse", "repeat"])
def test_toy_rewards_give_full_partial_and_no_credit(name):
    task = get_task(name)
    problem = task.problems(1, seed=0)[0]
    answer = problem["answer"]
    assert task.reward(problem, answer) == 1.0
    assert task.reward(problem, "") == 0.0
    half = answer[: len(answer) // 2]
    assert 0.0 < task.reward(problem, half + "#" * (len(answer) - len(half))) < 1.0


def test_char_match_is_positional_over_the_longer_string():
    assert char_match("abc", "abc") == 1.0
    assert char_match("abx", "abc") == pytest.approx(2 / 3)
    assert char_match("abcabc", "abc") == 0.5


@pytest.mark.parametrize("completion, expected", [
    ("so she has 3 + 4 = 7 apples.\n#### 7", 7),
    ("The answer is $1,234.50.", 1234.5),
    ("we get \\boxed{42} in the end", 42),
    ("5 then 6 then 18", 18),
    ("-3 degrees", -3),
    ("no number here", None),
])
def test_gsm8k_final_answer(completion, expected):
    got = final_answer(completion)
    assert (got is None) if expected is None else (got == expected)


def test_gsm8k_reads_user_jsonl_and_scores(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "2+2?", "answer": "2 plus 2 is 4\n#### 4"}) + "\n")
    task = get_task("gsm8k", str(data))
    problem = task.problems(1, seed=0)[0]
    assert task.reward(problem, "It is 4.\n#### 4") == 1.0
    assert task.reward(problem, "It is 5.") == 0.0


def test_bad_task_inputs_say_what_to_fix(tmp_path):
    with pytest.raises(TaskError, match="known tasks: addition"):
        get_task("nope")
    with pytest.raises(TaskError, match="needs 'dataset'"):
        get_task("gsm8k")
    with pytest.raises(TaskError, match="does not exist"):
        get_task("gsm8k", str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    with pytest.raises(TaskError, match="bad.jsonl:1: each line needs"):
        get_task("gsm8k", str(bad))
    with pytest.raises(TaskError, match="takes no dataset"):
        get_task("addition", str(bad))


def test_env_reward_book_scores_and_reports_errors():
    book = RewardBook()
    problem = get_task("addition").problems(1, seed=1)[0]
    ok = book.score(RewardRequest(job="t.j", task="addition",
                                  items=[RewardItem(problem=problem, completion=problem["answer"])]))
    assert ok.rewards == [1.0] and not ok.error
    bad = book.score(RewardRequest(job="t.j", task="nope", items=[]))
    assert "unknown task" in bad.error
    assert set(REGISTRY) >= {"addition", "reverse", "repeat", "gsm8k"}
