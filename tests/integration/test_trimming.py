"""Stream trimming: bounded lengths over a long-ish run, and never a pending entry."""

from __future__ import annotations

import time

import pytest

from consumers import trimming
from consumers.sources.scripted import ScriptedSource
from tests.integration.helpers import Trainer


@pytest.mark.timeout(30)
def test_trimming_keeps_pending_and_undelivered_entries(r, keys):
    stream = keys.work
    ids = [r.xadd(stream, {b"i": str(i).encode()}) for i in range(10)]
    r.xgroup_create(stream, "g1", id="0")
    r.xgroup_create(stream, "g2", id="0")
    r.xreadgroup("g1", "c", {stream: ">"}, count=10)
    r.xack(stream, "g1", *ids[:5])  # g1: 5..9 pending
    r.xreadgroup("g2", "c", {stream: ">"}, count=3)
    r.xack(stream, "g2", *ids[:3])  # g2: 3..9 not yet delivered
    assert trimming.trim_acknowledged(r, stream) == 3
    assert [i for i, _ in r.xrange(stream)] == ids[3:]
    r.xreadgroup("g2", "c", {stream: ">"}, count=10)
    r.xack(stream, "g2", *ids)
    assert trimming.trim_acknowledged(r, stream) == 2  # g1's pending 5..9 stay
    assert [i for i, _ in r.xrange(stream)] == ids[5:]
    r.xack(stream, "g1", *ids)
    assert trimming.trim_acknowledged(r, stream, keep_last=True) == 4
    assert [i for i, _ in r.xrange(stream)] == ids[9:]


@pytest.mark.timeout(30)
def test_a_stream_without_groups_is_not_trimmed(r, keys):
    for _ in range(5):
        r.xadd(keys.ready(0), {b"i": b"x"})
    assert trimming.trim_acknowledged(r, keys.ready(0)) == 0
    assert trimming.trim_acknowledged(r, keys.ready(1)) == 0  # no such stream
    assert r.xlen(keys.ready(0)) == 5


@pytest.mark.timeout(60)
def test_stream_lengths_stay_bounded_over_a_long_run(threads, r, keys):
    steps, tasks, size = 40, 3, 3  # groups 2 + oversample 1: surplus attempts get cancelled
    threads.admission(block_ms=20, lease_s=5, trim_every_s=0.05, control_retention_s=0.2,
                      snapshot_every=25, scheduler={"groups": 2, "oversample": 1, "rows": 8, "width": 64})
    source = ScriptedSource(rules=[{"sample": 2, "duration_s": 0.2}], default={"duration_s": 0.002})
    threads.consumer(source, slots=12, block_ms=20, lease_s=5, grace_s=1)
    trainer = Trainer(r, keys, tasks=tasks)
    streams = [keys.work, keys.results(0), keys.tasks(0), keys.control, keys.ready(0),
               keys.journal(0), keys.weights]
    longest = dict.fromkeys(streams, 0)
    trainer.open()
    for _ in range(steps):
        trainer.handover()
        trainer.wait(timeout_s=20)
        time.sleep(0.03)  # training: keeps the run longer than the control retention
        for stream in streams:
            longest[stream] = max(longest[stream], r.xlen(stream))
        longest["held"] = max(longest.get("held", 0), r.hlen(keys.held(0)))
        longest["cancelled"] = max(longest.get("cancelled", 0), r.zcard(keys.cancelled(0)))
    per_step = tasks * size
    assert longest[keys.work] <= 8 * per_step, longest
    assert longest[keys.results(0)] <= 8 * per_step, longest
    assert longest[keys.tasks(0)] <= 12, longest
    assert longest[keys.ready(0)] <= 6, longest
    assert longest[keys.weights] <= 6, longest
    assert longest[keys.journal(0)] <= 25 + 4 * per_step, longest
    assert longest["held"] <= 2 * per_step, longest
    cancels = sum(ready.record["cancelled"] for ready in trainer.readies)
    assert cancels >= steps  # the slow third samples were cancelled as surplus
    assert longest[keys.control] < cancels / 3 and longest["cancelled"] < cancels / 3, longest
