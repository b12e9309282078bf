"""The training loop: GRPO on complete rollout groups served by a `RolloutScheduler`.

    rollstream demo --steps 60 --out runs/demo      # all of it on one machine (rollstream/demo.py)

    engine = build_engine(load(RunConfig, "trainer.yaml").trainer)
    objective = GRPOObjective(temperature=1.0)      # the engines' sampling temperature
    with RolloutScheduler(objective, source, RedisPublisher(...), width=64, rows=16,
                          groups=8, tasks=env.tasks) as scheduler:
        history = train(engine, scheduler, objective, dataset, steps=100, on_step=print)

One step, top to bottom (`train`):

1. hand over:  `rows = scheduler(batch, engine.module)`. Before handing batch i over, the
   facade pushes the weights (`weights.load(model, version)`, then announces the version)
   when the served version has fallen `sync_every` updates behind; then it waits for the
   packed rows of complete groups and logs their `SchedulerRecord` (`scheduler.record`).
2. rescore:    the proximal policy is the weights the trainer holds now:
   `packed_log_probs(model, rows)` under no_grad.
3. loss:       the same rows with grad; `objective.loss(new, rows, proximal,
   trainer_version=...)`: decoupled PPO, weighted by behaviour importance.
4. step:       `engine.backward(loss); engine.step()` (DeepSpeed: ZeRO, clipping).
5. record:     a `StepRecord` (every SchedulerRecord field, `loss`, `reward_mean`, the
   loss metrics, the step's seconds) to the returned list, `on_step` and, given one,
   `Metrics.observe_train`. The next call's push (step 1) carries this update.

Fail fast: nothing here catches; a dead consumer raises from the scheduler call.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch

from pipeline.metrics import Metrics
from pipeline.scheduler import SchedulerRecord
from trainer.objective import GRPOObjective, Rows


@dataclass(frozen=True)
class StepRecord:
    """What one training step consumed and did (one line of metrics.jsonl)."""

    step: int
    record: SchedulerRecord
    loss: float
    reward_mean: float  # mean verifier reward of the admitted rollouts (NaN without any)
    step_s: float  # seconds of rescoring, loss and optimizer step (not the wait)
    tokens: int  # loss tokens
    train: Mapping[str, float] = field(default_factory=dict)  # GRPOObjective.loss metrics

    def row(self) -> dict[str, Any]:
        """A flat JSON-able dict: step, every SchedulerRecord field, loss, reward_mean,
        step_s, tokens, train; non-finite floats as None."""
        out = {"step": self.step, **asdict(self.record), "loss": self.loss,
               "reward_mean": self.reward_mean, "step_s": self.step_s, "tokens": self.tokens,
               "train": dict(self.train)}
        return _finite(out)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    return value


class TimedPublisher:
    """A `Publisher` that times each push of `inner` into `Metrics.observe_push`."""

    def __init__(self, inner: Any, metrics: Metrics | None = None) -> None:
        self.inner, self.metrics = inner, metrics
        self.pushes: list[tuple[int, float]] = []  # (version, seconds)

    def load(self, variables: Any, version: int) -> Any:
        start = time.monotonic()
        at = self.inner.load(variables, version)
        seconds = time.monotonic() - start
        self.pushes.append((version, seconds))
        if self.metrics is not None:
            self.metrics.observe_push(version, seconds)
        return at


def train(
    engine: Any,
    scheduler: Any,
    objective: GRPOObjective,
    dataset: Iterable[Any],
    *,
    steps: int | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
    metrics: Metrics | None = None,
    shard: int = 0,
    first_step: int = 0,
    stop: Callable[[], bool] | None = None,
) -> list[StepRecord]:
    """Train `engine` (a DeepSpeed engine) on the rows `scheduler` (a `RolloutScheduler`)
    serves for `dataset`'s batches, for `steps` steps, until the data ends, or until
    `stop()` (asked after each step) is true. Steps are numbered from `first_step` (a
    resumed run's data position)."""
    model = engine.module
    history: list[StepRecord] = []
    for batch in scheduler.tasks(dataset):
        # 1. hand over batch i (pushing the weights first when they are sync_every behind)
        rows = scheduler(batch, model)
        record: SchedulerRecord = scheduler.record
        start = time.monotonic()
        rows = _on(rows, engine.device)

        # 2. rescore: the proximal policy is the weights held now (record.updates of them)
        with torch.no_grad():
            proximal = objective.packed_log_probs(model, rows)

        # 3. loss: decoupled PPO against the proximal policy
        new = objective.packed_log_probs(engine, rows)
        loss, train_metrics = objective.loss(new, rows, proximal, trainer_version=record.updates)
        assert torch.isfinite(loss), f"step {first_step + len(history)}: non-finite loss {float(loss)}"

        # 4. step
        engine.backward(loss)
        engine.step()

        # 5. record (the push of this update happens at the next hand-over)
        step_s = time.monotonic() - start
        tokens = int(train_metrics["loss_tokens"])
        done = StepRecord(step=first_step + len(history), record=record, loss=float(loss.detach()),
                          reward_mean=float(record.metrics.get("reward_mean", math.nan)),
                          step_s=step_s, tokens=tokens, train=train_metrics)
        history.append(done)
        if metrics is not None:
            metrics.observe_train(shard, step_s=step_s, tokens=tokens, metrics=train_metrics,
                                  record=record)
        if on_step is not None:
            on_step(done)
        if steps is not None and len(history) >= steps:
            break
        if stop is not None and stop():
            break
    return history


def _on(rows: Rows, device: torch.device) -> Rows:
    if rows.tokens.device == device:
        return rows
    return replace(rows, **{f.name: getattr(rows, f.name).to(device) for f in fields(rows)
                            if getattr(rows, f.name) is not None})
