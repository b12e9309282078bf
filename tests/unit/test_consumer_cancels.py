"""`_Cancels`: what a rollout consumer knows of the cancelled attempts. A shard's set, read
again, replaces what was known of that shard (the admission pruned the rest); other shards
keep theirs; a member that does not name an attempt is left out, with a warning."""

from __future__ import annotations

import logging

from consumers.rollout import _Cancels
from pipeline import wire
from pipeline.sessions import Task


def _work(shard: int, group: int) -> wire.Work:
    return wire.Work(shard, 0, group, 1, 0, Task("t"), 0)


def test_a_shard_read_again_replaces_what_was_known_of_it_alone(caplog):
    cancels = _Cancels()
    cancels.load({0: [b"0:1:1:0", b"0:2:1:0"], 1: [b"0:1:1:0"]})
    cancels.note(wire.Cancel(0, 0, 3, 1, 0, "stale"))
    assert {g for g in range(5) if _work(0, g) in cancels} == {1, 2, 3}
    assert cancels.shards == {0, 1} and _work(1, 1) in cancels and _work(1, 2) not in cancels
    with caplog.at_level(logging.WARNING):
        cancels.load({0: [b"0:2:1:0", b"bad", b"0:x:1:0"]})
    assert {g for g in range(5) if _work(0, g) in cancels} == {2}
    assert _work(1, 1) in cancels  # shard 1 was not read again
    assert sum("not epoch:group:sample:attempt" in m for m in caplog.messages) == 2
