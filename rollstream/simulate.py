"""A discrete-event simulation of the scheduling core on a synthetic workload.

The pure `Scheduler` runs against simulated rollout slots and a simulated trainer on a
virtual clock: session durations are log-normal (heavy tail, capped; or, given `durations`,
a function of each attempt: `rollstream simulate --frontier` runs `SleepSource`'s, the
bench's own sessions), statuses follow a mix, and a cancelled session frees its slot at
once. Nothing sleeps, so hundreds of steps
of a heavy-tailed workload run in a second; the records are exactly what the scheduler
would report against real workers with the same timings.

`slot_accounting` splits the slot-seconds of a run (simulated here, measured by `rollstream
bench schedule`) into trained, wasted and pending work, one definition for both.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from pipeline.config import SchedulerConfig
from pipeline.scheduler import (
    Cancel, Emit, Fail, Finish, Handover, Open, PushWeights, Register, SampleKey, Scheduler,
    SchedulerRecord, Submit, Tick,
)
from pipeline.sessions import Status, Task


def task_id(batch: int, index: int) -> str:
    """The id of task `index` of batch `batch` (here and in `rollstream bench schedule`, so
    that a duration drawn from an attempt's key is the same in both)."""
    return f"{batch}.{index}"


@dataclass(frozen=True)
class Workload:
    """The synthetic rollouts and trainer."""

    slots: int = 64
    batch_size: int = 8
    median_s: float = 20.0
    sigma: float = 1.0
    cap: float = 20.0  # longest session, in medians
    train_s: float = 10.0  # one trainer step
    status_mix: Mapping[str, float] = field(default_factory=lambda: {
        "completed": 0.90, "agent_error": 0.03, "truncated": 0.04, "infra_error": 0.03})
    seed: int = 0
    call_at_end: bool = False  # a session's one call is made as it ends (SleepSource, calls=1)

    def duration(self, rng: random.Random) -> float:
        return min(rng.lognormvariate(math.log(self.median_s), self.sigma), self.cap * self.median_s)

    def outcome(self, rng: random.Random) -> tuple[Status, float | None]:
        status = Status(rng.choices(list(self.status_mix), weights=list(self.status_mix.values()))[0])
        if status in (Status.INFRA_ERROR, Status.CANCELLED):
            return status, None
        return status, float(rng.random() < 0.5)


@dataclass(frozen=True)
class Span:
    """One attempt's use of a slot: `busy_s` within the measured window, `length_s` its
    whole session time when it ended by itself (None: cancelled), `ended` whether it ended
    inside the window."""

    group: int
    sample: int
    attempt: int
    busy_s: float
    length_s: float | None
    ended: bool


FATES = ("trained", "cancelled", "superseded", "surplus", "waiting", "running")
"""What became of an attempt's slot-seconds (`slot_accounting`): trained; wasted as
cancelled, superseded or surplus; pending at the end as `waiting` (finished, its group not
trained yet) or `running`."""


def slot_accounting(spans: list[Span], trained: set[tuple[int, int, int]]) -> dict:
    """Slot-seconds by fate. An attempt is trained when `(group, sample, attempt)` is in
    `trained`; it is wasted when it ended in the window untrained and never will train:
    cancelled (surplus, stale, abandoned), superseded by a later attempt of its sample (stale
    or failed), or a surplus finisher of a trained group; anything else is pending at the
    end (in flight, or admitted into a group not yet trained). `waste_share` is wasted over
    busy slot-seconds; `trained_length_bias` the mean session time of the trained attempts
    over that of every attempt that ended by itself (1: no bias toward short sessions; a
    policy that cancels long sessions before they end hides part of its bias from this
    ratio, so `rollstream bench schedule` also reports the trained mean over the workload's
    own mean), `trained_length_s` that trained mean, and `slot_s` the slot-seconds of each
    of `FATES`."""
    latest: dict[tuple[int, int], int] = {}
    for s in spans:
        latest[(s.group, s.sample)] = max(latest.get((s.group, s.sample), -1), s.attempt)
    trained_groups = {g for g, _, _ in trained}
    fates = dict.fromkeys(FATES, 0.0)
    lengths: list[float] = []
    trained_lengths: list[float] = []
    for s in spans:
        fate = _fate(s, trained, latest, trained_groups)
        fates[fate] += s.busy_s
        if s.length_s is not None:
            lengths.append(s.length_s)
            if fate == "trained":
                trained_lengths.append(s.length_s)
    busy = sum(fates.values())
    wasted = fates["cancelled"] + fates["superseded"] + fates["surplus"]
    bias = None
    if lengths and trained_lengths:
        bias = round((sum(trained_lengths) / len(trained_lengths)) / (sum(lengths) / len(lengths)), 4)
    trained_mean = sum(trained_lengths) / len(trained_lengths) if trained_lengths else None
    return {"busy_slot_s": round(busy, 3), "wasted_slot_s": round(wasted, 3),
            "waste_share": round(wasted / busy, 4) if busy else 0.0,
            "trained_length_bias": bias, "trained_length_s": trained_mean,
            "slot_s": fates}


def _fate(s: Span, trained: set[tuple[int, int, int]], latest: dict[tuple[int, int], int],
          trained_groups: set[int]) -> str:
    """Which of `FATES` an attempt's slot-seconds met."""
    if (s.group, s.sample, s.attempt) in trained:
        return "trained"
    if not s.ended:
        return "running"
    if s.length_s is None:
        return "cancelled"
    if s.attempt < latest[(s.group, s.sample)]:
        return "superseded"
    return "surplus" if s.group in trained_groups else "waiting"


@dataclass
class StepReport:
    step: int
    time_s: float
    record: SchedulerRecord


class Simulation:
    """Runs the scheduler against `workload.slots` simulated slots and a trainer. An
    attempt's duration comes from `durations` when given (a function of its `Submit`: the
    bench draws `SleepSource`'s own, keyed by the attempt), else from `workload`'s
    generator."""

    def __init__(self, config: SchedulerConfig, workload: Workload,
                 durations: Callable[[Submit], float] | None = None) -> None:
        self.config, self.work = config, workload
        self._durations = durations
        self.sched = Scheduler(config)
        self.rng = random.Random(workload.seed)
        self.now = 0.0
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._queue: deque[Submit] = deque()  # submitted, waiting for a slot
        self._running: dict[SampleKey, tuple[float, float]] = {}  # key -> start, length
        self._cancelled: set[SampleKey] = set()
        self.busy_s = 0.0
        self.wasted_s = 0.0
        self.spans: list[Span] = []  # every attempt that ended
        self.trained: set[tuple[int, int, int]] = set()  # (group, sample, attempt) emitted
        self._next_batch = 0
        self._updates = 0
        self._steps = 0  # the run's length, its handovers tell the scheduler

    # ------------------------------------------------------------------ driving

    def steps(self, n: int) -> Iterator[StepReport]:
        """Run `n` trainer steps, yielding each step's report as it is emitted."""
        acts = self.sched.handle(Open(0), self.now)
        for _ in range(self.config.registered_ahead + 1):
            acts += self._register()
        self._steps = n
        acts += self._handover(0)
        emitted = 0
        while emitted < n:
            for emit in self._apply(acts):
                emitted += 1
                yield StepReport(emit.step, self.now, emit.record)
                self._at(self.now + self.work.train_s, "train", emit.step)
            if emitted == n:
                break
            if not self._events:
                raise RuntimeError("the simulation ran out of events before the step was emitted")
            self.now, _, kind, payload = heapq.heappop(self._events)
            if kind == "finish":
                acts = self._finish(payload)
            elif kind == "train":
                acts = self._trained(payload)
            else:
                acts = self.sched.handle(Tick(), self.now)

    def _register(self) -> list:
        b = self._next_batch
        self._next_batch += 1
        tasks = tuple(Task(task_id(b, i)) for i in range(self.work.batch_size))
        return self.sched.handle(Register(b, tasks), self.now)

    def _trained(self, step: int) -> list:
        self._updates += 1
        acts = self._register()  # the trainer's prefetch reads the next batch
        return acts + self._handover(step + 1)

    def _handover(self, step: int) -> list:
        """The trainer calls for `step`, saying how many steps of the run follow it."""
        return self.sched.handle(Handover(step, self._updates, steps_left=self._steps - step - 1), self.now)

    # ------------------------------------------------------------------ slots

    def _at(self, t: float, kind: str, payload: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def _apply(self, actions: list) -> list[Emit]:
        emits = []
        for a in actions:
            if isinstance(a, Submit):
                self._queue.append(a)
            elif isinstance(a, Cancel):
                self._cancel(a.key)
            elif isinstance(a, Emit):
                emits.append(a)
                self.trained.update((k.group, k.sample, k.attempt)
                                    for g in a.groups for k in g.samples)
            elif isinstance(a, Fail):
                raise RuntimeError(f"step {a.step} failed: {a.error}")
            elif isinstance(a, PushWeights):
                pass  # the simulated engines serve the new version at once
        self._fill()
        return emits

    def _fill(self) -> None:
        while self._queue and len(self._running) < self.work.slots:
            sub = self._queue.popleft()
            if sub.key in self._cancelled:
                self._cancelled.discard(sub.key)
                continue
            length = self._durations(sub) if self._durations else self.work.duration(self.rng)
            self._running[sub.key] = (self.now, length)
            version = self.sched.served
            self._at(self.now + length, "finish", (sub.key, version))
            if sub.deadline is not None:
                self._at(sub.deadline, "tick", None)

    def _cancel(self, key: SampleKey) -> None:
        entry = self._running.pop(key, None)
        if entry is None:
            self._cancelled.add(key)  # still queued: skipped when a slot frees
            return
        self.wasted_s += self.now - entry[0]
        self.busy_s += self.now - entry[0]
        self.spans.append(Span(key.group, key.sample, key.attempt, self.now - entry[0], None, True))

    def _finish(self, payload) -> list:
        key, version = payload
        entry = self._running.pop(key, None)
        if entry is None:
            return []  # cancelled while it ran; its slot was freed then
        self.busy_s += entry[1]
        self.spans.append(Span(key.group, key.sample, key.attempt, entry[1], entry[1], True))
        if self.work.call_at_end:
            version = self.sched.served
        status, reward = self.work.outcome(self.rng)
        return self.sched.handle(Finish(key, status, reward, version), self.now)

    def accounting(self) -> dict:
        """`slot_accounting` of the attempts so far; those still running count as pending."""
        running = [Span(k.group, k.sample, k.attempt, self.now - start, None, False)
                   for k, (start, _) in self._running.items()]
        return slot_accounting(self.spans + running, self.trained)


def run(config: SchedulerConfig, workload: Workload, steps: int,
        on_step: Callable[[StepReport], None] | None = None) -> dict:
    """Simulate `steps` trainer steps; return a summary."""
    sim = Simulation(config, workload)
    reports = []
    for report in sim.steps(steps):
        reports.append(report)
        if on_step is not None:
            on_step(report)
    elapsed = max(sim.now, 1e-9)
    trained = sum(r.record.groups for r in reports) * config.groups
    return {
        "steps": steps,
        "virtual_s": round(elapsed, 3),
        "trained_samples_per_s": round(trained / elapsed, 4),
        "slot_utilization": round(sim.busy_s / (elapsed * workload.slots), 4),
        "wasted_slot_s": round(sim.wasted_s, 3),
        "trainer_wait_share": round(sum(r.record.waited for r in reports) / elapsed, 4),
        "lag_max": max((r.record.lag for r in reports), default=0),
        "groups_abandoned": sum(r.record.abandoned for r in reports),
        **{k: v for k, v in sim.accounting().items() if k in ("waste_share", "trained_length_bias")},
    }
