"""Search-agent QA on your own documents (the HotpotQA shape), scored by exact match and F1.

The job names two JSONL files. The dataset holds one ``{"question": ..., "answer": ...}`` per
line (``answer`` may also be a list of accepted answers; other fields, such as HotpotQA's
``supporting_facts``, are ignored). The corpus holds one ``{"id": ..., "title": ..., "text":
...}`` passage per line (``title`` optional), the documents the built-in ``search`` tool reads
for this job: every tool call of the job carries ``{"corpus": <absolute path>}`` as its
context. Both files are read and checked when the task is built (at submission), so a bad
line fails the submission with its ``file:line``.

The reward follows the SQuAD / HotpotQA evaluation: the answer and each reference are
normalized (lower case, punctuation and the articles a / an / the removed, whitespace
collapsed); an exact match scores 1.0, otherwise the token-level F1 of the two bags of words.
With several references the best one counts. The answer is what the model wrote after its
last tool response (:func:`marlaas.tools.protocol.final_answer`), read by
:func:`extract_answer`. Deviation from the SQuAD script, which scores the whole prediction:
``<think>`` blocks and a chat template's leftover role line are dropped, the text after the
last ``Answer:`` label is taken when there is one, and only its first non-empty line counts
(a model that writes more lines after its answer is neither rewarded nor penalized for them).
An answer that normalizes to nothing (``"The."``) is refused in the dataset: an empty
prediction would match it exactly.
"""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from pathlib import Path

from marlaas.tasks.base import Task, TaskError, json_records
from marlaas.tools.protocol import final_answer, without_thinking

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_ROLE_LINE = re.compile(r"^\s*assistant\s*\n")  # what a chat template leaves once special tokens are skipped
_ANSWER_LABEL = re.compile(r"\banswer\s*:", re.IGNORECASE)


def normalize_answer(text: str) -> str:
    """SQuAD's normalization: lower case, no punctuation, no articles, single spaces."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when the normalized strings are equal, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(reference))


def token_f1(prediction: str, reference: str) -> float:
    """Token-level F1 between the normalized strings (bags of words); 1.0 when both are empty."""
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not predicted or not expected:
        return float(predicted == expected)
    common = sum((Counter(predicted) & Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def qa_score(prediction: str, references: list[str]) -> float:
    """Exact match 1.0, else the best token F1 over the references."""
    return max(max(exact_match(prediction, r), token_f1(prediction, r)) for r in references)


def extract_answer(completion: str) -> str:
    """The answer a completion commits to: its text after the last tool response, without
    ``<think>`` blocks or a chat template's role line, after the last ``Answer:`` label if it
    writes one, first non-empty line only."""
    text = _ROLE_LINE.sub("", without_thinking(final_answer(completion)))
    labels = list(_ANSWER_LABEL.finditer(text))
    if labels:
        text = text[labels[-1].end():]
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


class SearchQa(Task):
    name = "search-qa"
    kind = "agentic"
    description = ("questions over your own documents (dataset {question, answer}, corpus {id, title?, text}); "
                   "the model searches the corpus, rewarded by exact match / F1; needs a real model")
    tools = ("search",)
    needs_dataset = True
    needs_corpus = True
    max_new_tokens = 64  # per turn: a search call or a short answer
    max_tool_calls = 5
    max_observation_tokens = 256  # a few passages of a subword-tokenized model

    def __init__(self, dataset: str | None = None, corpus: str | None = None) -> None:
        super().__init__(dataset, corpus)
        self.items = load_questions(Path(dataset).expanduser())
        self.corpus_path = Path(corpus).expanduser().resolve()
        check_corpus(self.corpus_path)

    def tool_context(self) -> dict[str, str]:
        return {"corpus": str(self.corpus_path)}

    @staticmethod
    def prompt(item: dict) -> str:
        return (f"Question: {item['question']}\n"
                "Search the documents with the search tool, then answer in a few words.\nAnswer:")

    def sample_problem(self, rng: random.Random) -> dict:
        item = rng.choice(self.items)
        return {"prompt": self.prompt(item), "question": item["question"], "answer": item["answers"][0],
                "answers": item["answers"]}

    def longest_prompts(self) -> list[str]:
        return [self.prompt(item) for item in self.items]

    def reward(self, problem: dict, completion: str) -> float:
        return qa_score(extract_answer(completion), problem.get("answers") or [problem["answer"]])


def load_questions(path: Path) -> list[dict]:
    """The questions of a search-qa dataset: ``{"question": str, "answers": [str, ...]}`` each."""
    items = []
    for lineno, record in json_records(path, "dataset"):
        question, answer = record.get("question"), record.get("answer")
        answers = answer if isinstance(answer, list) else [answer]
        if not isinstance(question, str) or not question.strip():
            raise TaskError(f'{path}:{lineno}: needs "question", a non-empty string')
        if not answers or not all(isinstance(a, str) and normalize_answer(a) for a in answers):
            raise TaskError(f'{path}:{lineno}: needs "answer", a string (or a list of strings) with at '
                            "least one word besides punctuation and articles")
        items.append({"question": question.strip(), "answers": [a.strip() for a in answers]})
    if not items:
        raise TaskError(f"dataset {path} holds no questions: write one {{\"question\", \"answer\"}} per line")
    return items


def check_corpus(path: Path) -> int:
    """Check a search corpus as the search tool reads it; the number of passages."""
    count = 0
    for lineno, record in json_records(path, "corpus"):
        if not isinstance(record.get("text"), str):
            raise TaskError(f'{path}:{lineno}: each passage needs "text", a string '
                            '(and optionally "id" and "title")')
        if not isinstance(record.get("title") or "", str):
            raise TaskError(f'{path}:{lineno}: "title" must be a string')
        count += 1
    if not count:
        raise TaskError(f"corpus {path} holds no passages: write one {{\"id\", \"title\", \"text\"}} per line")
    return count
