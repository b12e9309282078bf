"""A `PolicySource` with a broken environment for chosen tasks, or slow sessions, for the
trainer process tests."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from consumers.sources.policy import PolicySource
from pipeline.sessions import Session, SessionRequest


class TestPolicySource(PolicySource):
    __test__ = False  # not a pytest class

    def __init__(self, *, fail_tasks: Iterable[int | str] = (), delay_s: float = 0.0,
                 slow_tasks: dict[str, float] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail_tasks = {str(t) for t in fail_tasks}
        self.delay_s = delay_s
        self.slow_tasks = dict(slow_tasks or {})  # task id -> its sessions' delay instead

    def run(self, request: SessionRequest) -> Session:
        if request.task.id in self.fail_tasks:
            raise RuntimeError(f"task {request.task.id}: the environment is broken")
        time.sleep(self.slow_tasks.get(request.task.id, self.delay_s))
        return super().run(request)
