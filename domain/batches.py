"""The batches of the trainer's data loader, and the tasks a batch stands for.

`task_ids(batch)` is the default: one task per integer `task_id` row. An environment's
`tasks(batch)` (`domain.envs`) gives the same tasks with each problem in its payload.
"""

from __future__ import annotations

from collections.abc import Mapping
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
