"""Liveness of the scheduling state machine: progress, not only invariants.

Under any sequence of outcomes (statuses, rewards or none, stale results, re-checks at
consumption, weight pushes, timeouts, late results of cancelled attempts), in both admission
modes, with or without oversample and `admit`: once the sources stop producing new work (no
more registrations), every step the trainer hands over is emitted or failed with a cause
within a bounded number of events, and every registered task of the open epoch ends exactly
once: trained in one step, or dropped with a cause (abandoned after `max_attempts`, or cut
as surplus by `admit`).
"""

import os
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.driver import Emit, Fail, Submit, of
from tests.unit.test_scheduler_properties import Run, configs

EXAMPLES = int(os.environ.get("ROLLSTREAM_PROPERTY_EXAMPLES", "150"))


class Drain:
    """The trainer keeps calling for steps while the sources finish what is in flight."""

    def __init__(self, run: Run) -> None:
        self.run, self.d, self.cfg = run, run.d, run.cfg
        self.stream = self.cfg["admission"] == "stream"
        self._seen, self._ended = run.opened_at, 0

    def registered(self) -> Counter:
        """Tasks registered in the open epoch (as `t{batch}.{i}`), with multiplicity."""
        return Counter(f"t{b}.{i}" for b in range(self.run.next_batch)
                       for i in range(self.cfg["batch_size"]))

    def ended(self) -> Counter:
        """Tasks of the open epoch that ended: trained in a step or dropped with a cause."""
        out: Counter = Counter()
        for emit in of(Emit, self.d.actions[self.run.opened_at:]):
            out.update(g.task.id for g in emit.groups)
            out.update(g.task.id for g in emit.dropped)
        return out

    def _outstanding(self) -> int:
        """Registered tasks of the open epoch not ended yet (counted incrementally)."""
        new = self.d.actions[self._seen:]
        self._seen = len(self.d.actions)
        for emit in of(Emit, new):
            self._ended += len(emit.groups) + len(emit.dropped)
        return self.run.next_batch * self.cfg["batch_size"] - self._ended

    def work_left(self) -> bool:
        sched = self.d.sched
        if sched._broken is not None:
            return False  # every later handover fails with the source's traceback
        if self.stream:
            return self._outstanding() > 0
        return self.d.step + 1 < self.run.next_batch

    def one_event(self) -> bool:
        """One event of the drain; whether it made progress (a result arrived, something
        was submitted, or a task ended)."""
        d, sched = self.d, self.d.sched
        before, outstanding = len(d.actions), self._outstanding()
        if d.running() and sched.pending_step is not None:
            self.run.op_finish()
            return True
        if sched.pending_step is None:
            self.run.op_handover()  # its updates jump, and the run's end it may name
        elif self.cfg["timeout_s"] is not None and d.running():
            d.tick(self.cfg["timeout_s"])
        else:
            d.tick(1.0)
        new = d.actions[before:]
        return bool(of(Submit, new)) or self._outstanding() < outstanding or (
            not self.stream and bool(of(Emit, new) or of(Fail, new)))

    def until_done(self) -> None:
        """Drain. Each sample can fail `max_attempts` times and go stale a few times, so the
        budget is a generous multiple of the work outstanding; three events in a row
        without progress (nothing running can end the pending step) is a stall."""
        size = self.cfg["groups"] + self.cfg["oversample"]
        budget = 50 + 8 * size * (self.cfg["max_attempts"] + 2) * (
            self.run.next_batch * self.cfg["batch_size"] + len(self.d.running()))
        events = idle = 0
        while self.work_left() or self.d.sched.pending_step is not None:
            idle = 0 if self.one_event() else idle + 1
            self.run.check()
            events += 1
            assert idle < 3, (
                f"stalled: step {self.d.sched.pending_step} pending, {len(self.d.running())} "
                f"running, {self._outstanding()} tasks outstanding ({self.cfg})")
            assert events <= budget, f"no progress after {events} events ({self.cfg})"


@st.composite
def tight_configs(draw):
    """Configs where re-checks bite: rollouts submitted ahead, `max_lag` at its minimum,
    a tail cut by oversample or `admit`, few attempts."""
    cfg = draw(configs())
    cfg["ahead"] = draw(st.integers(1, 2))
    cfg["max_lag"] = cfg["ahead"] + cfg["sync_every"] - 1
    cfg["max_attempts"] = draw(st.integers(1, 2))
    if draw(st.booleans()):
        cfg["batch_size"] = draw(st.integers(2, 3))
        cfg["admit"] = draw(st.integers(1, cfg["batch_size"] - 1))
    else:
        cfg["oversample"] = draw(st.integers(1, 2))
        if cfg["admission"] == "stream":
            size = cfg["groups"] + cfg["oversample"]
            cfg["inflight_samples"] = size * draw(st.integers(1, 3))
            if cfg.get("backup_limit") is not None:
                cfg["backup_limit"] = max(cfg["backup_limit"], cfg["oversample"])
    return cfg


def drain_after(run: Run, events: int) -> None:
    for _ in range(events):
        run.step()
    drain = Drain(run)
    drain.until_done()
    if run.d.sched._broken is None:
        left = drain.registered() - drain.ended()
        twice = drain.ended() - drain.registered()
        assert not left, f"tasks that never ended: {sorted(left)}"
        assert not twice, f"tasks that ended twice: {sorted(twice)}"


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), data=st.data())
def test_every_step_ends_and_every_task_ends_once_after_the_sources_stop(cfg, data):
    drain_after(Run(cfg, data), data.draw(st.integers(0, 60)))


@settings(max_examples=3 * EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=tight_configs(), data=st.data())
def test_liveness_holds_where_re_checks_reopen_complete_groups(cfg, data):
    """Updates jump past the bound between handovers, so groups admitted early are re-opened
    at consumption and their resubmissions may exhaust their attempts."""
    drain_after(Run(cfg, data, jumps=st.integers(1, 3)), data.draw(st.integers(0, 60)))
