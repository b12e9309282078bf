"""A read sent ahead (`streams.ReadAhead`, `redis_io.Sent`) returns what `read_group` returns;
dropped, its entries stay pending for the reader's backlog read. The admission consumer
reads ahead when a stream holds more than one read: every entry is still applied once, in
id order, and a read ahead is neither counted as taken by a predecessor nor lost on restart."""

import pytest

from consumers import journal
from consumers.admission import Admission
from pipeline import streams, wire
from pipeline.config import AdmissionConfig, build
from pipeline.redis_io import Sent
from pipeline.sessions import Call, Session, Status, Task

pytestmark = pytest.mark.timeout(60)

SCHEDULER = {"admission": "stream", "groups": 4, "batch_size": 2, "admit": 2, "max_lag": 1,
             "width": 64, "rows": 4}


def test_sent_commands_reply_later_and_a_dropped_reply_is_never_read(r, keys):
    sent = Sent(r, [("SET", keys.prefix + "a", "1"), ("GET", keys.prefix + "a")])
    assert r.get(keys.prefix + "b") is None  # the client's other connections work meanwhile
    assert sent.replies() == [b"OK", b"1"]
    with pytest.raises(RuntimeError):
        sent.replies()
    dropped = Sent(r, [("GET", keys.prefix + "a")])
    dropped.close()
    dropped.close()
    assert r.get(keys.prefix + "a") == b"1"  # a pooled connection reads no stale reply


def test_a_read_ahead_returns_what_a_read_returns_and_a_dropped_one_stays_pending(r, keys):
    stream = keys.results(0)
    streams.ensure_group(r, stream, "g")
    ids = [r.xadd(stream, {b"m": bytes([i])}) for i in range(5)]
    ahead = streams.ReadAhead(r, "g", "c", {stream: ">"}, count=3)
    taken = ahead.entries()
    assert ahead.entries() is taken
    assert [(e.stream, e.id, e.fields) for e in taken] == [(stream, i, {b"m": bytes([n])})
                                                           for n, i in enumerate(ids[:3])]
    dropped = streams.ReadAhead(r, "g", "c", {stream: ">"}, count=3)
    dropped.close()
    with pytest.raises(RuntimeError):
        dropped.entries()
    again = streams.read_group(r, "g", "c", {stream: "0"})
    assert [e.id for e in again] == ids  # delivered by the dropped read too: pending here
    assert streams.read_group(r, "g", "c", {stream: ">"}) == []


def _result(group: int, sample: int) -> dict:
    session = Session(Status.COMPLETED, 1.0, calls=[Call([1, 2], [3], [-0.5], 0)],
                      timings={"started": 0.0, "finished": 1.0})
    return wire.to_fields(wire.Result.from_session(0, 0, group, sample, 0, session, "test"))


def _admission(r, redis_config) -> Admission:
    config = build(AdmissionConfig, {"redis": redis_config.model_dump(), "scheduler": SCHEDULER,
                                     "block_ms": 1, "trim_every_s": 3600.0, "lease_s": 3600.0})
    return Admission(config, r, snapshot_every=10_000, read_count=3)


def _finishes(r, keys) -> list:
    return [event.key for event, _ in journal.events(r, keys, 0) if type(event).__name__ == "Finish"]


@pytest.mark.parametrize("restart", [False, True])
def test_the_admission_reads_ahead_and_applies_every_entry_once_in_order(r, keys, redis_config, restart):
    adm = _admission(r, redis_config)
    tasks = keys.tasks(0)
    r.xadd(tasks, wire.to_fields(wire.Open(0, 0)))
    r.xadd(tasks, wire.to_fields(wire.Registration(0, 0, 0, (Task("a"), Task("b")))))
    while adm.poll_once(1):
        pass
    for group in range(2):
        for sample in range(4):
            r.xadd(keys.results(0), _result(group, sample))
    assert adm.poll_once(1) == 3  # a cut read: the next one is sent ahead
    assert adm._ahead is not None
    assert adm._taken(0) == 0  # what the read ahead delivered is this consumer's own
    if restart:  # the read ahead is lost with its process: its entries are pending here
        adm = _admission(r, redis_config)
    while adm.poll_once(1):
        pass
    finished = _finishes(r, keys)
    assert [(k.group, k.sample) for k in finished] == [(g, s) for g in range(2) for s in range(4)]
    assert r.xpending(keys.results(0), adm.group)["pending"] == 0
    r.xadd(tasks, wire.to_fields(wire.Handover(0, 0, 0, 0, None)))
    while adm.poll_once(1):
        pass
    ready = wire.from_fields(r.xrange(keys.ready(0))[0][1], wire.Ready)
    assert ready.step == 0 and ready.record.groups == 2
