"""What one trainer rank (shard) writes to the pipeline, and how it reads its packed steps.

`TaskWriter(redis, keys, shard)` appends the trainer's protocol to `tasks:{shard}`:
`open(epoch)` when the task stream is (re)opened (a resume opens a new epoch, which cancels
what the old one left running), `register(epoch, batch, tasks)` as the prefetch reads each
task batch, `handover(epoch, step, updates, published)` when the trainer calls for a step.
`wait_ready(epoch, step, timeout_s)` reads `ready:{shard}` through the `TRAINER_GROUP`
group and acknowledges what it returns; a step that failed (a broken source, a refused
handover, a batch that cannot be packed) raises `StepFailed` with the admission consumer's
error. `announce_weights` appends a published weight version to the shared `weights`
stream (rank 0 does, after the pool agreed on the push).

Appends are not retried: a retried XADD whose reply was lost would repeat it. A connection
error propagates, and the trainer resumes from its checkpoint in a new epoch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import redis

from pipeline import wire
from pipeline.keys import TRAINER_GROUP, Keys
from pipeline.redis_io import ensure_group, text
from pipeline.sessions import Task

log = logging.getLogger(__name__)

_POLL_MS = 1000


class StepFailed(RuntimeError):
    """The admission consumer failed this step; `ready.record["error"]` says why."""

    def __init__(self, ready: wire.Ready) -> None:
        super().__init__(f"step {ready.step} of shard {ready.shard} failed:\n{ready.record['error']}")
        self.ready = ready


class TaskWriter:
    """The trainer side of one shard's streams (see the module docstring)."""

    def __init__(self, redis: redis.Redis, keys: Keys, shard: int, *, name: str | None = None) -> None:
        self.r = redis
        self.keys = keys
        self.shard = shard
        self.name = name or f"trainer-{shard}"
        ensure_group(self.r, keys.ready(shard), TRAINER_GROUP)

    # ------------------------------------------------------------------ writes

    def open(self, epoch: int) -> bytes:
        return self._append(wire.Open(self.shard, epoch))

    def register(self, epoch: int, batch: int, tasks: Sequence[Task]) -> bytes:
        return self._append(wire.Registration(self.shard, epoch, batch, tuple(tasks)))

    def handover(self, epoch: int, step: int, updates: int, published: int | None = None) -> bytes:
        return self._append(wire.Handover(self.shard, epoch, step, updates, published))

    def announce_weights(self, version: int, location: str, digest: str = "", size: int = 0) -> bytes:
        """Append weight `version` (served from `location`) to the shared weights stream."""
        return self.r.xadd(self.keys.weights, wire.to_fields(wire.Weights(version, location, digest, size)))

    def _append(self, msg: wire.Message) -> bytes:
        return self.r.xadd(self.keys.tasks(self.shard), wire.to_fields(msg))

    # ------------------------------------------------------------------ reads

    def wait_ready(self, epoch: int, step: int, timeout_s: float) -> wire.Ready:
        """The packed step `step` of `epoch`, acknowledged; entries of earlier steps or epochs
        are acknowledged and skipped. Raises StepFailed for a failed step, TimeoutError when
        nothing arrives within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        stream = self.keys.ready(self.shard)
        while True:
            entry = self._next(stream, deadline)
            if entry is None:
                raise TimeoutError(f"step {step} of epoch {epoch} not ready after {timeout_s}s")
            entry_id, fields = entry
            try:
                ready = wire.from_fields(fields, wire.Ready)
            except wire.SchemaError as exc:
                self._dead_letter(stream, entry_id, fields, str(exc))
                continue
            if (ready.epoch, ready.step) > (epoch, step):
                raise RuntimeError(f"ready for epoch {ready.epoch} step {ready.step} while "
                                   f"waiting for epoch {epoch} step {step}")
            self.r.xack(stream, TRAINER_GROUP, entry_id)
            if (ready.epoch, ready.step) < (epoch, step):
                log.info("skipping ready of epoch %d step %d", ready.epoch, ready.step)
                continue
            if "error" in ready.record:
                raise StepFailed(ready)
            return ready

    def _next(self, stream: str, deadline: float) -> tuple[bytes, dict] | None:
        """This reader's oldest unacknowledged entry, else the next new one."""
        while True:
            for start, block in (("0", None), (">", _POLL_MS)):
                left_ms = int((deadline - time.monotonic()) * 1000)
                if block is not None:
                    if left_ms <= 0:
                        return None
                    block = max(1, min(block, left_ms))
                reply = self.r.xreadgroup(TRAINER_GROUP, self.name, {stream: start}, count=1, block=block)
                for _, items in reply or []:
                    for entry_id, fields in items:
                        if fields:
                            return entry_id, fields
                        self.r.xack(stream, TRAINER_GROUP, entry_id)  # deleted while pending

    def _dead_letter(self, stream: str, entry_id: bytes, fields: dict, reason: str) -> None:
        log.warning("dead-lettered %s %s: %s", stream, text(entry_id), reason)
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(self.keys.dead, wire.dead_letter_fields(stream, entry_id, reason, fields))
        pipe.xack(stream, TRAINER_GROUP, entry_id)
        pipe.execute()
