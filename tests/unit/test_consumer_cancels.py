"""`_Cancels`: what a rollout consumer knows of the cancelled attempts (and the raw replies of
the read that brings the Cancels with the work, in either protocol). A shard's set is read
with each member's score; a Cancel read on `control` is noted with its time; what is older
than a time is forgotten; a member that does not name an attempt is left out, with a
warning."""

from __future__ import annotations

import logging

from consumers.rollout import _Cancels
from pipeline import streams, wire
from pipeline.sessions import Task


def _work(shard: int, group: int) -> wire.Work:
    return wire.Work(shard, 0, group, 1, 0, Task("t"), 0)


def test_cancels_are_known_by_attempt_and_forgotten_by_age(caplog):
    cancels = _Cancels()
    with caplog.at_level(logging.WARNING):
        cancels.load(0, [(b"0:1:1:0", 10.0), (b"0:2:1:0", 20.0), (b"bad", 1.0), (b"0:x:1:0", 1.0)])
    cancels.load(1, [(b"0:1:1:0", 30.0)])
    cancels.note(wire.Cancel(0, 0, 3, 1, 0, "stale"), 40.0)
    assert sum("not epoch:group:sample:attempt" in m for m in caplog.messages) == 2
    assert {g for g in range(5) if _work(0, g) in cancels} == {1, 2, 3}
    assert cancels.shards == {0, 1} and _work(1, 1) in cancels and _work(1, 2) not in cancels
    assert wire.Work(0, 0, 1, 1, 1, Task("t"), 0) not in cancels  # another attempt of the sample
    cancels.forget_before(20.0)
    assert {g for g in range(5) if _work(0, g) in cancels} == {2, 3} and _work(1, 1) in cancels
    cancels.forget_before(35.0)
    assert len(cancels) == 1 and _work(0, 3) in cancels and cancels.shards == {0, 1}


def test_raw_read_replies_in_either_protocol_give_the_same_entries():
    resp2 = [[b"s", [[b"1-0", [b"m", b"x", b"n", b"y"]], [b"2-0", None]]], [b"t", [[b"3-0", [b"m", b"z"]]]]]
    resp3 = {b"s": resp2[0][1], b"t": resp2[1][1]}
    want = [streams.Entry("s", b"1-0", {b"m": b"x", b"n": b"y"}), streams.Entry("s", b"2-0", None),
            streams.Entry("t", b"3-0", {b"m": b"z"})]
    assert streams._raw_entries(resp2) == streams._raw_entries(resp3) == want
    assert streams._raw_entries(None) == []
