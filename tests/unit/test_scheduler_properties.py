"""Property tests of the scheduling state machine over random event sequences: random
configs, statuses, staleness, timeouts, duplicate deliveries, broken sources and epochs."""

import os
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.scheduler import _IDLE, _RUNNING, FAILURE_CAUSE, Finish
from tests.unit.driver import Cancel, Discard, Driver, Emit, Status, Submit, of

FAILURES = set(FAILURE_CAUSE.values()) | {"unscored", "timeout"}
EXAMPLES = int(os.environ.get("ROLLSTREAM_PROPERTY_EXAMPLES", "150"))  # raise for a soak run


@st.composite
def configs(draw, admission=None, replacing=False):
    """A random scheduler config; `replacing`: a stream config with `oversample_start`
    "replace" that `Run.replace_first` can open with (two or more samples a group, an extra
    one, `replace_ahead` 1)."""
    admission = "stream" if replacing else admission or draw(st.sampled_from(["batch", "stream"]))
    groups = draw(st.integers(1 + replacing, 3))
    oversample = draw(st.integers(int(replacing), 2))
    ahead = draw(st.integers(0, 2))
    sync_every = draw(st.integers(1, 2))
    batch = draw(st.integers(1, 3))
    cfg = dict(
        admission=admission, groups=groups, oversample=oversample, ahead=ahead,
        sync_every=sync_every, max_lag=ahead + sync_every - 1 + draw(st.integers(0, 1)),
        max_attempts=draw(st.integers(1, 3)),
        timeout_s=draw(st.sampled_from([None, 4.0])),
        truncation=draw(st.sampled_from(["mask", "score", "zero"])),
        admit=draw(st.sampled_from([None, *range(1, batch + 1)])),
        batch_size=batch,
    )
    if admission == "stream":
        cfg["inflight_samples"] = (groups + oversample) * draw(st.integers(1, 4)) + draw(
            st.integers(0, groups + oversample - 1))
        cfg["oversample_start"] = "replace" if replacing else draw(
            st.sampled_from(["group", "straggler", "replace"][: 2 + (oversample > 0)]))
        if cfg["oversample_start"] == "replace":
            cfg["replace_ahead"] = 1.0 if replacing else draw(st.sampled_from([0.5, 1.0]))
        cfg["group_start"] = draw(st.sampled_from(["any", "handover"]))
        if cfg["oversample_start"] == "straggler":
            cfg["backup_limit"] = draw(st.sampled_from([None, max(1, oversample), oversample + 1]))
        if oversample:
            cfg["end_backups"] = draw(st.sampled_from([0, 0, 1, 2]))
    cfg["stale_running"] = draw(st.sampled_from(["cancel", "finish"]))
    return cfg


