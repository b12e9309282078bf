"""End to end over real Redis: an admission consumer and several rollout consumer processes,
driven step by step through TaskWriter, with every status path scripted."""

from __future__ import annotations

import pytest

from pipeline import wire
from pipeline.ready import expand
from pipeline.sessions import Task
from producers.trainer_link import StepFailed
from tests.integration.helpers import Trainer, admitted_tasks, resubmitted, wait_until

STEPS = 6
TASKS = 3
SCHEDULER = {"groups": 2, "ahead": 1, "max_lag": 1, "max_attempts": 3, "timeout_s": 1.5, "truncation": "score",
                 "rows": 8, "width": 64}

# Every status path, each on its own sample (task ids are "t{batch}.{index}").
SCRIPT = [
    {"task": "t1.0", "sample": 0, "attempt": 0, "status": "infra_error", "reward": None},
    {"task": "t1.1", "sample": 1, "attempt": 0, "status": "cancelled", "reward": None},
    {"task": "t2.0", "sample": 0, "status": "infra_error", "reward": None},  # every attempt: abandoned
    {"task": "t2.1", "sample": 0, "attempt": 0, "status": "truncated", "reward": None},  # unscored
    {"task": "t2.2", "sample": 1, "status": "truncated", "reward": 0.5},  # scored truncation: trains
    {"task": "t3.0", "sample": 0, "attempt": 0, "duration_s": 5.0},  # past the timeout
    {"task": "t3.1", "sample": 1, "status": "agent_error", "reward": 0.0},
    {"task": "t4.0", "sample": 0, "attempt": 0, "call_version": 0},  # stale at updates >= 3
    {"task": "t4.1", "sample": 0, "attempt": 0, "timings": {"env_s": -1.0}},  # invalid: dead letter
]
EXPECTED_RESUBMITTED = {"infra_error": 1 + 2 + 1, "cancelled": 1, "unscored": 1, "timeout": 1, "stale": 1}


@pytest.mark.timeout(90)
def test_processes_run_every_status_path_to_the_records_the_script_implies(procs, r, keys):
    procs.admission(block_ms=50, lease_s=5, trim_every_s=0.5, scheduler=SCHEDULER)
    for _ in range(3):
        procs.consumer(slots=3, block_ms=50, lease_s=5, grace_s=1,
                       source="consumers.sources.scripted:ScriptedSource",
                       source_args={"rules": SCRIPT, "default": {"duration_s": 0.005}})
    trainer = Trainer(r, keys, tasks=TASKS)
    readies = trainer.run(STEPS, timeout_s=30)

    assert [ready.step for ready in readies] == list(range(STEPS))
    every_task = [f"t{b}.{i}" for b in range(STEPS) for i in range(TASKS)]
    admitted = admitted_tasks(readies)
    assert sorted(admitted) == sorted(set(every_task) - {"t2.0"}), "each group admitted once"
    assert [ready.record.groups for ready in readies] == [3, 3, 2, 3, 3, 3]
    assert sum(ready.record.abandoned for ready in readies) == 1
    assert dict(resubmitted(readies)) == EXPECTED_RESUBMITTED
    for ready in readies:
        assert ready.error is None
        arrays = expand(ready.arrays)
        assert arrays["tokens"].shape == (8, 64)
        assert ready.record.cut == 0 and ready.record.lag <= 1
        assert arrays["loss_mask"].sum() > 0
        assert set(ready.record.packed) == {g for g, _, _ in ready.record.admitted}
    # the agent error and the scored truncation were admitted with their statuses
    step3 = readies[3].record.metrics
    assert step3["share_agent_error"] == pytest.approx(1 / 6)
    assert readies[2].record.metrics["share_truncated"] == pytest.approx(1 / 4)
    records = [wire.from_fields(f, wire.Record) for _, f in r.xrange(keys.records(0))]
    assert [rec.step for rec in records] == list(range(STEPS))
    dead = [f for _, f in r.xrange(keys.dead)]
    assert len(dead) == 1 and b"timings.env_s" in dead[0][b"reason"]


@pytest.mark.timeout(60)
def test_a_source_that_raises_fails_the_step_with_its_traceback(threads, r, keys):
    from consumers.sources.scripted import ScriptedSource

    threads.admission(block_ms=50, lease_s=5, scheduler={"groups": 2, "rows": 8, "width": 64})
    source = ScriptedSource(rules=[{"task": "t1.1", "sample": 1, "raise": "environment exploded"}],
                            default={"duration_s": 0.005})
    threads.consumer(source, slots=4, block_ms=50, lease_s=5, grace_s=1)
    trainer = Trainer(r, keys, tasks=2)
    trainer.open()
    trainer.handover()
    trainer.wait()
    trainer.handover()
    with pytest.raises(StepFailed) as failed:
        trainer.writer.wait_ready(0, 1, 20)
    assert "ScriptedError: environment exploded" in str(failed.value)
    assert "Traceback" in failed.value.ready.error
    # a later step of the broken epoch fails too; a new epoch runs again
    trainer.writer.handover(0, 2, 2)
    with pytest.raises(StepFailed):
        trainer.writer.wait_ready(0, 2, 20)
    again = Trainer(r, keys, epoch=1, first_update=2,
                    batch=lambda b: [Task(f"e1.{b}.{i}") for i in range(2)])
    readies = again.run(2, timeout_s=20)
    assert [len(ready.record.admitted) for ready in readies] == [2, 2]


@pytest.mark.timeout(60)
def test_an_async_source_runs_on_the_event_loop_and_honours_timeouts(threads, r, keys):
    from consumers.sources.scripted import AsyncScriptedSource

    threads.admission(block_ms=50, lease_s=5, scheduler={"groups": 2, "rows": 8, "width": 64, "timeout_s": 0.5})
    source = AsyncScriptedSource(rules=[{"task": "t1.0", "sample": 0, "attempt": 0, "duration_s": 30}],
                                 default={"duration_s": 0.005})
    consumer = threads.consumer(source, slots=4, block_ms=50, lease_s=5, grace_s=1)
    readies = Trainer(r, keys, tasks=2).run(3, timeout_s=20)
    assert dict(resubmitted(readies)) == {"timeout": 1}
    # the timed-out session is told to stop by the consumer's listener, a thread of its own
    # which nothing orders before the steps that follow
    wait_until(lambda: consumer.stats["cancelled"] >= 1 and consumer.stats["results_cancelled"] >= 1, 20,
               "the timed-out session to be cancelled")
