"""One vLLM ``AsyncLLM`` engine with LoRA enabled, shared by every job this replica serves.

Requests of all jobs go into the same engine concurrently, so its batches mix
adapters. Each (job, version) gets a LoRA name and int id of its own, never reused
for other weights (vLLM caches adapters and prefix blocks by name / id, so reuse
would serve stale weights); a job's previous version is removed when the next
one is loaded.

The engine returns *processed* logprobs: the log-probability of each sampled token
under the distribution it was actually drawn from (logits / temperature; no top-k,
top-p or min-p, which the trainer could not reproduce, and no sampling defaults taken
from the model's ``generation_config``). The trainer scores the same tempered policy,
so the PPO ratio compares like with like at every temperature. The top k at a sampled position
come from that same distribution; prompt logprobs are the model's own (vLLM scores prompt rows
without temperature).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from marlaas.platform.config import Config
from marlaas.vllm_plugin import KERNELS_ENV
from services.rollout.fair_share import FairShare, RunningShares
from services.rollout.utilization import Utilization

PREEMPTED = object()  # a request's run that the fair share took out of the engine


@contextlib.contextmanager
def cpu_engine_process(config: Config, args) -> Iterator[None]:
    """While the engine starts: on CPU with ``rollout.cpu_executor = "uni"``, the model runs in the
    engine core process with ``rollout.cpu_threads`` torch threads. The caller's own settings
    are restored afterwards (the in-process baseline trains in the same process)."""
    from vllm.platforms import current_platform

    if config.rollout.cpu_executor != "uni" or not current_platform.is_cpu():
        yield
        return
    import torch

    args.distributed_executor_backend = "uni"
    # vLLM turns "uni" into "mp" on CPU unless V1 multiprocessing is off; AsyncLLM still runs its
    # engine core in a process of its own. A spawned engine core reads OMP_NUM_THREADS at import,
    # a forked one inherits the torch setting.
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if config.rollout.cpu_threads:
        env["OMP_NUM_THREADS"] = str(config.rollout.cpu_threads)
    saved_env = {key: os.environ.get(key) for key in env}
    saved_threads = torch.get_num_threads()
    os.environ.update(env)
    torch.set_num_threads(config.rollout.cpu_threads or saved_threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved_threads)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


ENGINE_STOP_S = 1.0  # how long the engine core may take to exit on SIGTERM before SIGKILL (shutdown)


@dataclass(frozen=True)
class TopLogprobs:
    """The k most likely tokens at each of T positions and their logprobs, most likely first."""

    token_ids_T_K: np.ndarray  # int32
    logprobs_T_K: np.ndarray  # float32


@dataclass(frozen=True)
class Completion:
    """One sampled turn: token ids, the engine's (tempered) logprob of each, and why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str = "length"  # "stop" (eos or a stop string) | "length"
    stop_reason: str | int | None = None  # the stop string that ended it, if any
    cached_tokens: int = 0  # prompt tokens served from vLLM's prefix cache
    prompt_logprobs: list[float] | None = None  # when asked: each prompt token's logprob (the first's is NaN)
    top_logprobs: TopLogprobs | None = None  # when asked: the top k at each sampled position
    prompt_top_logprobs: TopLogprobs | None = None  # when asked: the top k at prompt positions 1.. (T = prompt - 1)


def top_of(flat, positions: range, k: int) -> TopLogprobs:
    """The top k at ``positions`` of vLLM's flat logprobs, where each position holds the scored
    token's entry, then the k most likely by rank (duplicates kept)."""
    starts_T = np.asarray([flat.start_indices[p] for p in positions], dtype=np.int64)
    if any(flat.end_indices[p] - flat.start_indices[p] != k + 1 for p in positions):
        raise RuntimeError(f"the engine's logprobs do not hold the top {k} at every position")
    at_T_K = starts_T[:, None] + np.arange(1, k + 1)
    return TopLogprobs(np.asarray(flat.token_ids, dtype=np.int32)[at_T_K],
                       np.asarray(flat.logprobs, dtype=np.float32)[at_T_K])


