"""One GRPO train step on the built-in model with 1 torch thread against every core, side by side.

    python benchmarks/train_threads.py [--threads 1,2] [--rounds 5] [--steps 4] [--json]

Why it matters: under ``async`` the trainer leaves the CPU engine a core, because one job
trains while others generate; under ``sync`` and ``sequential`` (and the in-process loop) the
engine idles while a job trains, so the trainer takes every core
(``services.trainer.policy.torch_threads``). This measures what that is worth for a step.

The batch has ``agentic-10``'s shape: 8 groups of 8 samples, a 30-token prompt and a 60-100
token completion each, a fifth of it a tool's answer (masked out of the loss). The thread
counts alternate round by round (``--rounds``, each ``--steps`` steps after one untimed step),
so a drift of the host's speed during the run lands on every count alike; the table gives
the median step of each count and its speed-up over the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def make_batch(seed: int = 1):
    """64 samples in 8 groups, agentic-10-sized: tool answers masked out of the loss."""
    import torch

    from marlaas.platform.events import Sample, TrajectoryBatch

    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(64):
        length = int(torch.randint(60, 101, (1,), generator=gen))
        answer = slice(length // 2, length // 2 + length // 5)  # the tool's answer, mid-completion
        mask = [0 if answer.start <= t < answer.stop else 1 for t in range(length)]
        samples.append(Sample(
            group=i // 8, prompt_ids=torch.randint(2, 128, (30,), generator=gen).tolist(),
            completion_ids=torch.randint(2, 128, (length,), generator=gen).tolist(),
            logprobs=[-4.0] * length, loss_mask=mask, reward=torch.rand((), generator=gen).item()))
    return TrajectoryBatch(samples=samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per count and round")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    counts = [int(n) for n in args.threads.split(",")]

    import torch
    from rich.console import Console
    from rich.progress import track
    from rich.table import Table

    from marlaas.basemodel import builtin_model_dir
    from marlaas.platform.adapters import init_adapter
    from marlaas.platform.events import GrpoSettings, LoraSettings
    from services.trainer.policy import PolicyTrainer

    model_dir = builtin_model_dir()
    trainer = PolicyTrainer(model_dir)
    settings = GrpoSettings()
    trainer.load("bench.job", 0, *init_adapter(model_dir, LoraSettings(), seed=0), None, settings)
    batch = make_batch()
    seconds: dict[int, list[float]] = {n: [] for n in counts}
    for _ in track(range(args.rounds), description="rounds", disable=args.json):
        for n in counts:
            torch.set_num_threads(n)
            trainer.train_step("bench.job", batch, settings)  # untimed: the thread pool settles
            for _ in range(args.steps):
                started = time.perf_counter()
                trainer.train_step("bench.job", batch, settings)
                seconds[n].append(time.perf_counter() - started)
    medians = {n: statistics.median(s) for n, s in seconds.items()}
    rows = [{"threads": n, "step_ms": medians[n] * 1000, "speedup": medians[counts[0]] / medians[n]}
            for n in counts]
    if args.json:
        print(json.dumps({"rows": rows}))
        return
    table = Table(title="GRPO train step, agentic-10-sized batch (median)")
    for column in ("torch threads", "step ms", f"speed-up over {counts[0]}"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(str(row["threads"]), f"{row['step_ms']:.0f}", f"{row['speedup']:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
