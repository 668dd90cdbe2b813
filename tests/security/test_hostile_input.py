"""Hostile input at the HTTP gateway: whatever a tenant sends gets a 4xx saying what was wrong,
never a 500, and is never read as something else (another script's digit as a version).

The gateway's ASGI app runs in the test against a real nats-server (tokens are checked in the
tenants bucket); where a request reaches the manager, the manager's own handler answers it.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from marlaas.platform import subjects
from marlaas.platform.bus import JOBS_BUCKET
from marlaas.platform.config import load_config
from marlaas.platform.events import JOB_RECORD, JobRecord, JobSpec, JobState, encode
from marlaas.platform.tenants import add_tenant
from services.gateway.app import create_app
from services.gateway.context import Gateway
from services.gateway.metrics import StackMetrics
from services.manager.job_admin import job_status, pin_version
from services.manager.service import Manager, api_responder

pytestmark = pytest.mark.timeout(120)
TOML = "application/toml"


@pytest.fixture
def config(tmp_path):
    return load_config(overrides={"home": str(tmp_path / "home")}, env={})


@pytest.fixture
async def acme(bus, file_store, config):
    """An HTTP client of the gateway app holding tenant acme's token."""
    _, token = await add_tenant(bus, "acme")
    app = create_app(Gateway(bus, file_store, config, StackMetrics()))
    # in this event loop, the bus's (litestar's own test client runs the app in another thread's)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway",
                                 headers={"Authorization": f"Bearer {token}"}) as client:
        yield client


@pytest.mark.parametrize("body, content_type", [
    (b"[" * 100_000 + b"]" * 100_000, "application/json"),
    (b'{"a": ' * 5_000 + b"1" + b"}" * 5_000, "application/json"),
    (b'task = "addition"\nsteps = 2\ntools = ' + b"[" * 100_000 + b"]" * 100_000, TOML),
    (b"grpo = " + b"{a = " * 5_000 + b"1" + b"}" * 5_000, TOML),
], ids=["100k-deep JSON array", "5k nested JSON objects", "100k-deep TOML array", "5k nested TOML tables"])
async def test_a_deeply_nested_job_is_a_400_that_names_the_limit(acme, bus, body, content_type):
    answer = await acme.post("/v1/jobs", content=body, headers={"Content-Type": content_type})
    assert answer.status_code == 400
    assert answer.json()["error"].startswith("the job is nested more than 32 levels deep")
    assert await bus.kv_keys(JOBS_BUCKET) == []


async def test_a_version_in_another_scripts_digits_pins_nothing(acme, bus, file_store, config):
    manager = await asyncio.to_thread(Manager, bus, file_store, config)
    await bus.serve(subjects.API_PIN, "manager", api_responder(lambda data: pin_version(manager.jobs, data)))
    spec = JobSpec(id="acme.job-1a2b3c", tenant="acme", name="job", task="addition", steps=9,
                   submitted_at=time.time())
    await bus.kv_create(JOBS_BUCKET, spec.id, encode(JobRecord(spec=spec, state=JobState.RUNNING, version=5)))

    for version in ("\u0663", "\uff13"):  # Arabic-Indic and fullwidth 3: int() reads both as 3
        answer = await acme.post(f"/v1/jobs/{spec.id}/versions/{version}/pin")
        assert answer.status_code == 400
        assert answer.json()["error"] == ("the version in the path must be a whole number from 0 to 100000 "
                                          f"(a committed version, in the digits 0-9, e.g. 3), not {version!r}")
    assert JOB_RECORD.decode((await bus.kv_get(JOBS_BUCKET, spec.id)).value).pinned == []
    assert (await acme.post(f"/v1/jobs/{spec.id}/versions/3/pin")).json()["pinned"] == [3]


async def test_an_unreadable_job_record_hides_only_itself(acme, bus, file_store, config):
    manager = await asyncio.to_thread(Manager, bus, file_store, config)
    spec = JobSpec(id="acme.job-ok", tenant="acme", name="ok", task="addition", steps=2, submitted_at=time.time())
    await bus.kv_create(JOBS_BUCKET, spec.id, encode(JobRecord(spec=spec, state=JobState.RUNNING, version=1)))
    await bus.kv_create(JOBS_BUCKET, "acme.job-junk", b'{"stream": "JOBS", "seq": 7}')  # a PubAck, say
    status = await job_status(manager.jobs, b"{}")
    assert [j.id for j in status.jobs] == ["acme.job-ok"] and not status.error
    listed = await acme.get("/v1/jobs")
    assert listed.status_code == 200 and [j["id"] for j in listed.json()] == ["acme.job-ok"]
