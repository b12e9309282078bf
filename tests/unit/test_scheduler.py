"""One test per rule of the scheduler specification (admission, staleness, long tail,
weight pushes, epochs, broken sources, SchedulerRecord) and of sample-completion backfill."""

import pytest

from pipeline.config import ConfigError, SchedulerConfig, build
import pipeline.scheduler as scheduler_module
from pipeline.scheduler import Handover, ProtocolError, Register, Scheduler
from pipeline.sessions import Task
from tests.unit.driver import (
    Abandon, Cancel, Discard, Driver, Emit, Fail, PushWeights, SampleKey, Status, Submit, of,
)

# ------------------------------------------------------------- registration and handover


def test_nothing_is_submitted_before_the_first_handover():
    d = Driver(groups=2)
    d.open()
    assert d.register(0) == [] and d.register(1) == []


def test_handover_of_batch_i_submits_batches_up_to_i_plus_ahead():
    d = Driver(groups=2, ahead=2, max_lag=2)
    d.open()
    for b in range(4):
        d.register(b, n=3)
    acts = d.handover(0)
    batches = {d.sched._groups[k.group].batch for k in (a.key for a in of(Submit, acts))}
    assert batches == {0, 1, 2}
    assert len(of(Submit, acts)) == 3 * 3 * 2
    d.finish_group(d.groups()[0]), d.finish_group(d.groups()[1]), d.finish_group(d.groups()[2])
    acts = d.handover(1)
    assert {a.task.id.split(".")[0] for a in of(Submit, acts)} == {"t3"}


def test_a_batch_registered_late_inside_the_window_is_submitted_at_once():
    d = Driver(groups=1, ahead=1)
    d.open()
    d.register(0, n=1)
    d.handover(0)
    assert [a.task.id for a in of(Submit, d.register(1, n=1))] == ["t1.0"]
    d.finish_group(d.groups()[0])
    assert of(Submit, d.register(2, n=1)) == []  # batch 2 waits for handover 1


def test_each_task_becomes_one_group_relabelled_by_group_sample_attempt():
    d = Driver(groups=3, oversample=1, ahead=0, max_lag=0)
    d.open(epoch=7)
    d.register(0, n=2)
    subs = of(Submit, d.handover(0))
    by_group: dict[int, list[SampleKey]] = {}
    for s in subs:
        by_group.setdefault(s.key.group, []).append(s.key)
        assert s.key.epoch == 7 and s.key.attempt == 0 and s.cause is None
    assert sorted(len(v) for v in by_group.values()) == [4, 4]
    assert all(sorted(k.sample for k in v) == [0, 1, 2, 3] for v in by_group.values())
    tasks = {s.key.group: s.task.id for s in subs}
    assert sorted(tasks.values()) == ["t0.0", "t0.1"]


@pytest.mark.parametrize("bad", [
    lambda d: d.handover(0),  # batch 0 never registered
    lambda d: (d.register(0), d.register(0)),  # registered twice
    lambda d: (d.register(0), d.handover(0), d.register(1), d.handover(1)),  # step 0 pending
    lambda d: d.send(Register(0, ())),  # empty batch
])
def test_protocol_violations_are_refused(bad):
    d = Driver(groups=1)
    d.open()
    with pytest.raises(ProtocolError):
        bad(d)


def test_events_before_the_stream_is_opened_are_refused():
    with pytest.raises(ProtocolError, match="opened"):
        Scheduler(SchedulerConfig()).handle(Register(0, (Task("a"),)), 0.0)


def test_admit_above_the_batch_size_is_refused_naming_admit():
    d = Driver(groups=1, admit=3)
    d.open()
    with pytest.raises(ProtocolError, match="admit=3"):
        d.register(0, n=2)
    with pytest.raises(ConfigError, match="admit=3 exceeds batch_size=2"):
        build(SchedulerConfig, {"admit": 3, "batch_size": 2})


def test_construction_refuses_max_lag_below_ahead_plus_sync_every_minus_one():
    with pytest.raises(ConfigError, match="max_lag"):
        build(SchedulerConfig, {"ahead": 2, "sync_every": 2, "max_lag": 2})
    assert build(SchedulerConfig, {"ahead": 2, "sync_every": 2, "max_lag": 3}).max_lag == 3


# ------------------------------------------------------------- admission by status


def _one_group(**config) -> Driver:
    config.setdefault("ahead", 0)
    config.setdefault("max_lag", 0)
    d = Driver(**config)
    d.open()
    d.register(0, n=1)
    d.handover(0)
    return d


@pytest.mark.parametrize("status", [Status.COMPLETED, Status.AGENT_ERROR])
def test_completed_and_agent_error_are_admitted(status):
    d = _one_group(groups=2)
    acts = d.finish_group(0, status=status, reward=0.5)
    (emit,) = of(Emit, acts)
    assert [len(g.samples) for g in emit.groups] == [2]
    assert of(Submit, acts) == [] and of(Discard, acts) == []


@pytest.mark.parametrize("truncation,reward", [("mask", None), ("mask", 1.0), ("zero", None),
                                               ("score", 0.0)])
def test_truncated_is_admitted_under_its_policy(truncation, reward):
    d = _one_group(groups=2, truncation=truncation)
    acts = d.finish_group(0, status=Status.TRUNCATED, reward=reward)
    assert len(of(Emit, acts)) == 1 and of(Submit, acts) == []


def test_unscored_truncation_under_score_is_resubmitted_as_a_failed_attempt():
    d = _one_group(groups=1, truncation="score", max_attempts=2)
    (key,) = d.running()
    acts = d.finish(key, status=Status.TRUNCATED, reward=None)
    (sub,) = of(Submit, acts)
    assert sub.cause == "unscored" and sub.key.attempt == 1 and sub.key.sample == key.sample
    assert of(Discard, acts)[0].reason == "unscored"
    acts = d.finish(sub.key, status=Status.TRUNCATED, reward=None)  # second failure: abandoned
    assert len(of(Abandon, acts)) == 1


@pytest.mark.parametrize("status,cause", [(Status.INFRA_ERROR, "infra_error"),
                                          (Status.CANCELLED, "cancelled")])
