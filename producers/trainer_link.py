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

A Redis outage (a restart, a dropped connection) is ridden out for up to `reconnect_s`
seconds: reads are retried (the trainer's pending ready entry is read again), and an append
whose reply was lost is checked against the stream's newest entry before it is sent again
(`streams.append_once`: this writer is its streams' only writer), so nothing is appended
twice. Past `reconnect_s`, `RedisUnavailable` propagates and the trainer resumes from its
checkpoint in a new epoch. Given the process's `stop` event, a wait for Redis ends with
`redis_io.Interrupted` as soon as it is set (SIGTERM during an outage).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence

import redis

from pipeline import wire
from pipeline.config import SchedulerConfig, build, scheduler_differences
from pipeline.errors import ConfigError
from pipeline.keys import STATE_CONFIG, TRAINER_GROUP, Keys
from pipeline.redis_io import ride_out, text
from pipeline.streams import ack, append_once, dead_letter, ensure_group, newest, read_group
from pipeline.sessions import Task

log = logging.getLogger(__name__)

_POLL_MS = 1000


class StepFailed(RuntimeError):
    """The admission consumer failed this step; `ready.error` says why."""

    def __init__(self, ready: wire.Ready) -> None:
        super().__init__(f"step {ready.step} of shard {ready.shard} failed:\n{ready.error or 'its Ready carries no record'}")
        self.ready = ready


class TaskWriter:
    """The trainer side of one shard's streams (see the module docstring)."""

    def __init__(self, redis: redis.Redis, keys: Keys, shard: int, *, name: str | None = None,
                 max_message_bytes: int = wire.MAX_MESSAGE_BYTES, reconnect_s: float = 300.0,
                 stop: threading.Event | None = None) -> None:
        self.r = redis
        self.keys = keys
        self.shard = shard
        self.name = name or f"trainer-{shard}"
        self.max_message_bytes = max_message_bytes  # an entry past it is refused (written) or dead-lettered (read)
        self.reconnect_s = reconnect_s
        self.stop = stop
        self.ride(lambda: ensure_group(self.r, keys.ready(shard), TRAINER_GROUP), "creating the ready group")

    def ride(self, fn, what: str):
        """`fn()` (idempotent), through a Redis outage of up to `reconnect_s`."""
        return ride_out(fn, what=f"trainer {self.shard}: {what}", total_s=self.reconnect_s, stop=self.stop)

    # ------------------------------------------------------------------ writes

    def open(self, epoch: int, scheduler: SchedulerConfig | None = None) -> bytes:
        """Open `epoch`, under the run's scheduler config when given: an admission consumer
        whose own config differs refuses the epoch and fails its first step."""
        run = None if scheduler is None else scheduler.model_dump(mode="json")
        return self._append(wire.Open(self.shard, epoch, run))

    def check_run_config(self, scheduler: SchedulerConfig) -> None:
        """Refuse (ConfigError, naming the differing fields) to start under another scheduler
        config than the one this shard's admission consumer recorded, if it has started."""
        have = self.ride(lambda: self.r.hget(self.keys.state(self.shard), STATE_CONFIG),
                         "reading the admission's config")
        if have is None:
            return
        differ = scheduler_differences(scheduler.model_dump(mode="json"),
                                       build(SchedulerConfig, json.loads(have)))
        if differ:
            raise ConfigError(
                f"scheduler: this trainer's scheduler config differs from the one admission shard "
                f"{self.shard} runs under ({self.keys.state(self.shard)}; trainer's != admission's): "
                f"{'; '.join(differ)}; give both the same scheduler section")

    def register(self, epoch: int, batch: int, tasks: Sequence[Task]) -> bytes:
        return self._append(wire.Registration(self.shard, epoch, batch, tuple(tasks)))

    def handover(self, epoch: int, step: int, updates: int, published: int | None = None,
                 steps_left: int | None = None) -> bytes:
        """Call for `step` (`steps_left`: the steps the trainer will call for after it, when
        it knows: the scheduler's `end_backups` acts on the run's last steps)."""
        return self._append(wire.Handover(self.shard, epoch, step, updates, published, steps_left))

    def announce_weights(self, version: int, location: str, digest: str = "", size: int = 0) -> bytes:
        """Append weight `version` (served from `location`) to the shared weights stream."""
        return self._xadd(self.keys.weights, wire.Weights(version, location, digest, size))

    def last_weights_version(self) -> int | None:
        """The version of the newest entry of the weights stream (None: nothing announced)."""
        last = self.ride(lambda: newest(self.r, self.keys.weights), "reading weights")
        return None if last is None else wire.from_fields(last[1], wire.Weights).version

    def _append(self, msg: wire.Message) -> bytes:
        return self._xadd(self.keys.tasks(self.shard), msg)

    def _xadd(self, stream: str, msg: wire.Message) -> bytes:
        """Append `msg`; one that does not encode within `max_message_bytes` raises
        SchemaError naming its kind, and nothing is written."""
        try:
            fields = wire.to_fields(msg, max_bytes=self.max_message_bytes)
        except wire.SchemaError as exc:
            raise wire.SchemaError(exc.field, f"{msg.KIND} refused, not written: {exc.reason}") from None
        return append_once(self.r, stream, fields, what=f"trainer {self.shard}: appending {msg.KIND}",
                           total_s=self.reconnect_s, stop=self.stop)

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
                ready = wire.from_fields(fields, wire.Ready, max_bytes=self.max_message_bytes)
            except wire.SchemaError as exc:
                self._dead_letter(stream, entry_id, fields, str(exc))
                continue
            if (ready.epoch, ready.step) > (epoch, step):
                raise RuntimeError(f"ready for epoch {ready.epoch} step {ready.step} while "
                                   f"waiting for epoch {epoch} step {step}")
            self.ride(lambda: ack(self.r, stream, TRAINER_GROUP, entry_id), "acknowledging")  # noqa: B023 (called within this iteration)
            if (ready.epoch, ready.step) < (epoch, step):
                log.info("skipping ready of epoch %d step %d", ready.epoch, ready.step)
                continue
            if ready.error is not None or ready.record is None:
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
                read = self.ride(lambda: read_group(self.r, TRAINER_GROUP, self.name, {stream: start},  # noqa: B023 (called within this iteration)
                                                    count=1, block_ms=block), "reading ready")  # noqa: B023 (called within this iteration)
                for _, entry_id, fields in read:
                    if fields:
                        return entry_id, fields
                    self.ride(lambda: ack(self.r, stream, TRAINER_GROUP, entry_id),  # noqa: B023
                              "acknowledging")  # deleted while pending

    def _dead_letter(self, stream: str, entry_id: bytes, fields: dict, reason: str) -> None:
        log.warning("dead-lettered %s %s: %s", stream, text(entry_id), reason)
        pipe = self.r.pipeline(transaction=True)
        dead_letter(pipe, self.keys.dead, stream, entry_id, reason, fields)
        ack(pipe, stream, TRAINER_GROUP, entry_id)
        pipe.execute()
