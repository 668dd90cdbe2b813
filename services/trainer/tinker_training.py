# over 500 lines: one ordered request protocol over one model record; its pure parts (turn, tensors) lead
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
since that step live in the holder's memory only: when the holder goes away (a restart, a crash),
the next request is done elsewhere after ``ORDER_WAIT_S``, the record says from which request the
gradients were lost, and the next ``optim_step`` fails (category "server", never a step on part of
the gradients), naming the ``forward_backward`` requests to send again.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from marlaas.platform.bus import Bus, Delivery, PoisonMessage, StaleRevision
from marlaas.platform.events import GrpoSettings, LoraSettings
from marlaas.platform.store import ObjectStore
from marlaas.platform.telemetry import span
from marlaas.platform.tenant_turns import TenantQueues
from marlaas.platform.usage import UsageCounters, report_usage, tinker_job
from services.trainer.grpo import micro_batches
from services.trainer.policy import NonFiniteUpdate, PolicyTrainer
from services.trainer.tinker_losses import (
    MAX_SPANS,
    LossInputError,
    check_inputs,
    check_loss,
    datum_loss,
    provenance_inputs,
)

log = structlog.get_logger("trainer.tinker")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
LORA_ALPHA = 32  # Tinker's
TRAIN_DURABLE = "trainer-tinker"  # the consumers' names: trainer-tinker-<tenant>
ORDER_WAIT_S = 30.0  # a request waits this long for an earlier one that is not done (the client may never send it)
NOT_MINE_S = 0.5  # a request another live replica must do goes back to the queue for this long
BEAT_S, REPLICA_DEAD_S = 3.0, 15.0  # each replica says it is alive this often; silent this long, it is gone
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
    tokens: int = 0  # target tokens trained on (a forward_backward's; metering)
    samples: int = 0  # datums trained on


class UserError(Exception):
    """A request the client got wrong: its future fails with category "user" and this message."""


class GradientsLost(Exception):
    """An ``optim_step`` whose gradients went with a trainer replica: its future fails with category
    "server"; the client sends the forward_backward requests again, then the step."""


def turn(seq_id: int, submitted_at: float, live: wire.TinkerLive, me: str, alive: set[str],
         now: float) -> tuple[bool, str]:
    """Whether this replica (``me``) does a model's request now, and why out of turn if so. It waits
    while another replica that is ``alive`` is doing one of the model's requests or holds its
    gradients (however long); and for an earlier request not done yet, for ``ORDER_WAIT_S`` after
    the model's last progress (the client may never send it)."""
    if live.working and live.working != me and live.working in alive:
        return False, ""
    if live.holder and live.holder != me and live.holder in alive:
        return False, ""
    if seq_id > live.last_seq + 1:
        if now - max(submitted_at, live.done_at) < ORDER_WAIT_S:
            return False, ""
        return True, f"request {live.last_seq + 1} never came"
    if live.holder and live.holder != me:
        return True, f"replica {live.holder}, which held the model's gradients, is gone"
    return True, ""


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