class Run:
    """Drives one scheduler with random events and checks the invariants after each."""

    def __init__(self, cfg: dict, data, jumps=st.integers(0, 2)) -> None:  # noqa: B008 (a strategy is immutable)
        self.cfg, self.data = cfg, data
        self.jumps = jumps  # updates between two handovers
        self.d = Driver(**cfg)
        self.epoch = 0
        self.d.open(0)
        self.opened_at = len(self.d.actions)  # the open epoch's actions start here
        self.next_batch = 0
        self.oldest: dict = {}  # key -> the oldest version its result reported
        self.admitted: set = set()
        self.failures: Counter = Counter()
        self.timeouts: Counter = Counter()  # timeout cancels per (epoch, group, sample)
        self._seen = 0  # actions already checked
        self.final: int | None = None  # the run's last step, as the latest handover said

    def draw(self, strategy):
        return self.data.draw(strategy)

    def step(self) -> None:
        d, sched = self.d, self.d.sched
        ops = ["tick", "publish"]
        if self.next_batch <= d.step + self.cfg["ahead"] + 3:  # a trainer prefetches a few
            ops.append("register")
        if d.running():
            ops += ["finish"] * 6
        if [k for k, how in d.ended.items() if how.startswith("cancel")]:
            ops.append("late")
        if sched.pending_step is None and (
                self.cfg["admission"] == "stream" or d.step + 1 < self.next_batch):
            ops += ["handover"] * 2
        ops += ["error", "reopen"]
        op = self.draw(st.sampled_from(ops))
        if op in ("error", "reopen") and self.draw(st.integers(0, 9)) > 0:
            op = "tick"  # rare
        getattr(self, "op_" + op)()
        self.check()

    def replace_first(self) -> None:
        """The opening of a `configs(replacing=True)` run: the first running sample finishes
        at version 0 and the trainer, called for step 0 after `max_lag` updates, waits for
        its groups; the next handover would make that admitted member stale, so it gets a
        replacement (the random events after this one start from a replaced member)."""
        self.op_register()
        key = self.d.running()[0]
        self.d.finish(key, oldest=0)
        self.oldest[key] = 0
        self.d.handover(0, updates=self.cfg["max_lag"])
        self.check()
        assert [k for g in self.d.sched._groups.values() for k in g.replaced] == [key.sample]

    # ops -----------------------------------------------------------------
    def op_register(self):
        self.d.register(self.next_batch, n=self.cfg["batch_size"])
        self.next_batch += 1

    def op_tick(self):
        self.d.tick(self.draw(st.sampled_from([0.5, 1.0, 3.0])))

    def op_publish(self):
        self.d.publish(self.d.sched.served + self.draw(st.integers(0, 1)))

    def op_handover(self):
        sched = self.d.sched
        if self.cfg.get("oversample_start") == "straggler":  # checked as the handover's own
            on_handover = sched._on_handover  # rules end, before later rules change the groups

            def checked(ev, out):
                on_handover(ev, out)
                if not sched._broken:
                    assert stragglers_left(sched) == [], "a group due a backup left without it"

            sched._on_handover = checked
        left = self.draw(st.sampled_from([None, 0, 1, 2, 3]))
        self.d.handover(updates=self.d.updates + self.draw(self.jumps), steps_left=left)
        self.final = None if left is None else self.d.step + left
        sched.__dict__.pop("_on_handover", None)
        if self.cfg["admission"] == "stream":
            assert sched._broken or stale_left(sched) == [], "a stale member left in a waiting group"

    def op_finish(self):
        d = self.d
        key = self.draw(st.sampled_from(d.running()))
        sub = d.submitted[key]
        status = self.draw(st.sampled_from(list(Status)))
        reward = self.draw(st.sampled_from([None, 0.0, 1.0]))
        oldest = self.draw(st.integers(sub.submitted_version, max(d.sched.served, sub.submitted_version)))
        acts = d.finish(key, status=status, reward=reward, oldest=oldest, dt=0.1)
        discards = [a.reason for a in of(Discard, acts) if a.key == key]
        if discards and discards[0] in FAILURES:
            self.failures[(key.epoch, key.group, key.sample)] += 1
        if not discards:
            self.oldest[key] = oldest

    def op_late(self):
        d = self.d
        key = self.draw(st.sampled_from(sorted(k for k, how in d.ended.items()
                                               if how.startswith("cancel"))))
        acts = d.sched.handle(Finish(key, Status.COMPLETED, 1.0, 0), d.now)
        assert acts == [Discard(key, "superseded")]

    def op_error(self):
        if self.d.running():
            self.d.finish(self.d.running()[0], error="Traceback: boom")

    def op_reopen(self):
        self.epoch += 1
        self.d.open(self.epoch)
        self.opened_at = len(self.d.actions)
        self.d.step, self.next_batch = -1, 0

    # invariants ----------------------------------------------------------
    def check(self) -> None:
        d, cfg = self.d, self.cfg
        new = d.actions[self._seen:]
        self._seen = len(d.actions)
        for emit in of(Emit, new):
            rec = emit.record
            assert rec.lag <= cfg["max_lag"]
            for g in emit.groups:
                assert len(g.samples) == cfg["groups"]
                assert len({k.sample for k in g.samples}) == cfg["groups"]
                assert all(k.group == g.group for k in g.samples)
                if cfg["admission"] == "batch":
                    assert g.batch == emit.step
                for k in g.samples:
                    ident = (k.epoch, k.group, k.sample)
                    assert ident not in self.admitted, "sample admitted twice"
                    self.admitted.add(ident)
                    assert d.ended.get(k) == "finish"
                    assert rec.updates - self.oldest[k] <= cfg["max_lag"]
        for a in new:
            ident = (a.key.epoch, a.key.group, a.key.sample) if isinstance(a, (Submit, Cancel)) else None
            if isinstance(a, Submit) and a.cause is None and a.key.attempt > 0:
                # oversample_start="replace": a replaced member's slot carries a new sample
                # (a first submission, yet a later attempt), with a failure count of its own
                self.failures.pop(ident, None)
                self.timeouts.pop(ident, None)
            elif isinstance(a, Cancel) and a.reason == "timeout":
                self.timeouts[ident] += 1
        for ident in set(self.failures) | set(self.timeouts):
            assert self.failures[ident] + self.timeouts[ident] <= cfg["max_attempts"]
        sched = d.sched
        assert sched.in_flight == len(d.running())
        if cfg["admission"] == "stream" and sched.target:
            assert sched.in_flight + sched.credits == sched.target, "credits drifted"
            starts = cfg["group_start"] == "any" or len(sched._groups) < max(1, sched._admit_default)
            if sched._tasks and not sched._broken and starts:  # group_start="handover": between
                assert sched.credits < cfg["groups"] + cfg["oversample"]  # handovers, credits wait
        if cfg.get("oversample_start") == "replace":
            assert replacements_left(sched, self.final) == [], "an ageing member left without its replacement"
        if cfg.get("end_backups"):
            assert end_backups_left(sched, self.final) == [], "a group of the run's last steps left without backups"


def stale_left(sched) -> list[tuple[int, int]]:
    """Stream mode, after a handover: the admitted members past the bound in the groups still
    waiting for others (each should have been discarded and resubmitted)."""
    bound = sched.updates - sched.config.max_lag
    return [(g.id, i) for g in sched._groups.values() if not g.complete for i in g.admitted
            if g.samples[i].oldest < bound]