def test_infra_error_and_cancelled_are_resubmitted_under_the_served_weights(status, cause):
    d = Driver(groups=1, ahead=1, max_lag=1)
    d.open()
    d.register(0, n=1), d.register(1, n=1), d.register(2, n=1)
    d.handover(0)
    d.finish_group(0)
    d.handover(1)  # pushes version 1
    assert d.sched.served == 1
    (key,) = d.running_of(1)
    assert d.submitted[key].submitted_version == 0
    (sub,) = of(Submit, d.finish(key, status=status, reward=None))
    assert (sub.cause, sub.key.attempt, sub.submitted_version) == (cause, 1, 1)


def test_max_attempts_failures_abandon_the_group_rather_than_train_it_incomplete():
    d = _one_group(groups=2, max_attempts=3)
    keep, key = d.running()
    for attempt in range(3):
        acts = d.finish(key, status=Status.INFRA_ERROR, reward=None)
        if attempt < 2:
            (sub,) = of(Submit, acts)
            key = sub.key
    (ab,) = of(Abandon, acts)
    assert ab.cause == "infra_error" and ab.task.id == "t0.0"
    assert [c.key for c in of(Cancel, acts)] == [keep]  # the sibling is cancelled
    (emit,) = of(Emit, acts)  # the batch is settled: an empty step, not an incomplete group
    assert emit.groups == () and emit.record.abandoned == 1 and emit.record.cancelled == 1
    assert emit.record.resubmitted["infra_error"] == 2


def test_with_oversample_one_exhausted_sample_does_not_abandon_a_group_that_can_complete():
    d = _one_group(groups=2, oversample=1, max_attempts=1)
    a, b, c = d.running()
    acts = d.finish(a, status=Status.INFRA_ERROR, reward=None)
    assert of(Abandon, acts) == [] and of(Submit, acts) == []
    d.finish(b)
    (emit,) = of(Emit, d.finish(c))
    assert emit.groups[0].samples == (b, c)


def test_a_result_for_a_superseded_attempt_is_dropped():
    d = _one_group(groups=1)
    (key,) = d.running()
    (sub,) = of(Submit, d.finish(key, status=Status.INFRA_ERROR, reward=None))
    acts = d.finish(key)  # a duplicate delivery of the old attempt
    assert acts == [Discard(key, "superseded")]
    (emit,) = of(Emit, d.finish(sub.key))
    assert emit.groups[0].samples == (sub.key,)


# ------------------------------------------------------------- staleness


def test_a_result_whose_oldest_call_is_past_max_lag_is_discarded_and_resubmitted():
    d = Driver(groups=1, ahead=1, max_lag=1, max_attempts=1)
    d.open()
    for b in range(3):
        d.register(b, n=1)
    d.handover(0)
    d.finish_group(0)
    d.handover(1)
    d.finish_group(1)
    d.handover(2)  # updates 2
    (key,) = d.running_of(2)
    acts = d.finish(key, oldest=0)  # lag 2 > 1
    assert of(Discard, acts) == [Discard(key, "stale")]
    (sub,) = of(Submit, acts)
    assert sub.cause == "stale" and sub.submitted_version == 2
    # stale is not a failed attempt: max_attempts=1 and the group is not abandoned
    assert of(Abandon, acts) == []
    (emit,) = of(Emit, d.finish(sub.key, oldest=2))
    assert emit.record.resubmitted["stale"] == 1 and emit.record.lag == 0


def test_a_running_rollout_whose_submission_is_past_the_bound_is_cancelled_before_waiting():
    d = Driver(groups=1, ahead=1, max_lag=1)
    d.open()
    for b in range(3):
        d.register(b, n=1)
    d.handover(0, updates=0)
    d.finish_group(0)
    (old,) = d.running_of(1)
    acts = d.handover(1, updates=3)  # the trainer made three updates: version 0 is 3 behind
    cancels = of(Cancel, acts)
    assert Cancel(old, "stale") in cancels
    resub = [s for s in of(Submit, acts) if s.key.group == old.group]
    assert resub[0].cause == "stale" and resub[0].submitted_version == 3
    assert acts.index(of(PushWeights, acts)[0]) < acts.index(resub[0])


def test_consumption_rechecks_the_lag_of_results_admitted_early():
    d = Driver(groups=2, ahead=1, max_lag=1)
    d.open()
    for b in range(3):
        d.register(b, n=1)
    d.handover(0, updates=0)
    early, running = d.running_of(1)
    d.finish(early, oldest=0)  # batch 1's first sample admitted at lag 0
    d.finish_group(0)
    acts = d.handover(1, updates=2)  # now its lag is 2
    assert Discard(early, "stale") in of(Discard, acts)
    assert Cancel(running, "stale") in of(Cancel, acts)  # its sibling, still running, too
    assert of(Emit, acts) == []
    new = sorted(s.key for s in of(Submit, acts) if s.key.group == early.group)
    assert [(k.sample, k.attempt) for k in new] == [(0, 1), (1, 1)]
    assert all(s.cause == "stale" for s in of(Submit, acts) if s.key in new)
    d.finish(new[0], oldest=2)
    (emit,) = of(Emit, d.finish(new[1], oldest=2))
    assert emit.record.lag == 0 and emit.record.resubmitted["stale"] == 2


def test_no_stale_cancel_when_the_engines_serve_nothing_fresher():
    d = Driver(groups=1, ahead=1, max_lag=1, sync_every=1)
    d.open()
    d.register(0, n=1), d.register(1, n=1)
    d.handover(0, updates=0)
    # a push makes the engines fresher, so a stale running rollout is replaced
    d.finish_group(0)
    acts = d.handover(1, updates=5)
    assert of(PushWeights, acts) == [PushWeights(5)] and len(of(Cancel, acts)) == 1


# ------------------------------------------------------------- timeouts


def test_a_rollout_past_its_deadline_is_cancelled_and_resubmitted_as_a_failed_attempt():
    d = Driver(groups=1, ahead=0, max_lag=0, timeout_s=10.0, max_attempts=2)
    d.open()
    d.register(0, n=1)
    (sub,) = of(Submit, d.handover(0))
    assert sub.deadline == pytest.approx(10.0)
    assert d.tick(9.9) == []
    acts = d.tick(0.2)
    assert of(Cancel, acts) == [Cancel(sub.key, "timeout")]
    (again,) = of(Submit, acts)
    assert again.cause == "timeout" and again.deadline == pytest.approx(20.1)
    acts = d.tick(10.0)  # second timeout: max_attempts=2 reached
    assert len(of(Abandon, acts)) == 1 and of(Abandon, acts)[0].cause == "timeout"
    (emit,) = of(Emit, acts)
    assert emit.record.resubmitted["timeout"] == 1 and emit.record.abandoned == 1


