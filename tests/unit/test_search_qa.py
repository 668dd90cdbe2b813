"""The search-qa task (answer extraction, SQuAD-style EM / F1, dataset and corpus checks) and
the search tool answering from a job's own corpus."""

import json
from pathlib import Path

import pytest

from marlaas.platform.events import RewardItem, RewardRequest
from marlaas.tasks import REGISTRY, TaskError, get_task
from marlaas.tasks.search_qa import exact_match, extract_answer, normalize_answer, qa_score, token_f1
from marlaas.tools import DEFAULT_CORPUS, ToolError, tool
from services.env.rewards import RewardBook
from services.env.tools import search_tool
from services.env.tools.search import CorpusError, CorpusIndexes, SearchIndex

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_DATASET = ROOT / "examples" / "search_qa" / "train.jsonl"
EXAMPLE_CORPUS = ROOT / "examples" / "search_qa" / "corpus.jsonl"


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


# --- scoring ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, normalized", [
    ("The Silver Heron!", "silver heron"),
    ("  an   Apple, a day ", "apple day"),
    ("2,914 metres.", "2914 metres"),
    ("Theatre", "theatre"),  # an article only as a whole word
])
def test_answers_are_normalized_as_squad_does(text, normalized):
    assert normalize_answer(text) == normalized


def test_exact_match_scores_one_and_f1_gives_partial_credit():
    assert exact_match("the Silver Heron.", "Silver Heron") == 1.0
    assert token_f1("Orlen", "Orlen Vasko") == pytest.approx(2 * 1.0 * 0.5 / 1.5)
    assert token_f1("Orlen Vasko of Pell", "Orlen Vasko") == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    assert token_f1("Hadrath", "Pell") == 0.0
    assert token_f1("the", "Pell") == 0.0  # nothing but an article left
    assert qa_score("glass shrimp", ["Caridina lucens", "glass shrimp"]) == 1.0
    assert qa_score("shrimp", ["Caridina lucens", "glass shrimp"]) == pytest.approx(2 / 3)


@pytest.mark.parametrize("completion, answer", [
    (" Hadrath\n", "Hadrath"),
    ('<tool_call>{"name":"search"}</tool_call><tool_response>Hadrath is a port</tool_response> Pell', "Pell"),
    ("<tool_response>x</tool_response>\nassistant\n<think>\nPell or Hadrath?\n</think>\n\nPell", "Pell"),
    ("I searched twice.\nAnswer: Orlen Vasko\nHe was a shipwright.", "Orlen Vasko"),
    ("Hadrath\nQuestion: what else?", "Hadrath"),
    ("<tool_response>x</tool_response>", ""),
])
def test_the_final_answer_is_read_after_the_last_tool_response(completion, answer):
    assert extract_answer(completion) == answer


def test_the_task_scores_the_example_questions():
    task = get_task("search-qa", str(EXAMPLE_DATASET), str(EXAMPLE_CORPUS))
    assert REGISTRY["search-qa"].kind == "agentic" and task.tools == ("search",)
    assert task.max_tool_calls == 5 and task.max_new_tokens == 64
    problems = task.problems(20, seed=0)
    assert problems == task.problems(20, seed=0)
    for problem in problems:
        assert problem["prompt"].startswith(f"Question: {problem['question']}\n")
        assert problem["prompt"].endswith("Answer:")
        searched = f'<tool_call>{{"name":"search"}}</tool_call><tool_response>...</tool_response> {problem["answer"]}'
        assert task.reward(problem, searched) == 1.0
        assert task.reward(problem, "I do not know") == 0.0
    assert len(task.longest_prompts()) == 13


def test_tool_context_names_the_corpus_by_absolute_path(tmp_path, monkeypatch):
    dataset = write_jsonl(tmp_path / "qa.jsonl", [{"question": "Capital?", "answer": "Hadrath"}])
    write_jsonl(tmp_path / "docs.jsonl", [{"id": 1, "text": "Hadrath is the capital."}])
    monkeypatch.chdir(tmp_path)
    task = get_task("search-qa", str(dataset), "docs.jsonl")
    assert task.tool_context() == {"corpus": str(tmp_path / "docs.jsonl")}
    assert get_task("multiply").tool_context() == {}


def test_the_env_builds_the_task_with_its_corpus_to_score():
    book = RewardBook()
    task = book.task("search-qa", str(EXAMPLE_DATASET), str(EXAMPLE_CORPUS))
    problem = task.problems(1, seed=0)[0]
    result = book.score(RewardRequest(job="acme.j", task="search-qa", dataset=str(EXAMPLE_DATASET),
                                      corpus=str(EXAMPLE_CORPUS),
                                      items=[RewardItem(problem=problem, completion=problem["answer"])]))
    assert result.error == "" and result.rewards == [1.0]


# --- dataset and corpus validation ----------------------------------------------------------------


@pytest.mark.parametrize("lines, message", [
    (['{"question": "q?", "answer": "Pell"}', "{not json"], r"qa.jsonl:2: not JSON .*one JSON object per line"),
    (['["q?", "a"]'], r"qa.jsonl:1: expected a JSON object, got list"),
    (['{"question": "", "answer": "Pell"}'], r'qa.jsonl:1: needs "question"'),
    (['{"question": "q?"}'], r'qa.jsonl:1: needs "answer", a string \(or a list of strings\)'),
    (['{"question": "q?", "answer": "The."}'], r'qa.jsonl:1: needs "answer".*besides punctuation and articles'),
    (['{"question": "q?", "answer": ["Pell", 3]}'], r'qa.jsonl:1: needs "answer"'),
    (["", "  "], r"holds no questions"),
])
def test_dataset_errors_name_the_line_and_the_fix(tmp_path, lines, message):
    dataset = write_jsonl(tmp_path / "qa.jsonl", lines)
    corpus = write_jsonl(tmp_path / "docs.jsonl", [{"id": 1, "text": "t"}])
    with pytest.raises(TaskError, match=message):
        get_task("search-qa", str(dataset), str(corpus))


