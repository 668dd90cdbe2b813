"""The trainer's half of the Tinker API: a model's training requests, one at a time, in order.

The gateway puts each request on the work queue ``marlaas.tinker.train.<tenant>`` (deduplicated
by its id, ``<model>:<seq_id>``) before it answers the client, and the client sends a model's
next request only once the previous one was taken. Any trainer replica may take it; it is done
in ``seq_id`` order all the same: the model's record (``TinkerLive``) says the last request done
and which replica holds gradients not yet stepped, and a request that is early, or at the wrong
replica, is put back until its turn (at most ``ORDER_WAIT_S`` after its model's last progress).
A request's outcome is its future in the ``tinker_futures`` bucket: the body the SDK expects, or
``{error, category}``. Tenants take turns at the queue (``marlaas.platform.tenant_turns``): one
tenant's backlog never makes another's request wait for all of it.

A model is a LoRA in the same peft model as the jobs' (``PolicyTrainer``), under the name
``tinker/<model id>``: ``forward_backward`` adds its gradients (kept until ``optim_step``, and the
model is pinned in memory meanwhile), ``optim_step`` takes an AdamW step with the client's
hyperparameters and writes the adapter and optimizer to the store (``TinkerLive``), so a model
pushed out of memory, or a trainer restarted, goes on from its last step. Gradients accumulated
since that step are lost with a restart: ``optim_step`` cannot tell, and steps on what is left.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

import msgspec
import numpy as np
import structlog
import torch
from tinker.proto import tinker_public_pb2 as pb

from marlaas.platform import subjects
from marlaas.platform import tinker_records as wire
from marlaas.platform.adapters import CONFIG_FILE, WEIGHTS_FILE, init_adapter, read_adapter
from marlaas.platform.bus import Bus, Delivery, PoisonMessage
from marlaas.platform.events import GrpoSettings, LoraSettings
from marlaas.platform.store import ObjectStore
from marlaas.platform.telemetry import span
from marlaas.platform.tenant_turns import TenantQueues
from services.trainer.grpo import micro_batches
from services.trainer.policy import NonFiniteUpdate, PolicyTrainer
from services.trainer.tinker_losses import LossInputError, check_inputs, check_loss, datum_loss

log = structlog.get_logger("trainer.tinker")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
LORA_ALPHA = 32  # Tinker's
TRAIN_DURABLE = "trainer-tinker"  # the consumers' names: trainer-tinker-<tenant>
ORDER_WAIT_S = 30.0  # a request waits this long for its turn (a lost earlier one, a dead replica's gradients)
ADAM_DEFAULTS = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
                 "grad_clip_norm": 0.0}  # the SDK's AdamParams


@dataclass
class Done:
    """A request's outcome: the future's body, the model's new state (None: unchanged), and the
    records to write for it (kind, id, record)."""

    media: str
    body: bytes
    live: wire.TinkerLive | None = None
    records: list[tuple[str, str, msgspec.Struct]] = field(default_factory=list)


class UserError(Exception):
    """A request the client got wrong: its future fails with category "user" and this message."""


def job_name(model_id: str) -> str:
    """The model's name among the trainer's hot adapters (never a job id: those have no '/')."""
    return f"tinker/{model_id}"


def lora_settings(model: wire.TinkerModel) -> LoraSettings:
    targets = (ATTENTION if model.train_attn else ()) + (MLP if model.train_mlp else ())
    if not targets:
        raise UserError("lora_config trains nothing: set train_attn or train_mlp (train_unembed alone is not "
                        "served: vLLM serves no LoRA on the output embedding)")
    return LoraSettings(rank=model.rank, alpha=LORA_ALPHA, target_modules=targets)


def datum_tensors(datum: pb.Datum) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A datum's input tokens and loss inputs, from the protobuf."""
    pieces = []
    for chunk in datum.model_input:
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise UserError(f"model_input chunks of type {chunk.WhichOneof('chunk')!r} are not served: this is a "
                            "text model (send EncodedTextChunk tokens)")
        pieces.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    inputs = {}
    for name, tensor in datum.loss_fn_inputs.items():
        if tensor.HasField("sparse_csr"):
            raise UserError(f"loss_fn_inputs[{name!r}] is sparse: send dense tensors")
        dtype = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64}.get(tensor.dtype)
        if dtype is None:
            raise UserError(f"loss_fn_inputs[{name!r}] has dtype {tensor.dtype}: send float32 or int64")
        inputs[name] = torch.from_numpy(np.frombuffer(tensor.dense, dtype=dtype).copy())
    return torch.from_numpy(tokens.astype(np.int64)), inputs


