"""Garbage collection of a job's objects against a real nats-server and a file:// store."""

from __future__ import annotations

import pytest

from marlaas.platform.bus import JOBS_BUCKET, VERSIONS_BUCKET
from marlaas.platform.commits import announce
from marlaas.platform.events import CommittedVersion, JobRecord, JobSpec, JobState, encode
from services.manager.gc import collect_job

pytestmark = pytest.mark.timeout(60)
JOB = "acme.add-1a2b3c"


def write_version(store, version: int, name: str) -> tuple:
    """One attempt at ``version``: adapter config + weights, optimizer state, a trajectory batch."""
    base = f"{JOB}/v{version:06d}/{name}"
    store.put_bytes(f"adapters/{base}/adapter_config.json", b"{}")
    adapter = store.put_bytes(f"adapters/{base}/adapter_model.safetensors", f"w{version}{name}".encode())
    optimizer = store.put_bytes(f"optimizer/{base}/adamw.pt", f"o{version}{name}".encode())
    store.put_bytes(f"trajectories/{base}/batch.json", b"[]")
    return adapter, optimizer


async def commit(bus, version: int, adapter, optimizer) -> None:
    committed = CommittedVersion(job=JOB, version=version, adapter=adapter,
                                 optimizer=optimizer if version else None, committed_at=float(version))
    await bus.kv_put(VERSIONS_BUCKET, JOB, encode(committed))
    await announce(bus, committed)


def keys_of(version: int, name: str, *kinds: str) -> set[str]:
    files = {"adapters": ("adapter_config.json", "adapter_model.safetensors"), "optimizer": ("adamw.pt",),
             "trajectories": ("batch.json",)}
    return {f"{kind}/{JOB}/v{version:06d}/{name}/{f}" for kind in kinds for f in files[kind]}


async def test_collect_job_keeps_the_last_versions_pinned_ones_and_what_may_be_in_flight(bus, file_store):
    spec = JobSpec(id=JOB, tenant="acme", name="add", task="addition", steps=10)
    await bus.kv_put(JOBS_BUCKET, JOB, encode(JobRecord(spec=spec, state=JobState.RUNNING, version=5,
                                                        pinned=[1])))
    for version in range(6):
        write_version(file_store, version, f"lost{version}")  # a crashed or losing attempt
        await commit(bus, version, *write_version(file_store, version, f"win{version}"))
    write_version(file_store, 6, "inflight")
    file_store.put_bytes("adapters/other.job/v000000/a/adapter_model.safetensors", b"x")  # not this job
    before = set(file_store.list())

    deleted = await collect_job(bus, file_store, JOB, keep_last=2)

    kept = (keys_of(1, "win1", "adapters")  # pinned
            | keys_of(4, "win4", "adapters") | keys_of(5, "win5", "adapters")  # the last two
            | keys_of(5, "win5", "optimizer")  # the committed latest's: a resume needs it
            | keys_of(5, "win5", "trajectories") | keys_of(5, "lost5", "trajectories")  # not trained yet
            | keys_of(6, "inflight", "adapters", "optimizer", "trajectories")  # above latest
            | {"adapters/other.job/v000000/a/adapter_model.safetensors"})
    assert set(file_store.list()) == kept
    assert deleted == len(before - kept)
    assert not (file_store.root / "adapters" / JOB / "v000000").exists()  # emptied folders are pruned

    assert await collect_job(bus, file_store, JOB, keep_last=2) == 0  # idempotent


async def test_a_finished_job_keeps_its_last_versions_and_an_unknown_job_is_left_alone(bus, file_store):
    spec = JobSpec(id=JOB, tenant="acme", name="add", task="addition", steps=2)
    await bus.kv_put(JOBS_BUCKET, JOB, encode(JobRecord(spec=spec, state=JobState.COMPLETED, version=2)))
    for version in range(3):
        await commit(bus, version, *write_version(file_store, version, f"win{version}"))

    await collect_job(bus, file_store, JOB, keep_last=1)

    assert set(file_store.list()) == (keys_of(2, "win2", "adapters", "optimizer", "trajectories"))
    file_store.put_bytes("adapters/acme.gone/v000000/a/adapter_model.safetensors", b"x")
    assert await collect_job(bus, file_store, "acme.gone", keep_last=1) == 0
    assert "adapters/acme.gone/v000000/a/adapter_model.safetensors" in file_store.list()


async def test_the_unfinished_files_of_a_killed_writer_go_with_their_attempt(bus, file_store):
    # a trainer killed between creating a temp file and renaming it into place leaves an
    # attempt that holds only that temp file: list() never shows it, collection must delete it
    spec = JobSpec(id=JOB, tenant="acme", name="add", task="addition", steps=4)
    await bus.kv_put(JOBS_BUCKET, JOB, encode(JobRecord(spec=spec, state=JobState.RUNNING, version=3)))
    killed = {}
    for version in range(4):
        for kind, name in (("adapters", "adapter_model.safetensors"), ("optimizer", "adamw.pt")):
            folder = file_store.root / kind / JOB / f"v{version:06d}" / "killed"
            folder.mkdir(parents=True)
            (folder / f".{name}.x1y2.tmp").write_bytes(b"half written")
            killed[(kind, version)] = folder
        await commit(bus, version, *write_version(file_store, version, f"win{version}"))
    assert file_store.interrupted_writes(f"adapters/{JOB}/") and not any(
        key.endswith(".tmp") for key in file_store.list())

    await collect_job(bus, file_store, JOB, keep_last=2)

    # the losing attempts of every committed version go, temp files and folders included
    assert not any(folder.exists() for folder in killed.values())
    assert file_store.interrupted_writes() == []
    assert set(file_store.list()) == (keys_of(2, "win2", "adapters") | keys_of(3, "win3", "adapters")
                                      | keys_of(3, "win3", "optimizer", "trajectories"))
