"""Redis Streams, the commands every side uses, in one place: create a group, read through
it, append, acknowledge, dead-letter, claim, list what is pending, read the newest entry, and
trim without removing an entry some group still needs.

The admission consumer, the rollout consumer, the trainer's link and `rollstream status` call
these; each takes a client or a pipeline (`r`), so a caller stages several in one
transaction. Entries come back as `Entry(stream, id, fields)`; `fields` is None (or empty)
for an entry deleted while it was pending, which its reader acknowledges and skips.

Trimming: a stream read through consumer groups is trimmed with `XTRIM MINID` to the lowest
id any of its groups may still need: the oldest entry pending in the group (delivered, not
yet acknowledged) or, if earlier, the first entry not yet delivered to it. Every entry below
that bound was delivered to every group and acknowledged, so nothing in flight is lost. A
stream without any group is left alone: whoever will read it has not started yet.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from itertools import chain
from typing import Any, NamedTuple

import redis

from pipeline import wire
from pipeline.redis_io import (
    FATAL,
    RETRYABLE,
    Outage,
    next_id,
    parse_id,
    pool_connection,
    raw_replies,
    send_commands,
    text,
    transaction_then,
)

log = logging.getLogger(__name__)

Fields = dict[bytes, bytes]
Client = Any
"""A `redis.Redis` or one of its pipelines (redis-py's stubs type their replies loosely)."""


class Entry(NamedTuple):
    """One stream entry as read: its stream's name, its id, its fields (None or empty when it
    was deleted while pending)."""

    stream: str
    id: bytes
    fields: Fields | None


# ------------------------------------------------------------------ groups and reads


def ensure_group(r: Client, stream: str, group: str, start: str = "0") -> bool:
    """Create consumer group `group` on `stream` (creating the stream too) reading from
    `start`; True if it was created, False if it already existed."""
    try:
        r.xgroup_create(stream, group, id=start, mkstream=True)
    except redis.exceptions.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
        return False
    log.debug("created group %s on %s", group, stream)
    return True


def read_group(r: redis.Redis, group: str, consumer: str, streams: Mapping[str, str], *,
               count: int | None = None, block_ms: int | None = None) -> list[Entry]:
    """XREADGROUP: from each stream, its entries after the given id (`>`: new ones; `0`: this
    consumer's pending ones), in the order the server returns them (its reply read raw:
    hiredis's lists, no redis-py callbacks)."""
    [taken] = raw_replies(r, [_read_group_args(group, consumer, streams, count, block_ms)])
    return _raw_entries(taken)


class ReadAhead:
    """A group read written now, its reply read later: Redis runs it as it arrives and keeps
    its reply while the reader works on what it read before, so a batch's read costs the
    reader only the reply's transfer, not the wait for it. It runs without a block, on a
    connection of `r`'s pool taken out of the pool until the reply is read (`receive`) or
    the read given up (`drop`). What it delivers is pending in the group from the moment Redis
    runs it, like any read's: a reader that stops before reading the reply finds those
    entries in its backlog (`0`), and one that counts its pending entries receives the reply
    first (its entries are this reader's, not another's)."""

    def __init__(self, r: redis.Redis, group: str, consumer: str, streams: Mapping[str, str], *,
                 count: int | None = None) -> None:
        self._pool = r.connection_pool
        self._conn: redis.connection.Connection | None = pool_connection(self._pool)
        try:
            send_commands(self._conn, [_read_group_args(group, consumer, streams, count, None)])
        except BaseException:
            self.drop()
            raise

    def receive(self) -> list[Entry]:
        """The read's entries, as `read_group` returns them (once; a lost connection raises
        redis-py's error and is closed)."""
        conn, self._conn = self._conn, None
        if conn is None:
            raise RuntimeError("this read's reply was already received or given up")
        try:
            reply = conn.read_response()
        except BaseException:
            conn.disconnect()
            raise
        finally:
            self._pool.release(conn)
        return _raw_entries(reply)

    def drop(self) -> None:
        """Give the read up unread: its connection is closed (the reply dropped with it) and
        handed back. What it delivered stays pending in the group."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.disconnect()
            self._pool.release(conn)


def read_group_and_follow(r: redis.Redis, group: str, consumer: str, streams: Mapping[str, str],
                          follow: Mapping[str, str], *, count: int | None = None,
                          block_ms: int | None = None) -> tuple[list[Entry], list[Entry]]:
    """`read_group`, then, in the same write, XREAD of the broadcast streams `follow` after
    their given ids, which Redis runs once the first read returns: what they hold as of that
    moment."""
    taken, followed = raw_replies(r, [_read_group_args(group, consumer, streams, count, block_ms),
                                   ("XREAD", "STREAMS", *follow, *follow.values())])
    return _raw_entries(taken), _raw_entries(followed)


def commit_then_read_group_and_follow(r: redis.Redis, commands: Sequence[tuple], group: str, consumer: str,
                                      streams: Mapping[str, str], follow: Mapping[str, str], *,
                                      count: int | None = None,
                                      ) -> tuple[list, tuple[list[Entry], list[Entry]] | None]:
    """`redis_io.transaction(r, commands)` and, written behind its EXEC in the same write,
    `read_group_and_follow` without a block (Redis runs it once the transaction applied):
    the EXEC's replies and the two reads' entries, or None for the reads when either
    replied with an error (the group's read may then have delivered entries all the same).
    Raises as `transaction` does (the reads may then have run, their replies lost)."""
    replies, (taken, followed) = transaction_then(r, commands, [
        _read_group_args(group, consumer, streams, count, None), ("XREAD", "STREAMS", *follow, *follow.values())])
    if isinstance(taken, redis.exceptions.ResponseError) or isinstance(followed, redis.exceptions.ResponseError):
        return replies, None
    return replies, (_raw_entries(taken), _raw_entries(followed))


def _read_group_args(group: str, consumer: str, streams: Mapping[str, str], count: int | None,
                     block_ms: int | None) -> tuple:
    options = [*(("COUNT", count) if count is not None else ()), *(("BLOCK", block_ms) if block_ms is not None else ())]
    return ("XREADGROUP", "GROUP", group, consumer, *options, "STREAMS", *streams, *streams.values())


def _raw_entries(reply: Any) -> list[Entry]:
    """The entries of a raw XREAD or XREADGROUP reply: nil, or by stream (RESP3's map, or
    RESP2's list of [stream, entries] pairs) each stream's [[id, [field, value, ...] or nil],
    ...]."""
    by_stream = reply.items() if isinstance(reply, dict) else reply or []
    return [Entry(name, entry_id, _fields(flat))
            for stream, entries in by_stream for name in (text(stream),) for entry_id, flat in entries]


def _fields(flat: list | None) -> Fields | None:
    """An entry's fields from its flat [field, value, ...] (None: deleted while pending); one
    field, as every message has, without slicing."""
    if flat is None:
        return None
    if len(flat) == 2:
        return {flat[0]: flat[1]}
    return dict(zip(flat[::2], flat[1::2]))


def read(r: redis.Redis, streams: Mapping[str, str], *, block_ms: int | None = None) -> list[Entry]:
    """XREAD (no group: a broadcast every reader sees): each stream's entries after its id
    (its reply read raw, as `read_group`'s)."""
    [followed] = raw_replies(r, [("XREAD", *(("BLOCK", block_ms) if block_ms is not None else ()),
                                  "STREAMS", *streams, *streams.values())])
    return _raw_entries(followed)


def entries(r: Client, stream: str, start: str = "-", end: str = "+", *,
            count: int | None = None) -> list[tuple[bytes, Fields]]:
    """XRANGE: the entries of `stream` from `start` to `end` (inclusive; `(id` excludes)."""
    return r.xrange(stream, min=start, max=end, count=count)


def newest(r: Client, stream: str) -> tuple[bytes, Fields] | None:
    """The newest entry of `stream`, or None when it has none."""
    last = r.xrevrange(stream, count=1)
    return (last[0][0], last[0][1]) if last else None


# ------------------------------------------------------------------ writes


def append(r: Client, stream: str, fields: Mapping[bytes | str, Any]) -> Any:
    """XADD `fields` to `stream` (its id, or the pipeline when `r` is one)."""
    return r.xadd(stream, dict(fields))


def xadd_args(stream: str, fields: Mapping[bytes | str, Any]) -> tuple:
    """The arguments of `append`'s XADD (an id Redis makes), for a transaction written at once
    (`redis_io.transaction`)."""
    return ("XADD", stream, "*", *chain.from_iterable(fields.items()))


def xadd_field_args(stream: str, field: bytes | str, value: Any) -> tuple:
    """`xadd_args(stream, {field: value})`, without the mapping (an entry of one field)."""
    return ("XADD", stream, "*", field, value)


def ack(r: Client, stream: str, group: str, *ids: bytes | str) -> Any:
    """XACK `ids` of `stream` in `group` (nothing sent when there are none)."""
    return r.xack(stream, group, *ids) if ids else 0


def dead_letter(r: Client, dead: str, stream: str, entry_id: bytes, reason: str,
                fields: Mapping) -> Any:
    """Append the entry `entry_id` of `stream`, with `reason`, to the dead-letter stream
    `dead` (the caller acknowledges it in the same transaction)."""
    return r.xadd(dead, wire.dead_letter_fields(stream, entry_id, reason, fields))


def _as_bytes(value: bytes | str | int | float) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def append_once(r: Client, stream: str, fields: dict, *, what: str, total_s: float,
                sleep: Callable[[float], None] = time.sleep, stop: threading.Event | None = None) -> bytes:
    """XADD `fields` to `stream` exactly once, riding out an outage of up to `total_s`.

    A connection error can leave it unknown whether the entry was appended (the reply was
    lost). Before appending again, the stream's newest entry is compared with `fields`: equal,
    it was appended. This is exact for a stream with a single writer whose consecutive
    entries differ (a shard's task stream, written by its trainer; the weights stream,
    written by rank 0). Set, `stop` ends a wait for Redis with `Interrupted`."""
    want = {_as_bytes(k): _as_bytes(v) for k, v in fields.items()}
    outage = Outage(what, total_s, stop=stop)
    unsure = False
    while True:
        try:
            if unsure:
                last = newest(r, stream)
                if last and {_as_bytes(k): _as_bytes(v) for k, v in (last[1] or {}).items()} == want:
                    outage.ended()
                    return last[0]
            entry_id = r.xadd(stream, fields)
        except FATAL:
            raise
        except RETRYABLE as exc:
            unsure = True
            outage.pause(exc, sleep)
            continue
        outage.ended()
        return entry_id


# ------------------------------------------------------------------ claims and pending


def claim(r: Client, stream: str, group: str, consumer: str, min_idle_ms: int,
          ids: Sequence[bytes]) -> list[bytes]:
    """XCLAIM (JUSTID): the ids of `ids` idle at least `min_idle_ms` now owned by `consumer`."""
    return r.xclaim(stream, group, consumer, min_idle_ms, list(ids), justid=True)


def pending(r: Client, stream: str, group: str, *, start: str | bytes = "-", end: str | bytes = "+",
            count: int, consumer: str | None = None, idle_ms: int | None = None) -> Any:
    """XPENDING's extended form: up to `count` pending entries between `start` and `end`
    (optionally of one consumer, idle at least `idle_ms`), each with its owner and idle time."""
    return r.xpending_range(stream, group, min=start, max=end, count=count,
                            consumername=consumer, idle=idle_ms)


def pending_of(r: Client, streams: Sequence[str], group: str, consumer: str) -> int:
    """How many entries of `streams` are pending in `group` for `consumer` (XPENDING's
    summary form, one round trip)."""
    pipe = r.pipeline(transaction=False)
    for stream in streams:
        pipe.xpending(stream, group)
    return sum(int(c["pending"]) for summary in pipe.execute() for c in summary["consumers"]
               if text(c["name"]) == consumer)


# ------------------------------------------------------------------ trimming


def _groups(r: Client, stream: str) -> list[dict]:
    try:
        return r.xinfo_groups(stream)
    except redis.exceptions.ResponseError as exc:
        if "no such key" in str(exc).lower():
            return []
        raise


def safe_minid(r: Client, stream: str) -> str | None:
    """The lowest id any group of `stream` still needs, or None (no group: do not trim)."""
    bounds = []
    for info in _groups(r, stream):
        name = text(info["name"])
        bound = next_id(info["last-delivered-id"])
        if int(info["pending"]):
            oldest = r.xpending(stream, name)["min"]
            if oldest is not None:  # None: acknowledged since XINFO
                bound = min(bound, text(oldest), key=parse_id)
        bounds.append(bound)
    return min(bounds, key=parse_id) if bounds else None


def trim_acknowledged(r: Client, stream: str, *, keep_last: bool = False,
                      keep_from: str | None = None) -> int:
    """Trim `stream` below `safe_minid`; with `keep_last`, never its newest entry (a reader
    joining later learns the current value from it); with `keep_from`, no entry from that id
    on (entries acknowledged but still referred to). Returns the entries removed."""
    bound = safe_minid(r, stream)
    if bound is None:
        return 0
    if keep_from is not None:
        bound = min(bound, keep_from, key=parse_id)
    if keep_last:
        last = newest(r, stream)
        if last:
            bound = min(bound, text(last[0]), key=parse_id)
    removed = r.xtrim(stream, minid=bound, approximate=False)
    if removed:
        log.debug("trimmed %d entries of %s below %s", removed, stream, bound)
    return removed


def trim_by_age(r: Client, stream: str, retention_s: float) -> int:
    """Trim entries older than `retention_s` before the stream's newest entry (ids are the
    server's clock, so no client clock enters the bound)."""
    last = newest(r, stream)
    if not last:
        return 0
    ms, _ = parse_id(last[0])
    return r.xtrim(stream, minid=f"{max(0, ms - int(retention_s * 1000))}-0", approximate=False)


def trim_length(r: Client, stream: str, maxlen: int) -> int:
    """Keep about the newest `maxlen` entries (for streams nobody acknowledges)."""
    return r.xtrim(stream, maxlen=maxlen, approximate=True)
