"""One admission consumer per shard, enforced (`consumers.fence`), with real processes: a
paused admission consumer is replaced by a second one once its lease lapses; resumed, its
next transaction is refused and it stops with a clear message; the run goes on under the
replacement, every step emitted once."""

from __future__ import annotations

import signal
import time

import pytest

from consumers.sources.scripted import ScriptedSource
from pipeline import wire
from pipeline.keys import TRAINER_GROUP, admission_group
from tests.integration.helpers import Trainer, tasks_of

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]
SCHEDULER = {"groups": 2, "rows": 4, "width": 64, "ahead": 0, "max_lag": 0}


def _wait(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _holder(r, keys) -> str:
    return (r.get(keys.lease(0)) or b"").decode()


@pytest.mark.parametrize("redis_url", ["server", "embedded"], indirect=True)
def test_a_paused_admission_is_replaced_then_fenced_when_it_resumes(procs, threads, r, keys):
    first = procs.admission(shard=0, shard_lease_s=1.5, block_ms=50, scheduler=SCHEDULER,
                            metrics_addr="127.0.0.1:0")
    _wait(lambda: _holder(r, keys).endswith(f":{first.pid}"), "the first consumer's lease")
    threads.consumer(ScriptedSource(default={"duration_s": 0.002}), slots=4, block_ms=20)
    trainer = Trainer(r, keys, tasks=2, ahead=0)
    trainer.open()
    trainer.handover()
    trainer.wait(timeout_s=20)

    first.signal(signal.SIGSTOP)  # paused: it holds the lease and renews nothing
    second = procs.admission(shard=0, shard_lease_s=1.5, block_ms=50, scheduler=SCHEDULER,
                             metrics_addr="127.0.0.1:0")
    # the lease is taken first, then the fence incremented: the takeover is both
    _wait(lambda: _holder(r, keys).endswith(f":{second.pid}") and int(r.get(keys.fence(0))) == 2,
          "the replacement's takeover")
    trainer.handover()
    trainer.wait(timeout_s=20)  # the replacement serves the step

    first.signal(signal.SIGCONT)  # resumed: its next transaction is refused
    assert first.wait(timeout_s=20) == 1
    assert "another admission consumer took the shard over" in first.output()
    assert second.alive
    for _ in range(2):
        trainer.handover()
        trainer.wait(timeout_s=20)
    # every step was emitted once: one Ready per step on the ready stream
    steps = [wire.from_fields(f, wire.Ready).step for _, f in r.xrange(keys.ready(0))]
    assert steps == [0, 1, 2, 3]
    assert r.xinfo_groups(keys.ready(0))[0]["name"].decode() == TRAINER_GROUP


@pytest.mark.parametrize("redis_url", ["server"], indirect=True)
def test_a_second_admission_waits_while_the_first_holds_the_shard(procs, r, keys):
    first = procs.admission(shard=0, shard_lease_s=3.0, block_ms=50, scheduler=SCHEDULER,
                            metrics_addr="127.0.0.1:0")
    _wait(lambda: _holder(r, keys).endswith(f":{first.pid}"), "the first consumer's lease")
    second = procs.admission(shard=0, shard_lease_s=3.0, block_ms=50, scheduler=SCHEDULER,
                             metrics_addr="127.0.0.1:0")
    _wait(lambda: "is held by admission consumer" in second.output(), "the second consumer's wait")
    # the first renews its lease (its TTL goes back up) while the second keeps waiting
    renewals, last = 0, r.pttl(keys.lease(0))
    deadline = time.monotonic() + 30
    while renewals < 3:
        assert time.monotonic() < deadline, "the first consumer stopped renewing its lease"
        ttl = r.pttl(keys.lease(0))
        renewals, last = renewals + (ttl > last), ttl
        time.sleep(0.02)
    assert _holder(r, keys).endswith(f":{first.pid}") and int(r.get(keys.fence(0))) == 1
    assert first.alive and second.alive
    first.terminate()  # a clean stop: the lease lapses, the second takes over
    _wait(lambda: _holder(r, keys).endswith(f":{second.pid}") and int(r.get(keys.fence(0))) == 2,
          "the takeover")


@pytest.mark.parametrize("redis_url", ["server", "embedded"], indirect=True)
def test_entries_a_fenced_predecessor_read_are_applied_by_the_replacement(threads, r, keys):
    """A predecessor that ran on after losing the shard reads under the same consumer name
    (its commits are fenced, its reads are not): what it read stays pending, unapplied, and
    a read of new entries never returns it. The shard's consumer reads such entries again:
    before refusing the handover whose batch's registration was taken, and every
    `shard_lease_s / 2` otherwise."""
    admission = threads.admission(shard=0, shard_lease_s=1.0, block_ms=20, scheduler=SCHEDULER)
    threads.consumer(ScriptedSource(default={"duration_s": 0.002}), slots=4, block_ms=20)
    trainer = Trainer(r, keys, tasks=2, ahead=0)
    trainer.open()

    def steal_registration(batch: int) -> None:
        # appended and read under the admission's name in one transaction: no reader between
        pipe = r.pipeline(transaction=True)
        pipe.xadd(keys.tasks(0), wire.to_fields(wire.Registration(0, 0, batch, tuple(tasks_of(batch, 2)))))
        pipe.xreadgroup(admission_group(0), admission.name, {keys.tasks(0): ">"}, count=10)
        _, read = pipe.execute()
        assert [len(entries) for _, entries in read] == [1]

    trainer.handover()
    trainer.writer.wait_ready(0, 0, 20)
    steal_registration(1)  # then at once the handover of step 1, which needs it
    trainer.handover()
    trainer.writer.wait_ready(0, 1, 20)
    assert admission.stats["taken_back"] == 1

    steal_registration(2)  # and no handover: the periodic check finds it
    # counted when found, applied by the next read
    _wait(lambda: admission.stats["taken_back"] == 2 and 2 in admission.sched._batches,
          "the periodic check", timeout_s=10)
    trainer.handover()
    trainer.writer.wait_ready(0, 2, 20)
    assert r.xlen(keys.dead) == 0


@pytest.mark.parametrize("redis_url", ["server", "embedded"], indirect=True)
def test_a_registration_after_one_a_predecessor_read_waits_for_it(threads, r, keys):
    """The predecessor read batch 1's registration; the replacement then reads batch 2's,
    and its handovers after. Batch 2 must not be registered before batch 1 (batch 1 would
    then be refused as registered out of order, and step 1 fail): the gap sends the
    replacement to its backlog first. The periodic check is minutes away here, so only the
    gap can find batch 1."""
    admission = threads.admission(shard=0, shard_lease_s=600.0, block_ms=20, scheduler=SCHEDULER)
    threads.consumer(ScriptedSource(default={"duration_s": 0.002}), slots=4, block_ms=20)
    trainer = Trainer(r, keys, tasks=2, ahead=0)
    trainer.open()
    trainer.handover()
    trainer.writer.wait_ready(0, 0, 20)

    def registration(batch: int) -> dict:
        return wire.to_fields(wire.Registration(0, 0, batch, tuple(tasks_of(batch, 2))))

    pipe = r.pipeline(transaction=True)  # batch 1 read under the admission's name, then batch 2
    pipe.xadd(keys.tasks(0), registration(1))
    pipe.xreadgroup(admission_group(0), admission.name, {keys.tasks(0): ">"}, count=10)
    pipe.xadd(keys.tasks(0), registration(2))
    assert [len(entries) for _, entries in pipe.execute()[1]] == [1]
    for step in (1, 2):
        trainer.handover()
        trainer.writer.wait_ready(0, step, 20)
    assert admission.stats["taken_back"] == 1
    assert r.xlen(keys.dead) == 0
