"""The trainer's side of task registration: `task_ids` and the prefetching task stream.

`TaskStream` wraps any iterable of task batches. Each time it is iterated (a start, or a
resume that reopens it) it opens a new epoch, then reads `ahead` batches beyond the one the
trainer is given and registers each batch as it is read, so when the trainer hands batch i
over, batches i + 1 ... i + ahead are already registered and can be submitted at once.
Nothing is read beyond that: the data position the trainer checkpoints stays its own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from pipeline.sessions import Task

Batch = Any


def task_ids(batch: Batch) -> list[Task]:
    """One task per integer `task_id` row, named by its decimal id."""
    if not isinstance(batch, Mapping) or "task_id" not in batch:
        raise ValueError("task_ids needs a batch mapping with a 'task_id' column")
    ids = batch["task_id"]
    if hasattr(ids, "tolist"):  # a tensor or an array
        ids = ids.tolist()
    tasks = []
    for value in ids:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"task_id rows must be integers, got {value!r}")
        tasks.append(Task(str(value)))
    return tasks


class TaskStream:
    """A re-iterable stream of task batches that registers each batch ahead of its step.

    `open()` is called at the start of each iteration and returns the new epoch;
    `register(epoch, index, tasks)` is called for each batch as it is read.
    """

    def __init__(
        self,
        dataset: Iterable[Batch],
        *,
        ahead: int,
        tasks: Callable[[Batch], Sequence[Task]],
        open: Callable[[], int],
        register: Callable[[int, int, Sequence[Task]], None],
    ) -> None:
        if ahead < 0:
            raise ValueError(f"ahead must be >= 0, got {ahead}")
        self.dataset = dataset
        self.ahead = ahead
        self._tasks = tasks
        self._open = open
        self._register = register

    def __iter__(self) -> Iterator[Batch]:
        epoch = self._open()
        source = iter(self.dataset)
        buffered: deque[Batch] = deque()
        index = 0

        def read() -> bool:
            nonlocal index
            try:
                batch = next(source)
            except StopIteration:
                return False
            self._register(epoch, index, list(self._tasks(batch)))
            index += 1
            buffered.append(batch)
            return True

        while len(buffered) <= self.ahead and read():
            pass
        while buffered:
            yield buffered.popleft()
            read()

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]
