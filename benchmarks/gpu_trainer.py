"""The trainer's GRPO step on a GPU beside the same step on the CPU, through ``PolicyTrainer`` itself.

    PYTHONPATH=libs:. python benchmarks/gpu_trainer.py [--quick] [--steps 5] [--json out.json]

Checks that ``services.trainer.policy.PolicyTrainer`` (``trainer.device = "cuda"``) trains a
LoRA on CUDA, and measures a step there against the same step on this machine's CPU, in one
run. Every case goes through the real path: ``PolicyTrainer(model_dir, device)``, ``load`` of a
version-0 adapter from ``marlaas.platform.adapters.init_adapter`` (rank 8, every projection), then
``train_step`` (micro-batches, chunked head logprobs, GRPO loss, clip, AdamW, export). Nothing
of the step is re-implemented here.

Shapes (models are float32, as ``PolicyTrainer`` loads them):
- ``tiny``: the built-in base model (``marlaas.basemodel``, Qwen3 layout, hidden 128, vocab 128);
  64 samples (8 groups of 8), 32-token prompts, 96-token completions: 8192 tokens a step.
- ``0.6b``: a randomly initialized model of Qwen3-0.6B's shape (28 layers, hidden 1024, vocab
  151936, tied embeddings; 596M parameters) built from a config and saved, so the trainer loads
  it from a directory as it loads any base. ``--quick`` shrinks it (2 layers, hidden 256, vocab
  4096) so the run fits a small CPU machine. Two batches: ``small`` (16 samples x 256 tokens,
  run on CPU and GPU for the ratio) and ``large`` (64 samples x 512 tokens, GPU only).

Cases: tiny on cpu and cuda; 0.6b/small on cpu and cuda; on cuda also 0.6b/large at the
default ``micro_batch_tokens`` (2048) and at 16384, and a bf16 variant (the base cast to bf16
after ``PolicyTrainer`` loads it: not a trainer option today, measured to see what one would
give). A case whose device is absent is skipped, so the script runs on a CPU-only machine.

The batch's sampling logprobs are the policy's own (scored by the trainer before the first
step, on the first device that runs the shape), so the first step is on-policy. Where a shape
runs on both devices they train on the same batch from the same adapter, and the first step's
loss, gradient norm and updated weights are compared across devices (``logprob_gap`` of the
GPU's first step is then the mean |logprob_gpu - logprob_cpu| of the trained tokens).

Checks (the run exits 1 if one fails): every step's loss and gradient norm are finite, the
adapter's weights are finite and changed, and where both devices ran a shape, the first step
agrees: loss within 1e-3 absolute, gradient norm within 1 %, and the update (the weights after
it less version 0's) within 5 % in L2 norm (AdamW's first step is about lr x sign(gradient), so
single weights with a near-0 gradient may move differently; their largest gap is reported).

Timing: ``--warmup`` untimed steps, then ``--steps`` timed ones (``torch.cuda.synchronize``
around each); a step is ``train_step`` whole, the export of the new version included.
``tokens/s`` counts prompt + completion tokens (no padding: every sample of a batch has the
same length). Peak memory: on cuda ``torch.cuda.max_memory_allocated`` over the timed steps
(``peak``: everything, base included; ``step``: above what was allocated before them); on cpu
the process's RSS sampled every 5 ms by a thread (``peak``: RSS; ``step``: above RSS before).
CPU cases use torch's default thread count (every core, as the trainer under ``sync``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from train_memory import PeakRss  # benchmarks/ is on sys.path when a benchmark runs as a script


@dataclass(frozen=True)
class Batch:
    samples: int
    prompt: int
    completion: int


@dataclass
class Case:
    shape: str
    batch_name: str
    device: str
    dtype: str = "float32"
    micro_batch_tokens: int = 2048
    steps: int = 5
    warmup: int = 1
    result: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        extra = "" if self.micro_batch_tokens == 2048 else f" mb{self.micro_batch_tokens}"
        return f"{self.shape}/{self.batch_name} {self.device} {self.dtype}{extra}"


BATCHES = {"tiny": Batch(64, 32, 96), "small": Batch(16, 32, 224), "large": Batch(64, 64, 448)}
QUICK_BATCHES = {"tiny": Batch(16, 16, 48), "small": Batch(8, 16, 48), "large": Batch(16, 16, 112)}
GROUP_SIZE = 8


def build_qwen3_dir(dest: Path, quick: bool, device: str) -> Path:
    """A Qwen3 of 0.6B's shape (``quick``: a small one) with seeded random weights, saved to ``dest``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if quick:
        shape = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    else:  # Qwen/Qwen3-0.6B's config.json
        shape = {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                 "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128}
    config = Qwen3Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=0,
                         eos_token_id=1, bos_token_id=None, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU where there is one: seconds, not a minute
        model = Qwen3ForCausalLM(config)
    model.save_pretrained(dest)
    del model
    return dest


def raw_batch(vocab: int, batch: Batch, seed: int = 1) -> list[dict]:
    """Groups of 8: random tokens (ids 3..vocab-1), every completion token trained, rewards in [0, 1]."""
    gen = torch.Generator().manual_seed(seed)
    return [{"group": i // GROUP_SIZE,
             "prompt_ids": torch.randint(3, vocab, (batch.prompt,), generator=gen).tolist(),
             "completion_ids": torch.randint(3, vocab, (batch.completion,), generator=gen).tolist(),
             "reward": torch.rand((), generator=gen).item()}
            for i in range(batch.samples)]


def on_policy_batch(trainer, job: str, raw: list[dict], temperature: float):
    """The batch with the loaded adapter's own tempered logprobs as the sampling logprobs, scored by
    the trainer's ``_score`` (what the engine would report, up to the engine-vs-trainer gap)."""
    from marlaas.platform.events import Sample, TrajectoryBatch

    blank = [Sample(**r, logprobs=[0.0] * len(r["completion_ids"]), loss_mask=[1] * len(r["completion_ids"]))
             for r in raw]
    trainer._activate(trainer.hot[job].slot)
    samples = []
    with torch.no_grad():
        for start in range(0, len(blank), GROUP_SIZE):
            part = blank[start:start + GROUP_SIZE]
            tokens_B_T, mask_B_T, _ = trainer._pack(part)
            logprobs_B_T = trainer._score(tokens_B_T, mask_B_T, temperature).cpu()
            for row, s in enumerate(part):
                p = len(s.prompt_ids)
                lp = logprobs_B_T[row, p:p + len(s.completion_ids)].tolist()
                samples.append(Sample(group=s.group, prompt_ids=s.prompt_ids, completion_ids=s.completion_ids,
                                      logprobs=lp, loss_mask=s.loss_mask, reward=s.reward))
    return TrajectoryBatch(samples=samples)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def make_trainer(model_dir: Path, device: str, dtype: str, micro_batch_tokens: int):
    from services.trainer.policy import PolicyTrainer, head_split_matches

    trainer = PolicyTrainer(model_dir, device, micro_batch_tokens=micro_batch_tokens)
    if dtype == "bfloat16":  # not a trainer option: cast the loaded base, probe the head split again
        trainer.base.to(torch.bfloat16)
        trainer.split_head = head_split_matches(trainer.base)
    return trainer


def run_case(case: Case, trainer, model_dir: Path, raw: list[dict], batch_cache: dict, job: str) -> dict:
    """Load a fresh version-0 adapter, train ``warmup + steps`` steps, measure and check."""
    from safetensors.torch import load as load_safetensors

    from marlaas.platform.adapters import init_adapter
    from marlaas.platform.events import GrpoSettings, LoraSettings
    from services.trainer.grpo import micro_batches

    settings = GrpoSettings(temperature=1.0)
    config_json, weights0 = init_adapter(model_dir, LoraSettings(), seed=0)
    trainer.micro_batch_tokens = case.micro_batch_tokens
    trainer.load(job, 0, config_json, weights0, None, settings)
    key = (case.shape, case.batch_name)
    batch = batch_cache.get(key)
    if batch is None:  # the first device to run this shape scores the batch; the others reuse it
        batch = batch_cache[key] = on_policy_batch(trainer, job, raw, settings.temperature)
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in batch.samples)
    trained = sum(sum(s.loss_mask) for s in batch.samples)
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in batch.samples]
    metrics, seconds, first_weights = [], [], None
    for _ in range(case.warmup):
        out = trainer.train_step(job, batch, settings)
        metrics.append(out.metrics)
        first_weights = first_weights or out.weights
    gc.collect()
    sync(case.device)
    if case.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        for _ in range(case.steps):
            sync(case.device)
            started = time.perf_counter()
            out = trainer.train_step(job, batch, settings)
            sync(case.device)
            seconds.append(time.perf_counter() - started)
            metrics.append(out.metrics)
            first_weights = first_weights or out.weights
        peak = torch.cuda.max_memory_allocated()
        peak_step = peak - before
    else:
        with PeakRss() as rss:
            for _ in range(case.steps):
                started = time.perf_counter()
                out = trainer.train_step(job, batch, settings)
                seconds.append(time.perf_counter() - started)
                metrics.append(out.metrics)
                first_weights = first_weights or out.weights
        peak, peak_step = rss.peak, rss.peak - rss.start
    sync(case.device)
    started = time.perf_counter()
    trainer.export(job)
    export_s = time.perf_counter() - started
    w0 = load_safetensors(weights0)
    w_last = load_safetensors(out.weights)
    change = max((w_last[k] - w0[k]).abs().max().item() for k in w0)
    finite_weights = all(torch.isfinite(t).all().item() for t in w_last.values())
    finite_metrics = all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in metrics)
    step_s = statistics.median(seconds)
    lora_params = sum(t.numel() for t in w0.values())
    base_params = sum(p.numel() for n, p in trainer.base.named_parameters() if "lora_" not in n)
    trainer.evict(job)
    first = metrics[0]
    return {
        "case": case.label, "shape": case.shape, "batch": case.batch_name, "device": case.device,
        "dtype": case.dtype, "micro_batch_tokens": case.micro_batch_tokens,
        "micro_batches": len(micro_batches(lengths, case.micro_batch_tokens)),
        "split_head": trainer.split_head, "samples": len(batch.samples), "tokens_per_step": tokens,
        "trained_tokens_per_step": trained, "warmup": case.warmup, "steps": case.steps,
        "step_s_median": step_s, "step_s_min": min(seconds), "step_s_max": max(seconds),
        "tokens_per_s": tokens / step_s, "trained_tokens_per_s": trained / step_s,
        "peak_bytes": peak, "peak_step_bytes": peak_step, "export_s": export_s,
        "base_params": base_params, "lora_params": lora_params,
        "first_step": {k: first[k] for k in ("loss", "grad_norm", "logprob_gap", "clip_fraction")},
        "last_loss": metrics[-1]["loss"], "adapter_max_abs_change": change,
        "finite": finite_metrics and finite_weights, "changed": change > 0,
        "_first_weights": first_weights, "_weights0": weights0,
    }