# ------------------------------------------------------------- the long tail


def test_oversample_admits_the_first_groups_finishers_and_cancels_the_rest():
    d = _one_group(groups=2, oversample=2)
    a, b, c, e = d.running()
    d.finish(c)
    acts = d.finish(a)
    assert sorted(x.key for x in of(Cancel, acts)) == [b, e]
    assert all(x.reason == "surplus" for x in of(Cancel, acts))
    (emit,) = of(Emit, acts)
    assert emit.groups[0].samples == (c, a)  # finishing order
    assert emit.record.cancelled == 2


def test_admit_takes_the_first_admit_groups_to_complete_and_cancels_the_others():
    d = Driver(groups=1, admit=2, ahead=0, max_lag=0)
    d.open()
    d.register(0, n=4)
    d.handover(0)
    g = d.groups()
    d.finish_group(g[2])
    acts = d.finish_group(g[0])
    assert sorted(c.key.group for c in of(Cancel, acts)) == [g[1], g[3]]
    (emit,) = of(Emit, acts)
    assert [x.group for x in emit.groups] == [g[2], g[0]]
    assert emit.record.groups == 2 and emit.record.cancelled == 2


def test_groups_complete_before_the_handover_are_emitted_at_the_handover():
    d = Driver(groups=1, ahead=1)
    d.open()
    d.register(0, n=1), d.register(1, n=1), d.register(2, n=1)
    d.handover(0)
    d.finish_group(0)
    assert of(Emit, d.finish_group(1)) == []  # step 1 not called yet
    (emit,) = of(Emit, d.handover(1))
    assert emit.step == 1 and emit.record.waited == 0.0


# ------------------------------------------------------------- weights


def test_weights_are_pushed_when_the_served_version_falls_sync_every_behind():
    d = Driver(groups=1, ahead=1, sync_every=2, max_lag=2)
    d.open()
    for b in range(7):
        d.register(b, n=1)
    pushes = []
    for step in range(6):
        acts = d.handover(step)
        pushes.append([p.version for p in of(PushWeights, acts)])
        d.finish_group(min(k.group for k in d.running()))
    assert pushes == [[], [], [2], [], [4], []]


def test_submissions_after_a_push_carry_the_new_version_and_running_ones_keep_running():
    d = Driver(groups=1, ahead=1, max_lag=1)
    d.open()
    for b in range(3):
        d.register(b, n=1)
    d.handover(0)
    d.finish_group(0)
    acts = d.handover(1)
    assert of(PushWeights, acts) == [PushWeights(1)] and of(Cancel, acts) == []
    (sub,) = of(Submit, acts)
    assert sub.submitted_version == 1 and acts.index(of(PushWeights, acts)[0]) < acts.index(sub)
    # the rollout running across the push finishes with calls of both versions
    (emit,) = of(Emit, d.finish_group(1, oldest=0))
    assert emit.record.version == 0 and emit.record.lag == 1


def test_published_versions_are_served_and_need_no_push():
    d = Driver(groups=1, ahead=0, max_lag=0)
    d.open()
    d.register(0, n=1), d.register(1, n=1)
    d.handover(0)
    d.finish_group(d.groups()[0])
    d.publish(1)
    acts = d.handover(1, updates=1)
    assert of(PushWeights, acts) == [] and of(Submit, acts)[0].submitted_version == 1


def test_handover_with_published_version_suppresses_the_push():
    d = Driver(groups=1, ahead=0, max_lag=0)
    d.open()
    d.register(0, n=1)
    acts = d.send(Handover(0, 3, published=3))
    assert of(PushWeights, acts) == [] and of(Submit, acts)[0].submitted_version == 3


# ------------------------------------------------------------- epochs, broken sources, close


def test_reopening_the_stream_cancels_everything_the_old_epoch_left_running():
    d = Driver(groups=2, ahead=1)
    d.open(0)
    d.register(0, n=2), d.register(1, n=2)
    d.handover(0)
    old = d.running()
    acts = d.open(1)
    assert sorted(c.key for c in of(Cancel, acts)) == old
    assert {c.reason for c in of(Cancel, acts)} == {"epoch"}
    assert d.finish(old[0]) == [Discard(old[0], "superseded")]
    d.register(0, n=1)
    subs = of(Submit, d.handover(0))
    assert subs and all(s.key.epoch == 1 for s in subs)
    with pytest.raises(ProtocolError):
        d.open(1)


def test_a_source_that_raises_fails_the_step_after_the_work_is_cancelled():
    d = Driver(groups=2, ahead=1)
    d.open()
    d.register(0, n=2), d.register(1, n=2)
    d.handover(0)
    first, *rest = d.running()
    acts = d.finish(first, status=Status.INFRA_ERROR, error="Traceback: boom")
    (fail,) = of(Fail, acts)
    assert fail.step == 0 and "boom" in fail.error
    assert sorted(c.key for c in of(Cancel, acts)) == rest
    assert acts.index(fail) > max(acts.index(c) for c in of(Cancel, acts))
    assert of(Submit, acts) == []


def test_a_source_error_between_steps_fails_the_next_handover():
    d = Driver(groups=1, ahead=1)
    d.open()
    d.register(0, n=1), d.register(1, n=1), d.register(2, n=1)
    d.handover(0)
    d.finish_group(0)
    (key,) = d.running()
    d.finish(key, error="Traceback: env crashed")
    (fail,) = of(Fail, d.handover(1))
    assert fail.step == 1 and "env crashed" in fail.error


def test_close_cancels_every_rollout_in_flight():
    d = Driver(groups=2, ahead=1)
    d.open()
    d.register(0, n=2), d.register(1, n=2)
    d.handover(0)
    running = d.running()
    acts = d.close()
    assert sorted(c.key for c in of(Cancel, acts)) == running and d.sched.in_flight == 0


# ------------------------------------------------------------- SchedulerRecord


