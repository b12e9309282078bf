"""Group-gated backfill (`SchedulerConfig.backfill="group"`, stream mode): the legacy
baseline of `rollstream bench schedule`. An ended sample's credit is held by its group until
every sample of the group has ended, then the group's credits are released together."""

import random

from pipeline.scheduler import Emit, Scheduler
from tests.unit.driver import Driver, Status, Submit, of


def _stream(**config) -> Driver:
    config = {"admission": "stream", "groups": 2, "ahead": 0, "max_lag": 10, **config}
    d = Driver(**config)
    d.open()
    return d


def _balanced(d: Driver) -> None:
    s = d.sched
    assert s.in_flight + s.credits + s.held_credits == s.target
    assert s.in_flight <= s.target


def test_sample_backfill_releases_each_credit_at_once():
    d = _stream(inflight_samples=4)
    d.register(0, n=4)
    g0, g1 = d.groups()
    d.finish(d.running_of(g0)[0])
    acts = d.finish(d.running_of(g1)[0])
    assert len(of(Submit, acts)) == 2  # two credits from two groups: one new group


def test_group_backfill_holds_credits_until_the_whole_group_has_ended():
    d = _stream(inflight_samples=4, backfill="group")
    d.register(0, n=4)
    g0, g1 = d.groups()
    assert of(Submit, d.finish(d.running_of(g0)[0])) == []
    assert of(Submit, d.finish(d.running_of(g1)[0])) == []
    assert (d.sched.credits, d.sched.held_credits, d.sched.in_flight) == (0, 2, 2)
    _balanced(d)
    acts = d.finish(d.running_of(g0)[0])  # g0 has ended: its two credits submit one group
    assert len(of(Submit, acts)) == 2 and {a.key.group for a in of(Submit, acts)} - {g0, g1}
    assert (d.sched.credits, d.sched.held_credits, d.sched.in_flight) == (0, 1, 3 + 0)
    _balanced(d)


def test_group_backfill_releases_with_the_cancelled_surplus_of_a_complete_group():
    d = _stream(inflight_samples=6, oversample=1, backfill="group")
    d.register(0, n=4)
    g0, g1 = d.groups()
    d.finish(d.running_of(g0)[0])
    acts = d.finish(d.running_of(g0)[0])  # complete: the surplus sample is cancelled
    assert d.running_of(g0) == []
    assert len(of(Submit, acts)) == 3 and d.sched.held_credits == 0
    _balanced(d)


def test_group_backfill_resubmission_takes_its_groups_held_credit_first():
    d = _stream(inflight_samples=4, backfill="group", max_attempts=3)
    d.register(0, n=4)
    g0, _ = d.groups()
    a, b = d.running_of(g0)
    d.finish(a)
    (sub,) = of(Submit, d.finish(b, status=Status.INFRA_ERROR, reward=None))
    assert sub.key.group == g0 and sub.cause == "infra_error"
    assert (d.sched.credits, d.sched.held_credits, d.sched.in_flight) == (0, 1, 3)
    _balanced(d)


def test_group_backfill_never_exceeds_the_target_under_random_outcomes():
    statuses = [Status.COMPLETED] * 6 + [Status.INFRA_ERROR, Status.CANCELLED]
    for seed in range(20):
        rng = random.Random(seed)
        d = _stream(inflight_samples=12, groups=3, oversample=1, admit=2, backfill="group",
                    max_attempts=2)
        for b in range(12):
            d.register(b, n=3)
        d.handover(0)
        for _ in range(300):
            running = d.running()
            if not running:
                break
            status = rng.choice(statuses)
            d.finish(rng.choice(running), status=status,
                     reward=None if status is not Status.COMPLETED else 1.0)
            _balanced(d)
            if d.sched.pending_step is None:  # the step was emitted: the next call
                d.handover()
                _balanced(d)
            restored = Scheduler.restore(d.sched.config, d.sched.snapshot())
            assert restored.snapshot() == d.sched.snapshot()
            assert restored.held_credits == d.sched.held_credits
        assert of(Emit, d.actions)
