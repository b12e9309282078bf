"""The rollout consumer's group commit of results (`consumers.rollout._GroupCommit`) and
its session threads (`_SessionThreads`)."""

from __future__ import annotations

import threading

import pytest

from consumers.rollout import _GroupCommit, _Publication, _SessionThreads
from tests.integration.helpers import wait_until


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
        with group._lock:
            return len(group._queue) == 4

    while not all_queued():  # the four wait, queued
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


def test_sessions_reuse_idle_threads_and_start_one_when_none_is_idle():
    ran: list[tuple[int, str]] = []
    release, done = threading.Event(), threading.Semaphore(0)

    def run(o):
        if o == "slow":
            assert release.wait(10)
        ran.append((o, threading.current_thread().name))
        done.release()

    threads = _SessionThreads("c", run)
    for i in range(3):  # one after another: one thread
        threads.start(i)
        assert done.acquire(timeout=10)
        # the session thread counts itself idle once `run` has returned, after `done`: until
        # then the next start finds none idle and starts another
        wait_until(lambda: threads._idle == 1, 20, "the session thread to count itself idle")
    threads.start("slow")  # busy while the next starts: a second thread
    threads.start(3)
    assert done.acquire(timeout=10)
    release.set()
    assert done.acquire(timeout=10)
    names = dict(ran)
    assert names[0] == names[1] == names[2] and names["slow"] != names[3]
    assert {names[0], names[3], names["slow"]} == {"c-session-1", "c-session-2"}
    threads.close()