def environment() -> dict:
    import peft
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "transformers": transformers.__version__, "peft": peft.__version__,
           "cpu": platform.processor() or platform.machine(), "cpu_threads": torch.get_num_threads()}
    try:
        with open("/proc/cpuinfo") as f:
            env["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=torch.cuda.get_device_name(0), gpu_memory_bytes=props.total_memory,
                   gpu_sms=props.multi_processor_count, gpu_capability=f"{props.major}.{props.minor}")
        try:
            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            env["driver"] = "unknown"
    return env


def compare_devices(results: list[dict]) -> list[dict]:
    """Where a shape/batch ran on cpu and on cuda (float32, default micro-batches): the step ratio and
    whether the first step agrees."""
    from safetensors.torch import load as load_safetensors

    rows = []
    by = {(r["shape"], r["batch"], r["device"]): r for r in results
          if r["dtype"] == "float32" and r["micro_batch_tokens"] == 2048}
    for (shape, batch, device), cpu in by.items():
        gpu = by.get((shape, batch, "cuda"))
        if device != "cpu" or gpu is None:
            continue
        w0 = load_safetensors(cpu["_weights0"])
        w_cpu, w_gpu = (load_safetensors(r["_first_weights"]) for r in (cpu, gpu))
        w_diff = max((w_cpu[k] - w_gpu[k]).abs().max().item() for k in w_cpu)
        # AdamW's first step is about lr x sign(gradient) per weight, so a weight whose gradient is
        # near 0 can move differently on each device: compare the whole update's size instead
        update = math.sqrt(sum(((w_cpu[k] - w0[k]) ** 2).sum().item() for k in w0))
        apart = math.sqrt(sum(((w_cpu[k] - w_gpu[k]) ** 2).sum().item() for k in w0))
        loss_diff = abs(cpu["first_step"]["loss"] - gpu["first_step"]["loss"])
        norm_cpu, norm_gpu = cpu["first_step"]["grad_norm"], gpu["first_step"]["grad_norm"]
        grad_rel = abs(norm_cpu - norm_gpu) / max(norm_cpu, 1e-12)
        rows.append({"shape": shape, "batch": batch, "cpu_step_s": cpu["step_s_median"],
                     "cuda_step_s": gpu["step_s_median"], "cuda_speedup": cpu["step_s_median"] / gpu["step_s_median"],
                     "first_loss_abs_diff": loss_diff, "first_grad_norm_rel_diff": grad_rel,
                     "first_weights_max_abs_diff": w_diff, "first_update_rel_l2_diff": apart / max(update, 1e-30),
                     "cuda_first_logprob_gap": gpu["first_step"]["logprob_gap"],
                     "agree": loss_diff <= 1e-3 and grad_rel <= 1e-2 and apart <= 0.05 * update})
    return rows


