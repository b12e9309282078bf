"""Crashes and restarts: kill -9 of rollout consumers and of the admission consumer, SIGTERM
hand-back, and state rebuilt from the snapshot and the journal."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import pytest

from consumers.admission import Admission
from consumers.sources.scripted import ScriptedSource
from pipeline import wire
from pipeline.config import AdmissionConfig
from pipeline.keys import WORK_GROUP
from pipeline.redis_io import connect
from pipeline.sessions import Task
from tests.integration.helpers import Trainer, admitted_tasks, resubmitted, wait_until

SCHEDULER = {"groups": 2, "rows": 8, "width": 64}


def pending_of(r, keys, consumer: str) -> int:
    return sum(int(c["pending"]) for c in r.xinfo_consumers(keys.work, WORK_GROUP)
               if c["name"].decode() == consumer)


@pytest.mark.timeout(60)
def test_a_killed_consumer_s_samples_come_back_as_infra_error_attempts(procs, threads, r, keys):
    threads.admission(block_ms=50, lease_s=1, trim_every_s=0.1, scheduler=SCHEDULER)
    script = {"rules": [{"task": "t1.*", "attempt": 0, "duration_s": 60}],
              "default": {"duration_s": 0.005}}
    doomed = procs.consumer(name="doomed", slots=8, block_ms=50, lease_s=1, grace_s=1,
                            source="consumers.sources.scripted:ScriptedSource", source_args=script)
    trainer = Trainer(r, keys, tasks=3)
    trainer.open()
    trainer.handover()
    trainer.wait()  # batch 1 (long first attempts) is now running in the doomed consumer
    wait_until(lambda: pending_of(r, keys, "doomed") == 6, 20, "batch 1 to start")
    doomed.kill()
    threads.consumer(ScriptedSource(**script), slots=8, block_ms=50, lease_s=1, grace_s=1)
    trainer.handover()
    ready = trainer.wait(timeout_s=20)
    assert ready.record.resubmitted["infra_error"] == 6
    assert sorted(t for _, _, t in ready.record.admitted) == ["t1.0", "t1.1", "t1.2"]
    assert pending_of(r, keys, "doomed") == 0
    trainer.handover()
    trainer.wait()
    assert sorted(admitted_tasks(trainer.readies)) == sorted(t.id for t in trainer.registered[:9])


@pytest.mark.timeout(90)
def test_killing_the_admission_consumer_repeatedly_loses_and_repeats_nothing(procs, threads, r, keys):
    steps, min_kills = 16, 4
    # no consumer dies here: leases long enough that a loaded machine's late heartbeat never
    # expires one (an expiry is an infra_error resubmission the count below would see)
    start = {"block_ms": 50, "lease_s": 15, "trim_every_s": 60, "scheduler": SCHEDULER}
    admission = [procs.admission(snapshot_every=7, **start)]
    # one infra_error first attempt in each trained batch, none in the batch still in flight at
    # the end: whether its resubmission came before the last step was emitted (and so counts
    # in that step's record) is a race, not something this test asserts
    script = {"rules": [{"task": f"t{b}.0", "sample": 0, "attempt": 0, "status": "infra_error"}
                        for b in range(steps)],
              "default": {"duration_s": 0.04}}
    for _ in range(2):
        threads.consumer(ScriptedSource(**script), slots=4, block_ms=50, lease_s=15, grace_s=1)
    done = threading.Event()
    kills = []

    def killer() -> None:
        """kill -9 at a random moment after each start, then start a new one, until done."""
        rng = random.Random(11)
        while not done.is_set():
            wait_until(lambda: "running" in admission[-1].output(), 20, "the admission to start")
            if done.wait(rng.uniform(0.05, 0.5)):
                return
            admission[-1].kill()
            kills.append(time.monotonic())
            admission.append(procs.admission(snapshot_every=7, **start))

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        readies = Trainer(r, keys, tasks=3).run(steps, timeout_s=45, train_s=0.2)
    finally:
        done.set()
        thread.join(30)
    assert len(kills) >= min_kills, f"only {len(kills)} kills happened during the run"

    every_task = [f"t{b}.{i}" for b in range(steps) for i in range(3)]
    assert sorted(admitted_tasks(readies)) == sorted(every_task)  # none lost, none twice
    assert dict(resubmitted(readies)) == {"infra_error": steps}
    ready_steps = [wire.from_fields(f, wire.Ready).step for _, f in r.xrange(keys.ready(0))]
    assert ready_steps == list(range(steps)), "a step was emitted twice"
    records = [wire.from_fields(f, wire.Record) for _, f in r.xrange(keys.records(0))]
    assert [rec.step for rec in records] == list(range(steps))
    assert sum(rec.groups for rec in records) == len(every_task)
    submitted = Counter()
    for _, fields in r.xrange(keys.work):
        work = wire.from_fields(fields, wire.Work)
        submitted[(work.epoch, work.group, work.sample, work.attempt)] += 1
    assert max(submitted.values()) == 1, "an attempt was submitted twice"
    # every sample of batches 0..steps (the last one in flight) plus one resubmission per
    # trained batch
    assert len(submitted) == steps * 7 + 6


@pytest.mark.timeout(60)
def test_a_restarted_admission_rebuilds_exactly_the_state_it_had(threads, r, keys, redis_config):
    first = threads.admission(snapshot_every=5, block_ms=50, lease_s=5, scheduler=SCHEDULER)
    threads.consumer(ScriptedSource(default={"duration_s": 0.002}), slots=4, block_ms=50, lease_s=5)
    trainer = Trainer(r, keys, tasks=3)
    trainer.run(4, timeout_s=20)
    wait_until(lambda: first.held_count() == 6, 10, "batch 4's results to be held")
    threads.stop(first)
    assert r.hget(keys.state(0), b"snapshot") is not None  # the journal may be empty or not
    config = AdmissionConfig(redis=redis_config, block_ms=50, lease_s=5, scheduler=SCHEDULER)
    again = Admission(config, connect(redis_config), snapshot_every=5)
    assert again.sched.snapshot() == first.sched.snapshot()
    assert again.held() == first.held() and again._refs == first._refs
    assert len(again.sched.live_groups()) == 3  # batch 4, complete, awaiting step 4
    threads._start(again, "admission")
    trainer.handover()
    ready = trainer.wait(timeout_s=20)
    assert sorted(t for _, _, t in ready.record.admitted) == ["t4.0", "t4.1", "t4.2"]
    assert again.held_count() <= 6  # batch 4's results released, batch 5's held


@pytest.mark.timeout(60)
def test_sigterm_hands_every_owned_entry_back_with_a_result(procs, threads, r, keys):
    threads.admission(block_ms=50, lease_s=30, scheduler=SCHEDULER)
    script = {"rules": [{"task": "t1.*", "sample": 0, "attempt": 0, "duration_s": 60, "cancellable": False},
                        {"task": "t1.*", "sample": 1, "attempt": 0, "duration_s": 60}],
              "default": {"duration_s": 0.005}}
    leaving = procs.consumer(name="leaving", slots=8, block_ms=50, lease_s=1, grace_s=0.5,
                             source="consumers.sources.scripted:ScriptedSource", source_args=script)
    trainer = Trainer(r, keys, tasks=3)
    trainer.open()
    trainer.handover()
    trainer.wait()
    wait_until(lambda: pending_of(r, keys, "leaving") == 6, 20, "batch 1 to start")
    began = time.monotonic()
    assert leaving.terminate(timeout_s=15) == 0
    assert time.monotonic() - began < 8
    assert pending_of(r, keys, "leaving") == 0
    results = [wire.from_fields(f, wire.Result) for _, f in r.xrange(keys.results(0))]
    handed_back = [res for res in results if res.consumer == "leaving" and res.attempt == 0
                   and res.status.value == "cancelled"]
    assert len(handed_back) == 6
    threads.consumer(ScriptedSource(**script), slots=8, block_ms=50, lease_s=1, grace_s=1)
    trainer.handover()
    ready = trainer.wait(timeout_s=20)
    assert ready.record.resubmitted["cancelled"] == 6
    assert "draining 6 sessions" in leaving.output() and "is stuck" in leaving.output()


@pytest.mark.timeout(60)
def test_each_shard_reclaims_only_its_own_work_from_a_killed_consumer(procs, threads, r, keys):
    for shard in (0, 1):
        threads.admission(shard=shard, block_ms=50, lease_s=1, scheduler=SCHEDULER)
    script = {"rules": [{"task": "s*.1.*", "attempt": 0, "duration_s": 60}],
              "default": {"duration_s": 0.005}}
    doomed = procs.consumer(name="doomed", slots=16, block_ms=50, lease_s=1, grace_s=1,
                            source="consumers.sources.scripted:ScriptedSource", source_args=script)
    trainers = [Trainer(r, keys, shard=s, batch=lambda b, s=s: [Task(f"s{s}.{b}.{i}") for i in range(3)])
                for s in (0, 1)]
    for t in trainers:
        t.open()
        t.handover()
    for t in trainers:
        t.wait()
    wait_until(lambda: pending_of(r, keys, "doomed") == 12, 20, "both shards' batch 1 to start")
    doomed.kill()
    threads.consumer(ScriptedSource(**script), slots=8, block_ms=50, lease_s=1, grace_s=1)
    for t in trainers:
        t.handover()
    for shard, t in enumerate(trainers):
        ready = t.wait(timeout_s=20)
        assert ready.shard == shard and ready.record.resubmitted["infra_error"] == 6
        assert sorted(task for _, _, task in ready.record.admitted) == [f"s{shard}.1.{i}" for i in range(3)]
