"""Held results that will never be emitted are released: those of a group the machine no
longer tracks at the next step, those of an earlier epoch when a new one opens."""

import pytest

from consumers.admission import Admission
from pipeline import wire
from pipeline.config import AdmissionConfig, build
from pipeline.scheduler import SampleKey, member
from pipeline.sessions import Call, Session, Status, Task

pytestmark = pytest.mark.timeout(60)

# batch mode, three groups of two a batch, two admitted: the third is cut as surplus
SCHEDULER = {"admission": "batch", "groups": 2, "batch_size": 3, "admit": 2, "ahead": 0,
             "max_lag": 1, "width": 64, "rows": 4}


def _admission(r, redis_config) -> Admission:
    config = build(AdmissionConfig, {"redis": redis_config.model_dump(), "scheduler": SCHEDULER,
                                     "block_ms": 1, "trim_every_s": 3600.0, "lease_s": 3600.0})
    return Admission(config, r, snapshot_every=10_000)


def _drain(adm: Admission) -> None:
    while adm.poll_once(1):
        pass


def _work(r, keys) -> dict[tuple[int, int], wire.Work]:
    """The submitted attempts, by (group, sample)."""
    out = {}
    for _, fields in r.xrange(keys.work):
        work = wire.from_fields(fields, wire.Work)
        out[(work.group, work.sample)] = work
    return out


def _finish(r, keys, work: wire.Work) -> None:
    session = Session(Status.COMPLETED, 1.0, calls=[Call([1, 2], [3], [-0.5], 0)],
                      timings={"started": 0.0, "finished": 1.0})
    result = wire.Result.from_session(0, work.epoch, work.group, work.sample, work.attempt, session, "test")
    r.xadd(keys.results(0), wire.to_fields(result))


def _key(work: wire.Work) -> SampleKey:
    return SampleKey(work.epoch, work.group, work.sample, work.attempt)


def _held(r, keys) -> set[str]:
    return {name.decode() for name in r.hkeys(keys.held(0))}


def test_a_cut_groups_held_result_is_released_by_the_step(r, keys, redis_config):
    adm = _admission(r, redis_config)
    tasks = keys.tasks(0)
    r.xadd(tasks, wire.to_fields(wire.Open(0, 0)))
    r.xadd(tasks, wire.to_fields(wire.Registration(0, 0, 0, (Task("a"), Task("b"), Task("c")))))
    r.xadd(tasks, wire.to_fields(wire.Handover(0, 0, 0, 0, None)))
    _drain(adm)
    work = _work(r, keys)
    groups = sorted({g for g, _ in work})
    assert len(groups) == 3 and len(work) == 6
    first, second, cut = groups
    # one result of the group that will be cut, held while its group may still complete
    _finish(r, keys, work[(cut, 0)])
    _drain(adm)
    cut_member = member(_key(work[(cut, 0)]))
    assert _held(r, keys) == {cut_member}
    # the two other groups complete: the batch has its two, the third is dropped, the step emitted
    for g in (first, second):
        for s in range(2):
            _finish(r, keys, work[(g, s)])
    _drain(adm)
    ready = wire.from_fields(r.xrange(keys.ready(0))[-1][1], wire.Ready)
    assert ready.error is None and sorted(ready.record.packed) == [first, second]
    assert [d[0] for d in ready.record.dropped] == [cut]
    assert _held(r, keys) == set(), "the cut group's result, never to be emitted, is released"
    assert not adm._held and not adm._decoded


def test_a_new_epoch_releases_the_held_results_of_the_last(r, keys, redis_config):
    adm = _admission(r, redis_config)
    tasks = keys.tasks(0)
    r.xadd(tasks, wire.to_fields(wire.Open(0, 0)))
    r.xadd(tasks, wire.to_fields(wire.Registration(0, 0, 0, (Task("a"), Task("b"), Task("c")))))
    _drain(adm)
    work = _work(r, keys)
    held = [work[key] for key in sorted(work)[:3]]
    for w in held:
        _finish(r, keys, w)
    _drain(adm)
    assert _held(r, keys) == {member(_key(w)) for w in held}
    r.xadd(tasks, wire.to_fields(wire.Open(0, 1)))
    _drain(adm)
    assert adm.sched.epoch == 1
    assert _held(r, keys) == set() and not adm._held and not adm._decoded
