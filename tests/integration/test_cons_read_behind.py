"""The commit of an inline read's results carries the next read of work behind its EXEC, in the
same write (`streams.commit_then_read_group_and_follow`): every work entry still gets one
result appended with its acknowledgement, when that read's reply is lost or refused (the
entries it took are adopted) and when the consumer stops holding entries read that way
(they are run and committed before it leaves)."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import redis

from consumers.sources.sleep import SleepSource
from pipeline import streams
from pipeline.keys import WORK_GROUP
from pipeline.redis_io import transaction, transaction_then
from tests.integration.test_inline_sessions import _fill, _results


def test_commands_behind_a_transaction_reply_after_its_exec(r, keys):
    stream = keys.results(0)
    replies, after = transaction_then(r, [("XADD", stream, "*", "m", "a"), ("XADD", stream, "*", "m", "b")],
                                      [("XLEN", stream), ("GET", stream), ("XRANGE", stream, "-", "+")])
    assert len(replies) == 2 and after[0] == 2
    assert isinstance(after[1], redis.exceptions.ResponseError) and "WRONGTYPE" in str(after[1])
    assert [fields for _, fields in after[2]] == [[b"m", b"a"], [b"m", b"b"]]
    assert transaction(r, [("XLEN", stream)]) == [2]


def test_a_commit_reads_the_next_work_behind_it(r, keys):
    _fill(r, keys, 6)
    streams.ensure_group(r, keys.work, WORK_GROUP)
    first = streams.read_group(r, WORK_GROUP, "c", {keys.work: ">"}, count=2)
    replies, reads = streams.commit_then_read_group_and_follow(
        r, [("XACK", keys.work, WORK_GROUP, *(e.id for e in first))], WORK_GROUP, "c", {keys.work: ">"},
        {keys.control: "0-0"}, count=3)
    assert replies == [2] and reads is not None
    taken, control = reads
    assert len(taken) == 3 and control == [] and taken[0].id > first[-1].id
    assert r.xpending(keys.work, WORK_GROUP)["pending"] == 3
    r.delete(keys.control)
    r.set(keys.control, "not a stream")
    replies, reads = streams.commit_then_read_group_and_follow(
        r, [("XACK", keys.work, WORK_GROUP, *(e.id for e in taken))], WORK_GROUP, "c", {keys.work: ">"},
        {keys.control: "0-0"}, count=3)
    assert replies == [3] and reads is None  # the XREAD of control refused: the group's read ran all the same
    assert r.xpending(keys.work, WORK_GROUP)["pending"] == 1


def _each_once(r, keys, n: int) -> None:
    results = _results(r, keys, n)
    ran = Counter((res.group, res.sample) for res in results)
    assert len(results) == n and set(ran.values()) == {1}
    deadline = time.monotonic() + 10
    while r.xpending(keys.work, WORK_GROUP)["pending"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r.xpending(keys.work, WORK_GROUP)["pending"] == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["reply lost", "read refused"])
def test_entries_read_behind_a_commit_whose_reply_is_lost_are_adopted(threads, r, keys, monkeypatch, how):
    real = streams.commit_then_read_group_and_follow
    calls = Counter()

    def lossy(*args, **kwargs):
        replies, reads = real(*args, **kwargs)
        calls["merged"] += 1
        if reads and reads[0] and calls["lost"] < 2:  # it delivered entries, then the reply is lost
            calls["lost"] += 1
            if how == "reply lost":
                raise redis.exceptions.ConnectionError("lost after the write")
            return replies, None
        return replies, reads

    monkeypatch.setattr(streams, "commit_then_read_group_and_follow", lossy)
    _fill(r, keys, 48)
    consumer = threads.consumer(SleepSource(median_s=0.0, prompt_tokens=8, completion_tokens=8, vocab=64, seed=0),
                                slots=8, block_ms=20, vocab=64)
    _each_once(r, keys, 48)
    assert calls["lost"] == 2 and calls["merged"] > 2
    if how == "reply lost":  # its retry found the batch acknowledged: not appended again
        assert consumer.stats["publish_retries"] == 2 and consumer.stats["republish_skipped"] > 0


@pytest.mark.timeout(60)
def test_entries_read_behind_the_last_commit_are_run_before_stopping(threads, r, keys, monkeypatch):
    real = streams.commit_then_read_group_and_follow
    taken: list[int] = []

    def then_stop(*args, **kwargs):
        replies, reads = real(*args, **kwargs)
        if reads and reads[0] and not taken:
            taken.append(len(reads[0]))
            threads.running[-1][0].set()  # the consumer's stop, with entries read behind this commit
        return replies, reads

    monkeypatch.setattr(streams, "commit_then_read_group_and_follow", then_stop)
    _fill(r, keys, 40)
    consumer = threads.consumer(SleepSource(median_s=0.0, prompt_tokens=8, completion_tokens=8, vocab=64, seed=0),
                                slots=8, block_ms=20, vocab=64)
    threads.stop(consumer)
    assert taken == [8]
    read = len(r.xrange(keys.work, "-", r.xinfo_groups(keys.work)[0]["last-delivered-id"]))
    assert r.xpending(keys.work, WORK_GROUP)["pending"] == 0
    assert r.xlen(keys.results(0)) == read == 16  # the first read's 8, and the 8 read behind its commit
