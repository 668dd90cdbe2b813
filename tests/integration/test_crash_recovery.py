"""Invariant 1 under crashes: SIGKILL the trainer (then the rollout) mid-run, restart it, and every
job still reaches its target with each version committed exactly once."""

from __future__ import annotations

import asyncio
import time

import pytest

from marlaas.platform.bus import Bus
from marlaas.platform.config import load_config
from marlaas.platform.events import POLICY
from marlaas.platform.nats_client import BusClient
from marlaas.stack.launcher import Stack

pytestmark = [pytest.mark.stack,  # starts a vLLM engine: not in `make test-fast`
              pytest.mark.own_stack("kills the trainer and rollout mid-job and restarts them")]

STEPS = 12


async def wait_for_version(client: BusClient, job: str, version: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while (await client.status(job))[0].version < version:
        assert time.monotonic() < deadline, f"{job} never reached v{version}"
        await asyncio.sleep(0.1)


async def announced_versions(url: str, job: str) -> list[int]:
    bus = await Bus.connect(url)
    try:
        return [POLICY.decode(d).version for d in await bus.read_all("POLICY", f"marlaas.policy.committed.{job}")]
    finally:
        await bus.close()


@pytest.mark.timeout(900)
def test_killed_trainer_and_rollout_lose_nothing_and_repeat_nothing(tmp_path):
    config = load_config(overrides={"home": str(tmp_path), "gateway.port": 0}, env={})
    with Stack(config) as stack:

        async def go() -> list:
            client = await BusClient.connect(stack.nats_url)
            jobs = await asyncio.gather(*(
                client.submit({"name": f"crash-{task}", "task": task, "steps": STEPS, "seed": 1})
                for task in ("addition", "reverse")))
            await wait_for_version(client, jobs[0], 3)
            stack.kill("trainer")  # mid-run: a batch may be half-trained, a version half-written
            stack.restart("trainer")
            await wait_for_version(client, jobs[0], 7)
            stack.kill("rollout")  # batches in flight are lost with the engine
            stack.restart("rollout")
            views = await client.wait(list(jobs), timeout_s=600)
            await client.close()
            return views

        views = asyncio.run(go())
        for view in views:
            assert view.state == "completed" and view.version == STEPS, view
            assert len(view.rewards) == STEPS
            versions = asyncio.run(announced_versions(stack.nats_url, view.id))
            assert versions == list(range(STEPS + 1)), versions  # no gap, no double step
