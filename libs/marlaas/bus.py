"""The bus: a small async API over nats-py JetStream that every service uses.

What it adds to nats-py: the project's topology (streams, KV buckets) created
idempotently, publish with ``Nats-Msg-Id`` dedup, durable pull consumers driven
by a loop that survives reconnects and maps a handler's outcome to
ack / nak(delay) / term, KV compare-and-set, and request/reply with queue groups.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from marlaas.events import EventDecodeError

log = structlog.get_logger("marlaas.bus")

JOBS_BUCKET = "jobs"
VERSIONS_BUCKET = "versions"
TOOLS_BUCKET = "tools"
TENANTS_BUCKET = "tenants"
SAMPLED_BUCKET = "sampled"  # per job: the last version whose batch rollout published


@dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: list[str]
    work_queue: bool = False
    max_age_s: float = 0.0  # 0 = keep forever


STREAMS = (
    StreamSpec("JOBS", ["marlaas.job.>"]),
    StreamSpec("POLICY", ["marlaas.policy.>"]),
    StreamSpec("TRAJ", ["marlaas.trajectory.>"], work_queue=True),
    StreamSpec("METRICS", ["marlaas.span.>"], max_age_s=7 * 24 * 3600),
)


@dataclass(frozen=True)
class BucketSpec:
    name: str
    history: int = 8
    ttl_s: float = 0.0  # 0 = keep forever; else an entry expires ttl_s after its last write


BUCKETS = (
    BucketSpec(JOBS_BUCKET),
    BucketSpec(VERSIONS_BUCKET),
    BucketSpec(TOOLS_BUCKET, history=1, ttl_s=30.0),  # tool servers re-announce as a heartbeat
    BucketSpec(TENANTS_BUCKET),
    BucketSpec(SAMPLED_BUCKET, history=1),
)


class StaleRevision(Exception):
    """A KV compare-and-set lost: the entry changed since it was read."""


class PoisonMessage(Exception):
    """A message that can never succeed: the consume loop terminates it instead of retrying."""


@dataclass(frozen=True)
class KvEntry:
    value: bytes
    revision: int


class Delivery:
    """One message taken from a durable consumer; the handler may settle it explicitly."""

    def __init__(self, msg: Msg) -> None:
        self.msg = msg
        self.settled = False

    @property
    def data(self) -> bytes:
        return self.msg.data

    @property
    def subject(self) -> str:
        return self.msg.subject

    @property
    def num_delivered(self) -> int:
        return self.msg.metadata.num_delivered

    async def ack(self) -> None:
        self.settled = True
        await self.msg.ack()

    async def nak(self, delay_s: float | None = None) -> None:
        self.settled = True
        await self.msg.nak(delay=delay_s)

    async def term(self) -> None:
        self.settled = True
        await self.msg.term()

    @contextlib.asynccontextmanager
    async def keep_alive(self, every_s: float = 5.0):
        """Send in-progress heartbeats while long work runs, so AckWait does not expire."""

        async def beat() -> None:
            while True:
                await asyncio.sleep(every_s)
                with contextlib.suppress(Exception):
                    await self.msg.in_progress()

        task = asyncio.create_task(beat())
        try:
            yield self
        finally:
            task.cancel()


Handler = Callable[[Delivery], Awaitable[None]]
GiveUp = Callable[[Delivery, Exception], Awaitable[None]]


class Bus:
    """A connection to NATS with the project's JetStream topology."""

    def __init__(self, nc: nats.NATS) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self._kv: dict[str, object] = {}
        self._requests: set[asyncio.Task] = set()  # in-flight request handlers, kept and drained

    @classmethod
    async def connect(cls, url: str, name: str = "marlaas", timeout_s: float | None = None) -> Bus:
        """Connect with unlimited reconnects; the topology must exist (see :meth:`ensure_topology`).

        ``timeout_s`` bounds the first connection (clients: fail fast if nothing is there).
        """

        async def on_error(exc: Exception) -> None:
            log.warning("nats error", error=str(exc), client=name)

        connecting = nats.connect(
            servers=[url], name=name, allow_reconnect=True, max_reconnect_attempts=-1,
            reconnect_time_wait=0.25, connect_timeout=2, error_cb=on_error,
        )
        try:
            nc = await asyncio.wait_for(connecting, timeout_s)
        except TimeoutError as exc:
            shown = url.rpartition("@")[2] if "@" in url else url  # never print the credentials
            raise ConnectionError(f"no NATS server answers at {shown} (is marlaas up?)") from exc
        return cls(nc)

    async def close(self) -> None:
        """Finish answering requests, drain and flush, then close; close anyway if draining fails."""
        if self._requests:
            await asyncio.gather(*self._requests, return_exceptions=True)
        try:
            await self.nc.drain()
        except Exception:  # reconnecting or already closed: nothing left to drain
            with contextlib.suppress(Exception):
                await self.nc.close()

    # --- topology ------------------------------------------------------------------------

    async def ensure_topology(
        self, duplicate_window_s: float = 300.0, bucket_ttl_s: Mapping[str, float] | None = None
    ) -> None:
        """Create the streams and KV buckets if missing; safe to call from every service.

        ``bucket_ttl_s`` overrides a bucket's entry TTL (tests shorten the tools registry's);
        an existing bucket whose TTL differs is updated in place.
        """
        for spec in STREAMS:
            config = StreamConfig(
                name=spec.name, subjects=spec.subjects, storage=StorageType.FILE,
                retention=RetentionPolicy.WORK_QUEUE if spec.work_queue else RetentionPolicy.LIMITS,
                duplicate_window=duplicate_window_s, max_age=spec.max_age_s or None,
            )
            try:
                await self.js.add_stream(config)
            except nats.js.errors.BadRequestError:
                await self.js.update_stream(config)
        for spec in BUCKETS:
            ttl_s = (bucket_ttl_s or {}).get(spec.name, spec.ttl_s)
            await self._bucket(spec.name)
            await self._set_bucket_ttl(spec.name, ttl_s)

    async def _bucket(self, bucket: str):
        if bucket not in self._kv:
            spec = next((b for b in BUCKETS if b.name == bucket), BucketSpec(bucket))
            try:
                self._kv[bucket] = await self.js.key_value(bucket)
            except nats.js.errors.BucketNotFoundError:
                self._kv[bucket] = await self.js.create_key_value(KeyValueConfig(
                    bucket=bucket, history=spec.history, ttl=spec.ttl_s or None,
                    storage=StorageType.FILE,
                ))
        return self._kv[bucket]

    async def _set_bucket_ttl(self, bucket: str, ttl_s: float) -> None:
        config = (await self.js.stream_info(f"KV_{bucket}")).config
        if (config.max_age or 0.0) == ttl_s:
            return
        config.max_age = ttl_s or None
        if ttl_s and (config.duplicate_window or 0.0) > ttl_s:  # the server refuses a window > max age
            config.duplicate_window = ttl_s
        await self.js.update_stream(config)

    # --- publish / request ---------------------------------------------------------------

    async def publish(self, subject: str, data: bytes, msg_id: str | None = None) -> bool:
        """Publish to JetStream; return False when the stream dropped it as a duplicate of ``msg_id``."""
        headers = {"Nats-Msg-Id": msg_id} if msg_id else None
        ack = await self.js.publish(subject, data, headers=headers)
        return not ack.duplicate

    async def request(self, subject: str, data: bytes, timeout_s: float = 10.0) -> bytes:
        """Core request/reply; raises ``TimeoutError`` when nobody answers in time."""
        try:
            reply = await self.nc.request(subject, data, timeout=timeout_s)
        except nats.errors.NoRespondersError as exc:
            raise TimeoutError(f"no service answers on {subject!r}: is it running?") from exc
        except nats.errors.TimeoutError as exc:
            raise TimeoutError(f"no reply on {subject!r} within {timeout_s:.1f}s") from exc
        return reply.data

    async def serve(
        self, subject: str, queue: str, answer: Callable[[bytes], Awaitable[bytes]]
    ):
        """Answer requests on ``subject`` in queue group ``queue``; each request runs as its own task."""

        async def on_msg(msg: Msg) -> None:
            async def run() -> None:
                try:
                    reply = await answer(msg.data)
                except Exception:  # a bad request must not take the service down
                    log.exception("request handler failed", subject=msg.subject)
                    return
                if msg.reply:
                    await msg.respond(reply)

            task = asyncio.get_running_loop().create_task(run())
            self._requests.add(task)
            task.add_done_callback(self._requests.discard)

        return await self.nc.subscribe(subject, queue=queue, cb=on_msg)

    async def read_all(self, stream: str, subject: str) -> list[bytes]:
        """Every message now stored in ``stream`` under ``subject``, oldest first (an ephemeral reader)."""
        info = await self.js.stream_info(stream)
        if info.state.messages == 0:
            return []
        sub = await self.js.pull_subscribe(subject, stream=stream)
        found: list[bytes] = []
        try:
            while True:
                try:
                    msgs = await sub.fetch(512, timeout=0.5)
                except (nats.errors.TimeoutError, asyncio.TimeoutError):
                    return found
                for msg in msgs:
                    found.append(msg.data)
                    await msg.ack()
        finally:
            await sub.unsubscribe()

    # --- key-value -----------------------------------------------------------------------

    async def kv_get(self, bucket: str, key: str) -> KvEntry | None:
        kv = await self._bucket(bucket)
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        return KvEntry(entry.value, entry.revision)

    async def kv_create(self, bucket: str, key: str, value: bytes) -> int:
        """Create ``key``; raise :class:`StaleRevision` if it already exists."""
        kv = await self._bucket(bucket)
        try:
            return await kv.create(key, value)
        except nats.js.errors.KeyWrongLastSequenceError as exc:
            raise StaleRevision(f"{bucket}/{key} already exists") from exc

    async def kv_update(self, bucket: str, key: str, value: bytes, revision: int) -> int:
        """Compare-and-set: write only if ``key`` is still at ``revision``."""
        kv = await self._bucket(bucket)
        try:
            return await kv.update(key, value, last=revision)
        except nats.js.errors.KeyWrongLastSequenceError as exc:
            raise StaleRevision(f"{bucket}/{key} is no longer at revision {revision}") from exc

    async def kv_put(self, bucket: str, key: str, value: bytes) -> int:
        """Write ``key`` unconditionally (an upsert, e.g. a heartbeat); return the new revision."""
        kv = await self._bucket(bucket)
        return await kv.put(key, value)

    async def kv_delete(self, bucket: str, key: str) -> None:
        """Remove ``key`` and all its history, leaving no delete marker: as if never written.

        A later compare-and-set on it fails (its last revision is gone), so a writer racing
        the deletion cannot bring it back by an update.
        """
        await self._bucket(bucket)
        await self.purge(f"KV_{bucket}", f"$KV.{bucket}.{key}")

    async def purge(self, stream: str, subject: str) -> None:
        """Delete every message of ``stream`` stored under ``subject`` (wildcards allowed)."""
        await self.js.purge_stream(stream, subject=subject)

    async def kv_keys(self, bucket: str) -> list[str]:
        """Every key ever written to ``bucket``, from the server's per-subject counts.

        (nats-py's ``kv.keys()`` reads a watcher and can return before it has seen a key
        that was just written; the stream's subject list cannot.)
        """
        await self._bucket(bucket)
        prefix = f"$KV.{bucket}."
        info = await self.js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>")
        return sorted(subject[len(prefix):] for subject in (info.state.subjects or {}))

    # --- durable consumers ---------------------------------------------------------------

    async def consume(
        self, stream: str, durable: str, subject: str, handler: Handler, *,
        stop: asyncio.Event, ack_wait_s: float = 30.0, max_deliver: int = 20,
        concurrency: int = 1, retry_delay_s: float = 1.0, deliver_new: bool = False,
        on_give_up: GiveUp | None = None,
    ) -> None:
        """Run ``handler`` on each message of a durable pull consumer until ``stop`` is set.

        A handler that returns without settling acks; one that raises :class:`PoisonMessage`
        or :class:`EventDecodeError` terms; any other exception naks with a delay
        (transient) until the ``max_deliver``-th attempt, which terms instead. Terming a
        message calls ``on_give_up`` (e.g. to fail the job it belonged to). Up to
        ``concurrency`` messages are handled at once. Connection loss and server restarts
        are ridden out: the loop keeps fetching once NATS is back.
        """
        config = ConsumerConfig(
            durable_name=durable, ack_policy=AckPolicy.EXPLICIT, ack_wait=ack_wait_s,
            max_deliver=max_deliver, max_ack_pending=max(concurrency, 1) * 4,
            deliver_policy=DeliverPolicy.NEW if deliver_new else DeliverPolicy.ALL,
        )
        slots = asyncio.Semaphore(concurrency)
        running: set[asyncio.Task] = set()
        sub = None
        try:
            while not stop.is_set():
                try:
                    if sub is None:
                        sub = await self.js.pull_subscribe(
                            subject, durable=durable, stream=stream, config=config
                        )
                    await slots.acquire()
                    try:
                        msgs = await sub.fetch(1, timeout=0.5)
                    except BaseException:
                        slots.release()
                        raise
                except (nats.errors.TimeoutError, asyncio.TimeoutError):
                    continue
                except Exception as exc:  # disconnected, server restarting: wait and fetch again
                    log.warning("fetch failed; retrying", stream=stream, durable=durable,
                                error=repr(exc))
                    await asyncio.sleep(0.5)
                    continue
                for msg in msgs:
                    task = asyncio.create_task(
                        self._handle(Delivery(msg), handler, retry_delay_s, max_deliver, on_give_up, slots)
                    )
                    running.add(task)
                    task.add_done_callback(running.discard)
            if running:  # drain: finish in-flight work and settle it before returning
                await asyncio.gather(*running, return_exceptions=True)
        finally:
            # An expired fetch leaves a status message in the subscription's queue; left
            # subscribed, it would hold Bus.close()'s drain for its full 30 s timeout.
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    @staticmethod
    async def _handle(
        delivery: Delivery, handler: Handler, retry_delay_s: float, max_deliver: int,
        on_give_up: GiveUp | None, slots: asyncio.Semaphore,
    ) -> None:
        try:
            await handler(delivery)
            if not delivery.settled:
                await delivery.ack()
        except Exception as exc:
            poison = isinstance(exc, (PoisonMessage, EventDecodeError))
            if poison or 0 < max_deliver <= delivery.num_delivered:
                log.error("terminating message", subject=delivery.subject, error=str(exc),
                          attempts=delivery.num_delivered)
                with contextlib.suppress(Exception):
                    await delivery.term()
                if on_give_up is not None:
                    try:
                        await on_give_up(delivery, exc)
                    except Exception:
                        log.exception("give-up hook failed", subject=delivery.subject)
            else:
                log.warning("handler failed; will retry", subject=delivery.subject, error=repr(exc),
                            attempt=delivery.num_delivered)
                with contextlib.suppress(Exception):
                    await delivery.nak(retry_delay_s * min(delivery.num_delivered, 10))
        finally:
            slots.release()

