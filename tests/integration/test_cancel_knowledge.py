"""A rollout consumer knows the cancelled attempts without asking at every read: each read
of work reads `control` from where the last one stopped in the same round trip (so a Cancel
committed before the work is read is known, even one the read waited for), a shard's
`cancelled` set is read when its first work comes, and again at each lease renewal, which
forgets what the admission pruned from it."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from consumers.sources.sleep import SleepSource
from pipeline import streams, wire
from pipeline.keys import WORK_GROUP
from pipeline.sessions import Task


def _work(group: int, sample: int) -> dict:
    return wire.to_fields(wire.Work(0, 0, group, sample, 0, Task(f"t{group}"), 0))


def _cancel(r, keys, group: int, sample: int, *, in_set: bool = True) -> None:
    """A Cancel as the admission commits it (on `control` and in the cancelled set), or on
    `control` alone."""
    pipe = r.pipeline(transaction=True)
    pipe.xadd(keys.control, wire.to_fields(wire.Cancel(0, 0, group, sample, 0, "test")))
    if in_set:
        pipe.zadd(keys.cancelled(0), {f"0:{group}:{sample}:0": time.time()})
    pipe.execute()


def _ran(r, keys, n: int) -> Counter:
    deadline = time.monotonic() + 20
    while r.xlen(keys.results(0)) < n:
        assert time.monotonic() < deadline, f"{r.xlen(keys.results(0))} results of {n}"
        time.sleep(0.01)
    return Counter((res.group, res.sample) for res in
                   (wire.from_fields(f, wire.Result) for _, f in r.xrange(keys.results(0))))


def _settled(r, keys) -> None:
    deadline = time.monotonic() + 10
    while r.xpending(keys.work, WORK_GROUP)["pending"]:
        assert time.monotonic() < deadline, "work still pending"
        time.sleep(0.01)


def _counted(consumer, stat: str, n: int) -> None:
    deadline = time.monotonic() + 10
    while consumer.stats[stat] < n:
        assert time.monotonic() < deadline, f"{stat}: {consumer.stats[stat]} of {n}"
        time.sleep(0.01)


def test_a_blocked_read_of_work_returns_the_control_entries_committed_before_its_work(r, keys):
    streams.ensure_group(r, keys.work, WORK_GROUP)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(streams.read_group_and_follow(
        r, WORK_GROUP, "c", {keys.work: ">"}, {keys.control: "0-0"}, count=8, block_ms=10_000)))
    reader.start()
    deadline = time.monotonic() + 10
    while not r.info("clients")["blocked_clients"]:  # the read waits for work
        assert time.monotonic() < deadline, "the read never blocked"
        time.sleep(0.005)
    _cancel(r, keys, 3, 1)
    r.xadd(keys.work, _work(3, 1))
    reader.join(10)
    [(taken, followed)] = got
    assert [wire.from_fields(e.fields, wire.Work).group for e in taken] == [3]
    assert [wire.from_fields(e.fields, wire.Cancel).sample for e in followed] == [1]


@pytest.mark.timeout(60)
def test_cancels_on_control_and_in_the_set_are_each_known_before_the_work_runs(threads, r, keys):
    streams.ensure_group(r, keys.work, WORK_GROUP)
    r.zadd(keys.cancelled(0), {"0:0:2:0": 1.0})  # before the consumer started: only in the set
    consumer = threads.consumer(SleepSource(median_s=0.0, prompt_tokens=8, completion_tokens=8, vocab=64, seed=0),
                                slots=4, block_ms=20, vocab=64)
    for sample in range(4):
        r.xadd(keys.work, _work(0, sample))
    _ran(r, keys, 3)  # the set was read with the shard's first work
    _settled(r, keys)
    _cancel(r, keys, 1, 0, in_set=False)  # on control alone: read with the next work
    _cancel(r, keys, 1, 3)  # on both, as the admission commits it
    for sample in range(4):
        r.xadd(keys.work, _work(1, sample))
    ran = _ran(r, keys, 5)
    _settled(r, keys)
    _counted(consumer, "skipped", 3)  # counted once their acknowledgement returned
    assert consumer.stats["skipped"] == 3 and set(ran.values()) == {1}
    assert set(ran) == {(0, 0), (0, 1), (0, 3), (1, 1), (1, 2)}


@pytest.mark.timeout(60)
def test_a_cancel_the_admission_pruned_is_forgotten_at_the_next_lease_renewal(threads, r, keys):
    streams.ensure_group(r, keys.work, WORK_GROUP)
    old = time.time() - 1000
    r.zadd(keys.cancelled(0), {"0:0:0:0": old, "0:0:1:0": old})
    consumer = threads.consumer(SleepSource(median_s=0.0, prompt_tokens=8, completion_tokens=8, vocab=64, seed=0),
                                slots=4, block_ms=20, vocab=64, lease_s=0.3, grace_s=1.0)
    r.xadd(keys.work, _work(0, 1))  # skipped: the set is read with the shard's first work
    _settled(r, keys)
    _counted(consumer, "skipped", 1)
    # the admission prunes the set and `control` by the same age: both old cancels go, a newer
    # one stays on `control`
    _cancel(r, keys, 0, 3)
    r.zremrangebyscore(keys.cancelled(0), "-inf", old)
    beat, seen = None, 0
    deadline = time.monotonic() + 10
    while seen < 3:  # three heartbeats (every lease_s / 3) span a lease renewal after the prune
        assert time.monotonic() < deadline, "no heartbeat"
        now = r.get(keys.consumer_heartbeat(consumer.name))
        if now != beat:
            beat, seen = now, seen + 1
        time.sleep(0.01)
    r.xadd(keys.work, _work(0, 0))
    r.xadd(keys.work, _work(0, 3))
    assert set(_ran(r, keys, 1)) == {(0, 0)}
    _settled(r, keys)
    _counted(consumer, "skipped", 2)  # the newer cancel is still known

