"""`marlaas tenant pause NAME` on a running stack: the paused tenant's job stops between versions
(what was in hand finishes) while another tenant's job goes on, its status says why, and once
`marlaas tenant resume NAME` it completes with every version announced exactly once (issue 40)."""

from __future__ import annotations

import asyncio
import time

import pytest

from marlaas.platform.bus import Bus
from marlaas.platform.events import POLICY
from marlaas.platform.nats_client import BusClient
from marlaas.platform.subjects import policy_committed
from marlaas.platform.tenant_turns import WEIGHTS_EVERY_S
from marlaas.stack.admin import PAUSED_KEY
from tests.tenant_admin import tenant_cli_ok

pytestmark = [pytest.mark.stack, pytest.mark.shared_stack]  # the session's stack: not in `make test-fast`

STEPS = 16  # more than the versions one job commits while a pause is being read (up to 5 s)


async def version_of(client: BusClient, job: str) -> int:
    return (await client.status(job))[0].version


async def wait_for_version(client: BusClient, job: str, version: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while await version_of(client, job) < version:
        assert time.monotonic() < deadline, f"{job} never reached v{version}"
        await asyncio.sleep(0.2)


@pytest.mark.timeout(600)
def test_a_paused_tenant_waits_while_another_goes_on_and_resumes_with_every_version_once(shared_stack):
    stack = shared_stack
    for name in ("pause-alice", "pause-bob"):
        tenant_cli_ok(stack.home, "add", name)

    async def go() -> None:
        alice = await BusClient.connect(stack.nats_url, tenant="pause-alice")
        bob = await BusClient.connect(stack.nats_url, tenant="pause-bob")
        job = await alice.submit({"name": "paused", "task": "addition", "steps": STEPS, "seed": 1})
        await wait_for_version(alice, job, 1)
        assert (await asyncio.to_thread(tenant_cli_ok, stack.home, "pause", "pause-alice"))["paused"] is True
        other = await bob.submit({"name": "goes-on", "task": "addition", "steps": 4, "seed": 2})
        await asyncio.sleep(WEIGHTS_EVERY_S + 1)  # every queue has read the pause
        held_at = await version_of(alice, job)
        [view] = await alice.status(job)
        assert view.state == "running" and "paused" in view.warnings.get(PAUSED_KEY, ""), view
        [done] = await bob.wait([other], timeout_s=400)  # bob's job goes on meanwhile
        assert done.state == "completed" and done.version == 4, done
        # alice's: at most the update that was being trained when the pause was read
        assert await version_of(alice, job) <= min(held_at + 1, STEPS - 1)
        assert (await asyncio.to_thread(tenant_cli_ok, stack.home, "resume", "pause-alice"))["paused"] is False
        [view] = await alice.wait([job], timeout_s=400)
        assert view.state == "completed" and view.version == STEPS, view
        await alice.close()
        await bob.close()
        bus = await Bus.connect(stack.nats_url)
        announced = [POLICY.decode(d) for d in await bus.read_all("POLICY", policy_committed(job))]
        await bus.close()
        assert sorted(a.version for a in announced) == list(range(STEPS + 1))  # each exactly once
        assert len({a.adapter.sha256 for a in announced}) == STEPS + 1

    asyncio.run(go())
