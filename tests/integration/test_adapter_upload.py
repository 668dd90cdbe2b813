"""Uploaded LoRA adapters (issue 38): a tenant uploads the PEFT directory of an adapter as a .tar.gz
and names it as a job's ``init_from``; a hostile archive is refused with a 400 naming what is
wrong, and another tenant's adapter answers like a missing one.

The gateway's ASGI app runs against a real nats-server (its quota is a KV entry) and a file store;
no manager and no engine: uploads are checked by the gateway alone. The SDK test serves the same
app over a real socket (uvicorn, in this event loop) and drives the synchronous SDK from a thread.
"""

from __future__ import annotations

import asyncio
import json
import socket
import tarfile

import httpx
import pytest
import uvicorn

from marlaas.basemodel import builtin_model_dir
from marlaas.platform.adapter_archives import adapter_archive
from marlaas.platform.adapter_uploads import adapter_id_of, read_uploaded_adapter
from marlaas.platform.adapters import CONFIG_FILE, WEIGHTS_FILE, init_adapter
from marlaas.platform.config import load_config
from marlaas.platform.events import LoraSettings
from marlaas.platform.tenants import add_tenant
from marlaas.sdk import Client
from marlaas.sdk.http import with_absolute_paths
from services.gateway import adapters as gateway_adapters
from services.gateway.app import create_app
from services.gateway.context import Gateway
from services.gateway.metrics import StackMetrics
from tests.archives import member, pax_bomb, tar_gz

pytestmark = pytest.mark.timeout(180)
GZIP = {"Content-Type": "application/gzip"}


@pytest.fixture(scope="module")
def adapter() -> tuple[bytes, bytes]:
    """A rank-4 adapter of the built-in base, as PEFT saves it."""
    return init_adapter(builtin_model_dir(), LoraSettings(rank=4, target_modules=("q_proj", "v_proj")), seed=0)


@pytest.fixture
async def tenants(bus, file_store, tmp_path):
    """HTTP clients of the gateway app holding alice's and bob's tokens."""
    config = load_config(overrides={"home": str(tmp_path / "home")}, env={})
    app = create_app(Gateway(bus, file_store, config, StackMetrics()))
    clients = {}
    for name in ("alice", "bob"):
        _, token = await add_tenant(bus, name)
        clients[name] = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway",
                                          headers={"Authorization": f"Bearer {token}"}, timeout=120)
    yield clients
    for client in clients.values():
        await client.aclose()


async def upload(client: httpx.AsyncClient, body: bytes, name: str = "warm") -> httpx.Response:
    return await client.post("/v1/adapters", params={"name": name}, content=body, headers=GZIP)


async def test_an_uploaded_adapter_is_listed_stored_and_deleted_for_its_tenant_only(tenants, file_store, adapter):
    alice, bob = tenants["alice"], tenants["bob"]
    answer = await upload(alice, adapter_archive(*adapter, 0.0))
    assert answer.status_code == 201, answer.text
    info = answer.json()
    assert info["id"] == adapter_id_of(*adapter) and (info["rank"], info["name"]) == (4, "warm")
    assert info["target_modules"] == ["q_proj", "v_proj"]
    assert (await upload(alice, adapter_archive(*adapter, 5.0), "again")).json() == info  # same files, same id
    assert [a["id"] for a in (await alice.get("/v1/adapters")).json()] == [info["id"]]
    assert read_uploaded_adapter(file_store, "alice", info["id"]) == adapter  # what the manager reads

    assert (await bob.get("/v1/adapters")).json() == []
    nobodys = f"adapter-{'0' * 32}"
    missing, others = await alice.delete(f"/v1/adapters/{nobodys}"), await bob.delete(f"/v1/adapters/{info['id']}")
    assert others.status_code == missing.status_code == 404
    assert others.json()["error"].replace(info["id"], "X") == missing.json()["error"].replace(nobodys, "X")
    assert read_uploaded_adapter(file_store, "bob", info["id"]) is None

    deleted = await alice.delete(f"/v1/adapters/{info['id']}")
    assert deleted.status_code == 200 and deleted.json() == {"id": info["id"], "deleted": True}
    assert (await alice.get("/v1/adapters")).json() == []
    assert (await alice.delete(f"/v1/adapters/{info['id']}")).status_code == 404


