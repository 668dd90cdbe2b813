"""The single-user baseline: GRPO + LoRA in one process, generate -> score -> update -> repeat.

    python benchmarks/inprocess_grpo.py [--task addition[,reverse]] [--steps 10] [--jobs N]
        [--group-size G] [--prompts-per-step P] [--max-new-tokens T] [--tool-latency S] [--json]

What one user with one job would write without marlaas, built from marlaas's own parts so
the comparison is fair: the same ``PolicyEngine`` (vLLM AsyncLLM with LoRA), the same
episodes (``run_episode``; problems from ``batch_seed``, a seed per sample and turn, a
batch's episodes concurrent), the task's own reward, the same ``PolicyTrainer`` (GRPO math,
AdamW; torch threads as the trainer service sets them where training and generation take
turns: every core) and a submission's job defaults.

Skipped: the broker (no NATS, no spans), the object store (each version's adapter goes to a
local directory and is loaded under a fresh version number, as rollout loads it) and the
service boundaries (rollout, trainer and env share this process and event loop; vLLM's
engine core is still its own child process). Tool calls run env's built-in tool functions
directly after ``--tool-latency`` s of ``asyncio.sleep``, as env injects latency. Nothing
overlaps: generation waits for the previous update, and ``--jobs N`` runs N jobs one after
another (seeds seed..seed+N-1, tasks cycling through ``--task``).

Timing: one untimed step of a throwaway job warms the engine and trainer first. The wall
then covers every job from its version-0 init to its last update. Per step: ``generate``
(episodes, tool waits included), ``reward``, ``train`` (update + export) and ``adapter``
(write the new version, load it into the engine). ``engine_busy`` / ``trainer_busy`` are
the engine's busy time (a request in it, as rollout measures
it) / train time over the wall; ``tokens_per_s`` is generated tokens over the wall.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import msgspec
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from marlaas.platform.adapters import CONFIG_FILE, WEIGHTS_FILE, init_adapter
from marlaas.platform.config import Config, load_config
from marlaas.platform.events import GrpoSettings, JobSpec, TrajectoryBatch, encode
from marlaas.tasks import Task, get_task
from marlaas.tools import BUILTIN, Tool, qualify, tool_subject
from marlaas.tools.serving import answer_tool_call
from services.rollout.agent import ConversationFormat, EpisodeLimits, Request, ToolBox, run_episode
from services.rollout.episode import episode_metrics
from services.rollout.service import batch_seed, sample_seed

PHASES = ("generate", "reward", "train", "adapter")


def tool_request(tools: list[Tool], latency_s: float) -> Request:
    """A ``ToolBox`` request without a broker: decode the call, sleep ``latency_s`` and run the
    built-in tool as env's serving shell does, encode the result."""
    by_subject = {tool_subject(f"{BUILTIN}.{t.name}"): t for t in tools}

    async def request(subject: str, data: bytes, timeout_s: float) -> bytes:
        if subject not in by_subject:  # as on the bus when nobody serves the subject
            raise TimeoutError(f"no tool answers on {subject!r}")
        answer = answer_tool_call(by_subject[subject], BUILTIN, data, delay=lambda qualified: latency_s)
        return encode(await asyncio.wait_for(answer, timeout_s))

    return request


def job_spec(task: Task, seed: int, steps: int, grpo: dict, tools: list[Tool]) -> JobSpec:
    """The spec a submission of ``task`` gets from the API defaults and the manager's validation."""
    settings = GrpoSettings(**grpo)  # 0 tokens = the task's budget, as the manager's validate fills it
    settings = msgspec.structs.replace(settings, max_new_tokens=settings.max_new_tokens or task.max_new_tokens)
    by_name = {f"{BUILTIN}.{t.name}": t for t in tools}
    missing = [name for name in task.tools if qualify(name) not in by_name]
    if missing:
        raise ValueError(f"task {task.name!r} calls {missing}: only built-in tools run in process")
    label = f"{task.name}-{seed}"
    return JobSpec(id=f"default.{label}", tenant="default", name=label, task=task.name, steps=steps, seed=seed,
                   tools=task.tools, tool_specs=tuple(by_name[qualify(n)].spec(BUILTIN) for n in task.tools),
                   grpo=settings, submitted_at=time.time())


