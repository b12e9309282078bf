"""The admission consumer's read ahead (`streams.ReadAhead`): the next batch's group read is
written as soon as a read returns entries and its reply read at the next poll. What it
delivers is this consumer's own (never taken for a predecessor's read), it is applied in
entry-id order with everything else, and a consumer that stops with one unread loses and
repeats nothing: its successor finds those entries in its backlog."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from consumers import journal
from consumers.admission import Admission
from consumers.fence import Fenced
from pipeline import streams, wire
from pipeline.config import AdmissionConfig, build
from pipeline.redis_io import connect
from pipeline.scheduler import Finish, Register
from pipeline.sessions import Task
from tests.integration.test_admission_order import SCHEDULER, _result

pytestmark = pytest.mark.timeout(60)

READ = 3  # results per read: eight results take three reads


def _admission(r, redis_config, read_count: int = READ, **kw) -> Admission:
    config = build(AdmissionConfig, {"redis": redis_config.model_dump(), "scheduler": SCHEDULER,
                                     "block_ms": 1, "trim_every_s": 3600.0, "lease_s": 3600.0})
    return Admission(config, r, snapshot_every=10_000, read_count=read_count, **kw)


def _drain(adm: Admission) -> None:
    while adm.poll_once(1):
        pass


def _started(r, keys, adm: Admission) -> None:
    """Step 0 handed over (two groups of four in flight), then their eight results appended."""
    tasks = keys.tasks(0)
    r.xadd(tasks, wire.to_fields(wire.Open(0, 0)))
    r.xadd(tasks, wire.to_fields(wire.Registration(0, 0, 0, (Task("a"), Task("b")))))
    r.xadd(tasks, wire.to_fields(wire.Handover(0, 0, 0, 0, None)))
    _drain(adm)
    assert adm.sched.in_flight == 8
    for group in range(2):
        for sample in range(4):
            r.xadd(keys.results(0), _result(group, sample))


def _pending(r, keys, adm: Admission) -> int:
    return r.xpending(keys.results(0), adm.group)["pending"]


def _wait_pending(r, keys, adm: Admission, n: int) -> None:
    """Until Redis has run the read written ahead: `n` results delivered, unacknowledged."""
    deadline = time.monotonic() + 10
    while _pending(r, keys, adm) != n:
        assert time.monotonic() < deadline, f"{_pending(r, keys, adm)} results pending, not {n}"
        time.sleep(0.005)


def _finishes(r, keys) -> Counter:
    return Counter((e.key.group, e.key.sample) for e, _ in journal.events(r, keys, 0) if isinstance(e, Finish))


def test_a_read_ahead_returns_what_a_read_would_and_drop_leaves_it_pending(r, keys):
    stream, group = keys.results(0), "g"
    streams.ensure_group(r, stream, group)
    ids = [r.xadd(stream, {wire.FIELD: bytes([i])}) for i in range(5)]
    ahead = streams.ReadAhead(r, group, "c", {stream: ">"}, count=3)
    got = ahead.receive()
    assert [(e.stream, e.id, e.fields) for e in got] == \
        [(stream, i, {wire.FIELD: bytes([n])}) for n, i in enumerate(ids[:3])]
    with pytest.raises(RuntimeError):
        ahead.receive()
    dropped = streams.ReadAhead(r, group, "c", {stream: ">"}, count=3)
    dropped.drop()  # unread: what it delivered is pending all the same, and a backlog read has it
    deadline = time.monotonic() + 10
    while r.xpending(stream, group)["pending"] != 5:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert [e.id for e in streams.read_group(r, group, "c", {stream: "0"})] == ids
    assert r.connection_pool._in_use_connections == set()  # both handed back


def test_the_read_ahead_is_the_consumer_s_own_not_a_predecessor_s(r, keys, redis_config):
    adm = _admission(r, redis_config)
    _started(r, keys, adm)
    assert adm.poll_once(1) == READ  # three results applied, the next three read ahead
    _wait_pending(r, keys, adm, READ)
    assert not adm._taken_back()  # pending here, unapplied: but its own, received now
    assert adm.stats["taken_back"] == 0
    _drain(adm)
    assert _finishes(r, keys) == Counter({(g, s): 1 for g in range(2) for s in range(4)})
    ready = wire.from_fields(r.xrange(keys.ready(0))[0][1], wire.Ready)
    assert ready.step == 0 and ready.record.groups == 2
    assert _pending(r, keys, adm) == 0 and adm.stats["taken_back"] == 0


def test_a_consumer_stopped_with_a_read_ahead_unread_loses_and_repeats_nothing(r, keys, redis_config):
    first = _admission(r, redis_config)
    _started(r, keys, first)
    assert first.poll_once(1) == READ
    _wait_pending(r, keys, first, READ)  # delivered by the read ahead, its reply never read
    again = _admission(connect(redis_config), redis_config)  # the same process: takes the shard at once
    _drain(again)  # its backlog first: the entries the read ahead delivered
    assert _finishes(r, keys) == Counter({(g, s): 1 for g in range(2) for s in range(4)})
    assert [wire.from_fields(f, wire.Ready).step for _, f in r.xrange(keys.ready(0))] == [0]
    assert _pending(r, keys, again) == 0
    with pytest.raises(Fenced, match="took the shard over"):
        first.poll_once(1)  # the one it replaced commits nothing more


def test_a_reconnect_forgets_the_read_ahead_its_backlog_returns(r, keys, redis_config):
    adm = _admission(r, redis_config)
    _started(r, keys, adm)
    assert adm.poll_once(1) == READ
    _wait_pending(r, keys, adm, READ)
    adm._reconnect()  # as after a connection error: recovery reads the backlog first
    _drain(adm)
    assert _finishes(r, keys) == Counter({(g, s): 1 for g in range(2) for s in range(4)})
    assert [wire.from_fields(f, wire.Ready).step for _, f in r.xrange(keys.ready(0))] == [0]
    assert _pending(r, keys, adm) == 0


def test_entries_taken_back_with_a_read_ahead_received_are_applied_once(r, keys, redis_config):
    """A predecessor's read found while the read ahead's reply is held: the backlog read
    that follows returns both, and the held reply is forgotten."""
    adm = _admission(r, redis_config)
    _started(r, keys, adm)
    assert adm.poll_once(1) == READ
    _wait_pending(r, keys, adm, READ)
    pipe = r.pipeline(transaction=True)  # appended and read under the admission's name at once
    pipe.xadd(keys.tasks(0), wire.to_fields(wire.Registration(0, 0, 1, (Task("c"), Task("d")))))
    pipe.xreadgroup(adm.group, adm.name, {keys.tasks(0): ">"}, count=10)
    assert [len(entries) for _, entries in pipe.execute()[1]] == [1]
    assert adm._taken_back()
    assert adm.stats["taken_back"] == 1
    _drain(adm)
    assert _finishes(r, keys) == Counter({(g, s): 1 for g in range(2) for s in range(4)})
    registered = [e.batch for e, _ in journal.events(r, keys, 0) if isinstance(e, Register)]
    assert registered == [0, 1]  # batch 1's: the predecessor read it
    assert _pending(r, keys, adm) == 0 and r.xpending(keys.tasks(0), adm.group)["pending"] == 0
