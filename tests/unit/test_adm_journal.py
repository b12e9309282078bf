"""The journal's bytes are msgpack's own (`msgpack.packb(..., use_bin_type=True)`), written
faster: a transaction's events and a snapshot read back by any msgpack reader as before."""

import msgpack
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from consumers.journal import _entry, decode_entry, encode_events, encode_snapshot
from pipeline.config import SchedulerConfig, build
from pipeline.scheduler import Finish, Handover, Open, Register, SampleKey, Scheduler, Tick
from pipeline.sessions import Status, Task
from tests.unit.test_journal import EVENTS

# msgpack-native payloads, as a Registration decodes them
NATIVE = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=300) | st.binary(max_size=300),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


def _msgpack(events) -> bytes:
    return msgpack.packb([_entry(event, now) for event, now in events], use_bin_type=True)


def test_every_event_kind_is_journaled_as_msgpack_packs_it():
    events = [(event, 1234.5 + i) for i, event in enumerate(EVENTS)]
    assert encode_events(events) == _msgpack(events)
    assert decode_entry(encode_events(events)) == events


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**31), st.floats(allow_nan=False) | st.none(),
                          st.integers(0, 2**31) | st.none(), NATIVE), max_size=8), st.floats(0, 2e9))
def test_any_events_journal_as_msgpack_packs_them(values, now):
    events = [(Finish(SampleKey(0, g, 1, 0), Status.COMPLETED, reward, version, None), now)
              for g, reward, version, _ in values]
    events += [(Register(3, tuple(Task(str(i), {"p": payload}) for i, (*_, payload) in enumerate(values))), now)]
    assert encode_events(events) == _msgpack(events)


def test_a_value_msgpack_packs_and_the_faster_encoder_refuses_is_packed_by_msgpack():
    events = [(Finish(SampleKey(0, 1, 2, 0), Status.COMPLETED, np.float64(0.25), 3, None), 5.0)]
    assert encode_events(events) == _msgpack(events)
    assert decode_entry(encode_events(events))[0][0].reward == 0.25


def test_a_snapshot_is_packed_as_msgpack_packs_it():
    config = build(SchedulerConfig, {"admission": "stream", "groups": 2, "batch_size": 2, "admit": 2,
                                     "inflight_samples": 8})
    sched = Scheduler(config, shard=0)
    for event in (Open(0), Register(0, (Task("a", {"x": [1, 2.5]}), Task("b"))), Handover(0, 0, None)):
        sched.handle(event, 10.0)
    assert sched.in_flight > 0
    assert encode_snapshot(sched) == msgpack.packb(sched.snapshot(), use_bin_type=True)


def test_a_finish_s_held_reference_rides_in_its_entry_and_replays_by_name():
    """A Finish whose result is held by reference carries its entry id (`h`) in the same
    map; the events decode as before (the id is not the event's), and `load` names it."""
    import fakeredis

    from consumers.journal import FIELD, HELD, encode_held, load
    from pipeline.keys import Keys
    from pipeline.scheduler import member

    key = SampleKey(0, 3, 1, 0)
    events = [(Finish(key, Status.COMPLETED, 1.0, 0, None), 5.0), (Tick(), 6.0)]
    data = encode_events(events, {0: b"1700000000000-7"})
    finish = {**_entry(*events[0]), "k": [0, 3, 1, 0], "h": b"1700000000000-7"}  # the key as packed
    assert msgpack.unpackb(data, raw=False) == [finish, _entry(*events[1])]
    assert decode_entry(data) == events
    r, keys = fakeredis.FakeRedis(), Keys("journal-refs")
    config = build(SchedulerConfig, {})
    r.hset(keys.state(0), HELD, encode_held({"0:1:0:0": b"1700000000000-2"}))
    r.xadd(keys.journal(0), {FIELD: encode_events([(Open(0), 4.0)])})
    r.xadd(keys.journal(0), {FIELD: data})
    _, replayed, refs = load(r, keys, 0, config)
    assert replayed == 3 and refs == {"0:1:0:0": b"1700000000000-2", member(key): b"1700000000000-7"}
