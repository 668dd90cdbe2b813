"""Addition's reward: how near the sum an integer answer is; only the sum earns 1.0."""

import pytest

from marlaas.tasks import get_task
from marlaas.tasks.base import numeric_closeness

PROBLEM = {"prompt": "49+97=", "answer": "146"}


@pytest.mark.parametrize("completion, expected", [
    ("146", 1.0),
    (" 146\n", 1.0),  # the completion is stripped
    ("145", 1 - 1 / 30),
    ("147", 1 - 1 / 30),
    ("136", 1 - 10 / 30),
    ("161", 0.5),
    ("116", 0.0),  # off by the tolerance: nothing
    ("99", 0.0),
    ("0", 0.0),
    ("1460", 0.0),
])
def test_an_integer_answer_earns_its_closeness_to_the_sum(completion, expected):
    assert get_task("addition").reward(PROBLEM, completion) == pytest.approx(expected)


@pytest.mark.parametrize("completion, expected", [
    ("", 0.0),
    ("1##", 0.5 * 1 / 3),
    ("14x", 0.5 * 2 / 3),
    ("146.", 0.5 * 3 / 4),
    ("0146", 0.0),  # a leading zero is not how the sum is written: half of no positional credit
    ("+146", 0.0),
    ("-146", 0.5 * 0 / 4),
    ("146 apples", 0.5 * 3 / 10),
])
def test_a_malformed_answer_earns_half_its_character_credit(completion, expected):
    assert get_task("addition").reward(PROBLEM, completion) == pytest.approx(expected)


def test_wrong_answers_score_below_right_ones_and_nearer_above_farther():
    task = get_task("addition")
    right = task.reward(PROBLEM, "146")
    ladder = [task.reward(PROBLEM, c) for c in ("146", "145", "140", "130", "120", "100")]
    assert right == 1.0
    assert ladder == sorted(ladder, reverse=True) and len(set(ladder)) == len(ladder)
    assert all(task.reward(PROBLEM, c) < right for c in ("145", "147", "146.", "1460", "0146", "14x"))
    assert task.reward(PROBLEM, "146.") < task.reward(PROBLEM, "145")


def test_only_the_sum_earns_full_credit_over_every_problem():
    task = get_task("addition")
    for problem in task.problems(200, seed=3):
        answer = int(problem["answer"])
        assert task.reward(problem, problem["answer"]) == 1.0
        near = [task.reward(problem, str(n)) for n in range(max(0, answer - 40), answer + 41) if n != answer]
        assert max(near) < 1.0 and min(near) == 0.0


def test_a_constant_guess_earns_less_than_the_base_model():
    # over every problem (a, b < 100), the best constant answer ("99") earns 0.27: below what the
    # default base earns sampled at T = 1 (about 0.36-0.40, docs/basemodel.md)
    task = get_task("addition")
    problems = [{"answer": str(a + b)} for a in range(100) for b in range(100)]
    best = max(sum(task.reward(p, str(c)) for p in problems) / len(problems) for c in range(0, 199, 3))
    assert best == pytest.approx(0.27, abs=0.01)


def test_numeric_closeness_reads_plain_integers_only():
    assert numeric_closeness("82", "82", 30) == 1.0
    assert numeric_closeness("67", "82", 30) == 0.5
    assert numeric_closeness("1000", "82", 30) == 0.0
    for text in ("", "82.0", "082", "-82", "+82", "8 2", "eighty-two", "1" * 19):
        assert numeric_closeness(text, "82", 30) is None
