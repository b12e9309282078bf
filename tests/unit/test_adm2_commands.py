"""A transaction's commands staged without redis-py's pipeline (`admission._Commands`) are
the arguments redis-py's pipeline stacks for the same calls, so the same bytes go on the
wire; a scheduler's attempt keys, made once per attempt, are the keys made afresh."""

import random

import pytest
import redis

from consumers.admission import _Commands
from consumers.fence import Fence
from pipeline import streams
from pipeline.config import SchedulerConfig
from pipeline.keys import Keys
from pipeline.scheduler import Finish, Handover, Open, Register, SampleKey, Scheduler, Submit
from pipeline.sessions import Status, Task


def _both(call) -> tuple[list[tuple], list[tuple]]:
    pipe = redis.Redis().pipeline(transaction=True)  # never connects: commands are only stacked
    staged = _Commands()
    call(pipe)
    call(staged)
    return [args for args, _ in pipe.command_stack], staged.stack


def test_every_command_is_stacked_as_redis_py_stacks_it():
    fence = Fence(redis.Redis(), Keys("t"), 0, lease_s=2.5)
    calls = [
        lambda c: streams.append(c, "s", {b"m": b"\x00\x01", b"n": b""}),
        lambda c: streams.ack(c, "s", "g", b"1-0", b"2-5"),
        lambda c: c.xdel("work", b"3-1"),
        lambda c: c.hset("held", mapping={"0:1:2:3": b"@1-0", "0:1:2:4": b"payload"}),
        lambda c: c.hset("state", "snapshot", b"\x81\xa1v\x02"),
        lambda c: c.hdel("held", "0:1:2:3", "0:1:2:4"),
        lambda c: c.zadd("cancelled", {"0:1:2:3": 1712.25}),
        lambda c: c.delete("journal"),
        fence.renew_in,
    ]
    for call in calls:
        stacked, staged = _both(call)
        assert staged == stacked
        assert [tuple(map(type, a)) for a in staged] == [tuple(map(type, a)) for a in stacked]


def test_an_xadd_without_fields_is_refused_as_redis_py_refuses_it():
    for stack in (redis.Redis().pipeline(transaction=True), _Commands()):
        with pytest.raises(redis.exceptions.DataError, match="XADD fields must be a non-empty dict"):
            streams.append(stack, "s", {})


def test_random_xadds_are_stacked_as_redis_py_stacks_them():
    rng = random.Random(7)
    for _ in range(200):
        fields = {rng.randbytes(rng.randrange(1, 5)): rng.randbytes(rng.randrange(0, 40))
                  for _ in range(rng.randrange(1, 4))}
        stacked, staged = _both(lambda c, f=fields: c.xadd("stream", f))
        assert staged == stacked


def _config() -> SchedulerConfig:
    return SchedulerConfig(admission="stream", groups=2, batch_size=2, admit=1, max_lag=1,
                           width=64, rows=4, max_attempts=3)


def test_attempt_keys_are_the_keys_of_their_attempts_also_after_a_restore():
    sched = Scheduler(_config())
    sched.handle(Open(0), 0.0)
    submits = [a for a in sched.handle(Register(0, (Task("a"), Task("b"))), 0.0) if isinstance(a, Submit)]
    sched.handle(Handover(0, 0), 0.0)
    first = submits[0].key
    # a failed attempt is resubmitted under the next attempt's key
    again = [a for a in sched.handle(Finish(first, Status.INFRA_ERROR), 1.0) if isinstance(a, Submit)]
    assert [a.key for a in again] == [SampleKey(0, first.group, first.sample, 1)]
    restored = Scheduler.restore(_config(), sched.snapshot())
    for machine in (sched, restored):
        for group in machine._groups.values():
            for sample in group.samples:
                assert machine._key(group, sample) == SampleKey(machine.epoch, group.id, sample.index,
                                                                sample.attempt)
    running = sorted(sched.running())
    assert sorted(restored.running()) == running
    outs = [m.handle(Finish(k, Status.COMPLETED, 1.0), 2.0) for m in (sched, restored) for k in running]
    assert outs[:len(running)] == outs[len(running):]