def test_record_counts_one_call_and_resets_for_the_next():
    d = Driver(groups=2, oversample=1, ahead=0, max_lag=0, max_attempts=3)
    d.open()
    d.register(0, n=2), d.register(1, n=1)
    d.handover(0)
    g0, g1 = d.groups()
    a, b, c = d.running_of(g0)
    (r,) = of(Submit, d.finish(a, status=Status.INFRA_ERROR, reward=None, dt=1.0))
    (r2,) = of(Submit, d.finish(r.key, status=Status.CANCELLED, reward=None, dt=1.0))
    d.finish(b, dt=1.0), d.finish(c, dt=1.0)  # g0 complete, r2 cancelled as surplus
    (emit,) = of(Emit, d.finish_group(g1, n=2, dt=1.0))
    rec = emit.record
    assert rec.groups == 2 and rec.updates == 0 and rec.version == 0 and rec.lag == 0
    assert rec.resubmitted == {"infra_error": 1, "cancelled": 1, "stale": 0, "timeout": 0,
                               "unscored": 0}
    assert rec.cancelled == 2 and rec.abandoned == 0 and rec.cut == 0
    assert rec.waited == pytest.approx(6.0)
    (emit,) = of(Emit, d.finish_group(of(Submit, d.handover(1))[0].key.group, n=2, dt=0.5))
    assert emit.record.resubmitted["infra_error"] == 0 and emit.record.cancelled == 1
    assert emit.record.waited == pytest.approx(1.0)


# ------------------------------------------------------------- stream admission (backfill)


def _stream(**config) -> Driver:
    config = {"admission": "stream", "groups": 2, "ahead": 0, "max_lag": 0, **config}
    d = Driver(**config)
    d.open()
    return d


def test_stream_fills_the_in_flight_target_from_registered_batches_in_order():
    d = _stream(inflight_samples=6)
    acts = d.register(0, n=2) + d.register(1, n=3)
    assert [s.task.id for s in of(Submit, acts)][::2] == ["t0.0", "t0.1", "t1.0"]
    assert d.sched.in_flight == 6 and d.sched.credits == 0


def test_every_finished_sample_is_one_credit_whatever_its_outcome():
    d = _stream(inflight_samples=4, max_attempts=1)
    d.register(0, n=4)
    g0, g1 = d.groups()
    a, b = d.running_of(g0)
    acts = d.finish(a, status=Status.INFRA_ERROR, reward=None)  # exhausts: group abandoned
    assert of(Abandon, acts) and Cancel(b, "abandoned") in acts
    (new,) = {s.key.group for s in of(Submit, acts)}  # two credits: one new group
    assert new not in (g0, g1) and d.sched.in_flight == 4


def test_a_resubmission_takes_one_credit_and_groups_credits_submit_one_group():
    d = _stream(inflight_samples=4, max_attempts=3)
    d.register(0, n=5)
    g0, g1 = d.groups()
    a, b = d.running_of(g0)
    (sub,) = of(Submit, d.finish(a, status=Status.INFRA_ERROR, reward=None))
    assert sub.key.group == g0 and sub.cause == "infra_error" and d.sched.credits == 0
    acts = d.finish(b)  # one credit: not yet a group
    assert of(Submit, acts) == [] and d.sched.credits == 1
    acts = d.finish(d.running_of(g1)[0])
    assert len(of(Submit, acts)) == 2 and d.sched.credits == 0


def test_stream_step_trains_the_first_admit_complete_groups_from_any_batch():
    d = _stream(inflight_samples=8, admit=2, max_lag=1)
    d.register(0, n=2), d.register(1, n=2)
    g = d.groups()
    d.handover(0)
    d.finish_group(g[3]), d.finish_group(g[1])
    # the trainer's call is answered with the two groups that completed first
    emits = of(Emit, d.actions)
    assert [x.group for x in emits[0].groups] == [g[3], g[1]]
    d.finish_group(g[0])
    (emit,) = of(Emit, d.handover(1) + d.finish_group(g[2]))
    assert [x.group for x in emit.groups] == [g[0], g[2]]


def test_stream_drops_stale_members_of_waiting_groups_at_consumption():
    d = _stream(inflight_samples=4, admit=1, max_lag=1, ahead=1)
    d.register(0, n=4)
    g0, g1 = d.groups()
    d.finish_group(g0, oldest=0)
    acts = d.handover(0, updates=3)
    stale = [x for x in of(Discard, acts) if x.reason == "stale"]
    assert len(stale) == 2 and of(Emit, acts) == []


def test_stream_resubmits_stale_members_of_a_waiting_group_at_the_handover():
    """A group still waiting on a straggler does not keep members that fell past the bound
    until it completes: they are resubmitted at the handover, to run beside the straggler."""
    d = _stream(inflight_samples=2, admit=1, max_lag=1, ahead=1, stale_running="finish")
    d.register(0, n=2)
    (g0,) = d.groups()
    early, late = d.running_of(g0)
    d.finish(early, oldest=0)
    acts = d.handover(0, updates=2)  # early's call is two updates old now
    assert Discard(early, "stale") in of(Discard, acts) and of(Emit, acts) == []
    (again,) = [s for s in of(Submit, acts) if s.cause == "stale"]
    assert (again.key.group, again.key.sample, again.key.attempt) == (g0, early.sample, 1)
    assert again.submitted_version == 2 and late in d.running()
    d.finish(late, oldest=2)
    (emit,) = of(Emit, d.finish(again.key, oldest=2))
    assert [x.group for x in emit.groups] == [g0] and emit.record.lag == 0
    assert emit.record.resubmitted["stale"] == 1


@pytest.mark.parametrize("mode", ["cancel", "finish"])
def test_stale_running_cancels_at_once_or_judges_the_result(mode):
    d = _stream(inflight_samples=2, admit=1, max_lag=1, ahead=1, stale_running=mode)
    d.register(0, n=1)
    (g0,) = d.groups()
    first, second = d.running_of(g0)
    acts = d.handover(0, updates=2)  # both submitted under version 0: past the bound
    if mode == "cancel":
        assert {c.key for c in of(Cancel, acts)} == {first, second}
        assert all(c.reason == "stale" for c in of(Cancel, acts))
        return
    assert of(Cancel, acts) == []
    acts = d.finish(first, oldest=0)  # its call was made under version 0: still stale
    assert Discard(first, "stale") in of(Discard, acts)
    (again,) = [s for s in of(Submit, acts) if s.cause == "stale"]
    d.finish(second, oldest=2)  # its first call came after the push: admitted
    (emit,) = of(Emit, d.finish(again.key, oldest=2))
    assert emit.record.lag == 0 and emit.record.groups == 1


