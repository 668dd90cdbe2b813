"""The judge reward's pure parts: its subject, prompt, verdict parsing and the errors it gives
before any HTTP call (the HTTP paths run against a real server in tests/integration/test_judge.py)."""

import pytest

from marlaas.platform.config import ConfigError, load_config
from marlaas.platform.events import RewardItem, RewardRequest
from marlaas.tools.registry import reward_subject
from services.env.judge import JUDGE_SUBJECT, MAX_ANSWER_CHARS, Judge, judge_prompt, judged_answer, parse_verdict


def test_the_judge_has_a_subject_the_per_task_subscription_does_not_match():
    assert reward_subject("judge") == JUDGE_SUBJECT == "marlaas.reward.builtin.judge"
    assert reward_subject("addition") == "marlaas.reward.addition"
    assert reward_subject("acme.length") == "marlaas.reward.acme.length"


@pytest.mark.parametrize("reply, reward", [
    ("yes", 1.0), (" Yes.", 1.0), ("**YES**", 1.0), ("correct", 1.0), ("True", 1.0),
    ("no", 0.0), ("No, it names another city.", 0.0), ("incorrect", 0.0), ("wrong", 0.0),
    ("Verdict: yes", 1.0), ("<think>the reference says Pell</think>\nno", 0.0),
    ("1", 1.0), ("0.75", 0.75), ("0", 0.0),
    ("", None), ("maybe", None), ("7", None), ("The answer is correct", None), ("not correct", None),
    ("<think>unfinished", None),
])
def test_verdicts_are_read_from_the_first_word(reply, reward):
    assert parse_verdict(reply) == reward


def test_the_prompt_shows_question_references_and_answer():
    prompt = judge_prompt("Capital of Velmora?", ["Hadrath", "Hadrath city"], "Hadrath")
    assert "Question: Capital of Velmora?\n" in prompt
    assert "Reference answer: Hadrath (also accepted: Hadrath city)\n" in prompt
    assert "Given answer: Hadrath\n" in prompt and prompt.endswith("Verdict:")


def test_the_judge_reads_the_final_answer_without_thinking_capped():
    assert judged_answer("<tool_response>Pell is a village</tool_response><think>hmm</think> Pell") == "Pell"
    assert len(judged_answer("x" * 5000)) == MAX_ANSWER_CHARS


def request(*problems: dict) -> RewardRequest:
    return RewardRequest(job="acme.j1", task="search-qa",
                         items=[RewardItem(problem=p, completion="Pell") for p in problems])


async def test_a_disabled_or_unnamed_judge_is_a_clear_error():
    judge = Judge(load_config(env={}).env)
    result = await judge.score(request({"question": "q", "answer": "Pell"}))
    assert result.rewards == [] and "judge is disabled: set env.judge_url" in result.error
    assert "acme.j1" in result.error
    await judge.aclose()
    judge = Judge(load_config(overrides={"env.judge_url": "http://127.0.0.1:9/v1"}, env={}).env)
    assert "env.judge_model is empty" in (await judge.score(request({"question": "q", "answer": "a"}))).error
    await judge.aclose()


async def test_problems_without_an_answer_cannot_be_judged():
    env = load_config(overrides={"env.judge_url": "http://127.0.0.1:9/v1", "env.judge_model": "m"}, env={}).env
    judge = Judge(env)
    result = await judge.score(request({"question": "q", "answer": "Pell"}, {"prompt": "p"}))
    assert "item 1: the judge needs a problem with a 'question'" in result.error
    await judge.aclose()


def test_judge_config_is_validated():
    env = load_config(overrides={"env.judge_api": "completions", "env.judge_timeout_s": 5}, env={}).env
    assert (env.judge_api, env.judge_timeout_s, env.judge_url) == ("completions", 5.0, "")
    for bad in ({"env.judge_api": "responses"}, {"env.judge_timeout_s": 0}, {"env.judge_concurrency": 0}):
        with pytest.raises(ConfigError):
            load_config(overrides=bad, env={})
