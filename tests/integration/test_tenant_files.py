"""Tenants' data files (issue 23): a job names its data by uploaded file id, never by a path on
the server, so a tenant cannot read another's data (or any file of the server) through its own
reward function, and no error tells whether a server path exists.

The gateway's ASGI app runs against a real nats-server with the manager's submit handler; the
SDK test serves the same app over a real socket (uvicorn, in this event loop) and drives the
synchronous SDK from a thread.
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import httpx
import msgspec
import pytest
import uvicorn

from marlaas.platform import subjects
from marlaas.platform.bus import JOBS_BUCKET
from marlaas.platform.config import load_config
from marlaas.platform.events import JOB_RECORD, RewardItem, RewardRequest
from marlaas.platform.files import DataFiles, FileMissing, file_id_of, put_file
from marlaas.platform.tenants import add_tenant
from marlaas.sdk import Client
from marlaas.tasks import get_task
from services.env.rewards import RewardBook
from services.gateway.app import create_app
from services.gateway.context import Gateway
from services.gateway.metrics import StackMetrics
from services.manager.service import Manager, api_responder

pytestmark = pytest.mark.timeout(180)
JSONL = {"Content-Type": "application/jsonl"}
PRIVATE = "".join(json.dumps({"question": f"Alice's secret {i}: what is {i} plus {i}?", "answer": f"#### {2 * i}"})
                  + "\n" for i in range(1, 6)).encode()
GSM8K = {"task": "gsm8k", "steps": 2, "grpo": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 16}}


@pytest.fixture
def config(tmp_path):
    return load_config(overrides={"home": str(tmp_path / "home"), "gateway.max_file_bytes": 4096,
                                      "gateway.max_files": 3}, env={})


@pytest.fixture
async def app(bus, file_store, config):
    """The gateway app, with the manager answering submissions."""
    manager = await asyncio.to_thread(Manager, bus, file_store, config)
    await bus.serve(subjects.API_SUBMIT, "manager", api_responder(manager.submissions.submit))
    return create_app(Gateway(bus, file_store, config, StackMetrics()))


@pytest.fixture
async def tenants(bus, app):
    """HTTP clients of the gateway app holding alice's and bob's tokens."""
    clients = {}
    for name in ("alice", "bob"):
        _, token = await add_tenant(bus, name)
        clients[name] = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway",
                                          headers={"Authorization": f"Bearer {token}"})
    yield clients
    for client in clients.values():
        await client.aclose()


async def upload(client: httpx.AsyncClient, data: bytes, name: str = "data.jsonl") -> httpx.Response:
    return await client.post("/v1/files", params={"name": name}, content=data, headers=JSONL)


async def submit(client: httpx.AsyncClient, **fields) -> httpx.Response:
    return await client.post("/v1/jobs", json={**GSM8K, **fields})


async def test_another_tenants_file_cannot_be_named_by_server_path_or_by_id(tenants, bus, file_store, tmp_path):
    alice, bob = tenants["alice"], tenants["bob"]
    own = await upload(alice, PRIVATE, "private.jsonl")
    assert own.status_code == 201, own.text
    alice_file = own.json()["id"]
    private_path = file_store.path(f"files/alice/{alice_file}")  # where the server keeps it
    (tmp_path / "alice-private.jsonl").write_bytes(PRIVATE)

    refusals = {}
    for path in (str(private_path), str(tmp_path / "alice-private.jsonl"), "/etc/passwd",
                 str(tmp_path / "no-such-file.jsonl"), "relative/data.jsonl"):
        for field in ("dataset", "eval_dataset"):
            answer = await submit(bob, **{field: path}, eval_every=1)
            assert answer.status_code == 400, answer.text
            refusals[path, field] = answer.json()["error"]
    corpus = await bob.post("/v1/jobs", json={"task": "search-qa", "steps": 2, "dataset": "file-x",
                                              "corpus": str(private_path)})
    assert corpus.status_code == 400 and corpus.json()["error"].startswith("field 'corpus': ")
    # the same words whether the path exists or not, is a file or not: nothing about the server leaks
    for (path, field), message in refusals.items():
        assert message == (f"field '{field}': {path!r} is not an uploaded file; a job names its data by file id: "
                           "upload the JSONL with POST /v1/files (it answers {\"id\": \"file-...\"}) and set "
                           f"{field} = \"file-...\", or let `marlaas submit` / the SDK upload a local file for you")

    stolen = await submit(bob, dataset=alice_file)  # alice's id means nothing to bob
    made_up = await submit(bob, dataset="file-" + "0" * 32)
    assert stolen.status_code == made_up.status_code == 400
    assert stolen.json()["error"] == made_up.json()["error"].replace("0" * 32, alice_file[5:])
    assert stolen.json()["error"].startswith(f"no file {alice_file!r} among your uploaded files: GET /v1/files")
    assert "secret" not in stolen.text
    assert await bus.kv_keys(JOBS_BUCKET) == []  # nothing was created

    mine = await submit(alice, dataset=alice_file, eval_every=1, eval_dataset=alice_file)
    assert mine.status_code == 201, mine.text
    record = JOB_RECORD.decode((await bus.kv_get(JOBS_BUCKET, mine.json()["id"])).value)
    assert record.spec.dataset == record.spec.eval_dataset == alice_file


async def test_an_upload_must_be_jsonl_objects_within_the_size_limit(tenants, file_store):
    alice = tenants["alice"]
    for data, status, says in [
        (b'{"question": "ok", "answer": "#### 1"}\n\n{"question": "broken"\n', 400,
         "line 3 is not JSON ("),
        (b'{"a": 1}\n[1, 2]\n', 400, "line 2 is a JSON list, not an object: write one JSON object per line"),
        (b'"just a string"', 400, "line 1 is a JSON str, not an object"),
        (b'{"a": "\xff"}\n', 400, "the file is not UTF-8 text (byte 7): save it as UTF-8 JSONL"),
        (b"", 400, "the file is empty (no JSON object on any line)"),
        (b"\n  \n\n", 400, "the file is empty (no JSON object on any line)"),
        (b'{"a": 1}\n' * 1000, 413, "the file is larger than 4096 bytes (gateway.max_file_bytes)"),
    ]:
        answer = await upload(alice, data)
        assert answer.status_code == status, answer.text
        assert answer.json()["error"].startswith(says), answer.text
    assert file_store.list("files/") == []  # none of it stored
    async def lines():  # streamed, with no Content-Length: counted as it arrives
        for _ in range(1000):
            yield b'{"a": 1}\n'

    streamed = await alice.post("/v1/files", content=lines(), headers=JSONL)
    assert streamed.status_code == 413 and "gateway.max_file_bytes" in streamed.json()["error"]

    good = await upload(alice, PRIVATE, "math.jsonl")
    assert good.status_code == 201
    assert good.json() == {"id": file_id_of(PRIVATE), "size": len(PRIVATE), "sha256": good.json()["sha256"],
                           "records": 5, "name": "math.jsonl", "created_at": good.json()["created_at"]}
    again = await upload(alice, PRIVATE, "renamed.jsonl")  # the same bytes are the same file
    assert again.status_code == 201 and again.json() == good.json()


async def test_tenants_list_and_delete_only_their_own_files(tenants):
    alice, bob = tenants["alice"], tenants["bob"]
    alice_file = (await upload(alice, PRIVATE, "alice.jsonl")).json()["id"]
    bob_file = (await upload(bob, b'{"question": "bob", "answer": "#### 0"}\n', "bob.jsonl")).json()["id"]
    shared = (await upload(bob, PRIVATE, "same-bytes.jsonl")).json()  # the same content, bob's own copy
    assert shared["id"] == alice_file

    assert [f["name"] for f in (await alice.get("/v1/files")).json()] == ["alice.jsonl"]
    assert [f["name"] for f in (await bob.get("/v1/files")).json()] == ["bob.jsonl", "same-bytes.jsonl"]

    assert (await bob.delete(f"/v1/files/{alice_file}")).status_code == 200  # bob's copy, not alice's
    assert [f["id"] for f in (await alice.get("/v1/files")).json()] == [alice_file]
    others = await alice.delete(f"/v1/files/{bob_file}")
    missing = await alice.delete("/v1/files/file-" + "0" * 32)
    assert others.status_code == missing.status_code == 404
    assert others.json()["error"] == f"no file {bob_file!r}: GET /v1/files lists your files"
    assert missing.json()["error"] == f"no file {'file-' + '0' * 32!r}: GET /v1/files lists your files"
    assert [f["id"] for f in (await bob.get("/v1/files")).json()] == [bob_file]

    assert (await alice.delete(f"/v1/files/{alice_file}")).json() == {"id": alice_file, "deleted": True}
    assert (await alice.get("/v1/files")).json() == []
    assert (await submit(alice, dataset=alice_file)).json()["error"].startswith(f"no file {alice_file!r}")
    assert (await alice.get("/v1/files", headers={"Authorization": "Bearer nope"})).status_code == 401


async def test_the_sdk_uploads_a_job_files_local_data_once_and_submits_its_id(app, bus, tmp_path):
    _, token = await add_tenant(bus, "carol")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="off"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "math.jsonl").write_bytes(PRIVATE)
    job_file = tmp_path / "job.toml"
    job_file.write_text('task = "gsm8k"\nsteps = 2\ndataset = "data/math.jsonl"\neval_every = 1\n'
                        'eval_dataset = "data/math.jsonl"\n[grpo]\nprompts_per_step = 2\ngroup_size = 2\n'
                        "max_new_tokens = 16\n")

    def use_the_sdk():
        with Client(f"http://127.0.0.1:{sock.getsockname()[1]}", token) as client:
            first, second = client.submit(job_file), client.submit(job_file)
            return first, second, client.files()

    try:
        while not server.started:
            await asyncio.sleep(0.05)
        first, second, files = await asyncio.to_thread(use_the_sdk)
    finally:
        server.should_exit = True
        await serving
    (uploaded,) = files  # one upload for both fields and both submissions
    assert uploaded.id == file_id_of(PRIVATE) and uploaded.name == "math.jsonl" and uploaded.records == 5
    for job in (first, second):
        spec = JOB_RECORD.decode((await bus.kv_get(JOBS_BUCKET, job)).value).spec
        assert spec.tenant == "carol" and spec.dataset == spec.eval_dataset == uploaded.id


def test_the_cli_leaves_a_file_id_alone_and_makes_local_paths_absolute(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from marlaas.cli.job_commands import submission_from_args

    monkeypatch.chdir(tmp_path)
    args = SimpleNamespace(file=None, name=None, task="search-qa", steps=2, seed=None, dataset="file-" + "a" * 32,
                           corpus="passages.jsonl", reward=None, tool=None, set=[])
    job = submission_from_args(args)
    assert job["dataset"] == "file-" + "a" * 32 and job["corpus"] == str(tmp_path / "passages.jsonl")


async def test_the_services_read_an_uploaded_file_from_the_store_for_its_tenant_only(file_store, tmp_path):
    record = put_file(file_store, "alice", PRIVATE, "math.jsonl")
    files = DataFiles(file_store, tmp_path / "cache", get_task)
    local = files.local_path("alice", record.id)
    assert local == str(tmp_path / "cache" / f"{record.sha256}.jsonl")
    assert Path(local).read_bytes() == PRIVATE
    assert files.local_path("alice", "/platform/path.jsonl") == "/platform/path.jsonl"  # the platform's own
    for tenant, ref in (("bob", record.id), ("alice", "file-../../alice/" + record.id), ("alice", "file-x")):
        with pytest.raises(FileMissing, match=f"^no file {ref!r} among your uploaded files"):
            files.local_path(tenant, ref)

    task = files.task("alice", "gsm8k", record.id)
    assert len(task.items) == 5
    book = RewardBook(files)  # env: a reward request names the job's tenant and its file id
    item = RewardItem(problem=task.problems(1, 0)[0], completion="#### 0")
    scored = book.score(RewardRequest(job="alice.j", task="gsm8k", items=[item], dataset=record.id, tenant="alice"))
    assert not scored.error and len(scored.rewards) == 1
    refused = book.score(RewardRequest(job="bob.j", task="gsm8k", items=[item], dataset=record.id, tenant="bob"))
    assert refused.error.startswith("task 'gsm8k' could not score job bob.j: no file") and not refused.rewards

    bad = put_file(file_store, "alice", b'{"question": "no answer here"}\n')
    with pytest.raises(Exception) as caught:
        files.task("alice", "gsm8k", bad.id)
    assert bad.id in str(caught.value) and str(tmp_path) not in str(caught.value)  # the id, never the cache path
    msgspec.json.encode(record)  # a FileInfo is what the gateway answers


async def test_a_tenant_keeps_at_most_max_files_and_others_are_not_held_back(tenants):
    alice, bob = tenants["alice"], tenants["bob"]
    kept = [(await upload(alice, f'{{"i": {i}}}\n'.encode())).json()["id"] for i in range(3)]
    refused = await upload(alice, b'{"i": 3}\n')
    assert refused.status_code == 429 and "gateway.max_files" in refused.json()["error"]
    assert [f["id"] for f in (await alice.get("/v1/files")).json()] == kept  # nothing half-created
    assert (await upload(alice, b'{"i": 0}\n')).status_code == 201  # the same bytes again: no new file
    assert (await upload(bob, b'{"i": 3}\n')).status_code == 201  # another tenant's quota is its own
    await alice.delete(f"/v1/files/{kept[0]}")
    assert (await upload(alice, b'{"i": 3}\n')).status_code == 201


CORPUS = "".join(json.dumps({"id": f"p{i}", "title": f"Alice's page {i}", "text": text}) + "\n"
                 for i, text in enumerate(["The zebra sleeps standing up.", "Tea grows on hills.",
                                           "Alice keeps her notes private."])).encode()


async def test_an_uploaded_corpus_reaches_env_by_file_id_and_tenant_not_by_rollouts_path(file_store, tmp_path):
    """In compose, rollout and env are different containers: the search tool's context names the
    upload (id and tenant), and env fetches its own copy, for that tenant only."""
    from services.env.tools import search_tool
    from services.env.tools.search import CorpusIndexes
    from services.rollout.service import tool_context

    corpus = put_file(file_store, "alice", CORPUS, "pages.jsonl")
    questions = put_file(file_store, "alice", b'{"question": "What sleeps standing?", "answer": "zebra"}\n')
    rollout_files = DataFiles(file_store, tmp_path / "rollout-cache", get_task)
    spec = msgspec.structs.replace(
        JOB_RECORD.decode(msgspec.json.encode({"spec": {"id": "alice.qa", "tenant": "alice", "name": "qa",
                                                        "task": "search-qa", "steps": 1}})).spec,
        dataset=questions.id, corpus=corpus.id)
    task = rollout_files.task("alice", "search-qa", spec.dataset, spec.corpus)
    context = tool_context(spec, task)
    assert context == {"corpus": corpus.id, "tenant": "alice"}  # not rollout's cached path

    env_files = DataFiles(file_store, tmp_path / "env-cache", get_task)  # env's own disk
    search = search_tool(None, 3, CorpusIndexes(tmp_path / "env-index"), env_files)
    found = await search.call('{"query": "zebra standing"}', context)
    assert "zebra" in found.lower() and (tmp_path / "env-cache").is_dir()
    with pytest.raises(Exception, match="no file"):  # another tenant naming alice's upload
        await search.call('{"query": "zebra"}', {"corpus": corpus.id, "tenant": "bob"})
