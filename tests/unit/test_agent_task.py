"""The generic ``agent`` task: its dataset rows, its job-file checks, and the built-in answer matchers."""

import json
from pathlib import Path

import pytest

from marlaas.platform.api import SubmitError, parse_submission
from marlaas.platform.config import load_config
from marlaas.platform.events import RewardItem, RewardRequest
from marlaas.platform.store import FileStore
from marlaas.tasks import TaskError, get_task
from marlaas.tasks.matchers import answer_text, contains, exact, numeric
from services.env.judge import question_and_references
from services.env.rewards import score_matched
from services.manager.service import Manager


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


CAPITALS = [{"prompt": "What is the capital of Peru?", "answer": "Lima", "country": "Peru"},
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Capital of Chile?"}],
             "answers": ["Santiago", "Santiago de Chile"]}]


def test_rows_reach_the_reward_as_written(tmp_path):
    task = get_task("agent", str(write_jsonl(tmp_path / "d.jsonl", CAPITALS)))
    assert task.kind == "agentic" and task.needs_tools and not task.has_reward
    drawn = task.problems(20, seed=0)
    assert {json.dumps(p, sort_keys=True) for p in drawn} == {json.dumps(r, sort_keys=True) for r in CAPITALS}
    assert task.longest_prompts() == ["What is the capital of Peru?", "Be brief.\nHi\nHello\nCapital of Chile?"]
    with pytest.raises(TaskError, match="no reward of its own"):
        task.reward(drawn[0], "Lima")


@pytest.mark.parametrize("row, message", [
    ({"answer": "x"}, 'needs "prompt" .* or "messages"'),
    ({"prompt": "q", "messages": [{"role": "user", "content": "q"}], "answer": "x"}, "keep one"),
    ({"prompt": "  ", "answer": "x"}, '"prompt" must be a non-empty string'),
    ({"prompt": "q"}, 'needs "answer" .* or "answers"'),
    ({"prompt": "q", "answer": ""}, '"answer" must be a non-empty string or a number'),
    ({"prompt": "q", "answers": []}, '"answers" must be a non-empty list'),
    ({"prompt": "q", "answer": True}, '"answer" must be'),
    ({"messages": [], "answer": "x"}, '"messages" must be a non-empty list'),
    ({"messages": [{"role": "tool", "content": "r"}, {"role": "user", "content": "q"}], "answer": "x"},
     'role \'tool\': use "user", "assistant" or "system"'),
    ({"messages": [{"role": "user", "content": "q", "name": "me"}], "answer": "x"}, "and nothing else"),
    ({"messages": [{"role": "user", "content": 3}], "answer": "x"}, r"messages\[0\].content must be a string"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}], "answer": "x"},
     "only the first message"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "answer": "x"},
     "must end with a user message"),
    ("[1, 2]", "expected a JSON object"),
])
def test_bad_rows_name_the_line_and_the_fix(tmp_path, row, message):
    path = write_jsonl(tmp_path / "d.jsonl", [CAPITALS[0], row])
    with pytest.raises(TaskError, match=f"d.jsonl:2: .*{message}"):
        get_task("agent", str(path))


def test_missing_or_empty_datasets_are_refused(tmp_path):
    with pytest.raises(TaskError, match="task 'agent' needs 'dataset'"):
        get_task("agent")
    with pytest.raises(TaskError, match="holds no rows"):
        get_task("agent", str(write_jsonl(tmp_path / "d.jsonl", [])))
    with pytest.raises(TaskError, match="does not exist"):
        get_task("agent", str(tmp_path / "nope.jsonl"))


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    return Manager(None, FileStore(home / "store"), load_config(overrides={"home": str(home)}, env={}))


