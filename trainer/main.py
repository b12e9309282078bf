"""`rollstream trainer --config FILE`: one trainer process (one DeepSpeed rank) of a run.

    rollstream trainer --config trainer.yaml                          # one rank
    torchrun --nproc_per_node 2 -m rollstream.cli trainer --config trainer.yaml
    deepspeed --num_gpus 8 --module rollstream.cli trainer --config trainer.yaml

The file is a `trainer.run_config.RunConfig` (redis, metrics_addr, trainer, scheduler,
objective, data, publisher, checkpoint, steps, share, step_timeout_s, max_message_bytes,
record). The run's
admission consumers (one per shard: `rollstream admission --shard N`, with the same
`scheduler` section: the trainer's is the run's, and an admission under another one is
refused at start naming the differing fields) and rollout consumers (`rollstream consumer`, whose source runs the
same `data.env`) run as their own processes.

Each process: reaches Redis and checks its credentials, and checks the engines its
publisher pushes to (`preflight`; a wrong URL, password or engine fails at once, before
DeepSpeed); builds its DeepSpeed engine (torch.distributed from the launcher's
environment; `trainer.deepspeed_engine`); joins the `Pool` when the world has more than one rank
(`shard = rank // share`; alone, the shard is `ROLLSTREAM_SHARD`, default 0); resumes from
the newest checkpoint under `checkpoint.dir` when there is one (`trainer.checkpoint`: the
model and optimizer, the data position, the version counter, and the task stream's
`position()`: in stream admission the tasks outstanding before the data position and
those already trained after it); then trains `steps` steps in
all with `trainer.loop.train` over its task stream (`batches`: a pure function of the
step, so the checkpointed step is the data position). It checkpoints every
`checkpoint.every` steps, at the end, and when it is asked to stop: SIGTERM or SIGINT on
any rank stops every rank after the step in progress (the stop is agreed in the pool),
which checkpoints and exits 0; while it waits for Redis (an outage) a signal ends the wait
at once (`redis_io.Interrupted`: exit 1, no checkpoint past the last). Rows holding ids
beyond the model's vocabulary, or positions beyond its context, stop it with a
`VocabError` naming the setting to fix. `/metrics`, `/healthz` and `/readyz` are served on
`metrics_addr` (`+rank` adds the launcher's `RANK` to its port). With `record` set, each
step appends one JSON line: `StepRecord.row()`, plus `rank`, `shard`, `epoch`, `run` (this
process's id), `pushed` (the weight version pushed before the step, or null), `publisher`
(whether this rank publishes), `tasks` (the task ids of the groups its rows hold),
`cut_tasks` (admitted, but cut or refused at packing), `dropped_tasks` ([task id, cause]:
abandoned after max_attempts, or surplus), `refused`, `surplus` and `overlong`: what an
audit of trained tasks reads.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pipeline.config import ConfigError
from pipeline.keys import Keys
from pipeline.metrics import Metrics, serving
from pipeline.redis_io import check, connect
from trainer import checkpoint
from trainer.run_config import DataConfig, RunConfig
from trainer.step_records import open_for_append
from domain.model import context_size, vocab_size

log = logging.getLogger(__name__)


def batches(data: DataConfig, shard: int, shards: int, start: int = 0) -> Iterator[dict[str, list[int]]]:
    """Batch `step` of batch share `shard` of `shards`, for step = start, start + 1, ...:
    `data.batch_size` consecutive task ids, disjoint across shares and steps."""
    step = start
    while True:
        first = data.first_task + (step * shards + shard) * data.batch_size
        yield {"task_id": list(range(first, first + data.batch_size))}
        step += 1


def data_env(data: DataConfig) -> Any:
    """The environment `data.env` names, built with `data.env_args` (a prompt set reads its
    file here); what it refuses is a `ConfigError` naming `data.env_args`."""
    from domain.envs import ENVS

    try:
        return ENVS[data.env](**data.env_args)
    except (TypeError, ValueError, OSError, KeyError) as exc:
        raise ConfigError(f"data.env_args: {data.env} refused {data.env_args!r}: {exc}") from exc


def _publisher(config: RunConfig, r: Any, keys: Keys) -> Any:
    """The publisher `config.publisher` describes; engines are checked (`preflight`) first."""
    from producers.publishers import DirectoryPublisher, RedisPublisher

    p = config.publisher
    if p.kind == "redis":
        return RedisPublisher(r, keys, keep=p.keep)
    assert p.path is not None
    if p.kind == "directory":
        return DirectoryPublisher(p.path, keep=p.keep)
    from producers.engine_publishers import SGLangPublisher, VLLMPublisher

    options: dict[str, Any] = {"keep": p.keep, "gateways": p.gateways, "timeout_s": p.timeout_s,
                               "retries": p.retries, "base": config.trainer.model.path}
    publisher = (VLLMPublisher(p.engines, p.path, pause_mode=p.pause_mode, **options) if p.kind == "vllm"
                 else SGLangPublisher(p.engines, p.path, **options))
    publisher.preflight()
    return publisher


def run(config: RunConfig, *, stop: threading.Event | None = None,
        metrics: Metrics | None = None, on_step: Callable[[dict[str, Any]], None] | None = None) -> int:
    """Train as the module docstring says; returns the steps trained in all (the data
    position at exit)."""
    from trainer.deepspeed_engine import build_engine
    from trainer.loop import StepRecord, TimedPublisher, train
    from trainer.objective import GRPOObjective
    from trainer.pool import Pool
    from trainer.rollout_scheduler import RolloutScheduler
    from trainer.task_stream import Resume

    stop = stop if stop is not None else threading.Event()
    env = data_env(config.data)  # before the engine: a bad data section fails at once
    objective = GRPOObjective(**config.objective.model_dump())
    with ExitStack() as stack:
        # Redis and its credentials, and the engines a publisher pushes to, before DeepSpeed:
        # a wrong URL, password or engine fails at once
        r = connect(config.redis)
        stack.callback(r.close)
        check(r, config.redis, stop)
        keys = Keys(config.redis.namespace)
        publisher = TimedPublisher(_publisher(config, r, keys), metrics)
        if callable(getattr(publisher.inner, "close", None)):
            stack.callback(publisher.inner.close)
        engine = build_engine(config.trainer)
        rank, world = dist.get_rank(), dist.get_world_size()
        pool = Pool(share=config.share, timeout_s=config.step_timeout_s + 600) if world > 1 else None
        shard = pool.shard if pool is not None else int(os.environ.get("ROLLSTREAM_SHARD", "0"))
        shards = pool.shards if pool is not None else 1
        run_id = uuid.uuid4().hex[:12]

        position = None
        if config.checkpoint.dir and config.checkpoint.resume != "never":
            position = checkpoint.load(engine, config.checkpoint.dir)
        if position is None and config.checkpoint.resume == "require":
            raise ConfigError(f"checkpoint.resume=require: no checkpoint under {config.checkpoint.dir}")
        start = position.step if position is not None else 0
        if start >= config.steps:
            log.warning("the checkpoint is at step %d of %d: nothing left to train", start, config.steps)
            return start

        # the trainer's scheduler section is the run's: the admission consumers must run
        # under the same one (checked at start, and on each epoch the trainer opens)
        rules = config.scheduler.model_dump(exclude={"timeout_s"})
        sched = RolloutScheduler(
            objective, None, publisher, redis=config.redis, shard=shard, pool=pool,
            tasks=env.tasks, step_timeout_s=config.step_timeout_s,
            max_message_bytes=config.max_message_bytes, timeout=config.scheduler.timeout_s,
            vocab=vocab_size(engine.module), context=context_size(engine.module), stop=stop, **rules)
        stack.callback(sched.close)
        if position is not None:
            data = Resume.from_data(position.data) if position.data is not None else None
            updates = sched.resume(position.updates, data)
            log.info("rank %d resumes at step %d, version %d", rank, start, updates)
        record = _record_file(config, rank, stack)

        every = config.checkpoint.every

        def save(step: int) -> None:
            if config.checkpoint.dir:
                checkpoint.save(engine, config.checkpoint.dir,
                                checkpoint.Position(step=step, updates=sched.updates, epoch=sched.epoch,
                                                    data=sched.position().to_data()),
                                keep=config.checkpoint.keep)

        def step_done(done: StepRecord) -> None:
            if position is not None and sched.reader and sched.epoch <= position.epoch:
                raise RuntimeError(f"epoch {sched.epoch} does not follow the checkpoint's {position.epoch}")
            row = {**done.row(), "rank": rank, "shard": shard, "epoch": sched.epoch, "run": run_id,
                   "pushed": sched.pushed, "publisher": pool is None or pool.publishes,
                   "tasks": list(sched.trained),
                   "cut_tasks": sorted(set(t for _, _, t in sched.admitted) - set(sched.trained)),
                   "dropped_tasks": [list(d) for d in sched.dropped], **sched.extra}
            if record is not None:
                record.write(json.dumps(row) + "\n")
                record.flush()
            if on_step is not None:
                on_step(row)
            if every and (done.step + 1) % every == 0:
                save(done.step + 1)

        def stopping() -> bool:
            return pool.any(stop.is_set()) if pool is not None else stop.is_set()

        history = train(engine, sched, objective, batches(config.data, shard, shards, start),
                        steps=config.steps - start, on_step=step_done, metrics=metrics,
                        shard=shard, first_step=start, stop=stopping,
                        minibatches=config.trainer.minibatches, epochs=config.trainer.epochs)
        end = start + len(history)
        if end > start and not (every and end % every == 0):  # else step_done saved it
            save(end)
    log.info("rank %d: trained steps %d..%d%s", rank, start, end - 1,
             " (stopped)" if stop.is_set() else "")
    return end


def _record_file(config: RunConfig, rank: int, stack: ExitStack) -> Any:
    if not config.record:
        return None
    return stack.enter_context(open_for_append(Path(config.record.replace("{rank}", str(rank)))))


def main(config: RunConfig) -> int:
    """The process: signals, metrics endpoint, `run`."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    started = threading.Event()
    rank = int(os.environ.get("RANK", "0"))  # the launcher's; torch.distributed starts later
    with serving("trainer", config.redis.namespace, config.metrics_addr, offsets={"rank": rank},
                 health=lambda: True, ready=started.is_set, targets=config.metrics_targets) as metrics:
        started.set()
        run(config, stop=stop, metrics=metrics)
    return 0
