"""Sessions of a source that never waits (`inline = True`) run on the consumer's reading
thread: every work entry still gets one result appended with its acknowledgement, a
cancelled attempt is acknowledged without running, and a session whose data does not
encode still fails its attempt with a dead letter naming the field."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from consumers.sources.sleep import SleepSource
from pipeline import wire
from pipeline.keys import WORK_GROUP
from pipeline.sessions import Session, Status, Task, runs_inline
from pipeline.streams import ensure_group


def _fill(r, keys, n: int) -> None:
    ensure_group(r, keys.work, WORK_GROUP)
    for i in range(n):
        r.xadd(keys.work, wire.to_fields(wire.Work(0, 0, i // 4, i % 4, 0, Task(f"t{i // 4}"), 0)))


def _results(r, keys, n: int) -> list[wire.Result]:
    deadline = time.monotonic() + 20
    while r.xlen(keys.results(0)) < n:
        assert time.monotonic() < deadline, f"{r.xlen(keys.results(0))} results of {n}"
        time.sleep(0.01)
    return [wire.from_fields(f, wire.Result) for _, f in r.xrange(keys.results(0))]


@pytest.mark.timeout(60)
def test_inline_sessions_each_publish_once_and_a_cancelled_attempt_is_skipped(threads, r, keys):
    source = SleepSource(median_s=0.0, prompt_tokens=8, completion_tokens=8, vocab=64, seed=0)
    assert runs_inline(source) and not runs_inline(SleepSource(median_s=0.01))
    r.zadd(keys.cancelled(0), {"0:2:1:0": 1.0})  # group 2, sample 1, attempt 0: cancelled
    _fill(r, keys, 40)
    consumer = threads.consumer(source, slots=8, block_ms=20, vocab=64)
    results = _results(r, keys, 39)
    deadline = time.monotonic() + 10
    while r.xpending(keys.work, WORK_GROUP)["pending"] and time.monotonic() < deadline:
        time.sleep(0.01)
    while consumer.stats["skipped"] < 1 and time.monotonic() < deadline:  # counted after its acknowledgement
        time.sleep(0.01)
    assert consumer.inline and consumer.stats["skipped"] == 1
    assert r.xpending(keys.work, WORK_GROUP)["pending"] == 0
    ran = Counter((res.group, res.sample) for res in results)
    assert len(results) == 39 and set(ran.values()) == {1} and (2, 1) not in ran
    assert all(res.status is Status.COMPLETED and len(res.chains) == 1 for res in results)


class ChangedAfterMaking(SleepSource):
    """Makes a valid call, then changes it: a positive log-prob."""

    def run(self, request):
        session = super().run(request)
        session.calls[0].logprobs[0] = 0.5
        return Session(session.status, session.reward, calls=session.calls)


@pytest.mark.timeout(60)
def test_an_inline_session_changed_after_making_fails_its_attempt_with_a_dead_letter(threads, r, keys):
    _fill(r, keys, 1)
    threads.consumer(ChangedAfterMaking(median_s=0.0, vocab=64, seed=0), slots=2, block_ms=20, vocab=64)
    [result] = _results(r, keys, 1)
    assert result.status is Status.INFRA_ERROR and result.error is None and not result.chains
    [(_, dead)] = r.xrange(keys.dead)
    assert dead[b"reason"].decode() == ("invalid session from ChangedAfterMaking for 0:0:0:0: "
                                         "chains.logprobs: must be finite and <= 0")
