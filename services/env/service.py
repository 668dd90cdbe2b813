"""Env shell: answer reward requests on ``marlaas.reward.<task>`` in the queue group ``env``.

Start more env processes to scale: NATS spreads requests over the queue group.
"""

from __future__ import annotations

import asyncio

import structlog

from marlaas.events import REWARD, EventDecodeError, RewardRequest, RewardResult, encode
from marlaas.runtime import Runtime
from services.env.rewards import RewardBook

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
    rt.ready()
    log.info("ready")
    await rt.stop.wait()