@pytest.mark.parametrize("mode", ["cancel", "finish"])
def test_the_version_index_of_running_samples_holds_only_what_can_still_go_stale(mode):
    """`cancel` looks running samples up by the version they were submitted under; `finish`
    judges each result and keeps no such index, so its snapshots do not grow with every
    submission of the epoch."""
    d = _stream(inflight_samples=4, admit=1, max_lag=1, ahead=1, stale_running=mode)
    d.register(0, n=12)
    for step in range(8):
        g = next(g for g in d.groups() if d.running_of(g))
        d.finish_group(g, oldest=d.updates)
        assert of(Emit, d.handover(step, updates=step + 1))
        d.publish(step + 1)
    assert len(d.submitted) >= 4 + 8 * 2 and len(d.running()) == 4
    held = len(d.sched.snapshot()["by_version"])
    assert held == 0 if mode == "finish" else 0 < held <= 2 * 4
    restored = Scheduler.restore(d.sched.config, d.sched.snapshot())
    assert restored.snapshot() == d.sched.snapshot()


def test_straggler_oversample_backs_up_a_group_whose_admitted_members_are_aging():
    d = _stream(inflight_samples=3, admit=1, groups=2, oversample=1, max_lag=1, ahead=1,
                oversample_start="straggler", stale_running="finish")
    d.register(0, n=1)
    (g0,) = d.groups()
    fast, straggler = d.running_of(g0)  # two of its three samples: the extra one waits
    assert d.sched.credits == 1 and len(d.submitted) == 2
    d.finish(fast, oldest=0)
    (backup,) = of(Submit, d.handover(0, updates=0))
    assert (backup.key.group, backup.key.sample, backup.key.attempt) == (g0, 2, 0)
    assert backup.cause is None and d.sched.in_flight == 2 and d.sched.credits == 1
    acts = d.finish(backup.key, oldest=0)  # the backup wins: the straggler is surplus
    assert Cancel(straggler, "surplus") in of(Cancel, acts)
    (emit,) = of(Emit, acts)
    assert [x.samples for x in emit.groups] == [(fast, backup.key)]


def test_straggler_oversample_waits_while_the_admitted_members_are_fresh():
    d = _stream(inflight_samples=3, admit=1, groups=2, oversample=1, max_lag=3, ahead=1,
                oversample_start="straggler")
    d.register(0, n=1)
    (g0,) = d.groups()
    fast, straggler = d.running_of(g0)
    d.finish(fast, oldest=0)
    assert of(Submit, d.handover(0, updates=0)) == []  # 0 > 0 - 3 + 1: no backup yet
    d.finish(straggler, oldest=0)
    assert d.ended.get(straggler) == "finish" and len(d.submitted) == 2


def test_straggler_oversample_backs_up_once_a_member_would_be_stale_at_the_next_handover():
    d = _stream(inflight_samples=6, admit=1, groups=2, oversample=1, max_lag=3, ahead=1,
                oversample_start="straggler", stale_running="finish")
    d.register(0, n=2)
    g0, g1 = d.groups()
    fast, straggler = d.running_of(g0)
    d.finish(fast, oldest=0)
    assert of(Submit, d.handover(0, updates=1)) == []  # 0 > 1 - 3 + 1: not yet
    assert of(Emit, d.finish_group(g1, oldest=1))
    (backup,) = of(Submit, d.handover(1, updates=2))  # 0 <= 2 - 3 + 1: due now
    assert (backup.key.group, backup.key.sample) == (g0, 2) and straggler in d.running()


def test_straggler_oversample_submits_the_extra_samples_once_the_group_needs_them():
    d = _stream(inflight_samples=3, admit=1, groups=2, oversample=1, max_attempts=1,
                oversample_start="straggler")
    d.register(0, n=1)
    (g0,) = d.groups()
    failed, _ = d.running_of(g0)
    acts = d.finish(failed, status=Status.INFRA_ERROR, reward=None)
    (extra,) = of(Submit, acts)
    assert extra.key.sample == 2 and of(Abandon, acts) == []


@pytest.mark.parametrize("limit", [None, 1])
def test_backup_limit_backs_up_the_groups_with_the_oldest_members_first(limit):
    d = _stream(inflight_samples=6, admit=1, groups=2, oversample=1, max_lag=1, ahead=1,
                oversample_start="straggler", stale_running="finish", backup_limit=limit)
    d.register(0, n=2)
    g0, g1 = d.groups()
    (fast0, slow0), (fast1, slow1) = d.running_of(g0), d.running_of(g1)
    d.finish(fast1, oldest=1)
    d.finish(fast0, oldest=0)  # g0's admitted member is the older: it goes first
    backups = of(Submit, d.handover(0, updates=1))  # both due: 0 and 1 <= 1 - 1 + 1
    assert [(b.key.group, b.key.sample) for b in backups] == [(g0, 2), (g1, 2)][:limit]
    if limit is None:
        return
    assert d.sched.credits == 3  # credits are free, but the limit holds g1's backup back
    acts = d.finish(backups[0].key, oldest=1)  # g0's backup wins: its straggler is surplus
    assert Cancel(slow0, "surplus") in of(Cancel, acts)
    (emit,) = of(Emit, acts)
    assert emit.record.backups == 1  # counted in the step after it was queued
    (late,) = of(Submit, d.handover(1, updates=1))  # room again: g1 is backed up now
    assert (late.key.group, late.key.sample) == (g1, 2) and slow1 in d.running()


def _ending(left: int = 1, **config) -> Driver:
    """Three groups of two (two extra samples each, held back as straggler backups that the
    bound never calls for), one sample of group 0 admitted, and step 0, with `left` steps
    after it, trained."""
    d = _stream(inflight_samples=8, admit=1, groups=2, oversample=2, max_lag=3, ahead=1,
                oversample_start="straggler", **config)
    d.register(0, n=3)
    g0, g1, _ = d.groups()
    d.finish(d.running_of(g0)[0], oldest=0)
    assert of(Submit, d.handover(0, updates=0, steps_left=left)) == []  # not among the last
    assert of(Emit, d.finish_group(g1, oldest=0))
    return d