async def sample_batch(engine, fmt: ConversationFormat, config: Config, spec: JobSpec, task: Task,
                       request: Request, lora, version: int) -> tuple[TrajectoryBatch, int, float]:
    """Version ``version``'s GRPO batch (rewards filled in) as rollout samples it, its generated
    tokens, and when generation ended (``perf_counter``): the rest was scoring."""
    grpo, rc = spec.grpo, config.rollout
    problems = task.problems(grpo.prompts_per_step, batch_seed(spec, version))
    prompt_ids = [fmt.prompt_ids(p["prompt"], list(spec.tool_specs)) for p in problems]

    async def episode(ids: list[int], prompt: int, sample: int):
        limits = EpisodeLimits(
            max_new_tokens=grpo.max_new_tokens,
            max_tool_calls=task.max_tool_calls if task.kind == "agentic" else 0,
            max_observation_tokens=task.max_observation_tokens,
            max_total_tokens=min(rc.max_model_len, len(ids) + task.max_episode_tokens(grpo.max_new_tokens)),
            tool_timeout_s=rc.tool_timeout_s)
        tools = ToolBox(spec.id, list(spec.tools), request, rc.tool_timeout_s, engine.utilization,
                        context=task.tool_context())
        return await run_episode(engine, fmt, ids, tools=tools, limits=limits, temperature=grpo.temperature,
                                 lora=lora, seed=lambda turn: sample_seed(spec, version, prompt, sample, turn),
                                 ignore_eos=grpo.ignore_eos)

    episodes = await asyncio.gather(*(episode(ids, i, j) for i, ids in enumerate(prompt_ids)
                                      for j in range(grpo.group_size)))
    generated = time.perf_counter()
    texts = [engine.tokenizer.decode(e.ids[len(e.prompt_ids):], skip_special_tokens=True) for e in episodes]
    finals = [engine.tokenizer.decode(e.final_turn_ids, skip_special_tokens=True) for e in episodes]
    rewards = [float(task.reward(problems[k // grpo.group_size], t)) for k, t in enumerate(finals)]  # as rollout
    samples = [e.to_sample(group=k // grpo.group_size, reward=r, text=t)
               for k, (e, r, t) in enumerate(zip(episodes, rewards, texts))]
    tokens = sum(len(s.ids) for e in episodes for s in e.segments if s.kind == "sampled")
    metrics = episode_metrics(episodes) if task.kind == "agentic" else {}
    batch = TrajectoryBatch(samples=samples, policy_version=version, metrics=metrics)
    return batch, tokens, generated


def write_version(job_dir: Path, version: int, config_json: bytes, weights: bytes) -> Path:
    """An adapter version as the PEFT directory vLLM loads; written to temp names, then renamed."""
    path = job_dir / f"v{version:06d}"
    path.mkdir(parents=True, exist_ok=True)
    for name, data in ((CONFIG_FILE, config_json), (WEIGHTS_FILE, weights)):
        (path / f"{name}.tmp").write_bytes(data)
        (path / f"{name}.tmp").rename(path / name)
    return path


async def run_job(engine, trainer, fmt, config: Config, spec: JobSpec, task: Task, request: Request,
                  job_dir: Path, keep: bool, on_step) -> list[dict]:
    """Train one job for ``spec.steps`` versions; one record of phase seconds per step."""
    config_json, weights = await asyncio.to_thread(init_adapter, config.base_model_dir, spec.lora, spec.seed)
    trainer.load(spec.id, 0, config_json, weights, None, spec.grpo)
    lora = await engine.use_adapter(spec.id, 0, write_version(job_dir, 0, config_json, weights))
    records = []
    for version in range(spec.steps):
        start = time.perf_counter()
        batch, tokens, generated = await sample_batch(engine, fmt, config, spec, task, request, lora, version)
        scored = time.perf_counter()
        result = await asyncio.to_thread(trainer.train_step, spec.id, batch, spec.grpo)
        trained = time.perf_counter()
        path = write_version(job_dir, version + 1, result.config_json, result.weights)
        if version + 1 < spec.steps:  # the last version is written (committed), never sampled
            lora = await engine.use_adapter(spec.id, version + 1, path)
        if not keep:
            for old in job_dir.iterdir():
                if old != path:
                    shutil.rmtree(old, ignore_errors=True)
        end = time.perf_counter()
        records.append({"job": spec.name, "version": version, "generate": generated - start,
                        "reward": scored - generated, "train": trained - scored, "adapter": end - trained,
                        "step": end - start, "tokens": tokens, "reward_mean": result.metrics["reward/mean"],
                        "tool_calls": batch.metrics.get("tool/calls", 0.0)})
        on_step(records[-1])
    trainer.evict(spec.id)
    await engine.drop_job(spec.id)
    return records


def start_trainer(config: Config):
    """The trainer service's ``PolicyTrainer``, with torch threads set as that service sets them
    for a schedule that never trains while the engine generates (the loop takes turns)."""
    import torch

    from services.trainer.policy import PolicyTrainer, torch_threads

    threads = torch_threads(config.trainer.torch_threads, config.trainer.device, beside_engine=False)
    if threads:
        torch.set_num_threads(threads)
    return PolicyTrainer(config.base_model_dir, config.trainer.device, config.trainer.hot_adapters,
                         config.trainer.micro_batch_tokens)


async def run_jobs(config: Config, tasks: list[Task], seeds: list[int], steps: int, grpo: dict,
                   tool_latency_s: float, work_dir: Path, keep: bool, progress: bool) -> dict:
    """Start the engine and trainer, warm them with one untimed step, then run the jobs in turn."""
    from services.rollout.engine import PolicyEngine  # vLLM and torch load late: --help stays instant

    engine = PolicyEngine(config)
    try:
        from services.env.tools import builtin_tools

        trainer = await asyncio.to_thread(start_trainer, config)
        tools = await builtin_tools(config) if any(t.tools for t in tasks) else []
        request = tool_request(tools, tool_latency_s)
        fmt = ConversationFormat(engine.tokenizer)
        specs = [job_spec(task, seed, steps, grpo, tools) for task, seed in zip(tasks, seeds)]
        warmup = msgspec.structs.replace(job_spec(tasks[0], -1, 1, grpo, tools), id="default.warmup", name="warmup")
        await run_job(engine, trainer, fmt, config, warmup, tasks[0], request, work_dir / "warmup", False,
                      lambda record: None)
        with Progress(console=Console(stderr=True), disable=not progress, transient=True) as bar:
            track = bar.add_task("in-process GRPO", total=len(specs) * steps)

            def on_step(record: dict) -> None:
                bar.update(track, advance=1, description=f"{record['job']} v{record['version']} "
                                                         f"reward {record['reward_mean']:.3f}")

            engine.utilization.take()  # measured like marlaas's engine: time with a request in it
            started = time.perf_counter()
            records = []
            for spec, task in zip(specs, tasks):
                records += await run_job(engine, trainer, fmt, config, spec, task, request,
                                         work_dir / spec.name, keep, on_step)
            wall = time.perf_counter() - started
            use = engine.utilization.take()
    finally:
        engine.shutdown()
    return summarize(records, len(specs), wall, use)


def summarize(records: list[dict], jobs: int, wall: float, use: dict[str, float]) -> dict:
    """The benchmark's figures from each step's record."""
    rewards: dict[str, list[float]] = {}
    for r in records:
        rewards.setdefault(r["job"], []).append(r["reward_mean"])
    return {
        "mode": "inprocess", "jobs": jobs, "steps": len(records), "wall_s": wall,
        "steps_per_hour": len(records) / wall * 3600,
        "step_s_median": statistics.median(r["step"] for r in records),
        "phase_s": {p: statistics.median(r[p] for r in records) for p in PHASES},
        "engine_busy": use["engine_busy_s"] / wall,
        "tool_wait_fraction": use["tools_pending_s"] / wall,
        "trainer_busy": sum(r["train"] for r in records) / wall,
        "tokens": sum(r["tokens"] for r in records),
        "tokens_per_s": sum(r["tokens"] for r in records) / wall,
        "tool_calls_per_episode": statistics.mean(r["tool_calls"] for r in records),
        "final_reward": {job: values[-1] for job, values in rewards.items()},
        "rewards": rewards,
    }


def run_inprocess(tasks: list[str], steps: int = 10, *, jobs: int | None = None, seed: int = 0,
                  group_size: int | None = None, prompts_per_step: int | None = None,
                  tool_latency_s: float = 0.0, max_new_tokens: int = 0, grpo: dict | None = None,
                  overrides: dict | None = None, work_dir: Path | None = None, progress: bool = True) -> dict:
    """Run ``jobs`` (default: one per task) GRPO jobs one after another in this process; the figures.

    ``grpo`` holds any other ``GrpoSettings`` fields, as a submission's ``grpo`` table (the named
    arguments win when set); ``overrides`` are config keys as for ``load_config`` (e.g.
    ``{"rollout.block_size": 32}``).
    Adapters go to a temporary directory, removed at the end; with ``work_dir`` every version
    stays there, as ``<work_dir>/<task>-<seed>/v000002/adapter_model.safetensors``.
    """
    jobs = len(tasks) if jobs is None else jobs
    grpo = {**(grpo or {}), **{k: v for k, v in (("group_size", group_size), ("prompts_per_step", prompts_per_step),
                                                 ("max_new_tokens", max_new_tokens)) if v}}
    root = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="marlaas-inprocess-"))
    try:
        config = load_config(overrides={"home": str(root / "home"), **(overrides or {})}, env={})
        chosen = [get_task(tasks[i % len(tasks)]) for i in range(jobs)]
        return asyncio.run(run_jobs(config, chosen, [seed + i for i in range(jobs)], steps, grpo,
                                    tool_latency_s, root, work_dir is not None, progress))
    finally:
        if work_dir is None:
            shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="addition", help="a task, or a comma list the jobs cycle through")
    parser.add_argument("--steps", type=int, default=10, help="versions per job")
    parser.add_argument("--jobs", type=int, default=None, help="jobs run one after another (default: one per task)")
    parser.add_argument("--seed", type=int, default=0, help="the first job's seed (job i gets seed + i)")
    parser.add_argument("--max-new-tokens", type=int, default=0, help="tokens per turn (0 = the task's)")
    parser.add_argument("--group-size", type=int, default=None, help=f"default {GrpoSettings().group_size}")
    parser.add_argument("--prompts-per-step", type=int, default=None,
                        help=f"default {GrpoSettings().prompts_per_step}")
    parser.add_argument("--tool-latency", type=float, default=0.0, help="seconds every tool call takes")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args()
    kwargs = dict(jobs=args.jobs, seed=args.seed, group_size=args.group_size, prompts_per_step=args.prompts_per_step,
                  tool_latency_s=args.tool_latency, max_new_tokens=args.max_new_tokens)
    result = run_inprocess(args.task.split(","), args.steps, **kwargs)
    if args.json:  # vLLM and its engine core log to stderr: stdout carries only this
        print(json.dumps(result))
        return
    r = result
    table = Table("jobs", "steps", "wall s", "steps/hour", "step s (median)", *(f"{p} s" for p in PHASES),
                  "engine busy", "trainer busy", "tokens/s")
    table.add_row(str(r["jobs"]), str(r["steps"]), f"{r['wall_s']:.1f}", f"{r['steps_per_hour']:.0f}",
                  f"{r['step_s_median']:.2f}", *(f"{r['phase_s'][p]:.2f}" for p in PHASES),
                  f"{r['engine_busy']:.0%}", f"{r['trainer_busy']:.0%}", f"{r['tokens_per_s']:.0f}")
    console = Console(width=160)
    console.print(table)
    for job, values in r["rewards"].items():
        console.print(f"{job}: reward per step {[round(v, 3) for v in values]}")


if __name__ == "__main__":
    main()
