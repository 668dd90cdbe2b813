"""What the engine's LoRA settings cost per step: generation alone, in a bare rollout engine.

    python benchmarks/engine_lora.py [--variants "8,16;1,16;8,8;1,8"] [--jobs 1,4] [--tokens 32]
                                     [--kernels fused,grouped,vllm] [--max-num-seqs 128,1024]

For each variant ``max_loras,max_lora_rank`` a fresh ``PolicyEngine`` (the one rollout
runs) generates, for 1 job and then for several jobs at once, 64 completions per job of
exactly ``--tokens`` tokens (``ignore_eos``) with a rank-8 adapter per job, and once with
no adapter at all. Printed: the median seconds of a batch over repeats, side by side. On
CPU, vLLM's LoRA path pads every adapter to ``max_lora_rank`` and sizes its buffers by
``max_loras``; this shows what those settings cost. ``--kernels`` runs each variant with
each of the CPU LoRA kernels named (``rollout.cpu_lora_kernels``): marlaas's fused layers
(``"fused"``, the default), marlaas's grouped ops alone (``"grouped"``) and vLLM's own
(``"vllm"``), side by side. ``--max-num-seqs`` runs each with each engine step size named
(``rollout.max_num_seqs``: the sequences one engine step holds; vLLM's default is 128).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from marlaas.platform.adapters import init_adapter, materialize, write_adapter
from marlaas.platform.config import load_config
from marlaas.platform.events import LoraSettings
from marlaas.platform.store import FileStore

PROMPT_IDS = [5, 6, 7, 8, 9, 10, 11, 12]


async def batch_s(engine, loras: list, tokens: int, repeats: int) -> float:
    times = []
    for r in range(repeats):
        start = time.perf_counter()
        await asyncio.gather(*(engine.generate(PROMPT_IDS, max_tokens=tokens, temperature=1.0, lora=lora,
                                               seed=r * 1000 + i, ignore_eos=True)
                               for lora in loras for i in range(64)))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def measure(max_loras: int, rank: int, job_counts: list[int], tokens: int, repeats: int,
                  work: Path, kernels: str = "fused", max_num_seqs: int = 0) -> dict:
    from services.rollout.engine import PolicyEngine

    config = load_config(overrides={"home": str(work / "home"), "rollout.max_loras": max_loras,
                                    "rollout.max_lora_rank": rank, "rollout.cpu_lora_kernels": kernels,
                                    **({"rollout.max_num_seqs": max_num_seqs} if max_num_seqs else {})},
                         env={})
    engine = PolicyEngine(config)
    try:
        store = FileStore(work / "store")
        loras = []
        for j in range(max(job_counts)):
            cfg, weights = init_adapter(config.base_model_dir, LoraSettings(rank=8), seed=j)
            blob = write_adapter(store, f"t.j{j}", 0, cfg, weights)
            loras.append(await engine.use_adapter(f"t.j{j}", 0, materialize(store, blob, work / f"a{j}")))
        await batch_s(engine, loras[:1], tokens, 1)  # warm
        seqs = engine.engine.vllm_config.scheduler_config.max_num_seqs
        row = {"variant": f"max_loras={max_loras}, max_lora_rank={rank}, {kernels} kernels, max_num_seqs={seqs}",
               "no adapter": await batch_s(engine, [None], tokens, repeats)}
        for n in job_counts:
            row[f"{n} job{'s' if n > 1 else ''}"] = await batch_s(engine, loras[:n], tokens, repeats)
        return row
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="8,16;1,16;8,8", help="max_loras,max_lora_rank;...")
    parser.add_argument("--jobs", default="1,4", help="jobs (adapters) generating at once")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per completion")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kernels", default="fused", help="CPU LoRA kernels to compare: fused,grouped,vllm")
    parser.add_argument("--max-num-seqs", default="0", help="engine step sizes to compare (0 = the config's)")
    args = parser.parse_args()
    counts = [int(x) for x in args.jobs.split(",")]
    rows = []
    work = Path(tempfile.mkdtemp(prefix="marlaas-engine-lora-"))
    console = Console(width=120)
    try:
        for variant in args.variants.split(";"):
            max_loras, rank = (int(x) for x in variant.split(","))
            for kernels in args.kernels.split(","):
                for seqs in (int(x) for x in args.max_num_seqs.split(",")):
                    with console.status(f"max_loras={max_loras}, max_lora_rank={rank}, {kernels} kernels, "
                                        f"max_num_seqs={seqs or 'config'}..."):
                        rows.append(asyncio.run(measure(max(max_loras, 1), rank, counts, args.tokens, args.repeats,
                                                        work / f"{variant.replace(',', '-')}-{kernels}-{seqs}",
                                                        kernels, seqs)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = Table("variant", *(k for k in rows[0] if k != "variant"))
    for row in rows:
        table.add_row(row["variant"], *(f"{v:.3f} s" for k, v in row.items() if k != "variant"))
    console.print(f"64 completions x {args.tokens} tokens per job, median of {args.repeats}:")
    console.print(table)


if __name__ == "__main__":
    main()