@pytest.mark.parametrize("lines, message", [
    (['{"id": 1, "text": "t"}', '{"id": 2, "body": "t"}'], r'docs.jsonl:2: each passage needs "text", a string'),
    (['{"id": 1, "text": "t", "title": 5}'], r'docs.jsonl:1: "title" must be a string'),
    (['{"id": 1, "text": "t"', ], r"docs.jsonl:1: not JSON"),
    ([""], r"holds no passages"),
])
def test_corpus_errors_name_the_line_and_the_fix(tmp_path, lines, message):
    dataset = write_jsonl(tmp_path / "qa.jsonl", [{"question": "q?", "answer": "Pell"}])
    corpus = write_jsonl(tmp_path / "docs.jsonl", lines)
    with pytest.raises(TaskError, match=message):
        get_task("search-qa", str(dataset), str(corpus))


def test_missing_files_and_missing_settings_are_refused(tmp_path):
    dataset = write_jsonl(tmp_path / "qa.jsonl", [{"question": "q?", "answer": "Pell"}])
    with pytest.raises(TaskError, match="needs 'corpus'"):
        get_task("search-qa", str(dataset))
    with pytest.raises(TaskError, match="needs 'dataset'"):
        get_task("search-qa", None, str(EXAMPLE_CORPUS))
    with pytest.raises(TaskError, match=r"corpus .*nope.jsonl does not exist"):
        get_task("search-qa", str(dataset), str(tmp_path / "nope.jsonl"))
    with pytest.raises(TaskError, match=r"dataset .*nope.jsonl does not exist"):
        get_task("search-qa", str(tmp_path / "nope.jsonl"), str(EXAMPLE_CORPUS))
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TaskError, match="cannot be read"):
        get_task("search-qa", str(dataset), str(tmp_path / "binary.jsonl"))
    with pytest.raises(TaskError, match="takes no corpus"):
        get_task("multiply", None, str(EXAMPLE_CORPUS))


# --- the search tool on a job's corpus ------------------------------------------------------------


async def test_search_reads_the_corpus_its_call_context_names(tmp_path):
    search = search_tool(SearchIndex.open(DEFAULT_CORPUS, tmp_path), default_k=1, job_corpora=CorpusIndexes(tmp_path))
    assert "context" not in search.parameters["properties"]  # the model cannot choose the corpus
    own = await search.call('{"query": "founder of Hadrath"}', {"corpus": str(EXAMPLE_CORPUS)})
    assert own.startswith("[1] Hadrath (vel-2)") and "Orlen Vasko" in own
    default = await search.call('{"query": "How deep is Lake Ivesh?"}', {})
    assert "Ivesh" in default
    with pytest.raises(ToolError, match="invalid arguments"):
        await search.call(json.dumps({"query": "x", "context": {"corpus": "/etc/passwd"}}))


async def test_an_unusable_job_corpus_is_a_tool_error_naming_the_file(tmp_path):
    search = search_tool(SearchIndex.open(DEFAULT_CORPUS, tmp_path), default_k=1, job_corpora=CorpusIndexes(tmp_path))
    with pytest.raises(ToolError, match=r"gone.jsonl does not exist"):
        await search.call('{"query": "x"}', {"corpus": str(tmp_path / "gone.jsonl")})
    bad = write_jsonl(tmp_path / "bad.jsonl", ['{"text": "fine"}', "{oops"])
    with pytest.raises(ToolError, match=r"bad.jsonl:2: not JSON"):
        await search.call('{"query": "x"}', {"corpus": str(bad)})
    with pytest.raises(ToolError, match="cannot be read"):
        await search.call('{"query": "x"}', {"corpus": str(tmp_path)})  # a directory


def test_job_corpora_are_kept_least_recently_used_and_reindexed_when_edited(tmp_path):
    corpora = [write_jsonl(tmp_path / f"c{i}.jsonl", [{"text": f"passage word{i}"}]) for i in range(3)]
    indexes = CorpusIndexes(tmp_path / "cache", capacity=2)
    first = indexes.get(corpora[0])
    assert indexes.get(corpora[0]) is first
    indexes.get(corpora[1])
    indexes.get(corpora[0])  # now the most recent: c1 is dropped next
    indexes.get(corpora[2])
    assert len(indexes) == 2 and indexes.get(corpora[0]) is first
    assert indexes.get(corpora[1]).from_cache  # reloaded from the disk cache (same sha256)
    write_jsonl(corpora[0], [{"text": "passage changed"}, {"text": "another one"}])
    edited = indexes.get(corpora[0])
    assert edited is not first and edited.search("changed", 1)[0][0].text == "passage changed"
    with pytest.raises(CorpusError, match="does not exist"):
        indexes.get(tmp_path / "missing.jsonl")


async def test_plain_tools_ignore_the_context_and_context_tools_need_the_parameter():
    @tool
    def echo(text: str) -> str:
        """Echo."""
        return text

    assert await echo.call('{"text": "hi"}', {"corpus": "/x"}) == "hi"

    @tool(context=True)
    def where(context: dict[str, str]) -> str:
        """Where the call came from."""
        return context.get("corpus", "-")

    assert where.parameters["properties"] == {}
    assert await where.call("{}", {"corpus": "/x"}) == "/x" and await where.call("{}") == "-"
    with pytest.raises(TypeError, match="needs a parameter named 'context'"):
        tool(echo.function, context=True)