def stragglers_left(sched) -> list[int]:
    """oversample_start="straggler", after a handover: the waiting groups that a look
    through every group finds due a backup (no more than `oversample` running, a member past
    the bound at the next handover) and not backed up, beyond what `backup_limit` leaves
    room for."""
    cfg, horizon = sched.config, sched.updates - sched.config.max_lag + 1
    due = sorted((min(g.samples[i].oldest for i in g.admitted), g.id, g) for g in sched._groups.values()
                 if g.admitted and not g.complete and not g.backed_up
                 and sum(s.state == _RUNNING for s in g.samples) <= cfg.oversample
                 and min(g.samples[i].oldest for i in g.admitted) <= horizon)
    if due and cfg.backup_limit is not None:
        _, _, first = due[0]
        extra = sum(s.state == _IDLE and s.attempt < 0 for s in first.samples[cfg.groups:])
        if sched._backups_in_flight() + extra > cfg.backup_limit:
            return []  # no room for the first in line, so none was backed up
    return [gid for _, gid, _ in due]


def replacements_left(sched, final: int | None) -> list[tuple[int, int]]:
    """oversample_start="replace": the (group, member) pairs that a look through every group
    would give a replacement now (the machine keeps only the groups that may need one); none
    in the run's last step (`final`, as the latest handover said), which no handover follows."""
    target = sched._admit_default
    if sched.pending_step is None or target - len(sched._complete) > sched.config.replace_ahead * target:
        return []
    if final is not None and sched.pending_step >= final:
        return []
    aging, queued = sched.updates - sched.config.max_lag, sched._queued()
    return [(g.id, i) for g in sched._groups.values() if not g.complete for i in g.admitted
            if g.samples[i].oldest <= aging and i not in g.replaced and sched._spare(g, queued)]


def end_backups_left(sched, final: int | None) -> list[int]:
    """end_backups: while the trainer waits for one of the run's last `end_backups` steps
    (`final`: the run's last step), the groups that a look through every group finds not
    complete, not backed up, with samples running and extra samples never run."""
    pending, k = sched.pending_step, sched.config.end_backups
    if pending is None or final is None or pending <= final - k or sched._broken:
        return []
    cfg = sched.config
    return [g.id for g in sched._groups.values()
            if not g.complete and not g.backed_up and any(s.state == _RUNNING for s in g.samples)
            and any(s.state == _IDLE and s.attempt < 0 for s in g.samples[cfg.groups:])]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), data=st.data())
def test_invariants_hold_over_random_event_sequences(cfg, data):
    run = Run(cfg, data)
    for _ in range(data.draw(st.integers(10, 80))):
        run.step()
    acts = run.d.close()
    # every submitted sample ends exactly once (the driver refuses a second end)
    assert set(run.d.submitted) == set(run.d.ended)
    assert run.d.sched.in_flight == 0 and all(isinstance(a, Cancel) for a in acts)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(replacing=True), data=st.data())
def test_invariants_hold_over_random_event_sequences_after_a_replacement(cfg, data):
    """Random events seldom make a replacement (a member aging while the trainer waits), so
    these runs open with one: whatever follows (the replaced member going stale, the
    replacement failing, timeouts, reopened epochs), the invariants hold."""
    run = Run(cfg, data)
    run.replace_first()
    for _ in range(data.draw(st.integers(10, 80))):
        run.step()
    acts = run.d.close()
    assert set(run.d.submitted) == set(run.d.ended)
    assert run.d.sched.in_flight == 0 and all(isinstance(a, Cancel) for a in acts)


@settings(max_examples=EXAMPLES, deadline=None)
@given(cfg=configs(admission="stream"), outcomes=st.lists(st.sampled_from(list(Status)), max_size=120),
       seed=st.integers(0, 2**16))
def test_backfill_conserves_in_flight_samples_exactly(cfg, outcomes, seed):
    """One credit per finished sample whatever its outcome: with tasks always available the
    number of samples in flight never drifts from the target."""
    import random

    rng = random.Random(seed)
    d = Driver(**cfg)
    d.open()
    batch = 0
    size = cfg["groups"] + cfg["oversample"]
    while d.sched.target == 0 or (d.sched.credits >= size and cfg["group_start"] == "any"):
        d.register(batch, n=cfg["batch_size"])
        batch += 1
    target = d.sched.target
    for status in outcomes:
        if len(d.sched._tasks) < 4 * target:
            d.register(batch, n=cfg["batch_size"])
            batch += 1
        if not d.running():  # "handover": the open groups make a step; the trainer's turn
            assert cfg["group_start"] == "handover" and len(d.sched._groups) >= d.sched._admit_default
            break
        d.finish(rng.choice(d.running()), status=status, reward=rng.choice([None, 1.0]))
        assert d.sched.in_flight + d.sched.credits == target, "in-flight samples drifted"
        if cfg["group_start"] == "any":  # "handover": new groups wait for the trainer's
            assert d.sched.credits < size, "credits left idle"
        assert len(d.running()) == d.sched.in_flight
