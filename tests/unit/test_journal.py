"""The admission journal's event codec round-trips every scheduler event."""

import msgpack
import pytest

from consumers.journal import (
    JournalError,
    decode_entry,
    decode_event,
    encode_event,
    encode_events,
)
from pipeline.scheduler import (
    Close,
    Finish,
    Handover,
    Open,
    Publish,
    Register,
    SampleKey,
    Tick,
)
from pipeline.sessions import Status, Task

EVENTS = [
    Open(3),
    Register(2, (Task("a", {"x": [1, 2], "y": {"z": "w"}}), Task("b"))),
    Handover(4, 7, None),
    Handover(5, 8, 8),
    Handover(6, 9, None, 0),
    Handover(7, 10, 10, 5),
    Finish(SampleKey(3, 10, 1, 2), Status.TRUNCATED, 0.5, 6, None),
    Finish(SampleKey(3, 10, 0, 0), Status.INFRA_ERROR, None, None, "Traceback ..."),
    Publish(9),
    Tick(),
    Close(),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_event_round_trips_with_its_time(event):
    assert decode_event(encode_event(event, 1234.5)) == (event, 1234.5)


def test_a_handover_journaled_before_the_runs_end_was_sent_reads_without_it():
    """A journal written before handovers carried `steps_left` holds no "l"; its handovers
    read as ones that do not say when the run ends."""
    old = msgpack.packb({"t": "handover", "n": 2.5, "step": 4, "u": 7, "p": None})
    assert decode_event(old) == (Handover(4, 7, None, None), 2.5)
    assert "l" not in msgpack.unpackb(encode_event(Handover(4, 7), 2.5))


def test_an_unknown_entry_is_refused():
    import msgpack

    with pytest.raises(JournalError, match="unknown"):
        decode_event(msgpack.packb({"t": "teleport", "n": 0.0}))


def test_a_transactions_events_are_one_entry_in_order():
    timed = [(event, 1000.0 + i) for i, event in enumerate(EVENTS)]
    assert decode_entry(encode_events(timed)) == timed
    assert decode_entry(encode_event(EVENTS[0], 1.5)) == [(EVENTS[0], 1.5)]  # an entry of one event
