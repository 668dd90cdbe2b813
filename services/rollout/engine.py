"""One vLLM ``AsyncLLM`` engine with LoRA enabled, shared by every job this replica serves.

Requests of all jobs go into the same engine concurrently, so its batches mix
adapters. Each (job, version) gets a LoRA name and int id of its own, never reused
for other weights (vLLM caches adapters and prefix blocks by name / id, so reuse
would serve stale weights); a job's previous version is removed when the next
one is loaded.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from marlaas.config import Config


@dataclass(frozen=True)
class Completion:
    """One sampled completion with the engine's logprob of each sampled token."""

    token_ids: list[int]
    logprobs: list[float]
    text: str


class PolicyEngine:
    """The shared multi-LoRA engine and the adapters loaded into it."""

    def __init__(self, config: Config) -> None:
        # vLLM reads these at import / engine start: set them before importing it
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.rollout.kv_cache_gib))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", config.rollout.cpu_threads_bind)
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
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
        )
        self.engine = AsyncLLM.from_engine_args(args)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self._ids = itertools.count(1)
        self._loaded: dict[str, tuple[int, object]] = {}  # job -> (version, LoRARequest)
        self.eos_token_id = self.tokenizer.eos_token_id

    async def use_adapter(self, job: str, version: int, adapter_dir: Path):
        """The LoRARequest for (job, version): a fresh name and int id; the old version is dropped.

        The caller serializes calls per job (and keeps ``adapter_dir`` in place while vLLM loads it).
        """
        from vllm.lora.request import LoRARequest

        current = self._loaded.get(job)
        if current is not None and current[0] == version:
            return current[1]
        request = LoRARequest(f"{job}@v{version}", next(self._ids), str(adapter_dir))
        await self.engine.add_lora(request)
        self._loaded[job] = (version, request)
        if current is not None:
            await self.engine.remove_lora(current[1].lora_int_id)
        return request

    async def drop_job(self, job: str) -> None:
        """Unload a finished job's adapter."""
        current = self._loaded.pop(job, None)
        if current is not None and not self.dead:
            await self.engine.remove_lora(current[1].lora_int_id)

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

    def encode_prompt(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    async def sample(self, prompt_ids: list[int], n: int, max_tokens: int, temperature: float,
                     lora, seed: int) -> list[Completion]:
        """``n`` completions of one prompt under ``lora``, with sampled-token logprobs."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        # FINAL_ONLY: vLLM aggregates the n children into one final output (streaming would not)
        params = SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, logprobs=0,
                                seed=seed, output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for output in self.engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), params,
                                                 request_id=uuid.uuid4().hex, lora_request=lora):
            final = output
        if final is None or len(final.outputs) != n:
            got = 0 if final is None else len(final.outputs)
            raise RuntimeError(f"engine returned {got} completions, asked for {n}")
        completions = []
        for out in sorted(final.outputs, key=lambda o: o.index):
            ids = list(out.token_ids)
            logprobs = [step[token].logprob for step, token in zip(out.logprobs, ids)]
            completions.append(Completion(ids, logprobs, out.text))
        return completions

    async def sample_many(self, prompts: list[list[int]], n: int, max_tokens: int, temperature: float,
                          lora, seed: int) -> list[list[Completion]]:
        """All prompts at once, so they share engine batches (with every other job's requests)."""
        return await asyncio.gather(*(
            self.sample(p, n, max_tokens, temperature, lora, seed + i) for i, p in enumerate(prompts)
        ))

    def shutdown(self) -> None:
        self.engine.shutdown()
        del self.engine  # let it go now, not in __del__ at interpreter exit (vLLM errors there)
