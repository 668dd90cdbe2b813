"""The built-in ``judge`` reward: an LLM says whether each final answer matches the reference.

A job opts in with ``reward = "judge"``; its requests reach the env on
``marlaas.reward.builtin.judge`` (two tokens after ``reward``, so the per-task
``marlaas.reward.*`` subscription never sees them). The judge is any OpenAI-compatible
server (vLLM, SGLang, a hosted API without a key) named by the env config:

    [env]
    judge_url = "http://127.0.0.1:8000/v1"   # "" = the judge is disabled
    judge_model = "Qwen/Qwen2.5-7B-Instruct"  # the name the server serves
    judge_api = "chat"                        # "completions" for a model without a chat template
    judge_structured_verdict = true           # vLLM only: the reply can only be "yes" or "no"

For every item the judge reads the question (the problem's ``question``, else its
``prompt``, else the last user message of its ``messages``), the reference (``answer``,
or every one of ``answers``) and the completion's final answer (the text after its last
tool response, ``<think>`` blocks dropped, at most the last :data:`MAX_ANSWER_CHARS`
characters), and is asked for one word, yes or no, at temperature 0. The verdict is read
from the reply's first word (after an optional ``Verdict:`` label; ``<think>`` blocks
skipped): yes / correct / true score 1.0, no / incorrect / wrong / false 0.0, and a
number in [0, 1] is taken as the score itself.

Verdicts of one request are asked for concurrently, at most ``judge_concurrency`` at once,
each within ``judge_timeout_s``. There is no fallback reward: a disabled judge, an
unreachable server, a timeout, an HTTP error, a reply that is not a completion, or a
verdict that is none of the above makes the whole request a ``RewardResult.error`` naming
the cause (the job fails with it, the env keeps serving). A judge that rambles instead of
answering yes / no is a misconfiguration to fix, not noise to train on: set
``judge_structured_verdict`` on a vLLM judge, or a ``judge_max_tokens`` that lets a thinking
judge finish. The rollout waits 60 s for a reward reply, so size ``judge_concurrency`` to
answer a step's batch within it.
"""

from __future__ import annotations

import asyncio
import re

import httpx
import structlog

from marlaas.platform.config import EnvConfig
from marlaas.platform.events import RewardItem, RewardRequest, RewardResult
from marlaas.tools.protocol import final_answer, without_thinking
from marlaas.tools.registry import reward_subject

log = structlog.get_logger("env.judge")

JUDGE_SUBJECT = reward_subject("judge")
MAX_ANSWER_CHARS = 1000  # a final answer is short; a runaway completion must not fill the judge's context
YES = frozenset({"yes", "correct", "true"})
NO = frozenset({"no", "incorrect", "wrong", "false"})
_LABEL = re.compile(r"^\s*(verdict|answer|judgement|judgment|score)\s*[:=-]\s*", re.IGNORECASE)
_FIRST_WORD = re.compile(r"[a-z]+|\d+(?:\.\d+)?")


class JudgeError(Exception):
    """The judge could not give a verdict; the message says why and what to check."""


def judge_prompt(question: str, references: list[str], answer: str) -> str:
    """What the judge is asked about one item (plain text: fits chat and completions alike)."""
    reference = references[0] + (f" (also accepted: {'; '.join(references[1:])})" if references[1:] else "")
    return ("You grade answers to questions.\n"
            f"Question: {question}\n"
            f"Reference answer: {reference}\n"
            f"Given answer: {answer}\n"
            "Does the given answer mean the same as the reference answer? Reply yes or no.\n"
            "Verdict:")


def parse_verdict(reply: str) -> float | None:
    """The reward a judge's reply stands for: 1.0 for yes, 0.0 for no, a score in [0, 1] as
    itself; None when the reply is none of those."""
    text = _LABEL.sub("", without_thinking(reply).strip().lower())
    word = _FIRST_WORD.search(text)
    if word is None or text[:word.start()].strip(" *\"'`_(["):  # the verdict must come first
        return None
    token = word.group()
    if token in YES:
        return 1.0
    if token in NO:
        return 0.0
    if token[0].isdigit() and 0.0 <= (score := float(token)) <= 1.0:
        return score
    return None


def judged_answer(completion: str) -> str:
    """The part of a completion the judge reads: its final answer, no ``<think>`` blocks, capped."""
    return without_thinking(final_answer(completion)).strip()[-MAX_ANSWER_CHARS:]


def question_and_references(item: RewardItem, position: int) -> tuple[str, list[str]]:
    """The question and accepted answers of one item; :class:`JudgeError` if its problem has none."""
    problem = item.problem
    question = problem.get("question") or problem.get("prompt") or last_user_message(problem.get("messages"))
    references = problem.get("answers") or ([problem["answer"]] if "answer" in problem else [])
    if isinstance(references, list):  # an agent dataset's answers may be numbers
        references = [str(r) if isinstance(r, (int, float)) and not isinstance(r, bool) else r for r in references]
    if not isinstance(question, str) or not references or not all(isinstance(r, str) for r in references):
        raise JudgeError(f"item {position}: the judge needs a problem with a 'question' (or 'prompt') and an "
                         "'answer' string; this task's problems have neither, so pick another reward")
    return question, references