async def test_a_hostile_or_wrong_upload_gets_a_400_naming_the_problem(tenants, adapter):
    alice = tenants["alice"]
    config, weights = adapter
    wide = json.loads(config) | {"r": 64}
    cases = [
        (tar_gz((member(CONFIG_FILE, tarfile.SYMTYPE, "/etc/passwd"), b""), (member(WEIGHTS_FILE), weights)),
         "is a link (to '/etc/passwd')"),
        (tar_gz((member(f"../{CONFIG_FILE}"), config), (member(WEIGHTS_FILE), weights)),
         "leaves the archive's folder"),
        (tar_gz((member(CONFIG_FILE), b" " * (2 << 20)), (member(WEIGHTS_FILE), weights)),
         "adapter_config.json is larger than 1 MiB"),
        (b"\x1f\x8b garbage, not an archive", "the body is not a .tar.gz archive"),
        (adapter_archive(json.dumps(wide).encode(), weights, 0.0), "r is 64, and this stack serves LoRA ranks 1..32"),
        (adapter_archive(config, b"\x80\x04 a pickle, never loaded", 0.0), "is not a safetensors file"),
        (adapter_archive(config, b"", 0.0), "is not a safetensors file"),
        # issue 48: an initialization that would rewrite the shared base in the trainer (H2, H3),
        # out-of-range or unsupported settings (L2), and a PAX header tarfile reads in quadratic time (H1)
        (adapter_archive(json.dumps(json.loads(config) | {"init_lora_weights": "pissa"}).encode(), weights, 0.0),
         "init_lora_weights is 'pissa'"),
        (adapter_archive(json.dumps(json.loads(config) | {"init_lora_weights": "pissa_niter_1000000000"}).encode(),
                         weights, 0.0), "init_lora_weights is 'pissa_niter_1000000000'"),
        (adapter_archive(json.dumps(json.loads(config) | {"lora_alpha": 1e308}).encode(), weights, 0.0),
         "lora_alpha is 1e+308"),
        (adapter_archive(json.dumps(json.loads(config) | {"exclude_modules": ".*"}).encode(), weights, 0.0),
         "exclude_modules is set"),
        (pax_bomb(), "PAX extended header of 160000 bytes"),
    ]
    for body, says in cases:
        answer = await upload(alice, body)
        assert answer.status_code == 400 and says in answer.json()["error"], (says, answer.text)
    assert (await alice.get("/v1/adapters")).json() == []  # nothing half-stored


async def test_an_oversized_body_is_refused_before_it_is_read(tenants, adapter, monkeypatch):
    monkeypatch.setattr(gateway_adapters, "MAX_BODY_BYTES", 4096)
    answer = await upload(tenants["alice"], adapter_archive(*adapter, 0.0))  # ~28 KiB
    assert answer.status_code == 413 and "the upload is larger than" in answer.json()["error"]


async def test_a_tenant_holds_at_most_its_adapter_quota_and_others_are_not_held_back(tenants, adapter, monkeypatch):
    monkeypatch.setattr(gateway_adapters, "MAX_ADAPTERS_PER_TENANT", 2)
    alice, bob = tenants["alice"], tenants["bob"]
    config, weights = adapter

    def variant(alpha: int) -> bytes:  # another adapter: the same weights under another alpha
        return adapter_archive(json.dumps(json.loads(config) | {"lora_alpha": alpha}).encode(), weights, 0.0)

    kept = [(await upload(alice, variant(alpha))).json()["id"] for alpha in (8, 16)]
    refused = await upload(alice, variant(32))
    assert refused.status_code == 429 and "you already have 2 adapters" in refused.json()["error"]
    assert (await upload(alice, variant(8))).status_code == 201  # the same adapter again: no new one
    assert (await upload(bob, variant(32))).status_code == 201  # another tenant's quota is its own
    await alice.delete(f"/v1/adapters/{kept[0]}")
    assert (await upload(alice, variant(32))).status_code == 201


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_the_sdk_uploads_a_local_adapter_directory_a_job_starts_from(bus, file_store, tmp_path, adapter):
    """``init_from`` naming a local PEFT directory (relative to the job file) is uploaded by the
    SDK and replaced by the adapter's id; a job's other init_from forms are left alone."""
    config = load_config(overrides={"home": str(tmp_path / "home")}, env={})
    _, token = await add_tenant(bus, "alice")
    folder = tmp_path / "jobs" / "warm"
    folder.mkdir(parents=True)
    (folder / CONFIG_FILE).write_bytes(adapter[0])
    (folder / WEIGHTS_FILE).write_bytes(adapter[1])
    (folder / "README.md").write_text("# model card")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(Gateway(bus, file_store, config, StackMetrics())),
                                           host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.05)

        def submit_side() -> tuple[dict, dict, list]:
            with Client(f"http://127.0.0.1:{port}", token) as client:
                job = with_absolute_paths({"task": "gsm8k", "init_from": "./warm",
                                           "then": {"task": "gsm8k", "init_from": "JOB@latest"}}, tmp_path / "jobs")
                uploaded = client.with_uploaded_data(job)
                again = client.with_uploaded_data({"init_from": str(folder)})
                return uploaded, again, client.adapters()

        uploaded, again, listed = await asyncio.to_thread(submit_side)
    finally:
        server.should_exit = True
        await serving
    assert uploaded["init_from"] == again["init_from"] == adapter_id_of(*adapter)
    assert uploaded["then"]["init_from"] == "JOB@latest"
    assert [a.id for a in listed] == [adapter_id_of(*adapter)] and listed[0].name == "warm"
