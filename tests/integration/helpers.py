"""A minimal trainer for integration tests: drives one shard through TaskWriter."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

from pipeline import wire
from pipeline.keys import Keys
from pipeline.sessions import Task
from producers.trainer_link import TaskWriter


def tasks_of(batch: int, n: int) -> list[Task]:
    return [Task(f"t{batch}.{i}", {"batch": batch}) for i in range(n)]


class Trainer:
    """Opens an epoch, registers batches `ahead` early, hands over each step with
    `updates == first_update + step` (announcing that version on the weights stream first)
    and waits for its Ready."""

    def __init__(self, r, keys: Keys, *, shard: int = 0, tasks: int = 3, ahead: int = 1,
                 epoch: int = 0, batch: Callable[[int], Sequence[Task]] | None = None,
                 first_update: int = 0) -> None:
        self.writer = TaskWriter(r, keys, shard)
        self.ahead = ahead
        self.epoch = epoch
        self.batch = batch or (lambda b: tasks_of(b, tasks))
        self.readies: list[wire.Ready] = []
        self.registered: list[Task] = []
        self.step = -1
        self.first_update = first_update

    def open(self) -> None:
        self.writer.open(self.epoch)
        for b in range(self.ahead + 1):
            self._register(b)

    def _register(self, b: int) -> None:
        tasks = list(self.batch(b))
        self.registered += tasks
        self.writer.register(self.epoch, b, tasks)

    def handover(self) -> int:
        self.step += 1
        updates = self.first_update + self.step
        if updates > 0:
            self.writer.announce_weights(updates, f"mem://{updates}")
        self.writer.handover(self.epoch, self.step, updates=updates, published=updates)
        return self.step

    def wait(self, timeout_s: float = 30.0) -> wire.Ready:
        ready = self.writer.wait_ready(self.epoch, self.step, timeout_s)
        self.readies.append(ready)
        self._register(self.step + self.ahead + 1)
        return ready

    def run(self, steps: int, timeout_s: float = 30.0, train_s: float = 0.0) -> list[wire.Ready]:
        """`steps` handovers, each followed by `train_s` seconds of "training"."""
        self.open()
        for _ in range(steps):
            self.handover()
            self.wait(timeout_s)
            time.sleep(train_s)
        return self.readies


def admitted_tasks(readies: Sequence[wire.Ready]) -> list[str]:
    return [task for ready in readies for _, _, task in ready.record.admitted]


def resubmitted(readies: Sequence[wire.Ready]) -> Counter:
    total: Counter = Counter()
    for ready in readies:
        total.update(ready.record.resubmitted)
    return +total


def entries(r, stream: str) -> list[tuple[bytes, dict]]:
    return r.xrange(stream)


def wait_until(predicate, timeout_s: float, what: str) -> None:
    """Poll `predicate` until it holds; fail naming `what` after `timeout_s`."""
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