def spans_of(spans) -> list[tuple[str, str, int, int]]:
    """Protobuf provenance spans as (kind "prompt" | "sampled", sequence_id, offset, length)."""
    found = []
    for entry in spans[:MAX_SPANS + 1]:
        kind = entry.WhichOneof("span")
        run = getattr(entry, kind) if kind else None
        if run is None:
            raise UserError("a provenance span names neither prompt nor sampled tokens")
        found.append(("prompt" if kind == "prompt_tokens" else "sampled", run.sequence_id, run.offset, run.length))
    return found


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
        entry = await self.bus.kv_get(wire.TINKER_BUCKET, wire.key("live", request.model_id))
        live = None if entry is None else msgspec.json.decode(entry.value, type=wire.TinkerLive)
        if live is not None and request.kind not in ("create_model", "load_weights") or \
                live is not None and request.kind == "load_weights" and request.seq_id:
            if 0 < request.seq_id <= live.last_seq:  # never do a request twice, nor one the model has passed
                return await wire.fail(self.bus, self.store, request.request_id, request.tenant,
                                       f"seq_id {request.seq_id} comes after the model's request {live.last_seq}: "
                                       "requests are done in seq_id order, each once")
            alive = {r for r in {live.working, live.holder} - {"", self.replica} if await self.is_alive(r)}
            go, why = turn(request.seq_id, request.submitted_at, live, self.replica, alive, time.time())
            if not go:  # back to the queue; sooner at the replica that can do the model's next request, so
                # that two replicas never pass the model's next two requests to and fro
                return await delivery.nak(0.05 if live.holder in ("", self.replica) else NOT_MINE_S)
            if why:
                log.warning("tinker request done out of turn", model=model.id, seq_id=request.seq_id, why=why)
            # the gradients held here are gone too when the base was reloaded (BaseGuard) since
            lost_here = live.holder == self.replica and job_name(model.id) not in self.policy.pinned
            if why or live.holder and live.holder != self.replica or lost_here:  # a request skipped, or the
                # holder gone: the gradients since the last step may miss some, and the next step fails saying so
                live = msgspec.structs.replace(live, holder="", lost_from=live.lost_from or live.pending_from
                                               or (live.last_seq + 1 if request.seq_id > live.last_seq + 1 else 0))
            try:  # the model is this replica's until the request is recorded: no other takes one meanwhile
                await self.bus.kv_update(wire.TINKER_BUCKET, wire.key("live", request.model_id), msgspec.json.encode(
                    msgspec.structs.replace(live, working=self.replica, done_at=time.time())), entry.revision)
            except StaleRevision:  # another replica took one of the model's requests first
                return await delivery.nak(0.05)
        if request.kind == "refused":  # the gateway refused it: only its place in the order is taken
            return await self._advance(request, live, None)
        started, done = time.monotonic(), None
        try:
            done = await self._do(request, model, live, delivery)
        finally:  # metered whether it succeeded or not: the trainer's time was spent either way
            await report_usage(self.bus, "trainer", tinker_job(request.tenant), UsageCounters(
                train_s=time.monotonic() - started, train_tokens=done.tokens if done else 0,
                train_samples=done.samples if done else 0, tinker_requests=1), tenant=request.tenant)

    async def _do(self, request: wire.TrainRequest, model: wire.TinkerModel, live: wire.TinkerLive | None,
                  delivery: Delivery) -> Done | None:
        """Do a request in its turn, record the model's progress and the future: its Done (None: failed)."""
        try:
            async with (span(self.bus, "trainer", f"tinker_{request.kind}", wire.span_job(request.tenant), 0,
                             model=request.model_id, seq_id=request.seq_id),
                        delivery.keep_alive()):
                checkpoint = await self._checkpoint(request, model) if request.kind == "load_weights" else None
                sequences = await self._sequences(request) if request.kind == "forward_backward" else {}
                done = await asyncio.to_thread(self._run, request, model, live, checkpoint, sequences)
        except (UserError, LossInputError, NonFiniteUpdate) as exc:
            await self._advance(request, live, None)
            await wire.fail(self.bus, self.store, request.request_id, request.tenant, str(exc))
            return None
        except GradientsLost as exc:
            await self._advance(request, msgspec.structs.replace(live, lost_from=0), None)
            await wire.fail(self.bus, self.store, request.request_id, request.tenant, str(exc), category="server")
            return None
        except Exception as exc:
            log.exception("tinker request failed", model=request.model_id, kind=request.kind)
            await self._advance(request, live, None)
            await wire.fail(self.bus, self.store, request.request_id, request.tenant,
                            f"the trainer failed on {request.kind}: {exc!r}", category="server")
            return None
        for kind, ident, record in done.records:  # written here, never from the thread: see _run
            await wire.write(self.bus, kind, ident, record)
            if kind == "checkpoint":
                await wire.index(self.bus, model.tenant, model.id, ident)
        await self._advance(request, live, done.live)
        await wire.finish(self.bus, self.store, wire.TinkerFuture(
            request_id=request.request_id, tenant=request.tenant, media=done.media, body=done.body))
        return done

    async def is_alive(self, replica: str) -> bool:
        beat = await wire.read(self.bus, "replica", replica, wire.ReplicaBeat)
        return beat is not None and time.time() - beat.at < REPLICA_DEAD_S

    async def beat(self, stop: asyncio.Event) -> None:
        """Say this replica is alive every ``BEAT_S`` until ``stop``: a model's request waits for a
        live replica holding its gradients (or doing its last request) however long that takes."""
        while not stop.is_set():
            with contextlib.suppress(Exception):  # the broker restarting: beat again next time
                await wire.write(self.bus, "replica", self.replica, wire.ReplicaBeat(id=self.replica, at=time.time()))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), BEAT_S)

    async def _advance(self, request: wire.TrainRequest, old: wire.TinkerLive | None,
                       new: wire.TinkerLive | None) -> None:
        """Record the model's state after ``request``: its new weights (if any; the old ones are
        deleted), the last request done, and whether this replica now holds gradients of it."""
        live = new or old
        if live is None:
            return
        job = job_name(request.model_id)
        holding = job in self.policy.pinned
        live = msgspec.structs.replace(live, last_seq=max(live.last_seq, request.seq_id), working="",
                                       holder=self.replica if holding else "",
                                       pending_from=(live.pending_from or request.seq_id) if holding else 0,
                                       done_at=time.time())
        await wire.write(self.bus, "live", request.model_id, live)
        if new is not None and old is not None and old.adapter is not None and old.adapter != new.adapter:
            await asyncio.to_thread(self.store.delete_prefix,
                                    self.store.key_of(old.adapter.uri).rsplit("/", 1)[0] + "/")

    # --- in a thread, with the policy's lock -----------------------------------------------------

    def _run(self, request: wire.TrainRequest, model: wire.TinkerModel, live: wire.TinkerLive | None,
             checkpoint: wire.TinkerCheckpoint | None, sequences: dict) -> Done:
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
            job = job_name(model.id)
            if job in self.policy.pinned and live.holder != self.replica:  # held here once, given up since
                self.policy.drop_gradients(job)
            body = json.loads(request.body) if request.kind != "forward_backward" else None
            match request.kind:
                case "forward_backward":
                    return self._forward_backward(model, request.body, sequences)
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

    async def _sequences(self, request: wire.TrainRequest) -> dict[str, wire.SequenceRecord]:
        """The recorded sequences a stable_reinforce request's provenance names (the tenant's own;
        missing ones are left out, and the datum naming one is refused)."""
        message = pb.ForwardBackwardRequest()
        message.ParseFromString(request.body)
        if message.loss_fn != "stable_reinforce":
            return {}
        names = {span[1] for datum in message.data for span in spans_of(datum.loss_fn_input_spans)}
        if len(names) > MAX_SPANS:
            raise UserError(f"the request's provenance names {len(names)} sequences: send at most {MAX_SPANS}")
        found = await asyncio.gather(*[wire.read(self.bus, "sequence", name, wire.SequenceRecord) for name in names])
        return {record.id: record for record in found if record is not None and record.tenant == request.tenant}

    async def _checkpoint(self, request: wire.TrainRequest, model: wire.TinkerModel) -> wire.TinkerCheckpoint:
        """The checkpoint a load_weights names (the tenant's own, or a published one)."""
        path = json.loads(request.body).get("path") or model.from_checkpoint
        found = await wire.read(self.bus, "checkpoint", path, wire.TinkerCheckpoint)
        if found is None or not wire.can_read(found, model.tenant):
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

    def _forward_backward(self, model: wire.TinkerModel, body: bytes, sequences: dict) -> Done:
        """The request's loss and its gradients, added to the model's; a request that fails adds nothing."""
        request = pb.ForwardBackwardRequest()
        request.ParseFromString(body)
        check_loss(request.loss_fn)
        config = {k: v.number for k, v in request.loss_fn_config_v2.items() if v.WhichOneof("value") == "number"}
        config = config or dict(request.loss_fn_config)
        data = [self._datum(i, datum, request.loss_fn, sequences) for i, datum in enumerate(request.data)]
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
        trained = not request.forward_only
        return Done("proto", result.SerializeToString(), tokens=sum(lengths) if trained else 0,
                    samples=len(data) if trained else 0)

    def _datum(self, i: int, datum: pb.Datum, loss_fn: str,
               sequences: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
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
        if loss_fn == "stable_reinforce":  # the recorded logprobs, never the client's
            inputs |= provenance_inputs(i, targets_T, spans_of(datum.loss_fn_input_spans), sequences)
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
        if live.lost_from:  # never a step on part of the gradients
            self.policy.drop_gradients(job)
            raise GradientsLost(f"the gradients of this model's requests from seq_id {live.lost_from} on are "
                                "incomplete (lost with a trainer replica that went away, or a request never "
                                "came): send those forward_backward requests again, then optim_step (the "
                                "weights are as of the last step, and the gradients were dropped)")
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
        # save_weights_external comes queued as save_weights_for_sampler (the gateway's model_request):
        # the same adapter files, under their own segment
        external = body.get("type") == "save_weights_external"
        segment = ("external_weights" if external else
                   "sampler_weights" if kind == "save_weights_for_sampler" else "weights")
        path = f"tinker://{model.id}/{segment}/{name}"
        adapter, state = self._put(wire.model_prefix(model, "checkpoints", uuid.uuid4().hex[:12]), config_json, weights,
                                   optimizer if kind == "save_weights" else None)
        now = time.time()
        checkpoint = wire.TinkerCheckpoint(path=path, tenant=model.tenant, model_id=model.id,
                                           kind="external" if external else "sampler" if state is None else "state",
                                           adapter=adapter, optimizer=state, rank=model.rank, created_at=now,
                                           expires_at=wire.expiry(body.get("ttl_seconds"), now))
        return Done("json", msgspec.json.encode({"path": path, "type": "save_weights_external" if external else kind}),
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
    beating = asyncio.create_task(trainer.beat(rt.stop))
    try:
        await queues.run(trainer.handle, rt.stop)
    finally:
        beating.cancel()
