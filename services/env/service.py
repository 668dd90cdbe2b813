"""Env shell: answer reward requests on ``marlaas.reward.<task>`` in the queue group ``env``,
and serve the built-in tools on ``marlaas.tool.builtin.<tool>`` (see ``services/env/tools``).

Start more env processes to scale: NATS spreads requests over the queue groups.
"""

from __future__ import annotations

import asyncio

import structlog

from marlaas.events import REWARD, EventDecodeError, RewardRequest, RewardResult, encode
from marlaas.runtime import Runtime
from services.env.rewards import RewardBook
from services.env.tools import serve_builtin_tools

log = structlog.get_logger("env")


def reward_subject(task: str) -> str:
    return f"marlaas.reward.{task}"


async def run(rt: Runtime) -> None:
    book = RewardBook()

    async def answer(data: bytes) -> bytes:
        try:
            request = REWARD.decode(data)
        except EventDecodeError as exc:
            return encode(RewardResult(error=str(exc)))
        if not isinstance(request, RewardRequest):
            return encode(RewardResult(error=f"expected a reward.request, got {type(request).__name__}"))
        result = await asyncio.to_thread(book.score, request)
        if result.error:
            log.warning("reward request refused", job=request.job, error=result.error)
        return encode(result)

    await rt.bus.serve(reward_subject("*"), "env", answer)
    tools = await serve_builtin_tools(rt.bus, rt.config)
    rt.ready()
    log.info("ready", tools=[sub.subject for sub in tools.subscriptions])
    try:
        await rt.stop.wait()
    finally:
        await tools.stop()
