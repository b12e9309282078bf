"""`end_backups` through the admission consumer: a handover that names the run's last step
backs up the stragglers of the groups still running, and an admission restarted from its
journal still knows the run's end."""

import pytest

from pipeline import wire
from pipeline.sessions import Task
from tests.integration.test_adm_held import _admission, _drain, _finish

pytestmark = pytest.mark.timeout(60)

# stream mode, groups of two with one extra sample held back for a straggler; the bound
# (max_lag 3) never calls for a backup within these steps, only the run's end does
SCHEDULER = {"admission": "stream", "groups": 2, "oversample": 1, "oversample_start": "straggler",
             "batch_size": 2, "admit": 1, "ahead": 1, "max_lag": 3, "inflight_samples": 6,
             "end_backups": 1, "width": 64, "rows": 4}


def _work(r, keys) -> list[wire.Work]:
    """The submitted attempts, in order."""
    return [wire.from_fields(fields, wire.Work) for _, fields in r.xrange(keys.work)]


def _named(work: list[wire.Work]) -> list[tuple[str, int, int]]:
    return [(w.task.id, w.sample, w.attempt) for w in work]


def test_the_runs_last_step_backs_up_the_stragglers_and_a_restart_keeps_it(r, keys, redis_config):
    adm = _admission(r, redis_config, SCHEDULER)
    tasks = keys.tasks(0)
    r.xadd(tasks, wire.to_fields(wire.Open(0, 0, adm.config.scheduler.model_dump(mode="json"))))
    r.xadd(tasks, wire.to_fields(wire.Registration(0, 0, 0, (Task("a"), Task("b")))))
    r.xadd(tasks, wire.to_fields(wire.Handover(0, 0, 0, 0, None, 1)))  # one step after this one
    _drain(adm)
    work = _work(r, keys)
    assert _named(work) == [("a", 0, 0), ("a", 1, 0), ("b", 0, 0), ("b", 1, 0)]
    for w in work[:1] + work[2:]:  # one of a's, both of b's: b completes, step 0 goes out
        _finish(r, keys, w)
    _drain(adm)
    assert r.xlen(keys.ready(0)) == 1 and len(_work(r, keys)) == 4  # no backup before the end
    r.xadd(tasks, wire.to_fields(wire.Handover(0, 0, 1, 1, None, 0)))  # the run's last step
    _drain(adm)
    assert _named(_work(r, keys)[4:]) == [("a", 2, 0)]  # a's straggler backed up by its extra sample

    restarted = _admission(r, redis_config, SCHEDULER)  # rebuilt from the snapshot and journal
    r.xadd(tasks, wire.to_fields(wire.Registration(0, 0, 1, (Task("c"),))))
    _drain(restarted)
    # a group started in the run's last step is backed up at once: the restart kept the end
    assert _named(_work(r, keys)[5:]) == [("c", 0, 0), ("c", 1, 0), ("c", 2, 0)]
