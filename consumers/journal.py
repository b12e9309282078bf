"""The admission consumer's durable scheduler state: a snapshot plus a journal of events.

The scheduling state machine is deterministic (`pipeline.scheduler`): the same events with
the same `now` give the same actions and the same state. So the admission consumer persists
*events*, not state. Every transition appends its event and `now` to the shard's journal
stream (`Keys.journal`) in the same `MULTI/EXEC` as its effects and the `XACK` of its input.
On start, the machine is rebuilt by restoring the snapshot (`Keys.state`, field `snapshot`)
and replaying the journal in order, discarding the actions (their effects are already in
Redis). An input that was read but whose transition never committed is still pending in its
consumer group and is processed again, as new.

The journal is bounded by snapshots: every `snapshot_every` transitions (or, when the last
snapshot held more samples than that, as many transitions as it held samples: a snapshot's
size grows with them) the transaction also writes a fresh snapshot and deletes the journal
(the snapshot covers it). A snapshot is
msgpack (`Scheduler.snapshot`), never pickle.

Journal entries are msgpack maps `{"t": kind, "n": now, ...}` in one field `e`; a
transaction journals its events in ONE entry whose `e` is the array of their maps, in order
(`encode_events`), so a batch of transitions costs one encode and one XADD. `load` reads
both forms.

The journal also says where the admitted results are: a Finish whose result the admission
holds by reference carries `"h"`, the id of the result's entry of `results:{shard}`, and a
snapshot is written with `held` (`Keys.state`), the map of every result then held by
reference (`member` name -> entry id). `load` gives those references back, the snapshot's
then the journal's; which of them are still held is the rebuilt machine's to say
(`Scheduler.admitted_keys`). So holding a result costs no write of its own.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping

import msgpack
import msgspec
import redis

from pipeline.config import SchedulerConfig
from pipeline.keys import STATE_CONFIG, Keys
from pipeline.scheduler import (
    Close,
    Event,
    Finish,
    Handover,
    Open,
    Publish,
    Register,
    SampleKey,
    Scheduler,
    Tick,
    member,
)
from pipeline.sessions import Status, Task

log = logging.getLogger(__name__)

FIELD = b"e"
SNAPSHOT = b"snapshot"
HELD = b"held"
"""The field of `Keys.state` beside the snapshot: the results held by reference then."""
CONFIG = STATE_CONFIG
_PAGE = 1000


class JournalError(RuntimeError):
    """The persisted state cannot be used (corrupt, or built under another config)."""


# ---------------------------------------------------------------------------- codec


def encode_event(event: Event, now: float) -> bytes:
    """The journal bytes of `event` applied at `now`."""
    return msgpack.packb({"n": float(now), **_fields(event)}, use_bin_type=True)


def encode_events(events: list[tuple[Event, float]], refs: Mapping[int, bytes] | None = None) -> bytes:
    """The journal bytes of several events applied in order (one entry for a transaction);
    `refs`: by the index of a Finish among them, the entry id of its result, held by
    reference."""
    entries = [_entry(event, now) for event, now in events]
    for i, ref in (refs or {}).items():
        entries[i]["h"] = ref
    return _pack(entries)


def encode_held(refs: Mapping[str, bytes]) -> bytes:
    """The `HELD` bytes of the results held by reference (`member` name -> entry id)."""
    return _pack(dict(refs))


_ENCODER = msgspec.msgpack.Encoder()


def _pack(value: object) -> bytes:
    """`msgpack.packb(value, use_bin_type=True)`: the same bytes, written by msgspec's
    encoder (about 3.5 times faster) for msgpack's own types; a value msgspec refuses (a
    numpy scalar, say) is packed by msgpack itself."""
    try:
        return _ENCODER.encode(value)
    except (TypeError, msgspec.EncodeError):
        return msgpack.packb(value, use_bin_type=True)


def _entry(event: Event, now: float) -> dict:
    """The map of one journal entry: `now`, then the event's fields (`_fields`), in order.
    A Finish, the most frequent event, is written directly (the same map)."""
    if type(event) is Finish:  # its key, a tuple, packs as the array of its fields
        return {"n": float(now), "t": "finish", "k": event.key,
                "s": _STATUS_VALUES[event.status], "r": event.reward, "o": event.oldest_version, "x": event.error}
    return {"n": float(now), **_fields(event)}


_STATUS_VALUES = {status: status.value for status in Status}  # (an enum's `.value` is a slow property)


def decode_entry(data: bytes) -> list[tuple[Event, float]]:
    """The events and their `now` of one journal entry (one event, or a transaction's)."""
    return [_event(d) for d in _maps(data)]


def _fields(event: Event) -> dict:
    if isinstance(event, Finish):
        return {"t": "finish", "k": event.key,
                "s": _STATUS_VALUES[event.status], "r": event.reward, "o": event.oldest_version,
                "x": event.error}
    if isinstance(event, Register):
        return {"t": "register", "b": event.batch,
                "tasks": [[t.id, dict(t.payload)] for t in event.tasks]}
    if isinstance(event, Handover):
        fields = {"t": "handover", "step": event.step, "u": event.updates, "p": event.published}
        if event.steps_left is not None:  # additive: a journal written before it has none
            fields["l"] = event.steps_left
        return fields
    if isinstance(event, Open):
        return {"t": "open", "epoch": event.epoch}
    if isinstance(event, Publish):
        return {"t": "publish", "version": event.version}
    if isinstance(event, Tick):
        return {"t": "tick"}
    if isinstance(event, Close):
        return {"t": "close"}
    raise TypeError(f"not a scheduler event: {event!r}")


def decode_event(data: bytes) -> tuple[Event, float]:
    """The event and `now` of a journal entry of one event."""
    return _event(msgpack.unpackb(data, raw=False, strict_map_key=False))


def _event(d: dict) -> tuple[Event, float]:
    kind, now = d["t"], d["n"]
    if kind == "finish":
        return Finish(SampleKey(*d["k"]), Status(d["s"]), d["r"], d["o"], d["x"]), now
    if kind == "register":
        return Register(d["b"], tuple(Task(i, p) for i, p in d["tasks"])), now
    if kind == "handover":
        return Handover(d["step"], d["u"], d["p"], d.get("l")), now
    if kind == "open":
        return Open(d["epoch"]), now
    if kind == "publish":
        return Publish(d["version"]), now
    if kind == "tick":
        return Tick(), now
    if kind == "close":
        return Close(), now
    raise JournalError(f"unknown journal entry kind {kind!r}")


# ---------------------------------------------------------------------------- persistence


def config_text(config: SchedulerConfig) -> bytes:
    return json.dumps(config.model_dump(mode="json"), sort_keys=True).encode()


def check_config(r: redis.Redis, keys: Keys, shard: int, config: SchedulerConfig) -> None:
    """Record the scheduler config of this shard's state on first use; refuse to resume
    state built under another one (replaying it would not reproduce what happened)."""
    want = config_text(config)
    r.hsetnx(keys.state(shard), CONFIG, want)
    have = r.hget(keys.state(shard), CONFIG)
    if have != want:
        raise JournalError(
            f"shard {shard}'s scheduler state ({keys.state(shard)}) was built under another "
            f"scheduler config: {have.decode()} != {want.decode()}; use a new namespace or "
            f"delete {keys.state(shard)} and {keys.journal(shard)} to start over")


def encode_snapshot(sched: Scheduler) -> bytes:
    return _pack(sched.snapshot())


def _entries(r: redis.Redis, stream: str) -> Iterator[tuple[bytes, dict]]:
    start = "-"
    while True:
        page = r.xrange(stream, min=start, max="+", count=_PAGE)
        yield from page
        if len(page) < _PAGE:
            return
        start = "(" + page[-1][0].decode()


def events(r: redis.Redis, keys: Keys, shard: int) -> Iterator[tuple[Event, float]]:
    """The journal's events and their `now`, in order."""
    for _, fields in _entries(r, keys.journal(shard)):
        yield from decode_entry(fields[FIELD])


def _maps(data: bytes) -> list[dict]:
    d = msgpack.unpackb(data, raw=False, strict_map_key=False)
    return d if isinstance(d, list) else [d]


def load(r: redis.Redis, keys: Keys, shard: int,
         config: SchedulerConfig) -> tuple[Scheduler, int, dict[str, bytes]]:
    """The scheduler as the snapshot and journal leave it, the journal's length, and the
    results held by reference that they name (`member` name -> entry id of
    `results:{shard}`; some may have been released since: see the module docstring)."""
    raw, held = r.hmget(keys.state(shard), [SNAPSHOT, HELD])
    if raw is None:
        sched = Scheduler(config, shard=shard)
    else:
        sched = Scheduler.restore(config, msgpack.unpackb(raw, raw=False, strict_map_key=False))
    refs: dict[str, bytes] = {} if held is None else msgpack.unpackb(held, raw=False)
    replayed = 0
    for _, fields in _entries(r, keys.journal(shard)):
        for d in _maps(fields[FIELD]):
            event, now = _event(d)
            sched.handle(event, now)
            replayed += 1
            if "h" in d:
                refs[member(event.key)] = d["h"]
    log.info("shard %d: restored %s and replayed %d journal entries (epoch %d, %d in flight)",
             shard, "a snapshot" if raw is not None else "no snapshot", replayed, sched.epoch,
             sched.in_flight)
    return sched, replayed, refs
