"""Peak memory of one GRPO train step: the old full-batch path against the micro-batched one.

    python benchmarks/train_memory.py [--quick] [--device cpu|cuda] [--vocab 151936]

The model is a Qwen3 built from a config in memory (saved to a temp dir so the real
``PolicyTrainer`` loads it) with a large vocabulary and a small width, so the
vocabulary-sized tensors dominate, as they do for a real Qwen3 with long completions.
Each measurement runs in a fresh subprocess so one run's allocator cache cannot hide
the next one's peak.

- ``full``: today's old path: the whole batch in one padded forward, then a full fp32
  log_softmax of B x T x V (``token_logprobs``), the loss, backward, an AdamW step.
- ``micro``: ``PolicyTrainer.train_step``: micro-batches of ``--budget`` padded tokens,
  logprobs of masked-in tokens only, from hidden states in checkpointed chunks.

Peak is measured over the step only (the model and adapter are loaded before): on CPU
the peak RSS above the pre-step RSS, sampled every millisecond by a thread (tracemalloc
does not see torch's allocations); on CUDA ``torch.cuda.max_memory_allocated`` above the
pre-step allocation. A ``full`` run whose estimated peak (four B x T x V fp32 tensors:
logits, log-softmax, and their gradients) would not fit in memory is skipped. On CPU
the children run with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed at 1 MiB so freed
tensors leave RSS at once and the sampled peak is the live peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PROMPT_TOKENS = 32
GROUP_SIZE = 8


def build_model_dir(dest: Path, vocab: int) -> Path:
    """A small-width, large-vocabulary Qwen3 saved with save_pretrained (seeded, random weights)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
        tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )
    Qwen3ForCausalLM(config).save_pretrained(dest)
    return dest


def make_batch(samples: int, completion: int, vocab: int):
    """Groups of 8 samples; completions of ``completion`` tokens, all trained, rewards in [0, 1]."""
    import torch

    from marlaas.platform.events import Sample, TrajectoryBatch

    gen = torch.Generator().manual_seed(1)
    return TrajectoryBatch(samples=[
        Sample(group=i // GROUP_SIZE,
               prompt_ids=torch.randint(2, vocab, (PROMPT_TOKENS,), generator=gen).tolist(),
               completion_ids=torch.randint(2, vocab, (completion,), generator=gen).tolist(),
               logprobs=[-10.0] * completion, loss_mask=[1] * completion,
               reward=torch.rand((), generator=gen).item())
        for i in range(samples)
    ])


def full_step(trainer, job: str, batch, settings) -> None:
    """The pre-micro-batching train step: one forward, full fp32 log_softmax, backward, step."""
    import torch

    from services.trainer.grpo import group_advantages, grpo_loss, token_logprobs

    hot = trainer.hot[job]
    trainer.model.set_adapter(hot.slot)
    trainer.model.train()
    tokens_B_T, mask_B_T, sample_lp_B_T = trainer._pack(batch.samples)  # right-padded: causal, no mask
    rewards_B = torch.tensor([s.reward for s in batch.samples])
    groups_B = torch.tensor([s.group for s in batch.samples])
    advantages_B = group_advantages(rewards_B, groups_B).to(trainer.device)
    logits = trainer.model(input_ids=tokens_B_T, use_cache=False).logits
    logprobs_B_T = token_logprobs(logits, tokens_B_T, settings.temperature)
    out = grpo_loss(logprobs_B_T, sample_lp_B_T, mask_B_T, advantages_B, settings.clip_eps)
    hot.optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(hot.params, settings.max_grad_norm)
    hot.optimizer.step()


class PeakRss:
    """Samples this process's RSS every millisecond in a thread; ``peak`` is the maximum seen."""

    def __init__(self) -> None:
        import psutil

        self._process = psutil.Process()
        self.start = self.peak = self._process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            time.sleep(0.001)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


