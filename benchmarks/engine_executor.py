"""Where the CPU engine runs its model, and what that costs in cores: ``mp`` against ``uni``.

    python benchmarks/engine_executor.py [--tokens 32] [--repeats 5] [--gap 1.0]

vLLM on CPU runs the model by default in a worker process that the engine core feeds
through a shared-memory queue; each side waits for the other by spinning (``sched_yield``)
for a second after every message, so while requests flow, and for a second after, two
processes hold two cores for one core's work. ``rollout.cpu_executor = "uni"`` runs the
model in the engine core process instead (vLLM's ``UniProcExecutor``, with one torch
thread by default: ``rollout.cpu_threads``).

For each executor a fresh ``PolicyEngine`` (the one rollout runs) with one rank-8 adapter
generates batches of 64 completions of exactly ``--tokens`` tokens, back to back and then
with a pause of ``--gap`` seconds after each (an agentic job waiting on its tools), then
sits idle for 3 s. Printed side by side: wall seconds per batch and CPU seconds per batch
(the whole process tree: the frontend, the engine core and any worker), and their ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

from marlaas.platform.adapters import init_adapter, materialize, write_adapter
from marlaas.platform.config import load_config
from marlaas.platform.events import LoraSettings
from marlaas.platform.store import FileStore

PROMPT_IDS = [5, 6, 7, 8, 9, 10, 11, 12]


def tree_cpu_s() -> float:
    """CPU seconds (user + system) of this process and all its descendants."""
    total = 0.0
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


async def measure(executor: str, tokens: int, repeats: int, gap_s: float, work: Path) -> dict:
    from services.rollout.engine import PolicyEngine

    config = load_config(overrides={"home": str(work / "home"), "rollout.cpu_executor": executor}, env={})
    engine = PolicyEngine(config)
    try:
        store = FileStore(work / "store")
        cfg, weights = init_adapter(config.base_model_dir, LoraSettings(rank=8), seed=0)
        lora = await engine.use_adapter("t.j0", 0, materialize(store, write_adapter(store, "t.j0", 0, cfg, weights),
                                                               work / "adapter"))
        processes = sorted(p.name() for p in psutil.Process().children(recursive=True))

        async def batch(r: int) -> None:
            await asyncio.gather(*(engine.generate(PROMPT_IDS, max_tokens=tokens, temperature=1.0, lora=lora,
                                                   seed=r * 1000 + i, ignore_eos=True) for i in range(64)))

        await batch(0)  # warm
        row = {"executor": executor, "processes": ", ".join(processes)}
        for label, pause in (("back to back", 0.0), (f"{gap_s:g} s gaps", gap_s)):
            cpu, start = tree_cpu_s(), time.perf_counter()
            for r in range(repeats):
                await batch(r)
                await asyncio.sleep(pause)
            row[f"{label}: wall s"] = (time.perf_counter() - start - pause * repeats) / repeats
            row[f"{label}: cpu s"] = (tree_cpu_s() - cpu) / repeats
        cpu = tree_cpu_s()
        await asyncio.sleep(3.0)
        row["idle 3 s: cpu s"] = tree_cpu_s() - cpu
        return row
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per completion")
    parser.add_argument("--repeats", type=int, default=5, help="batches per measurement")
    parser.add_argument("--gap", type=float, default=1.0, help="seconds of pause after each batch (tool wait)")
    args = parser.parse_args()
    console = Console(width=140)
    work = Path(tempfile.mkdtemp(prefix="marlaas-engine-executor-"))
    rows = []
    try:
        for executor in ("mp", "uni"):
            with console.status(f"executor {executor}..."):
                rows.append(asyncio.run(measure(executor, args.tokens, args.repeats, args.gap, work / executor)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = Table(*rows[0])
    for row in rows:
        table.add_row(*(v if isinstance(v, str) else f"{v:.3f}" for v in row.values()))
    console.print(f"64 completions x {args.tokens} tokens a batch, one rank-8 adapter, mean of {args.repeats}:")
    console.print(table)
    mp, uni = rows
    for key in [k for k in mp if k.endswith("s") and k != "processes" and mp[k] and uni[k]]:
        console.print(f"{key}: mp / uni = {mp[key] / uni[key]:.2f}x")


if __name__ == "__main__":
    main()