def test_end_backups_back_up_every_running_sample_in_the_runs_last_steps():
    d = _ending(end_backups=1)
    g0, g2 = sorted(d.sched.live_groups())
    straggler = d.running_of(g0)[0]
    backups = of(Submit, d.handover(1, updates=1, steps_left=0))  # the run's last step
    # one backup per running sample, from the group's extra samples, the groups in order
    assert [(b.key.group, b.key.sample, b.key.attempt) for b in backups] == [(g0, 2, 0), (g2, 2, 0), (g2, 3, 0)]
    assert all(b.cause is None for b in backups) and d.sched.in_flight + d.sched.credits == 8
    acts = d.finish(backups[0].key, oldest=1)  # g0's backup wins: its straggler is surplus
    assert Cancel(straggler, "surplus") in of(Cancel, acts)
    (emit,) = of(Emit, acts)
    assert emit.record.backups == 3 and emit.groups[0].group == g0
    # the run's end is trained: nothing more is backed up, whatever finishes
    assert of(Submit, d.finish(backups[1].key, oldest=1)) == []


@pytest.mark.parametrize("config, left", [({"end_backups": 1}, 1), ({"end_backups": 1}, None),
                                          ({}, 0)])
def test_end_backups_wait_for_the_runs_last_steps(config, left):
    """Not one of the last `end_backups` steps, a trainer that does not say when its run
    ends, or `end_backups` off: no backup."""
    d = _ending(**config)
    assert of(Submit, d.handover(1, updates=1, steps_left=left)) == []


def test_end_backups_back_up_a_group_started_in_the_runs_last_steps():
    d = _ending(2, end_backups=2)
    g0, g2 = sorted(d.sched.live_groups())
    d.handover(1, updates=1, steps_left=1)  # steps 1 and 2 are the last two
    assert len(d.running()) == 6 and d.sched.credits == 2  # 3 running, and their 3 backups
    (emit,) = of(Emit, d.finish_group(g0, oldest=1))  # its straggler wins, its backup is cut
    assert emit.groups[0].group == g0
    d.register(1, n=1)  # a group started in the run's last steps gets its backups as well
    d.handover(2, updates=2, steps_left=0)
    (g3,) = set(d.sched.live_groups()) - {g2}
    assert sorted(k.sample for k in d.running_of(g3)) == [0, 1, 2, 3]


def test_a_group_an_end_backup_left_short_by_failures_runs_its_other_extra_samples():
    """An end backup takes one extra sample per running one; a sample that fails for good
    then queues the others, as it does in a group not backed up (else, once the backup
    failed too, the group could complete only with a sample nothing would run)."""
    d = _stream(inflight_samples=3, groups=1, oversample=2, max_attempts=1,
                oversample_start="straggler", end_backups=1)
    d.register(0, n=1)
    (g0,) = d.groups()
    (first,) = d.running_of(g0)
    (backup,) = of(Submit, d.handover(0, updates=0, steps_left=0))
    assert backup.key.sample == 1
    (last,) = of(Submit, d.finish(first, status=Status.INFRA_ERROR, reward=None))
    assert (last.key.group, last.key.sample) == (g0, 2)
    assert of(Submit, d.finish(backup.key, status=Status.INFRA_ERROR, reward=None)) == []
    (emit,) = of(Emit, d.finish(last.key))
    assert emit.groups[0].samples == (last.key,)


def test_end_backups_need_stream_admission_and_extra_samples():
    with pytest.raises(ValueError, match="end_backups=2 needs admission='stream'"):
        SchedulerConfig(oversample=1, end_backups=2)
    with pytest.raises(ValueError, match="end_backups=1 needs oversample >= 1"):
        SchedulerConfig(admission="stream", end_backups=1)


def test_backup_limit_cannot_be_below_oversample():
    with pytest.raises(ValueError, match="backup_limit=1 is below oversample=2"):
        SchedulerConfig(admission="stream", groups=2, oversample=2, oversample_start="straggler",
                        backup_limit=1)


def test_straggler_oversample_needs_stream_admission():
    with pytest.raises(ValueError, match="oversample_start"):
        SchedulerConfig(admission="batch", oversample=1, oversample_start="straggler")


def _replacing(**config) -> Driver:
    return _stream(**{"inflight_samples": 20, "admit": 2, "groups": 3, "oversample": 2,
                      "max_lag": 1, "ahead": 1, "oversample_start": "replace",
                      "replace_ahead": 0.5, "stale_running": "finish", **config})


def test_replace_oversample_replaces_each_member_the_next_handover_makes_stale_as_the_step_nears():
    d = _replacing()
    d.register(0, n=3)
    g0, g1, g2 = d.groups()
    assert [len(d.running_of(g)) for g in (g0, g1, g2)] == [3, 3, 3]  # the extra two wait
    d.handover(0, updates=1)
    a, b, straggler = d.running_of(g0)
    assert of(Submit, d.finish(a, oldest=0) + d.finish(b, oldest=0)) == []  # 2 groups missing
    acts = d.finish_group(g1, oldest=1)  # the step lacks one group now: half of it
    assert sorted((s.key.group, s.key.sample, s.key.attempt, s.cause) for s in of(Submit, acts)) == [
        (g0, 3, 0, None), (g0, 4, 0, None)]  # one for each of a and b: stale at handover 1
    restored = Scheduler.restore(d.sched.config, d.sched.snapshot())
    assert restored.snapshot() == d.sched.snapshot()
    d.sched = restored  # the rest runs on the restored machine
    (emit,) = of(Emit, d.finish_group(g2, oldest=1))
    assert emit.record.backups == 2
    acts = d.handover(1, updates=2)
    assert {x.key for x in of(Discard, acts)} == {a, b}
    assert of(Submit, acts) == []  # replaced, and the group can complete: not run again
    # the straggler and both replacements; nothing else is left to run, so step 1 goes out
    (emit,) = of(Emit, d.finish_group(g0, oldest=2))
    (trained,) = emit.groups
    assert {k.sample for k in trained.samples} == {straggler.sample, 3, 4}
    assert emit.record.resubmitted["stale"] == 0


@pytest.mark.parametrize("left, replaced", [(None, True), (1, True), (0, False)])
def test_replace_oversample_replaces_nothing_in_the_runs_last_step(left, replaced):
    """No handover follows the run's last step to make a member stale: a trainer that says
    the step is its last gets no replacements for it."""
    d = _replacing()
    d.register(0, n=3)
    g0, g1, _ = d.groups()
    d.handover(0, updates=1, steps_left=left)
    a, b, _ = d.running_of(g0)
    d.finish(a, oldest=0)
    d.finish(b, oldest=0)
    acts = d.finish_group(g1, oldest=1)  # the step lacks one group: a and b are due
    assert len(of(Submit, acts)) == (2 if replaced else 0)