def batched(values: list[np.ndarray], dtype: int) -> pb.BatchedTensor:
    """Per-datum 1-D arrays as one protobuf BatchedTensor (byte offsets, n + 1 of them)."""
    offsets = np.cumsum([0] + [v.nbytes for v in values]).astype(np.int64)
    return pb.BatchedTensor(data=b"".join(v.tobytes() for v in values), offsets=offsets.tobytes(), dtype=dtype)


class TinkerTrainer:
    """Runs Tinker models' training requests on the trainer's policy."""

    def __init__(self, bus: Bus, store: ObjectStore, policy: PolicyTrainer, base_model_dir, max_tokens: int) -> None:
        self.bus, self.store, self.policy, self.base_model_dir = bus, store, policy, base_model_dir
        self.max_tokens = max_tokens  # a datum's longest input (rollout.max_model_len)
        self.vocab = policy.base.get_input_embeddings().num_embeddings
        self.replica = uuid.uuid4().hex[:12]  # which trainer process holds a model's gradients

    async def handle(self, delivery: Delivery) -> None:
        try:
            request = msgspec.json.decode(delivery.data, type=wire.TrainRequest)
            model = await wire.read(self.bus, "model", request.model_id, wire.TinkerModel, request.tenant)
        except msgspec.MsgspecError as exc:  # never redelivered for ever: the gateway wrote something unreadable
            raise PoisonMessage(f"unreadable Tinker request or model record: {exc}") from exc
        if await wire.read(self.bus, "future", request.request_id, wire.TinkerFuture) is not None:
            return  # done before a crash, or a duplicate: never train twice on one request
        if model is None or model.tenant != request.tenant:
            return await wire.fail(self.bus, self.store, request.request_id, request.tenant,
                                   f"no model {request.model_id!r}")
        live = await wire.read(self.bus, "live", request.model_id, wire.TinkerLive)
        if live is not None and request.kind not in ("create_model", "load_weights") or \
                live is not None and request.kind == "load_weights" and request.seq_id:
            if 0 < request.seq_id <= live.last_seq:  # never do a request twice, nor one the model has passed
                return await wire.fail(self.bus, self.store, request.request_id, request.tenant,
                                       f"seq_id {request.seq_id} comes after the model's request {live.last_seq}: "
                                       "requests are done in seq_id order, each once")
            wait = self.wait_reason(request, live)
            # counted from the model's last progress too: behind other tenants' turns, a request may
            # wait in the queue longer than ORDER_WAIT_S while its model moves on
            if wait and time.time() - max(request.submitted_at, live.done_at) < ORDER_WAIT_S:
                return await delivery.nak(0.05)
            if wait:
                log.warning("tinker request done out of turn", model=model.id, seq_id=request.seq_id, why=wait)
        if request.kind == "refused":  # the gateway refused it: only its place in the order is taken
            return await self._advance(request, live, None)
        try:
            async with span(self.bus, "trainer", f"tinker_{request.kind}", wire.span_job(request.tenant), 0,
                            model=request.model_id, seq_id=request.seq_id):
                async with delivery.keep_alive():
                    checkpoint = await self._checkpoint(request, model) if request.kind == "load_weights" else None
                    done = await asyncio.to_thread(self._run, request, model, live, checkpoint)
        except (UserError, LossInputError, NonFiniteUpdate) as exc:
            await self._advance(request, live, None)
            return await wire.fail(self.bus, self.store, request.request_id, request.tenant, str(exc))
        except Exception as exc:
            log.exception("tinker request failed", model=request.model_id, kind=request.kind)
            await self._advance(request, live, None)
            return await wire.fail(self.bus, self.store, request.request_id, request.tenant,
                                   f"the trainer failed on {request.kind}: {exc!r}", category="server")
        for kind, ident, record in done.records:  # written here, never from the thread: see _run
            await wire.write(self.bus, kind, ident, record)
            if kind == "checkpoint":
                await wire.index(self.bus, model.tenant, model.id, ident)
        await self._advance(request, live, done.live)
        await wire.finish(self.bus, self.store, wire.TinkerFuture(
            request_id=request.request_id, tenant=request.tenant, media=done.media, body=done.body))

    def wait_reason(self, request: wire.TrainRequest, live: wire.TinkerLive) -> str:
        """Why ``request`` must wait ("" = it need not): an earlier request of the model is not done
        yet, or another trainer replica holds gradients of the model that this one cannot see."""
        if request.seq_id > live.last_seq + 1:
            return f"request {live.last_seq + 1} is not done yet"
        if live.holder and live.holder != self.replica:
            return f"replica {live.holder} holds the model's gradients"
        return ""

    async def _advance(self, request: wire.TrainRequest, old: wire.TinkerLive | None,
                       new: wire.TinkerLive | None) -> None:
        """Record the model's state after ``request``: its new weights (if any; the old ones are
        deleted), the last request done, and whether this replica now holds gradients of it."""
        live = new or old
        if live is None:
            return
        job = job_name(request.model_id)
        holder = self.replica if job in self.policy.pinned else ""
        live = msgspec.structs.replace(live, last_seq=max(live.last_seq, request.seq_id), holder=holder,
                                       done_at=time.time())
        await wire.write(self.bus, "live", request.model_id, live)
        if new is not None and old is not None and old.adapter is not None and old.adapter != new.adapter:
            await asyncio.to_thread(self.store.delete_prefix,
                                    self.store.key_of(old.adapter.uri).rsplit("/", 1)[0] + "/")

    # --- in a thread, with the policy's lock -----------------------------------------------------

    def _run(self, request: wire.TrainRequest, model: wire.TinkerModel, live: wire.TinkerLive | None,
             checkpoint: wire.TinkerCheckpoint | None) -> Done:
        """Do the request. It holds the policy's lock, which the event loop's thread may wait for (an
        eviction), so it never waits on the loop: what it reads comes in, what it writes goes out."""
        with self.policy.lock:
            if request.kind == "create_model":
                return Done("json", *self._create(model))
            if request.kind == "load_weights":
                return Done("json", *self._load_checkpoint(model, checkpoint, json.loads(request.body), live))
            if live is None:
                raise UserError(f"model {model.id!r} is still being created: wait for create_model's future")
            self._make_hot(model, live)
            body = json.loads(request.body) if request.kind != "forward_backward" else None
            match request.kind:
                case "forward_backward":
                    return Done("proto", self._forward_backward(model, request.body))
                case "optim_step":
                    return Done("json", *self._optim_step(model, live, body))
                case "save_weights" | "save_weights_for_sampler":
                    return self._save(model, request.kind, body)
                case "unload_model":
                    self.policy.evict(job_name(model.id))
                    return Done("json", b'{"type": "unload_model"}')
        raise UserError(f"unknown request kind {request.kind!r}")

    def _put(self, prefix: str, config_json: bytes, weights: bytes, optimizer: bytes | None = None):
        """PEFT's two files (and the optimizer state) under a fresh ``prefix``: (adapter, optimizer) Blobs."""
        self.store.put_bytes(f"{prefix}/{CONFIG_FILE}", config_json)
        adapter = self.store.put_bytes(f"{prefix}/{WEIGHTS_FILE}", weights)
        state = self.store.put_bytes(f"{prefix}/adamw.pt", optimizer) if optimizer is not None else None
        return adapter, state

    def _write_live(self, model: wire.TinkerModel, steps: int) -> wire.TinkerLive:
        """The model's state after ``steps`` steps, under a fresh prefix (the caller deletes the last one)."""
        adapter, state = self._put(wire.model_prefix(model, "live", f"{steps:06d}-{uuid.uuid4().hex[:12]}"),
                                   *self.policy.export(job_name(model.id)))
        return wire.TinkerLive(model_id=model.id, steps=steps, adapter=adapter, optimizer=state)

    def _create(self, model: wire.TinkerModel) -> tuple[bytes, wire.TinkerLive]:
        config_json, weights = init_adapter(self.base_model_dir, lora_settings(model), model.seed or 0)
        self.policy.load(job_name(model.id), 0, config_json, weights, None, GrpoSettings())
        live = self._write_live(model, 0)
        return msgspec.json.encode({"model_id": model.id, "type": "create_model"}), live

    def _load_checkpoint(self, model: wire.TinkerModel, checkpoint: wire.TinkerCheckpoint, body: dict,
                         live: wire.TinkerLive | None) -> tuple[bytes, wire.TinkerLive]:
        config_json, weights = read_adapter(self.store, checkpoint.adapter)
        optimizer = None
        if body.get("optimizer"):
            if checkpoint.optimizer is None:
                raise UserError(f"{checkpoint.path} holds sampler weights only (no optimizer state): load it "
                                "without the optimizer, or save with save_state")
            optimizer = self.store.fetch(checkpoint.optimizer)
        steps = live.steps + 1 if live is not None else 0  # new weights: a replica holding the old ones reloads
        self.policy.load(job_name(model.id), steps, config_json, weights, optimizer, GrpoSettings())
        return (msgspec.json.encode({"model_id": model.id, "path": checkpoint.path, "type": "load_weights"}),
                self._write_live(model, steps))

    async def _checkpoint(self, request: wire.TrainRequest, model: wire.TinkerModel) -> wire.TinkerCheckpoint:
        """The checkpoint a load_weights names (the tenant's own)."""
        path = json.loads(request.body).get("path") or model.from_checkpoint
        found = await wire.read(self.bus, "checkpoint", path, wire.TinkerCheckpoint)
        if found is None or found.tenant != model.tenant:
            raise UserError(f"no checkpoint {path!r}: save_state or save_weights_for_sampler write one")
        return found

    def _make_hot(self, model: wire.TinkerModel, live: wire.TinkerLive) -> None:
        """Load the model from its last step unless it is in memory."""
        job = job_name(model.id)
        if self.policy.hot_version(job) == live.steps:
            return  # another replica's step (or load) since would have moved live.steps
        config_json, weights = read_adapter(self.store, live.adapter)
        optimizer = self.store.fetch(live.optimizer) if live.optimizer else None
        self.policy.load(job, live.steps, config_json, weights, optimizer, GrpoSettings())
        log.info("tinker model loaded from its last step", model=model.id, steps=live.steps)

    def _forward_backward(self, model: wire.TinkerModel, body: bytes) -> bytes:
        """The request's loss and its gradients, added to the model's; a request that fails adds nothing."""
        request = pb.ForwardBackwardRequest()
        request.ParseFromString(body)
        check_loss(request.loss_fn)
        config = {k: v.number for k, v in request.loss_fn_config_v2.items() if v.WhichOneof("value") == "number"}
        config = config or dict(request.loss_fn_config)
        data = [self._datum(i, datum, request.loss_fn) for i, datum in enumerate(request.data)]
        job = job_name(model.id)
        total = 0.0
        saved = self.policy.gradients(job)
        per_datum: list[dict[str, np.ndarray]] = [{} for _ in data]
        lengths = [tokens_T.numel() for tokens_T, _ in data]
        try:
            with torch.set_grad_enabled(not request.forward_only):
                for batch in micro_batches(lengths, self.policy.micro_batch_tokens):
                    scored = self.policy.target_logprobs(job, [(data[i][0], data[i][1]["target_tokens"])
                                                               for i in batch])
                    batch_loss = 0.0
                    for i, logprobs_T in zip(batch, scored, strict=True):
                        loss, out = datum_loss(request.loss_fn, logprobs_T, data[i][1], config)
                        if not torch.isfinite(loss):
                            raise NonFiniteUpdate(f"datum {i}: the loss is {loss.item()}")
                        batch_loss = batch_loss + loss
                        per_datum[i] = {name: values.float().cpu().numpy() for name, values in out.items()}
                    if not request.forward_only and isinstance(batch_loss, torch.Tensor) and batch_loss.requires_grad:
                        batch_loss.backward()
                    total += float(batch_loss)
        except BaseException:
            self.policy.restore_gradients(job, saved)
            raise
        if not request.forward_only:
            self.policy.pinned.add(job)  # its gradients wait for optim_step
        record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(request.data))
        for name in ("logprobs", "elementwise_loss"):
            record.fields[name].CopyFrom(batched([out[name] for out in per_datum], pb.DTYPE_FLOAT32))
        result = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record])
        result.metrics["loss:sum"] = total
        return result.SerializeToString()

    def _datum(self, i: int, datum: pb.Datum, loss_fn: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Datum ``i``'s tokens and loss inputs, checked before any of the request's work is done."""
        tokens_T, inputs = datum_tensors(datum)
        targets_T = inputs.get("target_tokens")
        if targets_T is None or targets_T.numel() != tokens_T.numel():
            raise UserError(f"datum {i}: loss_fn_inputs['target_tokens'] must hold one token per input "
                            f"token ({tokens_T.numel()}); it holds "
                            f"{'none' if targets_T is None else targets_T.numel()}")
        if not 0 < tokens_T.numel() <= self.max_tokens:
            raise UserError(f"datum {i} has {tokens_T.numel()} tokens: send 1 to {self.max_tokens} "
                            "(rollout.max_model_len)")
        for name, ids in (("model_input", tokens_T), ("target_tokens", targets_T)):
            if ids.min() < 0 or ids.max() >= self.vocab:
                raise UserError(f"datum {i}: {name} holds token ids outside 0..{self.vocab - 1}, the "
                                "base model's vocabulary")
        check_inputs(loss_fn, tokens_T.numel(), inputs)
        return tokens_T, inputs

    def _optim_step(self, model: wire.TinkerModel, live: wire.TinkerLive, body: dict) -> tuple[bytes, wire.TinkerLive]:
        params = body.get("adam_params") or body.get("optim_params") or {}
        if body.get("optimizer_params") is not None or not isinstance(params, dict) \
                or params.get("type", "adamw") != "adamw":
            raise UserError("only AdamW (adam_params) is served")
        values = {name: params.get(name, default) for name, default in ADAM_DEFAULTS.items()}
        bad = [name for name, v in values.items()
               if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0]
        if bad or not values["beta1"] < 1 or not values["beta2"] < 1:
            raise UserError(f"adam_params {bad or ['beta1', 'beta2']} must be finite numbers >= 0 (betas below 1)")
        job = job_name(model.id)
        metrics = self.policy.adam_step(
            job, float(values["learning_rate"]), (float(values["beta1"]), float(values["beta2"])),
            float(values["eps"]), float(values["weight_decay"]), float(values["grad_clip_norm"]))
        self.policy.pinned.discard(job)
        live = self._write_live(model, live.steps + 1)
        return msgspec.json.encode({"metrics": {f"{k}:mean": v for k, v in metrics.items()}}), live

    def _save(self, model: wire.TinkerModel, kind: str, body: dict) -> Done:
        config_json, weights, optimizer = self.policy.export(job_name(model.id))
        name = body.get("path")
        if kind == "save_weights_for_sampler" and name is None:  # ephemeral: a sampler, no checkpoint
            seq = body.get("sampling_session_seq_id")
            adapter, _ = self._put(wire.session_prefix(model.tenant, model.session, "samplers", uuid.uuid4().hex[:12]),
                                   config_json, weights)
            sampler = wire.TinkerSampler(id=f"{model.session}:sample:{seq}", tenant=model.tenant,
                                         base_model=model.base_model, adapter=adapter)
            return Done("json", msgspec.json.encode({"path": None, "sampling_session_id": sampler.id,
                                                     "type": "save_weights_for_sampler"}),
                        records=[("sampler", sampler.id, sampler)])
        segment = "sampler_weights" if kind == "save_weights_for_sampler" else "weights"
        path = f"tinker://{model.id}/{segment}/{name}"
        adapter, state = self._put(wire.model_prefix(model, "checkpoints", uuid.uuid4().hex[:12]), config_json, weights,
                                   optimizer if kind == "save_weights" else None)
        checkpoint = wire.TinkerCheckpoint(path=path, tenant=model.tenant, model_id=model.id,
                                           kind="sampler" if state is None else "state", adapter=adapter,
                                           optimizer=state, rank=model.rank, created_at=time.time())
        return Done("json", msgspec.json.encode({"path": path, "type": kind}),
                    records=[("checkpoint", path, checkpoint)])


async def run_tinker(rt, policy: PolicyTrainer) -> None:
    """Take Tinker training requests until ``rt.stop``, one at a time, tenants in turn: a tenant's
    backlog puts another tenant's next request behind at most one of its own (issue 35, F4). A
    job's trajectory batch, waiting for the policy's lock meanwhile, takes it between two requests."""
    trainer = TinkerTrainer(rt.bus, rt.store, policy, rt.config.base_model_dir, rt.config.rollout.max_model_len)
    queues = TenantQueues(rt.bus, "TINKER", TRAIN_DURABLE, subjects.TINKER_TRAIN,
                          ack_wait_s=rt.config.trainer.ack_wait_s,
                          max_deliver=-1)  # a request waiting for its model's turn is redelivered until it comes
    await queues.retire(TRAIN_DURABLE)
    await queues.run(trainer.handle, rt.stop)
