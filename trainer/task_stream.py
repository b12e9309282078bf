"""The trainer's side of task registration: the prefetching task stream (`task_ids`, the
default tasks of a batch, is `domain.batches.task_ids`).

`TaskStream` wraps any iterable of task batches. Each time it is iterated (a start, or a
resume that reopens it) it opens a new epoch, then reads `ahead` batches beyond the one the
trainer is given and registers each batch as it is read, so when the trainer hands batch i
over, batches i + 1 ... i + ahead are already registered and can be submitted at once.
Nothing is read beyond that: the data position the trainer checkpoints stays its own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from domain.batches import Batch
from pipeline.sessions import Task

class TaskStream:
    """A re-iterable stream of task batches that registers each batch ahead of its step, and
    knows which of the tasks it registered have ended.

    `open()` is called at the start of each iteration and returns the new epoch;
    `register(epoch, index, tasks)` is called for each batch as it is read. `ended(batch,
    task_id)` is told of each task a step trained or dropped (`batch` is the index it was
    registered under in the open epoch). `position()` is what a checkpoint keeps so that a
    resumed stream neither repeats nor loses a task (`Resume`).
    """

    def __init__(
        self,
        dataset: Iterable[Batch],
        *,
        ahead: int,
        tasks: Callable[[Batch], Sequence[Task]],
        open: Callable[[], int],
        register: Callable[[int, int, Sequence[Task]], None],
        resume: Resume | None = None,
    ) -> None:
        if ahead < 0:
            raise ValueError(f"ahead must be >= 0, got {ahead}")
        self.dataset = dataset
        self.ahead = ahead
        self._tasks = tasks
        self._open = open
        self._register = register
        self._resume = resume or Resume()
        self._reset()

    def _reset(self) -> None:
        self._yielded = 0  # batches of the dataset given to the trainer in this iteration
        # by registration index: the dataset batch it came from (-1: carried over), and its
        # registered tasks that have not ended, by id
        self._source: dict[int, int] = {}
        self._left: dict[int, dict[str, list[Task]]] = {}
        self._read: dict[int, list[str]] = {}  # dataset batch -> every task id it held

    def __iter__(self) -> Iterator[Batch]:
        self._reset()
        epoch = self._open()
        source = iter(self.dataset)
        buffered: deque[Batch] = deque()
        index = 0
        if self._resume.carry:  # tasks an earlier run left unfinished, before the position
            self._add(epoch, index, -1, list(self._resume.carry))
            index += 1
        read_count = 0

        def read() -> bool:
            nonlocal index, read_count
            try:
                batch = next(source)
            except StopIteration:
                return False
            tasks = list(self._tasks(batch))
            self._read[read_count] = [t.id for t in tasks]
            skip = list(self._resume.done.get(read_count, ()))
            todo = [t for t in tasks if not _take(skip, t.id)]
            if todo:
                self._add(epoch, index, read_count, todo)
            index += 1
            read_count += 1
            buffered.append(batch)
            return True

        while len(buffered) <= self.ahead and read():
            pass
        while buffered:
            batch = buffered.popleft()
            self._yielded += 1  # counted before the trainer's step: a checkpoint in it is past it
            yield batch
            read()

    def _add(self, epoch: int, index: int, batch: int, tasks: list[Task]) -> None:
        self._register(epoch, index, tasks)
        self._source[index] = batch
        left: dict[str, list[Task]] = {}
        for task in tasks:
            left.setdefault(task.id, []).append(task)
        self._left[index] = left

    def ended(self, index: int, task_id: str) -> None:
        """A task registered under `index` in the open epoch was trained or dropped."""
        left = self._left.get(index)
        tasks = None if left is None else left.get(task_id)
        if not tasks:
            raise ValueError(f"task {task_id!r} of batch {index} ended, but is not outstanding")
        tasks.pop()
        if not tasks:
            del left[task_id]

    def position(self) -> Resume:
        """Where a resumed stream continues, once the dataset is restarted at the trainer's
        data position (the batches given to the trainer so far, `step`): the tasks still
        outstanding from batches before it (`carry`, registered again at once), and the
        tasks of batches from it on that already ended (`done`, by their distance from it,
        skipped when those batches are read again)."""
        carry: list[Task] = []
        outstanding: dict[int, list[str]] = {}  # dataset batch (from the position) -> ids
        for index, left in self._left.items():
            tasks = [task for same in left.values() for task in same]
            batch = self._source[index]
            if batch < self._yielded:  # carried over (-1), or before the position
                carry += tasks
            else:
                outstanding[batch] = [task.id for task in tasks]
        done: dict[int, list[str]] = {}
        for batch, ids in self._read.items():
            if batch < self._yielded:
                continue
            ended = list(ids)  # ended, or skipped as done by an earlier run
            for task_id in outstanding.get(batch, ()):
                _take(ended, task_id)
            if ended:
                done[batch - self._yielded] = ended
        return Resume(tuple(carry), done)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Resume:
    """What a resumed task stream needs beyond its dataset restarted at the data position:
    `carry`, tasks registered before the position that never ended (registered again first,
    as one batch), and `done`, the ids of tasks that already ended among the batches from
    the position on (by distance from it; skipped when read again). Empty for a batch-mode
    run (step i trains batch i, and every task of it ends at step i)."""

    carry: tuple[Task, ...] = ()
    done: Mapping[int, Sequence[str]] = field(default_factory=dict)

    def to_data(self) -> dict[str, Any]:
        """msgpack-native data (a checkpoint's)."""
        return {"carry": [[t.id, dict(t.payload)] for t in self.carry],
                "done": [[k, list(v)] for k, v in sorted(self.done.items())]}

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> Resume:
        return cls(tuple(Task(i, p) for i, p in data.get("carry", ())),
                   {int(k): list(v) for k, v in data.get("done", ())})


def _take(ids: list[str], task_id: str) -> bool:
    """Remove one `task_id` from `ids`; whether there was one."""
    try:
        ids.remove(task_id)
    except ValueError:
        return False
    return True