@pytest.mark.parametrize("fields, message", [
    ({"tools": None}, "task 'agent' needs 'tools': the tools the model may call, at least one"),
    ({"tools": []}, "needs 'tools'"),
    ({"reward": ""}, ("task 'agent' needs 'reward': a built-in one \\(judge, exact, contains, numeric\\) or your "
                     "own 'acme.<name>'")),
    ({"reward": "fuzzy"}, "reward 'fuzzy': name your reward function as 'acme.<name>', or a built-in one"),
    ({"tools": ["other.lookup"]}, "belongs to tenant 'other'"),
    ({"dataset": None}, "task 'agent' needs 'dataset'"),
])
def test_the_job_file_is_checked_at_submission(manager, tmp_path, fields, message):
    job = {"task": "agent", "steps": 2, "tenant": "acme", "dataset": str(write_jsonl(tmp_path / "d.jsonl", CAPITALS)),
           "tools": ["acme.lookup_capital"], "reward": "contains", "system": "Answer with a city."}
    tree = {k: v for k, v in (job | fields).items() if v is not None}
    with pytest.raises(SubmitError, match=message):
        manager.submissions.validate(parse_submission(tree))


def test_a_valid_agent_job_keeps_its_system_prompt(manager, tmp_path):
    job = {"task": "agent", "steps": 2, "tenant": "acme", "dataset": str(write_jsonl(tmp_path / "d.jsonl", CAPITALS)),
           "tools": ["acme.lookup_capital"], "reward": "numeric", "system": "Answer with a city."}
    spec = manager.submissions.validate(parse_submission(job)).spec
    assert spec.system == "Answer with a city." and spec.reward == "numeric" and spec.tools == ("acme.lookup_capital",)


@pytest.mark.parametrize("completion, text", [
    ("Lima", "Lima"),
    ('<tool_call>{"name": "f"}</tool_call><tool_response>Quito</tool_response> Lima.', "Lima."),
    ("assistant\nLima", "Lima"),
    ("<think>Quito? no</think>Lima", "Lima"),
])
def test_the_answer_text_is_the_models_own_final_words(completion, text):
    assert answer_text(completion) == text


@pytest.mark.parametrize("matcher, row, completion, reward", [
    (exact, {"answer": "Lima"}, "lima.", 1.0),
    (exact, {"answer": "The Lima"}, "Lima", 1.0),  # articles and punctuation do not count
    (exact, {"answer": "Lima"}, "It is Lima", 0.0),
    (exact, {"answers": ["Santiago", "Santiago de Chile"]}, "Santiago de Chile", 1.0),
    (exact, {"answer": 42}, "42", 1.0),
    (contains, {"answer": "Lima"}, "The capital is Lima.", 1.0),
    (contains, {"answer": "Lima"}, "Limassol", 0.0),  # whole words only
    (contains, {"answer": "Lima"}, "<tool_response>Lima</tool_response>I do not know", 0.0),  # not the tool's words
    (contains, {"answers": ["x y", "Lima"]}, "lima, peru", 1.0),
    (contains, {"answer": "the"}, "anything", 0.0),  # a reference with no words matches nothing
    (numeric, {"answer": "1,234.50"}, "It costs $1234.5.", 1.0),
    (numeric, {"answer": 7}, "3 + 4 = 7", 1.0),
    (numeric, {"answer": "7"}, "#### 8 (not 7)", 0.0),
    (numeric, {"answer": "0.5"}, "1/2", 1.0),
    (numeric, {"answer": "7"}, "seven", 0.0),
])
def test_matchers(matcher, row, completion, reward):
    assert matcher(row, completion) == reward


def test_matcher_errors_name_the_item_and_the_fix():
    request = RewardRequest(job="acme.j", task="agent", items=[
        RewardItem(problem={"answer": "7"}, completion="7"), RewardItem(problem={"answer": "Lima"}, completion="7")])
    result = score_matched("numeric", numeric, request)
    assert "item 1" in result.error and "'Lima' is not a number; use 'exact' or 'contains'" in result.error
    result = score_matched("exact", exact, RewardRequest(job="acme.j", task="agent", items=[
        RewardItem(problem={"question": "q"}, completion="7")]))
    assert 'needs "answer"' in result.error
    assert score_matched("exact", exact, request).rewards == [1.0, 0.0]


def test_the_judge_reads_a_conversations_last_user_message():
    item = RewardItem(problem=CAPITALS[1], completion="Santiago")
    assert question_and_references(item, 0) == ("Capital of Chile?", ["Santiago", "Santiago de Chile"])
    assert question_and_references(RewardItem(problem={"prompt": "2+5?", "answer": 7}, completion=""), 0) == (
        "2+5?", ["7"])
