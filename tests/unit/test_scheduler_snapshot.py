"""`Scheduler.snapshot` / `Scheduler.restore`: a restored machine answers every later event
exactly as the original does, after a msgpack round trip of the snapshot."""

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config import SchedulerConfig
from pipeline.scheduler import Scheduler
from tests.unit.test_scheduler_properties import EXAMPLES, Run, configs


def _recording(sched: Scheduler) -> list:
    """Record every (event, now, actions) of the scheduler from now on."""
    log: list = []
    handle = sched.handle

    def record(event, now):
        actions = handle(event, now)
        log.append((event, now, actions))
        return actions

    sched.handle = record
    return log


def _roundtrip(snapshot: dict) -> dict:
    return msgpack.unpackb(msgpack.packb(snapshot, use_bin_type=True), raw=False,
                           strict_map_key=False)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), data=st.data())
def test_a_restored_scheduler_continues_exactly_like_the_original(cfg, data):
    _restores_exactly(Run(cfg, data), cfg, data)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(replacing=True), data=st.data())
def test_a_restored_scheduler_continues_exactly_like_the_original_after_a_replacement(cfg, data):
    run = Run(cfg, data)
    run.replace_first()
    _restores_exactly(run, cfg, data)


def _restores_exactly(run: Run, cfg: dict, data) -> None:
    for _ in range(data.draw(st.integers(0, 40))):
        run.step()
    restored = Scheduler.restore(SchedulerConfig(**cfg), _roundtrip(run.d.sched.snapshot()))
    log = _recording(run.d.sched)
    for _ in range(data.draw(st.integers(1, 40))):
        run.step()
    for event, now, actions in log:
        assert restored.handle(event, now) == actions, event
    assert _roundtrip(restored.snapshot()) == _roundtrip(run.d.sched.snapshot())


def test_snapshot_of_a_fresh_scheduler_restores():
    sched = Scheduler(SchedulerConfig(groups=2), shard=3)
    again = Scheduler.restore(SchedulerConfig(groups=2), _roundtrip(sched.snapshot()))
    assert again.shard == 3 and again.epoch == -1 and again.snapshot() == sched.snapshot()


def test_a_snapshot_of_another_version_is_refused():
    snap = Scheduler(SchedulerConfig()).snapshot()
    snap["v"] = 99
    try:
        Scheduler.restore(SchedulerConfig(), snap)
    except ValueError as exc:
        assert "version" in str(exc)
    else:
        raise AssertionError("restore accepted an unknown snapshot version")


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), data=st.data())
def test_the_journal_writes_a_snapshot_as_its_plain_lists(cfg, data):
    """Keys and samples' fields go into the snapshot as tuples: the journal's bytes are those
    of the same data as msgpack's lists and maps (what `restore` reads back)."""
    from consumers.journal import encode_snapshot

    run = Run(cfg, data)
    for _ in range(data.draw(st.integers(0, 40))):
        run.step()
    snap = run.d.sched.snapshot()
    assert encode_snapshot(run.d.sched) == msgpack.packb(_roundtrip(snap), use_bin_type=True)
