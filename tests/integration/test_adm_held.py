"""Held results that will never be emitted are released: those of a group the machine no
longer tracks at the next step, those of an earlier epoch when a new one opens; a restart
finds the same ones held."""

import msgpack
import pytest

from consumers import journal
from consumers.admission import REF, Admission
from pipeline import wire
from pipeline.config import AdmissionConfig, build
from pipeline.redis_io import parse_id
from pipeline.scheduler import SampleKey, member
from pipeline.sessions import Call, Session, Status, Task

pytestmark = pytest.mark.timeout(60)

# batch mode, three groups of two a batch, two admitted: the third is cut as surplus
SCHEDULER = {"admission": "batch", "groups": 2, "batch_size": 3, "admit": 2, "ahead": 0,
             "max_lag": 1, "width": 64, "rows": 4}


def _admission(r, redis_config, scheduler: dict = SCHEDULER) -> Admission:
    config = build(AdmissionConfig, {"redis": redis_config.model_dump(), "scheduler": scheduler,
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


def _held(adm: Admission) -> set[str]:
    """The members `adm` holds, the same as what Redis says it holds (a rebuilt machine's:
    nothing is written to hold a result; the journal names it)."""
    held = adm.held()
    adm._rebuild()  # as after a restart
    assert adm.held() == held
    return held


def _step_zero(r, keys, redis_config) -> tuple[Admission, dict[tuple[int, int], wire.Work]]:
    """An admission with epoch 0 open, batch 0 (three tasks) registered and step 0 handed
    over, and the attempts it submitted."""
    adm = _admission(r, redis_config)
    tasks = keys.tasks(0)
    r.xadd(tasks, wire.to_fields(wire.Open(0, 0)))
    r.xadd(tasks, wire.to_fields(wire.Registration(0, 0, 0, (Task("a"), Task("b"), Task("c")))))
    r.xadd(tasks, wire.to_fields(wire.Handover(0, 0, 0, 0, None)))
    _drain(adm)
    return adm, _work(r, keys)


def test_a_cut_groups_held_result_is_released_by_the_step(r, keys, redis_config):
    adm, work = _step_zero(r, keys, redis_config)
    groups = sorted({g for g, _ in work})
    assert len(groups) == 3 and len(work) == 6
    first, second, cut = groups
    # one result of the group that will be cut, held while its group may still complete
    _finish(r, keys, work[(cut, 0)])
    _drain(adm)
    cut_member = member(_key(work[(cut, 0)]))
    assert _held(adm) == {cut_member}
    # the two other groups complete: the batch has its two, the third is dropped, the step emitted
    for g in (first, second):
        for s in range(2):
            _finish(r, keys, work[(g, s)])
    _drain(adm)
    ready = wire.from_fields(r.xrange(keys.ready(0))[-1][1], wire.Ready)
    assert ready.error is None and sorted(ready.record.packed) == [first, second]
    assert [d[0] for d in ready.record.dropped] == [cut]
    assert not adm._held and not adm._decoded
    assert _held(adm) == set(), "the cut group's result, never to be emitted, is released"


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
    assert _held(adm) == {member(_key(w)) for w in held}
    r.xadd(tasks, wire.to_fields(wire.Open(0, 1)))
    _drain(adm)
    assert adm.sched.epoch == 1
    assert not adm._held and not adm._decoded and _held(adm) == set()


def _as_written_before_the_journal_named_them(r, keys, refs: dict[str, bytes]) -> None:
    """The shard's state as a consumer that held results in `held:{shard}` wrote it: each
    result's `@` and entry id there, no `h` in the journal, no `held` beside the snapshot."""
    entries = r.xrange(keys.journal(0))
    r.delete(keys.journal(0))
    for _, fields in entries:
        maps = msgpack.unpackb(fields[journal.FIELD], raw=False)
        r.xadd(keys.journal(0), {journal.FIELD: msgpack.packb(
            [{k: v for k, v in m.items() if k != "h"} for m in maps], use_bin_type=True)})
    r.hdel(keys.state(0), journal.HELD)
    r.hset(keys.held(0), mapping={name: REF + ref for name, ref in refs.items()})


def test_results_an_earlier_version_held_in_the_hash_are_held_after_an_upgrade(r, keys, redis_config):
    adm, work = _step_zero(r, keys, redis_config)
    first, second, _ = sorted({g for g, _ in work})
    for g, s in ((first, 0), (first, 1), (second, 0)):
        _finish(r, keys, work[(g, s)])
    _drain(adm)
    refs = dict(adm._refs)
    assert len(refs) == 3 and set(refs) == adm.held()
    _as_written_before_the_journal_named_them(r, keys, refs)
    adm._rebuild()  # the upgraded consumer's recovery
    assert adm._refs == refs and adm.held() == set(refs) and adm.held_count() == 3
    adm.trim()
    assert min(refs.values(), key=parse_id) in [i for i, _ in r.xrange(keys.results(0))]  # kept
    _finish(r, keys, work[(second, 1)])
    _drain(adm)
    ready = wire.from_fields(r.xrange(keys.ready(0))[-1][1], wire.Ready)
    assert ready.error is None and sorted(ready.record.packed) == [first, second]
    assert not adm.held() and not r.exists(keys.held(0))  # packed from their entries, then released