def last_user_message(messages) -> str | None:
    """The content of a conversation's last user message (an ``agent`` dataset row's question)."""
    users = [m.get("content") for m in messages or [] if isinstance(m, dict) and m.get("role") == "user"]
    return users[-1] if users else None


class Judge:
    """The judge reward: one HTTP client to the configured server, shared by every request."""

    def __init__(self, env: EnvConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.env = env
        self.url = env.judge_url.rstrip("/")
        self.client = httpx.AsyncClient(
            timeout=env.judge_timeout_s,
            limits=httpx.Limits(max_connections=env.judge_concurrency),
            transport=transport or httpx.AsyncHTTPTransport(retries=1),  # one retry of a failed connect
        )

    async def aclose(self) -> None:
        await self.client.aclose()

    async def score(self, request: RewardRequest) -> RewardResult:
        """A reward in [0, 1] for every item, or an error naming what went wrong."""
        try:
            self.check_enabled()
            asked = [question_and_references(item, i) for i, item in enumerate(request.items)]
            bound = asyncio.Semaphore(self.env.judge_concurrency)

            async def one(position: int, item: RewardItem) -> float:
                question, references = asked[position]
                async with bound:
                    return await self.verdict(position, question, references, judged_answer(item.completion))

            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(i, item)) for i, item in enumerate(request.items)]
            return RewardResult(rewards=[t.result() for t in tasks])
        except* JudgeError as failed:
            error = str(failed.exceptions[0])
        except* Exception as failed:  # a bug here must fail this job, not the env
            log.error("judge failed", job=request.job, exc_info=failed.exceptions[0])
            error = f"{type(failed.exceptions[0]).__name__}: {failed.exceptions[0]}"
        return RewardResult(error=f"judge reward for job {request.job}: {error}")

    def check_enabled(self) -> None:
        if not self.url:
            raise JudgeError("the judge is disabled: set env.judge_url (an OpenAI-compatible base URL, e.g. "
                             "http://127.0.0.1:8000/v1) and env.judge_model in the env service's config")
        if not self.env.judge_model:
            raise JudgeError(f"env.judge_model is empty: name the model {self.url} serves")

    async def verdict(self, position: int, question: str, references: list[str], answer: str) -> float:
        """Ask the judge about one item; its reward."""
        reply = await self.ask(judge_prompt(question, references, answer))
        value = parse_verdict(reply)
        if value is None:
            raise JudgeError(
                f"item {position}: the judge's reply {reply[:80]!r} is not yes, no or a score in [0, 1]; "
                "check env.judge_model and env.judge_api, set env.judge_structured_verdict on a vLLM judge, "
                "or raise env.judge_max_tokens for a thinking judge")
        return value

    async def ask(self, prompt: str) -> str:
        """One completion from the judge at temperature 0: the reply's text."""
        env = self.env
        body: dict = {"model": env.judge_model, "max_tokens": env.judge_max_tokens, "temperature": 0.0}
        if env.judge_api == "chat":
            endpoint, body["messages"] = "chat/completions", [{"role": "user", "content": prompt}]
        else:
            endpoint, body["prompt"] = "completions", prompt
        if env.judge_structured_verdict:
            body["structured_outputs"] = {"choice": ["yes", "no"]}
        url = f"{self.url}/{endpoint}"
        try:
            response = await self.client.post(url, json=body)
        except httpx.TimeoutException:
            raise JudgeError(f"the judge at {url} did not answer within {env.judge_timeout_s} s "
                             "(env.judge_timeout_s)") from None
        except httpx.HTTPError as exc:
            raise JudgeError(f"the judge at {url} is unreachable ({type(exc).__name__}: {exc}); "
                             "check env.judge_url and that the server is up") from None
        if response.is_error:
            hint = ('; a model without a chat template needs env.judge_api = "completions"'
                    if endpoint.startswith("chat") and "chat template" in response.text else "")
            raise JudgeError(f"the judge at {url} answered HTTP {response.status_code}: "
                             f"{response.text[:300]}{hint}")
        try:
            choice = response.json()["choices"][0]
            text = choice["message"]["content"] if env.judge_api == "chat" else choice["text"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise JudgeError(f"the judge at {url} sent a reply that is not an OpenAI "
                             f"{endpoint} response ({type(exc).__name__}: {exc})") from None
        if not isinstance(text, str):  # a chat reply may hold only reasoning or a tool call
            raise JudgeError(f"the judge at {url} sent no text in its reply")
        return text
