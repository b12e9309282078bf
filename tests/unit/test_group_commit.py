"""The rollout consumer's group commit of results (`consumers.rollout._GroupCommit`)."""

from __future__ import annotations

import threading

import pytest

from consumers.rollout import _GroupCommit, _Publication


def _publication(i: int) -> _Publication:
    return _Publication(owned=None, fields={b"m": str(i).encode()}, dead=None)  # type: ignore[arg-type]


def test_publications_queued_during_a_commit_share_the_next_one():
    batches: list[list[bytes]] = []
    first_in_flight, queued = threading.Event(), threading.Event()
    group: _GroupCommit

    def commit(batch):
        batches.append([p.fields[b"m"] for p in batch])
        if len(batches) == 1:  # hold the first commit until the others have queued
            first_in_flight.set()
            assert queued.wait(10)

    group = _GroupCommit(commit)
    first = threading.Thread(target=group.publish, args=(_publication(0),))
    first.start()
    assert first_in_flight.wait(10)
    others = [threading.Thread(target=group.publish, args=(_publication(i),)) for i in range(1, 5)]
    for t in others:
        t.start()

    def all_queued() -> bool:
        with group._cond:
            return len(group._queue) == 4

    while not all_queued():  # the four wait on the condition, queued
        threading.Event().wait(0.001)
    queued.set()
    for t in [first, *others]:
        t.join(10)
    assert batches[0] == [b"0"] and sorted(batches[1]) == [b"1", b"2", b"3", b"4"] and len(batches) == 2


def test_every_publication_of_a_failed_commit_raises():
    def commit(batch):
        raise RuntimeError("fenced")

    with pytest.raises(RuntimeError, match="fenced"):
        _GroupCommit(commit).publish(_publication(0))
