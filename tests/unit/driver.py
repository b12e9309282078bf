"""A thin test driver around the pure scheduler: it keeps the clock, the actions and the
set of samples in flight, as the admission consumer's shell would."""

from __future__ import annotations

from pipeline.config import SchedulerConfig
from pipeline.scheduler import (
    Abandon, Cancel, Close, Discard, Emit, Fail, Finish, Handover, Open, Publish, PushWeights,
    Register, SampleKey, Scheduler, Submit, Tick,
)
from pipeline.sessions import Status, Task


class Driver:
    def __init__(self, **config) -> None:
        self.sched = Scheduler(SchedulerConfig(**config))
        self.now = 0.0
        self.actions: list = []
        self.submitted: dict[SampleKey, Submit] = {}
        self.ended: dict[SampleKey, str] = {}  # key -> "cancel:<reason>" or "finish"
        self._live: set[SampleKey] = set()  # submitted, not ended
        self.step = -1
        self.updates = 0

    # events -------------------------------------------------------------
    def send(self, event, dt: float = 0.0) -> list:
        self.now += dt
        acts = self.sched.handle(event, self.now)
        for a in acts:
            if isinstance(a, Submit):
                assert a.key not in self.submitted, f"{a.key} submitted twice"
                self.submitted[a.key] = a
                self._live.add(a.key)
            elif isinstance(a, Cancel):
                assert a.key in self.submitted and a.key not in self.ended, a
                self.ended[a.key] = f"cancel:{a.reason}"
                self._live.discard(a.key)
        self.actions.extend(acts)
        return acts

    def open(self, epoch: int = 0) -> list:
        return self.send(Open(epoch))

    def register(self, batch: int, n: int = 2) -> list:
        return self.send(Register(batch, tuple(Task(f"t{batch}.{i}") for i in range(n))))

    def handover(self, step: int | None = None, updates: int | None = None, **kw) -> list:
        self.step = self.step + 1 if step is None else step
        self.updates = self.updates + (0 if self.step == 0 else 1) if updates is None else updates
        return self.send(Handover(self.step, self.updates, **kw))

    def finish(self, key: SampleKey, status=Status.COMPLETED, reward=1.0, oldest=None,
               error=None, dt: float = 0.0) -> list:
        acts = self.send(Finish(key, Status(status), reward, oldest, error), dt)
        if not any(isinstance(a, Discard) and a.key == key and a.reason == "superseded" for a in acts):
            assert key not in self.ended, f"{key} ended twice"
            self.ended[key] = "finish"
            self._live.discard(key)
        return acts

    def tick(self, dt: float) -> list:
        return self.send(Tick(), dt)

    def publish(self, version: int) -> list:
        return self.send(Publish(version))

    def close(self) -> list:
        return self.send(Close())

    # queries ------------------------------------------------------------
    def running(self) -> list[SampleKey]:
        return sorted(self._live)

    def running_of(self, group: int) -> list[SampleKey]:
        return [k for k in self.running() if k.group == group]

    def groups(self) -> list[int]:
        return sorted({k.group for k in self.submitted})

    def finish_group(self, group: int, n: int | None = None, **kw) -> list:
        acts = []
        for key in self.running_of(group)[:n]:
            acts += self.finish(key, **kw)
        return acts


def of(kind, actions) -> list:
    return [a for a in actions if isinstance(a, kind)]


__all__ = [
    "Abandon", "Cancel", "Close", "Discard", "Driver", "Emit", "Fail", "PushWeights",
    "SampleKey", "Status", "Submit", "of",
]
