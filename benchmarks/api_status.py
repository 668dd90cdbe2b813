"""How fast the HTTP API answers status reads with 1,000 jobs in the registry.

    python benchmarks/api_status.py [--jobs 1000] [--lists 20] [--gets 300]

Starts a throwaway stack with only the manager and the gateway (no engine, no trainer),
writes ``--jobs`` valid job records of one tenant straight into the ``jobs`` KV bucket
(10 % queued, 20 % running, 70 % completed with 40 versions of rewards; the queued ones
are too big for the KV budget, so they stay queued and each asks for a queue position,
which reads every tenant's records), then times ``GET /v1/jobs`` (the whole list) and
``GET /v1/jobs/{id}`` over keep-alive connections, and prints the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time

import httpx
from rich.console import Console
from rich.table import Table

from marlaas.platform.bus import JOBS_BUCKET, Bus
from marlaas.platform.config import load_config
from marlaas.platform.events import JobRecord, JobSpec, JobState, encode
from marlaas.platform.tenants import add_tenant
from marlaas.stack.launcher import Stack

TENANT = "bench"


def make_record(i: int, now: float) -> JobRecord:
    """A plausible record: state by index, 40 rewards for completed jobs."""
    state = JobState.QUEUED if i % 10 == 0 else JobState.RUNNING if i % 10 < 3 else JobState.COMPLETED
    spec = JobSpec(id=f"{TENANT}.job-{i:06d}", tenant=TENANT, name=f"job-{i}", task="addition", steps=40,
                   seed=i, submitted_at=now - 3600 + i)
    done = state is JobState.COMPLETED
    return JobRecord(
        spec=spec, state=state, version=40 if done else 5 if state is JobState.RUNNING else -1,
        rewards=[0.5 + 0.01 * k for k in range(40 if done else 5 if state is JobState.RUNNING else 0)],
        kv_cache_bytes=2**40 if state is JobState.QUEUED else 0,  # never fits: stays queued
        admitted_at=spec.submitted_at + 1 if state is not JobState.QUEUED else 0.0,
        first_commit_at=spec.submitted_at + 5 if state is not JobState.QUEUED else 0.0,
        last_commit_at=spec.submitted_at + 45 if done else 0.0,
        finished_at=spec.submitted_at + 45 if done else 0.0,
    )


async def fill(url: str, jobs: int) -> str:
    """Write the records; return the tenant's token."""
    bus = await Bus.connect(url, name="bench")
    try:
        _, token = await add_tenant(bus, TENANT, max_jobs=jobs)
        now = time.time()
        await asyncio.gather(*(bus.kv_put(JOBS_BUCKET, f"{TENANT}.job-{i:06d}", encode(make_record(i, now)))
                               for i in range(jobs)))
        return token
    finally:
        await bus.close()


def timed(client: httpx.Client, path: str, headers: dict[str, str] | None = None) -> tuple[float, httpx.Response]:
    start = time.perf_counter()
    response = client.get(path, headers=headers)
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    return elapsed, response


def row(table: Table, what: str, times: list[float], note: str = "") -> None:
    times = sorted(times)
    p95 = times[min(len(times) - 1, int(0.95 * len(times)))]
    table.add_row(what, str(len(times)), f"{statistics.median(times) * 1000:.1f}", f"{p95 * 1000:.1f}",
                  f"{len(times) / sum(times):.1f}", note)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--lists", type=int, default=20)
    parser.add_argument("--gets", type=int, default=300)
    args = parser.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory(prefix="marlaas-bench-") as home:
        config = load_config(overrides={"home": home, "gateway.port": 0}, env={})
        with console.status("starting nats-server, manager and gateway..."):
            stack = Stack(config, services=("manager", "gateway")).start()
        try:
            token = asyncio.run(fill(stack.nats_url, args.jobs))
            url = (stack.run_dir / "gateway.url").read_text().strip()
            with httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {token}"}) as client:
                timed(client, "/v1/jobs")  # warm up
                lists, size = [], 0
                for _ in range(args.lists):
                    elapsed, response = timed(client, "/v1/jobs")
                    lists.append(elapsed)
                    size = len(response.content)
                    assert len(response.json()) == args.jobs
                ids = [f"{TENANT}.job-{i:06d}" for i in range(args.jobs)]
                rng = random.Random(0)
                gets = {"queued": [], "other": []}
                for job in rng.choices(ids, k=args.gets):
                    elapsed, response = timed(client, f"/v1/jobs/{job}")
                    gets["queued" if response.json()["state"] == "queued" else "other"].append(elapsed)
                operator = {"Authorization": f"Bearer {stack.operator_token}"}  # /metrics is the operator's
                metrics = [timed(client, "/metrics", operator)[0] for _ in range(5)]
        finally:
            stack.stop()
    table = Table("request", "n", "median ms", "p95 ms", "req/s (serial)", "note",
                  title=f"HTTP API with {args.jobs} jobs of one tenant")
    row(table, "GET /v1/jobs", lists, f"{args.jobs} jobs, {size / 1024:.0f} KiB")
    row(table, "GET /v1/jobs/{id} (running/done)", gets["other"], "one KV read")
    if gets["queued"]:
        row(table, "GET /v1/jobs/{id} (queued)", gets["queued"], "+ queue position (all records, at most 1 s old)")
    row(table, "GET /metrics", metrics, "every record + span counters")
    console.print(table)


if __name__ == "__main__":
    main()