def measure_one(args: argparse.Namespace) -> dict:
    """Child process: load the model, make the job hot, run one step of ``args.path``, report."""
    import gc

    import torch

    from marlaas.platform.adapters import init_adapter
    from marlaas.platform.events import GrpoSettings, LoraSettings
    from services.trainer.policy import PolicyTrainer

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:  # kept while stepping: peft's export looks at it
        model_dir = build_model_dir(Path(tmp), args.vocab)
        trainer = PolicyTrainer(model_dir, args.device, micro_batch_tokens=args.budget)
        settings = GrpoSettings(temperature=0.7)
        trainer.load("bench.job", 0, *init_adapter(model_dir, LoraSettings(), seed=0), None, settings)
        batch = make_batch(args.samples, args.completion, args.vocab)

        def step() -> None:
            if args.path == "full":
                full_step(trainer, "bench.job", batch, settings)
            else:
                trainer.train_step("bench.job", batch, settings)

        gc.collect()
        started = time.perf_counter()
        if args.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        else:
            with PeakRss() as rss:
                step()
            peak = rss.peak - rss.start
        seconds = time.perf_counter() - started
    return {"peak_bytes": peak, "seconds": seconds, "split_head": trainer.split_head}


def available_bytes(device: str) -> int:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_properties(0).total_memory
    import psutil

    return psutil.virtual_memory().available


def run_child(args: argparse.Namespace, path: str, samples: int, completion: int) -> dict:
    cmd = [sys.executable, __file__, "--child", path, "--samples", str(samples), "--completion",
           str(completion), "--vocab", str(args.vocab), "--budget", str(args.budget),
           "--device", args.device, "--threads", str(args.threads)]
    # glibc serves allocations under its (adaptive, up to 32 MiB) mmap threshold from heaps it
    # rarely returns, so RSS would lag freed memory; a fixed 1 MiB threshold makes RSS track live data
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"rc {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="32k vocabulary, 16/64 samples x 128/512 tokens")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--vocab", type=int, default=None, help="default 151936 (Qwen3), 32000 with --quick")
    parser.add_argument("--budget", type=int, default=4096, help="micro_batch_tokens of the micro path")
    parser.add_argument("--samples", type=int, nargs="*", default=None, help="batch sizes")
    parser.add_argument("--completion", type=int, nargs="*", default=None, help="completion lengths")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--child", choices=("full", "micro"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.vocab = args.vocab or (32000 if args.quick else 151936)
    if args.child:
        args.path = args.child
        args.samples, args.completion = args.samples[0], args.completion[0]
        args.threads = args.threads or __import__("torch").get_num_threads()
        print(json.dumps(measure_one(args)))
        return

    from rich.console import Console
    from rich.table import Table

    batch_sizes = args.samples or [16, 64]
    lengths = args.completion or ([128, 512] if args.quick else [128, 512, 1024])
    room = available_bytes(args.device)
    table = Table(title=f"one GRPO train step, peak memory ({args.device}, vocab {args.vocab}, "
                        f"hidden 64, prompt {PROMPT_TOKENS}, micro_batch_tokens {args.budget})")
    for column in ("samples", "completion", "logits fp32", "full peak", "micro peak", "full / micro",
                   "full s", "micro s"):
        table.add_column(column, justify="right")
    for samples in batch_sizes:
        for completion in lengths:
            logits_bytes = samples * (PROMPT_TOKENS + completion) * args.vocab * 4
            micro = run_child(args, "micro", samples, completion)
            if 4 * logits_bytes > 0.7 * room:
                full = {"error": f"skipped: needs ~{gib(4 * logits_bytes)}"}
            else:
                full = run_child(args, "full", samples, completion)
            cells = [str(samples), str(completion), gib(logits_bytes)]
            for r in (full, micro):
                cells.append(r.get("error") or gib(r["peak_bytes"]))
            both = "error" not in full and "error" not in micro
            cells.append(f"{full['peak_bytes'] / micro['peak_bytes']:.1f}x" if both else "-")
            cells += [f"{r['seconds']:.1f}" if "seconds" in r else "-" for r in (full, micro)]
            table.add_row(*cells)
            print(f"done: {samples} x {completion}", file=sys.stderr, flush=True)
    Console(width=150).print(table)


if __name__ == "__main__":
    main()
