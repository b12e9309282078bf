"""A discrete-event simulation of the scheduling core on a synthetic workload.

The pure `Scheduler` runs against simulated rollout slots and a simulated trainer on a
virtual clock: session durations are log-normal (heavy tail, capped), statuses follow a
mix, and a cancelled session frees its slot at once. Nothing sleeps, so hundreds of steps
of a heavy-tailed workload run in a second; the records are exactly what the scheduler
would report against real workers with the same timings.
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

    def duration(self, rng: random.Random) -> float:
        return min(rng.lognormvariate(math.log(self.median_s), self.sigma), self.cap * self.median_s)

    def outcome(self, rng: random.Random) -> tuple[Status, float | None]:
        status = Status(rng.choices(list(self.status_mix), weights=list(self.status_mix.values()))[0])
        if status in (Status.INFRA_ERROR, Status.CANCELLED):
            return status, None
        return status, float(rng.random() < 0.5)


@dataclass
class StepReport:
    step: int
    time_s: float
    record: SchedulerRecord


class Simulation:
    """Runs the scheduler against `workload.slots` simulated slots and a trainer."""

    def __init__(self, config: SchedulerConfig, workload: Workload) -> None:
        self.config, self.work = config, workload
        self.sched = Scheduler(config)
        self.rng = random.Random(workload.seed)
        self.now = 0.0
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._queue: deque[Submit] = deque()  # submitted, waiting for a slot
        self._running: dict[SampleKey, float] = {}  # key -> start time
        self._cancelled: set[SampleKey] = set()
        self.busy_s = 0.0
        self.wasted_s = 0.0
        self._next_batch = 0
        self._updates = 0

    # ------------------------------------------------------------------ driving

    def steps(self, n: int) -> Iterator[StepReport]:
        """Run `n` trainer steps, yielding each step's report as it is emitted."""
        acts = self.sched.handle(Open(0), self.now)
        for _ in range(self.config.ahead + 1):
            acts += self._register()
        acts += self.sched.handle(Handover(0, self._updates), self.now)
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
        tasks = tuple(Task(f"task-{b}-{i}") for i in range(self.work.batch_size))
        return self.sched.handle(Register(b, tasks), self.now)

    def _trained(self, step: int) -> list:
        self._updates += 1
        acts = self._register()  # the trainer's prefetch reads the next batch
        return acts + self.sched.handle(Handover(step + 1, self._updates), self.now)

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
            self._running[sub.key] = self.now
            version = self.sched.served
            self._at(self.now + self.work.duration(self.rng), "finish", (sub.key, version))
            if sub.deadline is not None:
                self._at(sub.deadline, "tick", None)

    def _cancel(self, key: SampleKey) -> None:
        start = self._running.pop(key, None)
        if start is None:
            self._cancelled.add(key)  # still queued: skipped when a slot frees
            return
        self.wasted_s += self.now - start
        self.busy_s += self.now - start

    def _finish(self, payload) -> list:
        key, version = payload
        start = self._running.pop(key, None)
        if start is None:
            return []  # cancelled while it ran; its slot was freed then
        self.busy_s += self.now - start
        status, reward = self.work.outcome(self.rng)
        return self.sched.handle(Finish(key, status, reward, version), self.now)


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
    }
