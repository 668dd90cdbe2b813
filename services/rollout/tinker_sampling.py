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
``max_tokens``. ``prompt_logprobs`` (each prompt token's own) is served; top-k and target logprobs
are not (the request fails saying so).
"""

from __future__ import annotations

import asyncio
import random
import shutil
from collections import OrderedDict

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

log = structlog.get_logger("rollout.tinker")
MAX_ADAPTERS = 8  # Tinker samplers' adapters kept in the engine (beside the jobs')
SAMPLE_DURABLE = "rollout-tinker"  # the consumers' names: rollout-tinker-<tenant>


class SampleError(Exception):
    """A request the client got wrong: its future fails with category "user"."""


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

    async def sample(self, request: wire.SampleRequest) -> bytes:
        body = msgspec.json.decode(request.body)  # the gateway took it as a JSON object
        try:
            prompt = wire.prompt_tokens(body.get("prompt"))
        except ValueError as exc:
            raise SampleError(str(exc)) from None
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise SampleError("sampling_params must be an object")
        if body.get("topk_prompt_logprobs") or body.get("topk_sample_logprobs") or body.get("target_prompt_logprobs"):
            raise SampleError("top-k and target logprobs are not served here: ask for prompt_logprobs (each prompt "
                              "token's own), or score with the training client's forward")
        with_prompt = bool(body.get("prompt_logprobs"))
        n, max_tokens = body.get("num_samples", 1), params.get("max_tokens")
        vocab = len(self.engine.tokenizer)
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise SampleError(f"the prompt holds token ids outside 0..{vocab - 1}, the base model's vocabulary")
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
            turns = await asyncio.gather(*[
                self.engine.generate(prompt, max_tokens=int(max_tokens),
                                     temperature=float(params.get("temperature", 1.0)),
                                     lora=lora, seed=s, stop=stop_strings or None, stop_token_ids=stop_ids or None,
                                     ignore_eos=stop is not None, top_p=float(params.get("top_p", 1.0)),
                                     top_k=int(params.get("top_k", -1)), prompt_logprobs=with_prompt and j == 0)
                for j, s in enumerate(seeds)])
        finally:
            if request.sampler.adapter is not None:
                self.loaded[request.sampler.adapter.sha256] -= 1
        response = pb.SampleResponse()
        if with_prompt:
            scored = np.asarray(turns[0].prompt_logprobs, dtype=np.float32)
            last_n = body.get("prompt_logprobs_last_n")
            if isinstance(last_n, int) and 0 < last_n < len(scored):
                scored[:-last_n] = np.nan  # "not requested", as the SDK reads it
            response.prompt_logprobs = scored.tobytes()
        for turn in turns:
            response.sequences.add(
                stop_reason=pb.STOP_REASON_STOP if turn.finish_reason == "stop" else pb.STOP_REASON_LENGTH,
                tokens=np.asarray(turn.token_ids, dtype=np.int32).tobytes(),
                logprobs=np.asarray(turn.logprobs, dtype=np.float32).tobytes())
        return response.SerializeToString()

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
