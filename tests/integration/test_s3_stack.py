"""The stack in its deployed shape: adapters and optimizer state in an S3 store (a real SeaweedFS server, via minio)."""

from __future__ import annotations

import asyncio

import pytest

from marlaas.platform.config import load_config
from marlaas.platform.nats_client import BusClient
from marlaas.platform.store import S3Store
from marlaas.stack.launcher import Stack

pytestmark = [pytest.mark.stack,  # starts a vLLM engine: not in `make test-fast`
              pytest.mark.own_stack("the object store on a real S3 server")]


@pytest.mark.timeout(400)
def test_a_job_commits_its_versions_to_the_s3_store(tmp_path, s3_server):
    config = load_config(overrides={"home": str(tmp_path), "gateway.port": 0, "store_url": "s3://marlaas/run1"}, env={})

    async def go(url: str) -> str:
        client = await BusClient.connect(url)
        job = await client.submit({"name": "s3", "task": "repeat", "steps": 2, "seed": 1})
        (view,) = await client.wait([job], timeout_s=300)
        await client.close()
        assert view.state == "completed" and view.version == 2
        return job

    with Stack(config, child_env={"MARLAAS_S3_ENDPOINT": s3_server}) as stack:
        job = asyncio.run(go(stack.nats_url))

    keys = S3Store("marlaas", "run1", endpoint=s3_server).list(f"adapters/{job}/")
    versions = sorted({key.split("/")[2] for key in keys})
    assert versions == ["v000000", "v000001", "v000002"]
    for v in versions:
        names = {key.rsplit("/", 1)[1] for key in keys if f"/{v}/" in key}
        assert names == {"adapter_config.json", "adapter_model.safetensors"}
    assert S3Store("marlaas", "run1", endpoint=s3_server).list(f"optimizer/{job}/")
    assert not (tmp_path / "store").exists()  # nothing fell back to the file store
