"""Metering's ledger: the USAGE stream's events folded into the ``usage`` KV bucket.

One record per tenant, UTC day and job (``marlaas.platform.usage.record_key``). Each event is
applied exactly once, across redeliveries and manager restarts:

- an event goes to exactly one record (its key is a function of the event alone);
- a record keeps the stream sequence of the last event applied to it, and :func:`fold` skips
  one at or below it (a manager that wrote the record and crashed before its ack);
- the consumer delivers one event at a time in stream order (``max_ack_pending = 1``: a
  message not yet acked, a nak'd one included, holds back every later one), so sequences
  reach a record in increasing order and "at or below the last" means "already applied";
- the write is a compare-and-set against the revision read: a second manager (the one being
  replaced) that applied the same event first makes this one read again, and skip it.
"""

from __future__ import annotations

import asyncio

import msgspec
import structlog

from marlaas.platform import subjects
from marlaas.platform.bus import USAGE_BUCKET, Bus, Delivery, StaleRevision
from marlaas.platform.events import encode
from marlaas.platform.usage import USAGE, USAGE_RECORD, UsageRecord, UsageReported, add, day_of, key_of

log = structlog.get_logger("manager")


def fold(record: UsageRecord | None, event: UsageReported, seq: int) -> UsageRecord | None:
    """``record`` (None: none yet) with ``event``, stream sequence ``seq``, added; None when
    ``seq`` was applied to it already (a redelivery, or a manager that crashed before its ack)."""
    if record is not None and seq <= record.last_seq:
        return None
    if record is None:
        record = UsageRecord(tenant=event.tenant, day=day_of(event.at), job=event.job)
    return msgspec.structs.replace(record, counters=add(record.counters, event.counters),
                                   events=record.events + 1, last_seq=seq,
                                   updated_at=max(record.updated_at, event.at))


async def apply_usage(bus: Bus, event: UsageReported, seq: int) -> bool:
    """Fold ``event`` (stream sequence ``seq``) into its record; False if it was applied already."""
    key = key_of(event)
    while True:
        entry = await bus.kv_get(USAGE_BUCKET, key)
        record = USAGE_RECORD.decode(entry.value) if entry is not None else None
        folded = fold(record, event, seq)
        if folded is None:
            return False
        try:
            if entry is None:
                await bus.kv_create(USAGE_BUCKET, key, encode(folded))
            else:
                await bus.kv_update(USAGE_BUCKET, key, encode(folded), entry.revision)
            return True
        except StaleRevision:  # another writer got there first: read it again
            continue


async def on_usage(bus: Bus, delivery: Delivery) -> None:
    """The consumer's handler: decode (a malformed event is poison: terminated), fold, store."""
    event = USAGE.decode(delivery.data)
    if not await apply_usage(bus, event, delivery.msg.metadata.sequence.stream):
        log.info("usage event applied already; skipped", job=event.job,
                 seq=delivery.msg.metadata.sequence.stream)


async def keep_ledger(bus: Bus, stop: asyncio.Event) -> None:
    """Fold the USAGE stream into the ``usage`` bucket until ``stop``, one event at a time in
    stream order (see the module docstring); an event is retried until it is stored."""
    await bus.consume("USAGE", "manager-usage", subjects.usage("*"), lambda d: on_usage(bus, d), stop=stop,
                      max_deliver=-1, max_ack_pending=1, retry_delay_s=0.5)
