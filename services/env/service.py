"""Env shell: answer reward requests on ``marlaas.reward.<task>`` in the queue group ``env``,
the built-in ``judge`` reward on ``marlaas.reward.builtin.judge`` (see ``services/env/judge.py``) and
the answer matchers on ``marlaas.reward.builtin.<exact|contains|numeric>`` (``marlaas.tasks.matchers``),
serve the built-in tools on ``marlaas.tool.builtin.<tool>`` (see ``services/env/tools``; ``python``
only with ``env.python_tool = "env"``, else the ``sandbox`` service serves it), and keep the tool
registry for tenants' tools and the sandbox's (``marlaas.registry.<tenant>.announce``: tenants live
in NATS accounts of their own, the sandbox is a user without JetStream, and neither writes the
``tools`` bucket itself).

Start more env processes to scale: NATS spreads requests over the queue groups.
"""

from __future__ import annotations

import asyncio

import structlog

from marlaas.platform import subjects
from marlaas.platform.events import RewardResult, encode
from marlaas.platform.files import DataFiles
from marlaas.platform.runtime import Runtime
from marlaas.platform.telemetry import span
from marlaas.tasks import get_task
from marlaas.tasks.matchers import MATCHERS
from marlaas.tools.registry import reward_subject, serve_registrar
from marlaas.tools.serving import decode_reward_request
from services.env.judge import JUDGE_SUBJECT, Judge
from services.env.rewards import RewardBook, score_matched
from services.env.tools import serve_builtin_tools

log = structlog.get_logger("env")


async def run(rt: Runtime) -> None:
    files = DataFiles(rt.store, rt.config.home_dir / "cache" / "files", get_task)  # tenants' uploads
    book = RewardBook(files)
    judge = Judge(rt.config.env)

    async def answer(data: bytes) -> bytes:
        request = decode_reward_request(data)
        if isinstance(request, RewardResult):
            return encode(request)
        async with span(rt.bus, "env", "score", request.job, -1, items=len(request.items)):
            result = await asyncio.to_thread(book.score, request)
        if result.error:
            log.warning("reward request refused", job=request.job, error=result.error)
        return encode(result)

    async def answer_judge(data: bytes) -> bytes:
        request = decode_reward_request(data)
        if isinstance(request, RewardResult):
            return encode(request)
        result = await judge.score(request)
        if result.error:
            log.warning("judge reward failed", job=request.job, error=result.error)
        return encode(result)

    def answer_matched(name: str):
        async def answer(data: bytes) -> bytes:
            request = decode_reward_request(data)
            if isinstance(request, RewardResult):
                return encode(request)
            # the completions are a model's output, untrusted: scored off the event loop
            result = await asyncio.to_thread(score_matched, name, MATCHERS[name], request)
            if result.error:
                log.warning("reward request refused", job=request.job, error=result.error)
            return encode(result)

        return answer

    await rt.bus.serve(subjects.task_reward(), "env", answer)
    await rt.bus.serve(JUDGE_SUBJECT, "env", answer_judge)
    for name in MATCHERS:
        await rt.bus.serve(reward_subject(name), "env", answer_matched(name))
    tools = await serve_builtin_tools(rt.bus, rt.config, files)
    await serve_registrar(rt.bus)
    rt.ready()
    log.info("ready", tools=[sub.subject for sub in tools.subscriptions], judge=rt.config.env.judge_url or "off")
    try:
        await rt.stop.wait()
    finally:
        await tools.stop()
        await judge.aclose()
