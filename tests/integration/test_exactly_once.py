"""Exactly-once without the broker's duplicate window: with JetStream's window cut to half a second,
repeated announcements of a job's current version (what a restarted trainer sends) and a trainer
restart make no version sampled or trained twice."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from marlaas.platform.audit import audit_training
from marlaas.platform.bus import VERSIONS_BUCKET, Bus
from marlaas.platform.commits import announce
from marlaas.platform.config import load_config
from marlaas.platform.events import COMMITTED
from marlaas.platform.nats_client import BusClient
from marlaas.platform.telemetry import read_spans
from marlaas.stack.launcher import Stack

pytestmark = [pytest.mark.stack,  # starts a vLLM engine: not in `make test-fast`
              pytest.mark.own_stack("duplicate_window_s = 0.5 and a trainer killed mid-batch")]

STEPS = 8


@pytest.mark.timeout(600)
def test_repeated_announcements_past_the_duplicate_window_sample_nothing_twice(tmp_path):
    config = load_config(overrides={"home": str(tmp_path), "gateway.port": 0, "duplicate_window_s": 0.5}, env={})

    async def repeat_announcements(url: str, job: str, until: asyncio.Event) -> int:
        bus = await Bus.connect(url)
        sent = 0
        while not until.is_set():
            entry = await bus.kv_get(VERSIONS_BUCKET, job)
            if entry is not None:
                await announce(bus, COMMITTED.decode(entry.value))  # the window has passed: not deduplicated
                sent += 1
            await asyncio.sleep(0.6)
        await bus.close()
        return sent

    async def run(stack: Stack):
        client = await BusClient.connect(stack.nats_url)
        job = await client.submit({"name": "once", "task": "addition", "steps": STEPS, "seed": 3})
        done = asyncio.Event()
        repeater = asyncio.create_task(repeat_announcements(stack.nats_url, job, done))
        deadline = time.monotonic() + 300
        while (await client.status(job))[0].version < 3:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.3)
        await asyncio.to_thread(stack.kill, "trainer")  # it re-announces every job's version when it is back
        await asyncio.to_thread(stack.restart, "trainer")
        [view] = await client.wait([job], timeout_s=400)
        done.set()
        sent = await repeater
        bus = await Bus.connect(stack.nats_url)
        spans = [s for s in await read_spans(bus) if s.job == job]
        await bus.close()
        await client.close()
        return view, sent, spans

    with Stack(config) as stack:
        view, sent, spans = asyncio.run(run(stack))

    assert view.state == "completed" and view.version == STEPS
    assert sent >= 5  # the current version was announced again and again, outside the window
    sampled = Counter(s.version for s in spans if s.phase == "generate")
    assert sampled == Counter(range(STEPS)), sampled  # every version sampled exactly once
    assert audit_training(spans) == []  # ... and trained exactly once, on-policy