def mib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.0f} MiB"


def main() -> int:  # noqa: C901 -- a straight-line benchmark: parse, pick the cases, run them, print the tables
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes and batches, 2 steps (for a CPU box)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per GPU case (default 5; --quick 2)")
    parser.add_argument("--cpu-steps", type=int, default=None, help="timed steps per CPU case (default 3; 0.6b: 2)")
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU cases (no ratios)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()

    from marlaas.basemodel import builtin_model_dir

    cuda = torch.cuda.is_available()
    gpu_steps = args.steps or (2 if args.quick else 5)
    batches = QUICK_BATCHES if args.quick else BATCHES
    big = "0.6b-quick" if args.quick else "0.6b"
    cases: list[Case] = []
    if not args.no_cpu:
        cases += [Case("tiny", "tiny", "cpu", steps=args.cpu_steps or (2 if args.quick else 3)),
                  Case(big, "small", "cpu", steps=args.cpu_steps or 2)]
    if cuda:
        cases += [Case("tiny", "tiny", "cuda", steps=gpu_steps), Case(big, "small", "cuda", steps=gpu_steps),
                  Case(big, "large", "cuda", steps=gpu_steps),
                  Case(big, "large", "cuda", micro_batch_tokens=16384, steps=gpu_steps),
                  Case(big, "large", "cuda", dtype="bfloat16", steps=gpu_steps),
                  Case(big, "large", "cuda", dtype="bfloat16", micro_batch_tokens=16384, steps=gpu_steps)]
    else:
        print("no CUDA device: running the CPU cases only", file=sys.stderr)
    env = environment()
    print(json.dumps(env), file=sys.stderr, flush=True)

    results: list[dict] = []
    batch_cache: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        big_dir = build_qwen3_dir(Path(tmp) / big, args.quick, "cuda" if cuda else "cpu")
        print(f"built {big} in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
        dirs = {"tiny": builtin_model_dir(), big: big_dir}
        vocab = {"tiny": 128, big: 4096 if args.quick else 151936}
        trainer, trainer_key = None, None
        for n, case in enumerate(cases):
            key = (case.shape, case.device, case.dtype)
            if key != trainer_key:
                trainer = None
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
                started = time.perf_counter()
                trainer, trainer_key = make_trainer(dirs[case.shape], case.device, case.dtype, 2048), key
                load_s = time.perf_counter() - started
            raw = raw_batch(vocab[case.shape], batches[case.batch_name])
            result = run_case(case, trainer, dirs[case.shape], raw, batch_cache, f"bench.job{n}")
            result["trainer_load_s"] = load_s
            results.append(result)
            print(f"{case.label}: {result['step_s_median'] * 1000:.0f} ms/step, "
                  f"{result['tokens_per_s']:.0f} tokens/s, peak {mib(result['peak_bytes'])}, "
                  f"loss {result['first_step']['loss']:+.4g} -> {result['last_loss']:+.4g}, "
                  f"finite {result['finite']}, changed {result['changed']}", file=sys.stderr, flush=True)
        trainer = None
    ratios = compare_devices(results)

    from rich.console import Console
    from rich.table import Table

    console = Console(width=170)
    title = (f"GRPO train step through PolicyTrainer ({env.get('gpu', 'no GPU')}; CPU {env['cpu']}, "
             f"{env['cpu_threads']} threads)")
    table = Table(title=title)
    for column in ("case", "base params", "tokens/step", "micro-batches", "step ms (median)", "tokens/s",
                   "peak", "step peak", "export ms", "first loss", "grad norm", "finite", "changed"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(r["case"], f"{r['base_params'] / 1e6:.1f}M", str(r["tokens_per_step"]), str(r["micro_batches"]),
                      f"{r['step_s_median'] * 1000:.1f}", f"{r['tokens_per_s']:.0f}", mib(r["peak_bytes"]),
                      mib(r["peak_step_bytes"]), f"{r['export_s'] * 1000:.1f}", f"{r['first_step']['loss']:+.2e}",
                      f"{r['first_step']['grad_norm']:.3g}", str(r["finite"]), str(r["changed"]))
    console.print(table)
    if ratios:
        side = Table(title="cpu against cuda, same batch, same version-0 adapter")
        for column in ("shape/batch", "cpu ms", "cuda ms", "cuda speed-up", "|first loss diff|",
                       "grad norm rel diff", "update rel diff (L2)", "max |weights diff|", "logprob gap", "agree"):
            side.add_column(column, justify="right")
        for r in ratios:
            side.add_row(f"{r['shape']}/{r['batch']}", f"{r['cpu_step_s'] * 1000:.1f}",
                         f"{r['cuda_step_s'] * 1000:.1f}", f"{r['cuda_speedup']:.1f}x",
                         f"{r['first_loss_abs_diff']:.1e}", f"{r['first_grad_norm_rel_diff']:.1e}",
                         f"{r['first_update_rel_l2_diff']:.1e}", f"{r['first_weights_max_abs_diff']:.1e}",
                         f"{r['cuda_first_logprob_gap']:.1e}", str(r["agree"]))
        console.print(side)
    by_case = {r["case"]: r for r in results}
    ref = by_case.get(f"{big}/large cuda float32")
    if ref:
        for other in (f"{big}/large cuda float32 mb16384", f"{big}/large cuda bfloat16",
                      f"{big}/large cuda bfloat16 mb16384"):
            if other in by_case:
                console.print(f"{other}: {ref['step_s_median'] / by_case[other]['step_s_median']:.2f}x the step rate "
                              f"of {ref['case']}, peak {mib(by_case[other]['peak_bytes'])} against "
                              f"{mib(ref['peak_bytes'])}")
    ok = all(r["finite"] and r["changed"] for r in results) and all(r["agree"] for r in ratios)
    console.print(f"checks: {'PASS' if ok else 'FAIL'} (finite loss, grad norm and weights; adapter changed; "
                  f"cpu and cuda agree on the first step where both ran)")
    if args.json:
        for r in results:
            r.pop("_first_weights", None)
            r.pop("_weights0", None)
        args.json.write_text(json.dumps({"environment": env, "results": results, "cpu_vs_cuda": ratios,
                                         "checks_pass": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
