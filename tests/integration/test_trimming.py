"""Stream trimming: bounded lengths over a long-ish run, and never a pending entry."""

from __future__ import annotations

import time

import pytest

from pipeline import streams as trimming
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
    adm = threads.admission(block_ms=20, lease_s=5, trim_every_s=0.05, control_retention_s=0.2,
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
        longest["held"] = max(longest.get("held", 0), adm.held_count())
        assert not r.exists(keys.held(0))  # held by reference: nothing written to hold them
        longest["cancelled"] = max(longest.get("cancelled", 0), r.zcard(keys.cancelled(0)))
    per_step = tasks * size
    assert longest[keys.work] <= 8 * per_step, longest
    assert longest[keys.results(0)] <= 8 * per_step, longest
    assert longest[keys.tasks(0)] <= 12, longest
    assert longest[keys.ready(0)] <= 6, longest
    assert longest[keys.weights] <= 6, longest
    assert longest[keys.journal(0)] <= 25 + 4 * per_step, longest
    assert longest["held"] <= 2 * per_step, longest
    cancels = sum(ready.record.cancelled for ready in trainer.readies)
    assert cancels >= steps  # the slow third samples were cancelled as surplus
    assert longest[keys.control] < cancels / 3 and longest["cancelled"] < cancels / 3, longest


@pytest.mark.timeout(60)
def test_results_held_by_reference_are_kept_by_trimming_until_their_step_is_emitted(r, keys, redis_config):
    """An admitted result is held as a reference to its entry of the results stream: that
    entry, acknowledged, stays through trimming until its step is emitted, and a rebuilt
    admission packs it from there."""
    from consumers.admission import Admission
    from pipeline import wire
    from pipeline.config import AdmissionConfig, build
    from pipeline.ready import expand
    from pipeline.sessions import Call, Session, Status, Task

    scheduler = {"admission": "stream", "groups": 4, "batch_size": 2, "admit": 2, "max_lag": 1,
                 "width": 64, "rows": 4}
    config = build(AdmissionConfig, {"redis": redis_config.model_dump(), "scheduler": scheduler,
                                     "block_ms": 1, "trim_every_s": 3600.0, "lease_s": 3600.0})
    adm = Admission(config, r, snapshot_every=10_000)
    r.xadd(keys.tasks(0), wire.to_fields(wire.Open(0, 0)))
    r.xadd(keys.tasks(0), wire.to_fields(wire.Registration(0, 0, 0, (Task("a"), Task("b")))))
    while adm.poll_once(1):
        pass
    ids = []
    for group in range(2):
        for sample in range(4):
            session = Session(Status.COMPLETED, float(sample % 2),
                              calls=[Call([1, 2], [3, 4 + group], [-0.5, -0.25], 0)],
                              timings={"started": 0.0, "finished": 1.0})
            result = wire.Result.from_session(0, 0, group, sample, 0, session, "test")
            ids.append(r.xadd(keys.results(0), wire.to_fields(result)))
    while adm.poll_once(1):
        pass
    refs = dict(adm._refs)
    assert set(refs) == adm.held() and sorted(refs.values()) == sorted(ids)  # references, not payloads
    assert not r.exists(keys.held(0))  # nothing written to hold them: the journal names them
    assert r.xpending(keys.results(0), adm.group)["pending"] == 0  # acknowledged
    adm.trim()
    assert [i for i, _ in r.xrange(keys.results(0))] == ids  # kept: still held
    adm._rebuild()  # as after a restart: nothing decoded in memory
    assert adm._refs == refs  # the journal named them
    r.xadd(keys.tasks(0), wire.to_fields(wire.Handover(0, 0, 0, 0, None)))
    while adm.poll_once(1):
        pass
    ready = wire.from_fields(r.xrange(keys.ready(0))[0][1], wire.Ready)
    assert ready.error is None and sorted(ready.record.packed) == [0, 1]
    tokens = expand(ready.arrays)["tokens"]
    assert sorted(tokens[tokens > 0].tolist()) == sorted([1, 2, 3, 4] * 4 + [1, 2, 3, 5] * 4)
    assert not adm.held()
    adm.trim()
    assert r.xlen(keys.results(0)) == 0  # emitted: nothing holds them any more
