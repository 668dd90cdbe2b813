"""Shared fixtures: a real nats-server, a connected bus, an S3-compatible server, a file store."""

from __future__ import annotations

import pytest

from marlaas.bus import Bus
from marlaas.embedded_nats import EmbeddedNats
from marlaas.store import FileStore

@pytest.fixture
def nats_server(tmp_path):
    """A nats-server with JetStream storing under this test's tmp dir; restartable on its port."""
    server = EmbeddedNats(tmp_path / "nats").start()
    yield server
    server.stop()


@pytest.fixture
async def bus(nats_server):
    """A bus connected to ``nats_server`` with the project's streams and KV buckets created."""
    connected = await Bus.connect(nats_server.url, name="test")
    await connected.ensure_topology()
    yield connected
    await connected.close()


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on a free loopback port; yields its ``host:port`` endpoint.

    Fake credentials go in the environment (moto accepts any), where S3Store reads them.
    """
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as env:
        for var in ("MARLAAS_S3_ACCESS_KEY", "AWS_ACCESS_KEY_ID"):
            env.setenv(var, "marlaas-test")
        for var in ("MARLAAS_S3_SECRET_KEY", "AWS_SECRET_ACCESS_KEY"):
            env.setenv(var, "marlaas-test-secret")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        yield f"{host}:{port}"
        server.stop()


@pytest.fixture
def file_store(tmp_path):
    """A ``file://`` object store under this test's tmp dir."""
    return FileStore(tmp_path / "store")