class PolicyEngine:
    """The shared multi-LoRA engine and the adapters loaded into it."""

    def __init__(self, config: Config) -> None:
        # vLLM reads these at import / engine start: set them before importing it
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.rollout.kv_cache_gib))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", config.rollout.cpu_threads_bind)
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        os.environ[KERNELS_ENV] = config.rollout.cpu_lora_kernels  # read by marlaas.vllm_plugin in the engine core
        # tenants' weighted shares of the waiting queue (not under frontier dispatch, which orders it itself)
        self.fair = FairShare() if config.rollout.fair_share and config.rollout.dispatch == "fifo" else None
        # ... and of its running requests while several tenants are busy (frontier dispatch orders
        # requests by its own priority, which the running set's turns would override)
        self.running = (RunningShares(config.rollout.fair_share_running)
                        if self.fair is not None and config.rollout.fair_share_running else None)
        self.weights: dict[str, float] = {}  # tenant -> weight (the rollout service keeps it current)
        from transformers import AutoTokenizer
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        model_dir = str(config.base_model_dir)
        rc = config.rollout
        args = AsyncEngineArgs(
            model=model_dir, tokenizer=model_dir, enable_lora=True, max_loras=rc.max_loras,
            max_lora_rank=rc.max_lora_rank, max_cpu_loras=rc.max_loras * 2, dtype=rc.dtype,
            max_model_len=rc.max_model_len, gpu_memory_utilization=rc.gpu_memory_utilization,
            enforce_eager=True, disable_log_stats=True, seed=0,
            logprobs_mode="processed_logprobs",  # the tempered policy the trainer scores
            # no cap of vLLM's (20 by default) on a request's logprob width: next_token_logprobs asks for
            # whole rows, and every width a user can ask for is bounded where it is asked (tinker_sampling)
            max_logprobs=-1,
            generation_config="vllm",  # no sampling defaults from the model's generation_config.json
            enable_prefix_caching=True,  # a multi-turn episode re-enters with its whole prefix
            # never split a prompt's prefill across steps: vLLM-cpu 0.32 kills the engine when a
            # seeded request's chunked prefill discards a sample ("CPU Generator does not use offset")
            enable_chunked_prefill=False, max_num_batched_tokens=max(rc.max_model_len, 4096),
            worker_extension_cls="marlaas.vllm_plugin.probe.EngineProbe",  # lora_kernels() asks it
            scheduling_policy="priority" if rc.dispatch == "frontier" or self.fair else "fcfs",
            **({"block_size": rc.block_size} if rc.block_size else {}),
            **({"max_num_seqs": rc.max_num_seqs} if rc.max_num_seqs else {}),
        )
        with cpu_engine_process(config, args):
            self.engine = AsyncLLM.from_engine_args(args)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self._ids = itertools.count(1)
        self._loaded: dict[str, dict[int, object]] = {}  # job -> version -> LoRARequest
        self.eos_token_id = self.tokenizer.eos_token_id
        self.vocab_size = self.engine.model_config.get_vocab_size()  # the logits' width (a next-token row's)
        self.utilization = Utilization()

    async def use_adapter(self, job: str, version: int, adapter_dir: Path, keep: set[int] | frozenset = frozenset()):
        """The LoRARequest for (job, version): a fresh name and int id. The job's other versions
        are dropped, but those in ``keep`` (bounded staleness: versions still generating).

        The caller serializes calls per job (and keeps ``adapter_dir`` in place while vLLM loads it).
        """
        from vllm.lora.request import LoRARequest

        versions = self._loaded.setdefault(job, {})
        request = versions.get(version)
        if request is None:
            request = LoRARequest(f"{job}@v{version}", next(self._ids), str(adapter_dir))
            await self.engine.add_lora(request)
            versions[version] = request
        for old in [v for v in versions if v != version and v not in keep]:
            await self.engine.remove_lora(versions.pop(old).lora_int_id)
        return request

    async def lora_kernels(self) -> str | None:
        """The CPU LoRA kernels the engine core runs ("fused", "grouped", "vllm"); None off CPU."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None
        return (await self.engine.collective_rpc("marlaas_lora_kernels"))[0]

    async def check_lora_kernels(self, wanted: str) -> str | None:
        """:meth:`lora_kernels`, or a clear error when they are not those configured."""
        running = await self.lora_kernels()
        if running is None or running == wanted:
            return running
        if running == "vllm":
            why = ("vLLM did not load marlaas's plugin (the 'vllm.general_plugins' entry point 'marlaas_cpu_lora'). "
                   "Reinstall the project (make setup, or pip install -e .) so that its entry points are registered, "
                   "or set rollout.cpu_lora_kernels = \"vllm\"")
        else:
            why = f"the engine core saw {KERNELS_ENV}={running}; do not set it by hand, rollout sets it from the config"
        raise RuntimeError(f"rollout.cpu_lora_kernels = {wanted!r} but the vLLM engine core runs {running!r}: {why}")

    def served_version(self, job: str, lora) -> int:
        """The version ``lora`` (a request of :meth:`use_adapter`) serves for ``job`` (-1: unknown)."""
        return next((v for v, r in (self._loaded.get(job) or {}).items() if r is lora), -1)

    async def drop_job(self, job: str) -> None:
        """Unload a finished job's adapters."""
        versions = self._loaded.pop(job, None) or {}
        if not self.dead:
            for request in versions.values():
                await self.engine.remove_lora(request.lora_int_id)

    @property
    def dead(self) -> bool:
        """The engine core died (vLLM cannot recover it in-process)."""
        return self.engine.errored

    async def watch(self, stop: asyncio.Event, every_s: float = 1.0) -> None:
        """Stop the service when the engine dies, so it exits and is restarted."""
        while not stop.is_set():
            if self.dead:
                stop.set()
                return
            await asyncio.sleep(every_s)

    async def generate(self, prompt_ids: list[int], *, max_tokens: int, temperature: float, lora,
                       seed: int | None, stop: list[str] | None = None, ignore_eos: bool = False,
                       top_p: float = 1.0, top_k: int = 0, stop_token_ids: list[int] | None = None,
                       prompt_logprobs: bool = False, top_logprobs: int = 0, prompt_top_logprobs: int = 0,
                       priority: int = 0, tenant: str = "", rank: int = 1) -> Completion:
        """One completion of ``prompt_ids`` (token in, token out) under ``lora``.

        Each sample is its own request with its own seed (vLLM's ``n > 1`` is a frontend
        fan-out giving child j the seed ``seed + j``, which overlaps other prompts' streams).
        A stop string is kept in the output, and ``token_ids`` end with the token completing it.
        ``top_logprobs`` / ``prompt_top_logprobs``: k > 0 adds the k most likely tokens at each
        sampled / prompt position (the callers bound k). ``priority``: the request's place in the
        queue under ``rollout.dispatch = "frontier"`` (lower first); under "fifo" with
        ``rollout.fair_share``, ``tenant``'s weighted share places it instead (:meth:`_run`), and
        ``rank`` (its job's priority, ``fair_share.RANKS``) among the tenant's own requests.
        """
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        scores_prompt = prompt_logprobs or prompt_top_logprobs > 0
        params = SamplingParams(
            n=1, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=max(top_k, 0), min_p=0.0,
            logprobs=top_logprobs, seed=seed, stop=stop or None, include_stop_str_in_output=True,
            ignore_eos=ignore_eos, stop_token_ids=stop_token_ids or None,
            prompt_logprobs=prompt_top_logprobs if scores_prompt else None,
            output_kind=RequestOutputKind.FINAL_ONLY,
            flat_logprobs=True,  # flat lists, not a dict of Logprob objects per token
        )
        final = await self._run(prompt_ids, params, lora, priority, tenant, rank)
        out = final.outputs[0]
        ids = list(out.token_ids)
        flat = out.logprobs  # each position: the sampled token's, then the top k (vLLM's order)
        if [flat.token_ids[i] for i in flat.start_indices] != ids:
            raise RuntimeError("the engine's logprobs are not those of the tokens it sampled")
        logprobs = [flat.logprobs[i] for i in flat.start_indices]
        scored = None
        prompt = final.prompt_logprobs  # position 0 has none; each other's first entry is the prompt token's own
        if prompt_logprobs:
            scored = [float("nan")] + [prompt.logprobs[prompt.start_indices[i]] for i in range(1, len(prompt_ids))]
            if [prompt.token_ids[prompt.start_indices[i]] for i in range(1, len(prompt_ids))] != prompt_ids[1:]:
                raise RuntimeError("the engine's prompt logprobs are not those of the prompt's tokens")
        return Completion(ids, logprobs, out.text, out.finish_reason or "length", out.stop_reason,
                          final.num_cached_tokens or 0, scored,
                          top_logprobs=top_of(flat, range(len(ids)), top_logprobs) if top_logprobs else None,
                          prompt_top_logprobs=top_of(prompt, range(1, len(prompt_ids)), prompt_top_logprobs)
                          if prompt_top_logprobs else None)

    async def next_token_logprobs(self, prompt_ids: list[int], *, lora, tenant: str = "") -> np.ndarray:
        """``logprobs_P_V``: the model's whole next-token distribution (log-softmax of the logits,
        no temperature) at each prompt position but the last; row i predicts ``prompt_ids[i + 1]``.

        One prefill with vLLM's full prompt logprob rows (``prompt_logprobs=-1``): P x V values go
        through vLLM's frontend as Python lists, so the caller bounds P x V.
        """
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(n=1, max_tokens=1, temperature=0.0, prompt_logprobs=-1, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY, flat_logprobs=True)
        flat = (await self._run(prompt_ids, params, lora, 0, tenant)).prompt_logprobs
        first = flat.start_indices[1]  # position 0 has no row
        width = flat.end_indices[1] - first  # the prompt token's own entry, then all V by rank
        rows = len(prompt_ids) - 1
        if len(flat.token_ids) - first != rows * width:
            raise RuntimeError("the engine's full prompt logprob rows are not all of one width")
        ids_P_V = np.asarray(flat.token_ids[first:], dtype=np.int64).reshape(rows, width)[:, 1:]
        ranked_P_V = np.asarray(flat.logprobs[first:], dtype=np.float32).reshape(rows, width)[:, 1:]
        logprobs_P_V = np.full(ids_P_V.shape, -np.inf, dtype=np.float32)
        np.put_along_axis(logprobs_P_V, ids_P_V, ranked_P_V, axis=1)  # from rank order to token id order
        return logprobs_P_V

    async def _run(self, prompt_ids: list[int], params, lora, priority: int, tenant: str = "", rank: int = 1):
        """vLLM's final output of one request (``params.n == 1``); with fair share on, let into the
        engine within ``tenant``'s share of its running requests (:class:`RunningShares`: run again
        from the start if preempted) and placed in vLLM's queue by its tenant's share (its cost:
        the prompt and the token budget)."""
        cost = len(prompt_ids) + (params.max_tokens or 0)
        ticket = self.running.ticket(tenant, cost, rank) if self.running is not None and tenant else None
        try:
            while True:
                if ticket is not None:
                    await self.running.enter(ticket, self.weights)  # held back while over its share
                final = await self._attempt(prompt_ids, params, lora, priority, tenant, rank, ticket)
                if final is not PREEMPTED:
                    break
        finally:
            if ticket is not None:
                self.running.leave(ticket, self.weights)
        if final is None or len(final.outputs) != 1:
            raise RuntimeError(f"engine returned no completion for a {len(prompt_ids)}-token prompt")
        return final

    async def _attempt(self, prompt_ids: list[int], params, lora, priority: int, tenant: str, rank: int, ticket):
        """One run of a request in vLLM: its final output, or :data:`PREEMPTED` when the fair
        share took it out of the engine (vLLM aborted it)."""
        from vllm.inputs import TokensPrompt

        share = None
        if self.fair is not None and tenant:
            share, priority = self.fair.admit(tenant, len(prompt_ids) + (params.max_tokens or 0),
                                              self.weights.get(tenant, 1.0), rank)

        async def final_output():
            final = None
            with self.utilization.engine_request():
                async for output in self.engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), params,
                                                         request_id=uuid.uuid4().hex, lora_request=lora,
                                                         priority=priority):
                    final = output
            return final

        try:
            if ticket is None:
                return await final_output()
            run = asyncio.ensure_future(final_output())  # a task of its own: a preemption cancels it alone
            ticket.stop = run.cancel
            return await run
        except asyncio.CancelledError:
            if ticket is None or not ticket.preempted or asyncio.current_task().cancelling():
                raise
            return PREEMPTED  # vLLM aborted it (its generate's own cancel handling); it runs again
        finally:
            if ticket is not None:
                ticket.stop = None
            if share is not None:
                self.fair.done(share)

    def shutdown(self) -> None:
        """Stop the engine core: vLLM SIGTERMs it and, after ``ENGINE_STOP_S``, SIGKILLs it. Its
        requests are drained or aborted by then and it holds nothing to keep (the KV cache, the
        loaded adapters), so waiting for its own interpreter to tear down (3 s, measured) buys
        nothing."""
        self.engine.shutdown(timeout=ENGINE_STOP_S)
        del self.engine  # let it go now, not in __del__ at interpreter exit (vLLM errors there)