def test_members_admitted_before_a_restore_get_their_replacements_as_they_age_after_it():
    d = _replacing()
    d.register(0, n=3)
    g0, g1, g2 = d.groups()
    d.handover(0, updates=1)
    a, b, _ = d.running_of(g0)
    d.finish(a, oldest=1)
    d.finish(b, oldest=1)  # fresh at update 1: nothing to replace yet
    assert of(Submit, d.finish_group(g1, oldest=1)) == []
    assert of(Emit, d.finish_group(g2, oldest=1))  # step 0 out
    d.sched = Scheduler.restore(d.sched.config, d.sched.snapshot())
    d.handover(1, updates=2)  # a and b stale at the next handover now
    d.register(1, n=3)
    g3 = next(g for g in d.groups() if g not in (g0, g1, g2))
    acts = d.finish_group(g3, oldest=2)  # the step lacks half of it: replacements for a and b
    assert sorted((s.key.group, s.key.sample, s.key.attempt) for s in of(Submit, acts)
                  if s.key.group == g0) == [(g0, 3, 0), (g0, 4, 0)]


@pytest.mark.parametrize("start", ["replace", "straggler"])
def test_the_admitted_members_caches_are_cleared_of_trained_groups_when_nothing_ages(monkeypatch, start):
    # with a bound nothing reaches, no member ever ages: the trained groups' entries are
    # cleared by rebuilds, so the caches stay within twice the most members admitted at once,
    # plus 64
    monkeypatch.setattr(scheduler_module, "_COMPACT_MIN", 64)
    d = _stream(inflight_samples=12, admit=2, groups=2, oversample=1, max_lag=10**6, ahead=1,
                oversample_start=start)
    sizes, most = [], 0
    for step in range(200):
        d.register(step, n=2)
        while d.running():
            d.finish(d.running()[0], oldest=d.updates)
            most = max(most, sum(len(g.admitted) for g in d.sched._groups.values()))
        assert of(Emit, d.handover(step, updates=step)) or step == 0
        sizes.append((d.sched._waiting_entries, len(d.sched._admitted_by_version)))
        assert d.sched._waiting_entries == sum(map(len, d.sched._waiting_at.values()))
        assert max(sizes[-1]) <= 2 * most + 64
        assert start == "replace" or sizes[-1][1] == 0
    assert len(d.submitted) > 4 * 64 and max(map(max, sizes)) > 64  # rebuilt, not merely small


def test_a_replaced_member_runs_again_when_its_group_cannot_complete_without_it():
    d = _replacing(groups=2, oversample=1, max_attempts=1)
    d.register(0, n=3)
    g0, g1, g2 = d.groups()
    d.handover(0, updates=1)
    a, _ = d.running_of(g0)
    d.finish(a, oldest=0)
    (replacement,) = of(Submit, d.finish_group(g1, oldest=1))
    assert (replacement.key.group, replacement.key.sample) == (g0, 2)
    d.finish(replacement.key, status=Status.INFRA_ERROR, reward=None)  # failed for good
    d.finish_group(g2, oldest=1)  # step 0 emitted
    acts = d.handover(1, updates=2)
    assert Discard(a, "stale") in of(Discard, acts)
    (again,) = of(Submit, acts)
    assert again.cause == "stale" and (again.key.group, again.key.sample, again.key.attempt) == (g0, a.sample, 1)


def test_a_spare_slot_carries_a_new_sample_with_its_own_failure_count():
    d = _replacing(max_attempts=2)
    d.register(0, n=3)
    g0, g1, g2 = d.groups()
    d.handover(0, updates=1)
    a, b, straggler = d.running_of(g0)
    (again,) = of(Submit, d.finish(a, status=Status.INFRA_ERROR, reward=None))  # a's 1st failure
    d.finish(again.key, oldest=0)
    d.finish(b, oldest=0)
    d.finish_group(g1, oldest=1)  # a and b get replacements 3 and 4
    d.finish_group(g2, oldest=1)  # step 0 out
    d.handover(1, updates=2)  # a and b stale: replaced, so their slots are spares
    (three,) = [k for k in d.running_of(g0) if k.sample == 3]
    (three_again,) = of(Submit, d.finish(three, status=Status.INFRA_ERROR, reward=None))
    (spare,) = of(Submit, d.finish(three_again.key, status=Status.INFRA_ERROR, reward=None))
    assert (spare.key.sample, spare.cause) == (a.sample, None)  # 3 failed for good: a's slot
    (resubmitted,) = of(Submit, d.finish(spare.key, status=Status.INFRA_ERROR, reward=None))
    # the spare's first failure, not a's second: run again in a's slot, not given up
    assert (resubmitted.key.sample, resubmitted.cause) == (a.sample, "infra_error")
    assert {k.sample for k in d.running_of(g0)} == {straggler.sample, 4, a.sample}


@pytest.mark.parametrize("config, says", [
    ({"admission": "batch", "oversample": 1}, "oversample_start='replace' needs admission='stream'"),
    ({"oversample": 0}, "needs oversample >= 1"),
    ({"replace_ahead": 0}, "replace_ahead"),
    ({"replace_ahead": 1.5}, "replace_ahead"),
])
def test_replace_oversample_refuses_a_config_it_cannot_run(config, says):
    with pytest.raises(ValueError, match=says):
        SchedulerConfig(**{"admission": "stream", "groups": 2, "oversample": 1,
                           "oversample_start": "replace", **config})


def _started(acts) -> list[int]:
    """The groups whose first attempts `acts` submit, in order."""
    return sorted({s.key.group for s in of(Submit, acts) if s.key.attempt == 0 and s.cause is None})


def test_handover_group_start_starts_new_groups_only_as_the_trainer_hands_over():
    d = _stream(inflight_samples=8, admit=2, group_start="handover", max_attempts=1)
    assert len(_started(d.register(0, n=8))) == 2  # before any handover: enough for a step
    assert d.sched.credits == 4
    assert len(_started(d.handover(0))) == 2  # the rest of the target, at the handover
    g0, g1, g2, g3 = d.groups()
    assert _started(d.finish_group(g0)) == []  # its credits wait for the next handover
    (emit,) = of(Emit, acts := d.finish_group(g1))
    assert [x.group for x in emit.groups] == [g0, g1] and _started(acts) == []
    assert d.sched.credits == 4 and len(d.running()) == 4
    new = _started(d.handover(1))
    assert len(new) == 2 and min(new) > g3 and d.sched.credits == 0
    # groups lost between handovers: once those left cannot make a step, one starts at once
    lost = [d.finish(d.running_of(g)[0], status=Status.INFRA_ERROR, reward=None) for g in (g3, *new)]
    assert [len(_started(acts)) for acts in lost] == [0, 0, 1]
    assert len(d.sched._groups) == 2 == len(d.running()) // 2


