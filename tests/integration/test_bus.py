"""The bus against a real nats-server: dedup, redelivery, ack/nak/term, KV CAS, restart, RPC."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter

import nats.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig
from polling import eventually

from marlaas.platform.bus import Bus, Delivery, KvEntry, PoisonMessage, StaleRevision
from marlaas.platform.events import JOB
from marlaas.stack.embedded_nats import EmbeddedNats

pytestmark = pytest.mark.timeout(60)

TRAJ_SUBJECT = "marlaas.trajectory.ready.acme.j1"
JOB_SUBJECT = "marlaas.job.state.acme.j1"


@contextlib.asynccontextmanager
async def consuming(bus: Bus, stream: str, durable: str, subject: str, handler, **options):
    """Run ``bus.consume`` in the background for the duration of the block, then stop it."""
    stop = asyncio.Event()
    loop_task = asyncio.create_task(
        bus.consume(stream, durable, subject, handler, stop=stop, **options)
    )
    try:
        yield loop_task
    finally:
        stop.set()
        await asyncio.wait_for(loop_task, timeout=5)


def recorder(seen: list[tuple[bytes, int]]):
    async def handler(delivery: Delivery) -> None:
        seen.append((delivery.data, delivery.num_delivered))

    return handler


async def stream_messages(bus: Bus, stream: str) -> int:
    return (await bus.js.stream_info(stream)).state.messages


async def stream_holds(bus: Bus, stream: str, count: int) -> bool:
    return await stream_messages(bus, stream) == count


async def take_without_ack(url: str, subject: str, durable: str, stream: str, count: int,
                           ack_wait_s: float) -> Bus:
    """A second worker takes ``count`` messages from the durable and holds them unacked."""
    worker = await Bus.connect(url, name="doomed-worker")
    config = ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT,
                            ack_wait=ack_wait_s, max_deliver=20, max_ack_pending=8)
    sub = await worker.js.pull_subscribe(subject, durable=durable, stream=stream, config=config)
    taken = await sub.fetch(count, timeout=2)
    assert len(taken) == count
    return worker


# --- publish ---------------------------------------------------------------------------------


async def test_duplicate_publish_with_same_msg_id_is_stored_once(bus):
    subject = "marlaas.policy.committed.acme.j1"
    assert await bus.publish(subject, b"v1", msg_id="acme.j1:1") is True
    assert await bus.publish(subject, b"v1 re-announced", msg_id="acme.j1:1") is False
    assert await stream_messages(bus, "POLICY") == 1
    stored = await bus.js.get_msg("POLICY", 1)
    assert stored.data == b"v1"

    assert await bus.publish(subject, b"v2", msg_id="acme.j1:2") is True
    assert await stream_messages(bus, "POLICY") == 2


async def test_ensure_topology_is_idempotent(bus):
    await bus.publish(JOB_SUBJECT, b"kept")
    await bus.ensure_topology()  # a second service starting up
    assert await stream_messages(bus, "JOBS") == 1


# --- durable consumers ---------------------------------------------------------------------


async def test_message_of_a_consumer_that_dies_unacked_is_redelivered_to_another(bus, nats_server):
    await bus.publish(TRAJ_SUBJECT, b"batch-1")
    worker = await take_without_ack(nats_server.url, TRAJ_SUBJECT, "trainer", "TRAJ", 1, 1.0)
    await worker.nc.close()  # dies without acking

    seen: list[tuple[bytes, int]] = []
    async with consuming(bus, "TRAJ", "trainer", TRAJ_SUBJECT, recorder(seen)):
        await eventually(lambda: seen, what="redelivery")
        await eventually(lambda: stream_holds(bus, "TRAJ", 0), what="the redelivery acked")
    assert seen == [(b"batch-1", 2)]  # the second delivery, to the surviving consumer


@pytest.mark.parametrize("outcome", ["term", "poison", "undecodable"])
async def test_termed_message_is_not_redelivered(bus, outcome):
    terminated: list[dict] = []

    async def on_advisory(msg) -> None:
        terminated.append(json.loads(msg.data))

    advisories = "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.JOBS.watcher"
    await bus.nc.subscribe(advisories, cb=on_advisory)
    await bus.publish(JOB_SUBJECT, b"not an event")
    calls: list[int] = []

    async def handler(delivery: Delivery) -> None:
        calls.append(delivery.num_delivered)
        if outcome == "term":
            await delivery.term()
        elif outcome == "poison":
            raise PoisonMessage("job acme.j1 sent a batch that can never train")
        else:
            JOB.decode(delivery.data)

    # an unsettled message would come back after 0.4 s, a nak'ed one after 0.1 s
    async with consuming(bus, "JOBS", "watcher", JOB_SUBJECT, handler,
                         ack_wait_s=0.4, retry_delay_s=0.1):
        await eventually(lambda: terminated, what="a MSG_TERMINATED advisory")
        await asyncio.sleep(1.0)
    assert calls == [1]
    assert [a["stream_seq"] for a in terminated] == [1]
    info = await bus.js.consumer_info("JOBS", "watcher")
    assert (info.num_ack_pending, info.num_redelivered) == (0, 0)


async def test_transient_failure_is_nacked_and_retried(bus):
    await bus.publish(TRAJ_SUBJECT, b"batch-1")
    attempts: list[tuple[int, float]] = []

    async def handler(delivery: Delivery) -> None:
        attempts.append((delivery.num_delivered, time.monotonic()))
        if delivery.num_delivered == 1:
            raise ConnectionError("object store briefly unreachable")

    # ack_wait is long: a retry within it can only come from the nak
    async with consuming(bus, "TRAJ", "trainer", TRAJ_SUBJECT, handler,
                         ack_wait_s=10.0, retry_delay_s=0.2):
        await eventually(lambda: len(attempts) == 2, what="a retry")
        await eventually(lambda: stream_holds(bus, "TRAJ", 0), what="the retry acked")
    assert [n for n, _ in attempts] == [1, 2]
    assert attempts[1][1] - attempts[0][1] >= 0.15  # nak(delay) held it back


# --- key-value -------------------------------------------------------------------------------


async def test_kv_compare_and_set(bus):
    assert await bus.kv_get("versions", "acme.j1") is None
    rev0 = await bus.kv_create("versions", "acme.j1", b"v0")
    assert await bus.kv_get("versions", "acme.j1") == KvEntry(b"v0", rev0)
    rev1 = await bus.kv_update("versions", "acme.j1", b"v1", revision=rev0)
    assert rev1 > rev0

    with pytest.raises(StaleRevision, match=f"versions/acme.j1 is no longer at revision {rev0}"):
        await bus.kv_update("versions", "acme.j1", b"v1 from a stale read", revision=rev0)
    with pytest.raises(StaleRevision, match="versions/acme.j1 already exists"):
        await bus.kv_create("versions", "acme.j1", b"v0 again")

    entry = await bus.kv_get("versions", "acme.j1")
    assert (entry.value, entry.revision) == (b"v1", rev1)
    assert await bus.kv_keys("versions") == ["acme.j1"]


async def test_concurrent_compare_and_set_has_one_winner(bus):
    rev = await bus.kv_create("versions", "acme.j1", b"v0")
    results = await asyncio.gather(
        *(bus.kv_update("versions", "acme.j1", f"v1 by {i}".encode(), revision=rev)
          for i in range(4)),
        return_exceptions=True,
    )
    assert sum(isinstance(r, int) for r in results) == 1
    assert sum(isinstance(r, StaleRevision) for r in results) == 3


# --- server restart ----------------------------------------------------------------------


async def publish_until_stored(bus: Bus, subject: str, data: bytes, msg_id: str) -> None:
    """Publish while the server may still be coming back; ``msg_id`` makes retries safe."""
    deadline = time.monotonic() + 10
    while True:
        try:
            await bus.publish(subject, data, msg_id=msg_id)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


@pytest.mark.parametrize("crash", [False, True], ids=["stop", "kill"])
async def test_consume_loop_survives_server_restart_without_losing_acked_messages(
    bus, nats_server, crash
):
    for i in range(2):
        await bus.publish(TRAJ_SUBJECT, f"unacked-{i}".encode())
    # a worker takes these two and goes down with the server, never acking them
    worker = await take_without_ack(nats_server.url, TRAJ_SUBJECT, "trainer", "TRAJ", 2, 3.0)

    seen: list[tuple[bytes, int]] = []
    async with consuming(bus, "TRAJ", "trainer", TRAJ_SUBJECT, recorder(seen)) as loop_task:
        for i in range(5):
            await bus.publish(TRAJ_SUBJECT, f"acked-{i}".encode())
        await eventually(lambda: len(seen) == 5, what="the first five handled")
        # acks of a work queue delete: only the worker's two remain
        await eventually(lambda: stream_holds(bus, "TRAJ", 2), what="five acked")
        await worker.nc.close()

        nats_server.stop(kill=crash)  # killed: only fsynced state (sync_interval: always) is left
        nats_server.start()
        await eventually(lambda: bus.nc.stats["reconnects"] == 1 and bus.nc.is_connected,
                         timeout_s=10, what="the bus reconnected")
        for i in range(3):
            await publish_until_stored(bus, TRAJ_SUBJECT, f"after-{i}".encode(), f"after-{i}")
        await eventually(lambda: len(seen) == 10, timeout_s=15, what="all ten handled")
        await eventually(lambda: stream_holds(bus, "TRAJ", 0), what="all acked")
        assert not loop_task.done()

    handled = Counter(data for data, _ in seen)
    expected = {f"{kind}-{i}".encode() for kind, n in (("acked", 5), ("unacked", 2), ("after", 3))
                for i in range(n)}
    assert set(handled) == expected
    assert max(handled.values()) == 1  # nothing acked before the restart came back
    assert all(n == 1 for data, n in seen if not data.startswith(b"unacked"))
    unacked = sorted(n for data, n in seen if data.startswith(b"unacked"))
    if crash:
        # A killed server restores the consumer's delivery counts as last flushed, which can
        # predate the worker's fetch: the message still comes back, maybe as a first delivery.
        assert set(unacked) <= {1, 2}
    else:
        assert unacked == [2, 2]


# --- a lost ack (what a leader election does) --------------------------------------------


def first_publish_times_out(bus: Bus, monkeypatch, reaches_the_stream: bool, meanwhile=None) -> list:
    """Make the bus's first JetStream publish time out, after it was stored or before it was
    sent (then ``meanwhile`` runs first, e.g. another writer); return the publishes made."""
    real, calls = bus.js.publish, []

    async def publish(subject, payload=b"", **kwargs):
        calls.append(subject)
        if len(calls) > 1:
            return await real(subject, payload, **kwargs)
        if reaches_the_stream:
            await real(subject, payload, **kwargs)
        elif meanwhile is not None:
            await meanwhile()
        raise nats.errors.TimeoutError

    monkeypatch.setattr(bus.js, "publish", publish)
    return calls


async def test_a_publish_whose_ack_was_lost_is_repeated_and_stored_once(bus, monkeypatch):
    calls = first_publish_times_out(bus, monkeypatch, reaches_the_stream=True)
    assert await bus.publish(JOB_SUBJECT, b"once") is True  # the repeat's duplicate is its own
    assert len(calls) == 2 and await stream_messages(bus, "JOBS") == 1


async def test_a_compare_and_set_whose_ack_was_lost_is_not_taken_for_a_lost_race(bus, monkeypatch):
    rev0 = await bus.kv_create("versions", "acme.j1", b"v0")
    calls = first_publish_times_out(bus, monkeypatch, reaches_the_stream=True)
    # the repeat is refused (the key moved: by this very write), and the key's next revision is it
    rev1 = await bus.kv_update("versions", "acme.j1", b"v1", revision=rev0)
    assert len(calls) == 2
    assert await bus.kv_get("versions", "acme.j1") == KvEntry(b"v1", rev1)
    assert (await bus.js.stream_info("KV_versions")).state.messages == 2  # v0 and v1, once


async def test_a_compare_and_set_that_lost_while_timing_out_raises_stale_revision(bus, monkeypatch):
    rev0 = await bus.kv_create("versions", "acme.j1", b"v0")
    other = await Bus.connect(bus.nc.connected_url.geturl(), name="other-writer")

    async def the_other_writer_wins() -> None:
        await other.kv_update("versions", "acme.j1", b"v1 by the other", revision=rev0)

    calls = first_publish_times_out(bus, monkeypatch, reaches_the_stream=False,
                                    meanwhile=the_other_writer_wins)
    try:
        with pytest.raises(StaleRevision):
            await bus.kv_update("versions", "acme.j1", b"v1 by us", revision=rev0)
    finally:
        await other.close()
    assert len(calls) == 2  # repeated once after the timeout, then refused: never blindly again
    assert (await bus.kv_get("versions", "acme.j1")).value == b"v1 by the other"


async def test_a_deleted_durable_consumer_is_added_again(bus):
    handled = []

    async def handle(delivery: Delivery) -> None:
        handled.append(delivery.data)

    async with consuming(bus, "TRAJ", "trainer", TRAJ_SUBJECT, handle):
        await bus.publish(TRAJ_SUBJECT, b"before")
        await eventually(lambda: handled == [b"before"], what="the first message")
        await bus.js.delete_consumer("TRAJ", "trainer")  # nats-py alone would fetch in vain for ever
        await bus.publish(TRAJ_SUBJECT, b"after")
        await eventually(lambda: handled == [b"before", b"after"], timeout_s=15, what="the consumer back")


# --- request / reply -----------------------------------------------------------------------


async def test_queue_group_answers_each_request_once(bus, nats_server):
    other = await Bus.connect(nats_server.url, name="env-2")
    calls = Counter()

    def env_replica(name: str):
        async def answer(data: bytes) -> bytes:
            calls[name] += 1
            return data + b" scored by " + name.encode()

        return answer

    try:
        await bus.serve("marlaas.reward.toy", "env", env_replica("env-1"))
        await other.serve("marlaas.reward.toy", "env", env_replica("env-2"))
        await other.nc.flush()

        replies = await asyncio.gather(
            *(bus.request("marlaas.reward.toy", f"r{i}".encode(), timeout_s=2) for i in range(40))
        )
        await asyncio.sleep(0.2)  # a second answer to any request would have been counted by now
        assert [r.split(b" ")[0] for r in replies] == [f"r{i}".encode() for i in range(40)]
        assert sum(calls.values()) == 40
        # both replicas serve the group; the split is random, so ask more until both have answered
        for _ in range(20):
            if set(calls) == {"env-1", "env-2"}:
                break
            await bus.request("marlaas.reward.toy", b"more", timeout_s=2)
    finally:
        await other.close()
    assert set(calls) == {"env-1", "env-2"}


async def test_request_nobody_serves_raises_timeout_error(bus):
    with pytest.raises(TimeoutError, match="no service answers on 'marlaas.tool.acme.nope'"):
        await bus.request("marlaas.tool.acme.nope", b"{}", timeout_s=1)


async def test_request_answered_too_late_raises_timeout_error(bus):
    async def slow(data: bytes) -> bytes:
        await asyncio.sleep(1)
        return data

    await bus.serve("marlaas.tool.acme.slow", "tools", slow)
    with pytest.raises(TimeoutError, match=r"no reply on 'marlaas.tool.acme.slow' within 0.2s"):
        await bus.request("marlaas.tool.acme.slow", b"{}", timeout_s=0.2)


# --- the embedded server the tests stand on -----------------------------------------------


def test_embedded_server_on_a_taken_port_fails_clearly(nats_server, tmp_path):
    with pytest.raises(RuntimeError, match="address already in use"):
        EmbeddedNats(tmp_path / "second", port=nats_server.port).start()


async def test_kv_keys_lists_every_key_right_after_it_is_written(bus):
    assert await bus.kv_keys("jobs") == []
    for i in range(20):
        await bus.kv_create("jobs", f"tenant.job-{i:02d}", b"{}")
        assert len(await bus.kv_keys("jobs")) == i + 1  # read-your-writes, every time
    assert await bus.kv_keys("jobs") == [f"tenant.job-{i:02d}" for i in range(20)]


async def test_a_message_that_keeps_failing_is_given_up_after_max_deliver(bus):
    await bus.publish("marlaas.job.failure.t.j", b"{}")
    stop, given_up, attempts = asyncio.Event(), [], []

    async def always_fails(delivery):
        attempts.append(delivery.num_delivered)
        raise RuntimeError("store unreachable")

    async def give_up(delivery, exc):
        given_up.append((delivery.num_delivered, str(exc)))
        stop.set()

    await asyncio.wait_for(bus.consume("JOBS", "giveup", "marlaas.job.failure.>", always_fails, stop=stop,
                                       max_deliver=3, retry_delay_s=0.05, on_give_up=give_up), 30)
    assert attempts == [1, 2, 3] and given_up == [(3, "store unreachable")]


async def test_a_read_from_a_replica_that_is_behind_is_read_again_until_it_has_caught_up(bus, monkeypatch):
    """``read_all`` trusts the leader's count, not one read. A reader placed on a lagging replica
    (simulated here: the first two reads miss the newest message, as a replica still applying it
    would) is read again; one that never catches up gives what it has when ``catch_up_s`` ends."""
    subject = "marlaas.policy.committed.acme.lag"
    for version in range(3):
        await bus.publish(subject, f"v{version}".encode(), msg_id=f"acme.lag:{version}")
    read_once, reads = bus._read_once, []

    async def lagging(stream, wanted, behind_for: int):
        found = await read_once(stream, wanted)
        reads.append(len(found))
        return found[:-1] if len(reads) <= behind_for else found

    monkeypatch.setattr(bus, "_read_once", lambda stream, wanted: lagging(stream, wanted, behind_for=2))
    assert await bus.read_all("POLICY", subject) == [b"v0", b"v1", b"v2"]
    assert len(reads) == 3  # two short reads, then the whole stream

    reads.clear()
    monkeypatch.setattr(bus, "_read_once", lambda stream, wanted: lagging(stream, wanted, behind_for=10**6))
    started = time.monotonic()
    assert await bus.read_all("POLICY", subject, catch_up_s=1.0) == [b"v0", b"v1"]
    assert len(reads) >= 2 and time.monotonic() - started < 10
