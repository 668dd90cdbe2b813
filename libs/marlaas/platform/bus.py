# over 500 lines: one class, Bus; every JetStream call shares its retries, dedup ids and reconnecting consume loop
"""The bus: a small async API over nats-py JetStream that every service uses.

What it adds to nats-py: the project's topology (streams, KV buckets) created
idempotently, publish with ``Nats-Msg-Id`` dedup, durable pull consumers driven
by a loop that survives reconnects and maps a handler's outcome to
ack / nak(delay) / term, KV compare-and-set, and request/reply with queue groups.

On a JetStream cluster (a broker URL listing several servers, streams at ``num_replicas=3``)
it also rides out a leader election, 4-10 s in which publishes, KV operations and fetches
fail: each JetStream request is repeated for up to :data:`RETRY_DEADLINE_S` while it fails
transiently (no responders, a timeout, "unavailable"). Every publish and KV write carries a
``Nats-Msg-Id`` so that a repeat of one whose ack was lost is stored once; a compare-and-set
that lost to another writer is never repeated, it raises :class:`StaleRevision`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

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

from marlaas.platform import subjects
from marlaas.platform.events import EventDecodeError
from marlaas.platform.nats_access import redact_url, server_urls, url_credentials

log = structlog.get_logger("marlaas.platform.bus")
T = TypeVar("T")

RETRY_DEADLINE_S = 30.0  # a JetStream request is repeated this long (an election takes 4-10 s)
PING_INTERVAL_S = 10  # a server that died without closing the socket is noticed within ~2 pings
CONSUMER_CHECK_AFTER = 5  # fetches refused in a row before the consume loop checks its consumer
# nobody answered (no stream leader yet, a node restarting) or JetStream said it cannot now
TRANSIENT = (
    asyncio.TimeoutError, nats.errors.NoRespondersError, nats.errors.OutboundBufferLimitError,
    nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError,
)
STREAM_NOT_FOUND = 10059  # also what a node still recovering its metadata may say of a stream
CONSUMER_NOT_FOUND = 10014
# what a fetch gets from a consumer without a leader, or one that is gone
REFUSED_FETCH = (nats.js.errors.ServiceUnavailableError, nats.js.errors.NotFoundError)
WRONG_LAST_SEQUENCE = (10071, 10164)  # a compare-and-set's expected revision is not the key's
MSG_ID, EXPECTED_REVISION = "Nats-Msg-Id", "Nats-Expected-Last-Subject-Sequence"


def is_transient(exc: BaseException) -> bool:
    """Whether a failed JetStream request may succeed if repeated (see :data:`TRANSIENT`)."""
    if isinstance(exc, nats.js.errors.NotFoundError):
        return exc.err_code == STREAM_NOT_FOUND  # asked of a stream known to exist
    return isinstance(exc, TRANSIENT)


def connect_options(url: str) -> dict:
    """nats-py ``connect`` options for ``url`` (one server or a comma-separated list): every
    server, reconnect forever, ping every :data:`PING_INTERVAL_S`. The credentials also go as
    options, so the servers a cluster announces (without them in their address) accept it too."""
    user, password = url_credentials(url)
    credentials = {"user": user, "password": password} if user and password else {}
    return dict(servers=server_urls(url), allow_reconnect=True, max_reconnect_attempts=-1,
                reconnect_time_wait=0.25, connect_timeout=2, ping_interval=PING_INTERVAL_S,
                **credentials)

JOBS_BUCKET = "jobs"
VERSIONS_BUCKET = "versions"
TOOLS_BUCKET = "tools"
TENANTS_BUCKET = "tenants"
SAMPLED_BUCKET = "sampled"  # per job: the last version whose batch rollout published
TINKER_BUCKET = "tinker"  # the Tinker API's sessions, models, samplers, checkpoints
TINKER_FUTURES_BUCKET = "tinker_futures"  # the Tinker API's finished requests, kept an hour
USAGE_BUCKET = "usage"  # metering: one record per tenant, UTC day and job (marlaas.platform.usage)


@dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: list[str]
    work_queue: bool = False
    max_age_s: float = 0.0  # 0 = keep forever


STREAMS = (
    StreamSpec("JOBS", [subjects.JOBS_STREAM]),
    StreamSpec("POLICY", [subjects.POLICY_STREAM]),
    StreamSpec("TRAJ", [subjects.TRAJ_STREAM], work_queue=True),
    StreamSpec("METRICS", [subjects.METRICS_STREAM], max_age_s=7 * 24 * 3600),
    StreamSpec("TINKER", [subjects.TINKER_STREAM], work_queue=True),  # Tinker clients' requests
    StreamSpec("USAGE", [subjects.USAGE_STREAM], max_age_s=30 * 24 * 3600),  # folded into the usage bucket
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
    BucketSpec(TINKER_BUCKET, history=1),
    BucketSpec(TINKER_FUTURES_BUCKET, history=1, ttl_s=3600.0),  # the SDK collects a result in seconds
    BucketSpec(USAGE_BUCKET, history=1),
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

    def defer(self) -> None:
        """The handler has passed this message to work of its own, which acks or naks it later:
        the consumer loop then settles nothing when the handler returns, and fetches on."""
        self.settled = True

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

    retry_deadline_s = RETRY_DEADLINE_S

    def __init__(self, nc: nats.NATS) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.replicas = 1  # of the streams and buckets this bus creates (ensure_topology sets it)
        self._kv: dict[str, object] = {}
        self._requests: set[asyncio.Task] = set()  # in-flight request handlers, kept and drained

    @classmethod
    async def connect(cls, url: str, name: str = "marlaas", timeout_s: float | None = None,
                      inbox_prefix: str | None = None) -> Bus:
        """Connect with unlimited reconnects; the topology must exist (see :meth:`ensure_topology`).

        ``url`` is one server or a cluster's, comma-separated (see :func:`connect_options`).
        ``timeout_s`` bounds the first connection (clients: fail fast if nothing is there).
        ``inbox_prefix``: the reply subjects' prefix a restricted user must use (the sandbox's).
        """

        async def on_error(exc: Exception) -> None:
            log.warning("nats error", error=str(exc), client=name)

        inbox = {"inbox_prefix": inbox_prefix} if inbox_prefix else {}
        connecting = nats.connect(**connect_options(url), name=name, error_cb=on_error, **inbox)
        try:
            nc = await asyncio.wait_for(connecting, timeout_s)
        except TimeoutError as exc:  # never print the credentials
            raise ConnectionError(f"no NATS server answers at {redact_url(url)} (is marlaas up?)") from exc
        return cls(nc)

    async def _retrying(self, what: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """``await attempt()``, repeated while it fails transiently (:func:`is_transient`) for up
        to :attr:`retry_deadline_s`; then its last failure propagates."""
        deadline = time.monotonic() + self.retry_deadline_s
        delay, failures = 0.1, 0
        while True:
            try:
                result = await attempt()
            except Exception as exc:
                if not is_transient(exc) or self.nc.is_closed or time.monotonic() + delay > deadline:
                    raise
                failures += 1
                if failures == 1:
                    log.warning("JetStream unavailable (an election?); retrying", what=what, error=repr(exc))
                await asyncio.sleep(delay)
                delay = min(2 * delay, 1.0)
                continue
            if failures:
                log.info("JetStream answers again", what=what, failures=failures)
            return result

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
        self, duplicate_window_s: float = 300.0, bucket_ttl_s: Mapping[str, float] | None = None,
        replicas: int = 1,
    ) -> None:
        """Create the streams and KV buckets if missing; safe to call from every service.

        ``bucket_ttl_s`` overrides a bucket's entry TTL (tests shorten the tools registry's);
        an existing bucket whose TTL differs is updated in place. ``replicas`` is each stream's
        and bucket's number of copies (3 on a three-node cluster); an existing one is scaled to it.
        """
        self.replicas = replicas
        for spec in STREAMS:
            config = StreamConfig(
                name=spec.name, subjects=spec.subjects, storage=StorageType.FILE,
                retention=RetentionPolicy.WORK_QUEUE if spec.work_queue else RetentionPolicy.LIMITS,
                duplicate_window=duplicate_window_s, max_age=spec.max_age_s or None,
                num_replicas=replicas,
            )
            await self._retrying(f"create stream {spec.name}", functools.partial(self._add_or_update_stream, config))
        for spec in BUCKETS:
            ttl_s = (bucket_ttl_s or {}).get(spec.name, spec.ttl_s)
            await self._bucket(spec.name)
            await self._retrying(f"configure bucket {spec.name}",
                                 functools.partial(self._reconcile_bucket, spec.name, ttl_s, replicas))

    async def _add_or_update_stream(self, config: StreamConfig) -> None:
        try:
            await self.js.add_stream(config)
        except nats.js.errors.BadRequestError:
            await self.js.update_stream(config)

    async def _bucket(self, bucket: str):
        if bucket not in self._kv:
            self._kv[bucket] = await self._retrying(f"open bucket {bucket}",
                                                    lambda: self._open_bucket(bucket))
        return self._kv[bucket]

    async def _open_bucket(self, bucket: str):
        spec = next((b for b in BUCKETS if b.name == bucket), BucketSpec(bucket))
        try:
            return await self.js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            return await self.js.create_key_value(KeyValueConfig(
                bucket=bucket, history=spec.history, ttl=spec.ttl_s or None,
                storage=StorageType.FILE, replicas=self.replicas,
            ))

    async def _reconcile_bucket(self, bucket: str, ttl_s: float, replicas: int) -> None:
        config = (await self.js.stream_info(subjects.kv_stream(bucket))).config
        if (config.max_age or 0.0) == ttl_s and (config.num_replicas or 1) == replicas:
            return
        config.max_age = ttl_s or None
        config.num_replicas = replicas
        if ttl_s and (config.duplicate_window or 0.0) > ttl_s:  # the server refuses a window > max age
            config.duplicate_window = ttl_s
        await self.js.update_stream(config)

    # --- publish / request ---------------------------------------------------------------

    async def publish(self, subject: str, data: bytes, msg_id: str | None = None) -> bool:
        """Publish to JetStream; return False when the stream dropped it as a duplicate of ``msg_id``.

        Without ``msg_id`` the message gets a fresh one, so that repeating a publish whose ack
        was lost (an election) stores it once; a duplicate of that id is this call's own message.
        """
        headers = {MSG_ID: msg_id or uuid.uuid4().hex}
        ack = await self._retrying(f"publish {subject}",
                                   lambda: self.js.publish(subject, data, headers=dict(headers)))
        return not ack.duplicate or msg_id is None

    async def request(self, subject: str, data: bytes, timeout_s: float = 10.0) -> bytes:
        """Core request/reply; raises ``TimeoutError`` when nobody answers in time."""
        try:
            reply = await self.nc.request(subject, data, timeout=timeout_s)
        except nats.errors.NoRespondersError as exc:
            raise TimeoutError(f"no service answers on {subject!r}: is it running?") from exc
        except nats.errors.TimeoutError as exc:
            raise TimeoutError(f"no reply on {subject!r} within {timeout_s:.1f}s") from exc
        return reply.data

    async def answered(self, subject: str, data: bytes, timeout_s: float = 2.0) -> bool:
        """Whether a request on ``subject`` reaches anyone now: False when the server says nobody
        subscribes to it; a subscriber slow to reply (busy) counts as one."""
        try:
            await self.nc.request(subject, data, timeout=timeout_s)
        except nats.errors.NoRespondersError:
            return False
        except nats.errors.TimeoutError:
            pass
        return True

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

    async def read_all(self, stream: str, subject: str, catch_up_s: float = 30.0) -> list[bytes]:
        """Every message now stored in ``stream`` under ``subject``, oldest first (an ephemeral reader).

        The count to expect comes from the stream's leader. A reader placed on a replica still
        catching up (a node just restarted) sees fewer: it is read again until the replica has
        caught up, for up to ``catch_up_s``.
        """
        deadline = time.monotonic() + catch_up_s
        while True:
            expected = await self._stored(stream, subject)  # again each time: a purge lowers it
            found = await self._read_once(stream, subject) if expected else []
            if len(found) >= expected or time.monotonic() > deadline:
                if len(found) < expected:
                    log.warning("a stream replica is behind its leader", stream=stream, subject=subject,
                                read=len(found), stored=expected)
                return found
            await asyncio.sleep(0.5)

    async def _stored(self, stream: str, subject: str) -> int:
        """How many messages the leader of ``stream`` holds under ``subject``."""
        info = await self._retrying(f"stream info {stream}",
                                    lambda: self.js.stream_info(stream, subjects_filter=subject))
        return sum((info.state.subjects or {}).values())

    async def _read_once(self, stream: str, subject: str) -> list[bytes]:
        sub = await self.js.pull_subscribe(subject, stream=stream)
        found: list[bytes] = []
        try:
            if (await sub.consumer_info()).num_pending == 0:  # nothing stored under ``subject``
                return found
            while True:  # until nothing is pending, not until a fetch is slow (a loaded machine)
                try:
                    msgs = await sub.fetch(512, timeout=2.0)
                except (TimeoutError, nats.errors.TimeoutError):
                    if (await sub.consumer_info()).num_pending == 0:
                        return found
                    continue
                for msg in msgs:
                    found.append(msg.data)
                    await msg.ack()
                if msgs[-1].metadata.num_pending == 0:
                    return found
        finally:
            await sub.unsubscribe()

    # --- key-value -----------------------------------------------------------------------

    async def kv_get(self, bucket: str, key: str) -> KvEntry | None:
        await self._bucket(bucket)
        msg = await self._retrying(f"kv get {bucket}/{key}", lambda: self._last_message(bucket, key))
        if msg is None or msg.data is None:
            return None
        if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE"):
            return None
        return KvEntry(msg.data, msg.seq)

    async def _last_message(self, bucket: str, key: str):
        try:
            return await self.js.get_msg(subjects.kv_stream(bucket), subject=subjects.kv(bucket, key))
        except nats.js.errors.NotFoundError as exc:
            if is_transient(exc):
                raise
            return None  # no such key

    async def kv_create(self, bucket: str, key: str, value: bytes) -> int:
        """Create ``key``; raise :class:`StaleRevision` if it already exists."""
        return await self._kv_write(bucket, key, value, 0, f"{bucket}/{key} already exists")

    async def kv_update(self, bucket: str, key: str, value: bytes, revision: int) -> int:
        """Compare-and-set: write only if ``key`` is still at ``revision``."""
        return await self._kv_write(bucket, key, value, revision,
                                    f"{bucket}/{key} is no longer at revision {revision}")

    async def kv_put(self, bucket: str, key: str, value: bytes) -> int:
        """Write ``key`` unconditionally (an upsert, e.g. a heartbeat); return the new revision."""
        return await self._kv_write(bucket, key, value, None, "")

    async def _kv_write(self, bucket: str, key: str, value: bytes, revision: int | None,
                        stale: str) -> int:
        """Write ``key`` (if ``revision`` is given, only while the key is at it; 0: absent);
        return the new revision, or raise :class:`StaleRevision` with ``stale``.

        The write is repeated while it fails transiently, always with the same message id. If
        an attempt timed out, it may have been stored: a cluster drops the repeat as a duplicate
        (and acks the stored one), but a single server checks the revision first and refuses it,
        so a refusal then is checked against the key's next revision after ``revision``.
        """
        await self._bucket(bucket)
        subject, msg_id = subjects.kv(bucket, key), uuid.uuid4().hex
        headers = {MSG_ID: msg_id}
        if revision is not None:
            headers[EXPECTED_REVISION] = str(revision)
        timed_out = False

        async def attempt() -> int:
            nonlocal timed_out
            try:
                return (await self.js.publish(subject, value, headers=dict(headers))).seq
            except TimeoutError:
                timed_out = True
                raise
            except nats.js.errors.APIError as exc:
                if exc.err_code not in WRONG_LAST_SEQUENCE:
                    raise
                stored = await self._written_after(bucket, subject, revision, msg_id) if timed_out else None
                if stored is None:
                    raise StaleRevision(stale) from exc
                return stored

        return await self._retrying(f"kv write {bucket}/{key}", attempt)

    async def _written_after(self, bucket: str, subject: str, revision: int, msg_id: str) -> int | None:
        """The revision of the write ``msg_id`` if it is ``subject``'s first after ``revision``."""
        try:
            msg = await self.js.get_msg(subjects.kv_stream(bucket), seq=revision + 1, subject=subject, next=True)
        except nats.js.errors.NotFoundError as exc:
            if is_transient(exc):
                raise
            return None
        return msg.seq if (msg.headers or {}).get(MSG_ID) == msg_id else None

    async def kv_delete(self, bucket: str, key: str) -> None:
        """Remove ``key`` and all its history, leaving no delete marker: as if never written.

        A later compare-and-set on it fails (its last revision is gone), so a writer racing
        the deletion cannot bring it back by an update.
        """
        await self._bucket(bucket)
        await self.purge(subjects.kv_stream(bucket), subjects.kv(bucket, key))

    async def purge(self, stream: str, subject: str) -> None:
        """Delete every message of ``stream`` stored under ``subject`` (wildcards allowed)."""
        await self._retrying(f"purge {stream} {subject}",
                             lambda: self.js.purge_stream(stream, subject=subject))

    async def kv_keys(self, bucket: str, under: str = "") -> list[str]:
        """Every key ever written to ``bucket`` (only those starting ``under.``, if given), from
        the server's per-subject counts.

        (nats-py's ``kv.keys()`` reads a watcher and can return before it has seen a key
        that was just written; the stream's subject list cannot.)
        """
        await self._bucket(bucket)
        prefix = subjects.kv(bucket, "")
        wanted = subjects.kv(bucket, f"{under}.>" if under else ">")
        info = await self._retrying(f"kv keys {bucket}", lambda: self.js.stream_info(
            subjects.kv_stream(bucket), subjects_filter=wanted))
        return sorted(subject[len(prefix):] for subject in (info.state.subjects or {}))

    # --- durable consumers ---------------------------------------------------------------

    async def consume(
        self, stream: str, durable: str, subject: str, handler: Handler, *,
        stop: asyncio.Event, ack_wait_s: float = 30.0, max_deliver: int = 20,
        concurrency: int = 1, retry_delay_s: float = 1.0, deliver_new: bool = False,
        on_give_up: GiveUp | None = None, max_ack_pending: int = 0,
    ) -> None:
        """Run ``handler`` on each message of a durable pull consumer until ``stop`` is set.

        A handler that returns without settling acks; one that raises :class:`PoisonMessage`
        or :class:`EventDecodeError` terms; any other exception naks with a delay
        (transient) until the ``max_deliver``-th attempt, which terms instead. Terming a
        message calls ``on_give_up`` (e.g. to fail the job it belonged to). Up to
        ``concurrency`` messages are handled at once. Connection loss, server restarts and
        leader elections are ridden out: the loop keeps fetching once NATS is back, and after
        :data:`CONSUMER_CHECK_AFTER` refused fetches in a row it adds the durable consumer again
        if it is gone (nats-py never recreates one, and would be refused for ever).
        ``max_ack_pending`` (default: 4 x ``concurrency``) must cover the messages a handler
        defers (:meth:`Delivery.defer`) and holds unsettled, or the consumer stops delivering.
        """
        config = ConsumerConfig(
            durable_name=durable, filter_subject=subject, ack_policy=AckPolicy.EXPLICIT, ack_wait=ack_wait_s,
            max_deliver=max_deliver, max_ack_pending=max_ack_pending or max(concurrency, 1) * 4,
            deliver_policy=DeliverPolicy.NEW if deliver_new else DeliverPolicy.ALL,
        )
        slots = asyncio.Semaphore(concurrency)
        running: set[asyncio.Task] = set()
        sub, failures, refused = None, 0, 0
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
                except (TimeoutError, nats.errors.TimeoutError):
                    failures = refused = 0
                    continue
                except Exception as exc:  # disconnected, server restarting, an election: fetch again
                    failures += 1
                    if failures == 1 or failures % 20 == 0:
                        log.warning("fetch failed; retrying", stream=stream, durable=durable,
                                    error=repr(exc), in_a_row=failures)
                    if isinstance(exc, REFUSED_FETCH):
                        refused += 1
                        if refused % CONSUMER_CHECK_AFTER == 0:
                            await self._restore_consumer(stream, config)
                    await asyncio.sleep(0.5)
                    continue
                failures = refused = 0
                for msg in msgs:
                    task = asyncio.create_task(
                        settle(Delivery(msg), handler, retry_delay_s, max_deliver, on_give_up, slots)
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

    async def _restore_consumer(self, stream: str, config: ConsumerConfig) -> None:
        """Add durable consumer ``config`` to ``stream`` again if it is gone; a consumer that is
        there (its leader being elected) is left alone, and so is a failure to tell."""
        try:
            await self.js.consumer_info(stream, config.durable_name)
        except nats.js.errors.NotFoundError as exc:
            if exc.err_code != CONSUMER_NOT_FOUND:  # the stream itself (a node still recovering)
                return
            log.warning("durable consumer is gone; adding it again", stream=stream,
                        durable=config.durable_name)
            try:
                await self.js.add_consumer(stream, config)  # idempotent: a racing twin's add is the same
            except Exception as exc:
                log.warning("could not add the consumer again", stream=stream, durable=config.durable_name,
                            error=repr(exc))
        except Exception as exc:  # no meta leader yet: look again after the next refusals
            log.info("consumer check failed", stream=stream, durable=config.durable_name, error=repr(exc))


async def settle(
    delivery: Delivery, handler: Handler, retry_delay_s: float, max_deliver: int,
    on_give_up: GiveUp | None, slots: asyncio.Semaphore,
) -> None:
    """Run ``handler`` on one work-queue delivery and settle it: ack when it returns (unless it
    settled the message itself); term a poison message, or one on its last attempt, and call
    ``on_give_up``; otherwise nak it with a backoff. Releases one of ``slots`` in any case.
    :meth:`Bus.consume` settles each message this way, and so does a reader of its own
    (``marlaas.platform.tenant_turns``)."""
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