def test_handover_group_start_needs_stream_admission():
    with pytest.raises(ValueError, match="group_start='handover' needs admission='stream'"):
        SchedulerConfig(admission="batch", group_start="handover")


def test_stream_emits_what_it_has_once_nothing_is_left_to_run():
    d = _stream(inflight_samples=2, admit=2, max_attempts=1)
    d.register(0, n=2)
    d.handover(0)
    g0, = d.groups()
    d.finish_group(g0)
    g1 = [g for g in d.groups() if g != g0][0]
    (emit,) = of(Emit, d.finish(d.running_of(g1)[0], status=Status.INFRA_ERROR, reward=None))
    assert [x.group for x in emit.groups] == [g0] and emit.record.abandoned == 1


# ------------------------------------------------------------- liveness (each once a stall)


def _reopened(**config):
    """Batch 1's first group completes during step 0, then the handover of step 1 comes two
    updates later: the re-check at consumption finds its rollout stale and re-opens it."""
    d = Driver(groups=1, ahead=1, max_lag=1, max_attempts=1, **config)
    d.open()
    n = config.get("batch_size") or 1
    d.register(0, n=n), d.register(1, n=n)
    d.handover(0)
    early = min(k.group for k in d.running() if d.sched._groups[k.group].batch == 1)
    d.finish(d.running_of(early)[0], oldest=0)
    for g in sorted({k.group for k in d.running() if d.sched._groups[k.group].batch == 0}):
        d.finish_group(g)
    acts = d.handover(1, updates=2)
    (stale,) = [a for a in of(Discard, acts) if a.reason == "stale"]
    (again,) = [s for s in of(Submit, acts) if s.cause == "stale"]
    assert stale.key.group == again.key.group == early
    return d, early, again.key


def test_a_reopened_group_whose_resubmission_exhausts_is_abandoned_despite_its_cancelled_surplus():
    d, early, key = _reopened(oversample=1)  # the group's second sample was cut as surplus
    acts = d.finish(key, status=Status.INFRA_ERROR, reward=None)
    (ab,) = of(Abandon, acts)
    (emit,) = of(Emit, acts)
    assert ab.group == early and emit.step == 1 and emit.groups == ()
    assert [(x.group, x.cause) for x in emit.dropped] == [(early, "infra_error")]
    assert emit.record.abandoned == 1


def test_a_batch_cut_by_admit_settles_when_its_reopened_group_is_abandoned():
    d, early, key = _reopened(batch_size=2, admit=1)
    cut = [x for x in d.sched._batches[1].dropped]
    assert [x.cause for x in cut] == ["surplus"]  # the other group was cut when `early` completed
    acts = d.finish(key, status=Status.INFRA_ERROR, reward=None)
    (emit,) = of(Emit, acts)
    assert emit.groups == () and emit.record.abandoned == 1
    assert sorted(x.cause for x in emit.dropped) == ["infra_error", "surplus"]


def test_a_reopened_group_completes_again_and_trains():
    d, early, key = _reopened(batch_size=2, admit=1)
    (emit,) = of(Emit, d.finish(key))
    assert [g.group for g in emit.groups] == [early] and emit.groups[0].samples == (key,)
    assert [x.cause for x in emit.dropped] == ["surplus"] and emit.record.abandoned == 0


def test_stream_abandons_a_reopened_group_instead_of_keeping_it_forever():
    d = _stream(groups=1, oversample=1, inflight_samples=2, max_lag=1, ahead=1, max_attempts=1)
    d.register(0, n=1)
    (g,) = d.groups()
    d.finish(d.running_of(g)[0], oldest=0)  # complete; its sibling is cut as surplus
    acts = d.handover(0, updates=2)  # stale at consumption: re-opened and resubmitted
    (again,) = [s for s in of(Submit, acts) if s.cause == "stale"]
    acts = d.finish(again.key, status=Status.INFRA_ERROR, reward=None)
    assert [a.group for a in of(Abandon, acts)] == [g]
    (emit,) = of(Emit, acts)  # nothing left to run: the step ends, reporting the drop
    assert emit.groups == () and [(x.group, x.cause) for x in emit.dropped] == [(g, "infra_error")]
    assert d.sched.live_groups() == frozenset()


def test_a_completed_rollout_without_a_reward_is_a_failed_attempt_not_a_failed_step():
    d = _one_group(groups=2, max_attempts=2)
    a, b = d.running()
    acts = d.finish(a, status=Status.COMPLETED, reward=None)
    (sub,) = of(Submit, acts)
    assert of(Discard, acts) == [Discard(a, "unscored")] and sub.cause == "unscored"
    d.finish(b)
    (emit,) = of(Emit, d.finish(sub.key))
    assert emit.record.resubmitted["unscored"] == 1 and len(emit.groups) == 1


def test_every_task_ends_in_exactly_one_emit_trained_or_dropped():
    d = Driver(groups=1, ahead=0, max_lag=0, max_attempts=1, admit=2, batch_size=3)
    d.open()
    d.register(0, n=3)
    d.handover(0)
    g0, g1, g2 = d.groups()
    d.finish_group(g0)
    d.finish(d.running_of(g1)[0], status=Status.INFRA_ERROR, reward=None)  # abandoned
    (emit,) = of(Emit, d.finish_group(g2))
    assert [g.task.id for g in emit.groups] == ["t0.0", "t0.2"]
    assert [(x.task.id, x.cause) for x in emit.dropped] == [("t0.1", "infra_error")]


def test_a_short_first_batch_does_not_shrink_the_stream_target_or_the_step():
    """A resumed epoch registers the tasks carried over as a short batch first; without
    batch_size the largest batch so far sizes the in-flight target and the step."""
    d = _stream(groups=1, ahead=1, max_lag=1)
    d.register(0, n=1)
    assert d.sched.target == 2 and d.sched._admit_default == 1
    d.register(1, n=3)
    assert d.sched.target == 6 and d.sched.in_flight + d.sched.credits == 6
    assert d.sched.in_flight == 4 and d.sched._admit_default == 3
