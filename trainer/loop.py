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
2. update:     `update(engine, objective, rows, ...)`: PPO over `minibatches` slices of the
   rows for `epochs` passes, one optimizer step each (`engine.backward(loss); engine.step()`;
   DeepSpeed: ZeRO, clipping). The proximal policy is the weights the trainer holds before
   the first of them: with one minibatch and one epoch, the gradient pass's own log-probs,
   detached (one forward pass); otherwise `packed_log_probs(model, rows)` under no_grad,
   once. Each loss is `objective.loss(new, part, proximal, loss_tokens=...)`: decoupled PPO,
   weighted by behaviour importance, summed over the part's loss tokens and divided by the
   count over every data-parallel rank (`global_tokens`), so that N ranks training on a
   split of the rows take the update one rank takes on all of them.
3. record:     a `StepRecord` (every SchedulerRecord field, `loss`, `reward_mean`, the
   loss metrics, the step's seconds) to the returned list, `on_step` and, given one,
   `Metrics.observe_train`. The next call's push (step 1) carries this update.

Fail fast: nothing here catches; a dead consumer raises from the scheduler call.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
import torch.distributed as dist

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
        out = {"step": self.step, **self.record.fields(), "loss": self.loss,
               "reward_mean": self.reward_mean, "step_s": self.step_s, "tokens": self.tokens,
               "train": dict(self.train)}
        return finite(out)


def finite(value: Any) -> Any:
    """`value` with every non-finite float, in mappings and lists too, as None (for JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
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
    minibatches: int = 1,
    epochs: int = 1,
) -> list[StepRecord]:
    """Train `engine` (a DeepSpeed engine) on the rows `scheduler` (a `RolloutScheduler`)
    serves for `dataset`'s batches, for `steps` steps, until the data ends, or until
    `stop()` (asked after each step) is true. Steps are numbered from `first_step` (a
    resumed run's data position). Each step takes `minibatches` x `epochs` optimizer steps
    (`update`)."""
    model = engine.module
    history: list[StepRecord] = []
    for batch in scheduler.tasks(dataset):
        # 1. hand over batch i (pushing the weights first when they are sync_every behind)
        left = None if steps is None else steps - len(history) - 1  # the steps after this one
        rows = scheduler(batch, model, steps_left=left)
        record: SchedulerRecord = scheduler.record
        start = time.monotonic()

        # 2. update: PPO minibatches and epochs against the proximal policy
        loss, train_metrics = update(engine, objective, _on(rows, engine.device),
                                     trainer_version=record.updates, minibatches=minibatches,
                                     epochs=epochs)
        assert math.isfinite(loss), f"step {first_step + len(history)}: non-finite loss {loss}"

        # 3. record (the push of this update happens at the next hand-over)
        step_s = time.monotonic() - start
        tokens = int(train_metrics["loss_tokens"])
        done = StepRecord(step=first_step + len(history), record=record, loss=loss,
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


def update(engine: Any, objective: GRPOObjective, rows: Rows, *, trainer_version: int | None = None,
           minibatches: int = 1, epochs: int = 1) -> tuple[float, dict[str, float]]:
    """PPO on `rows`: `epochs` passes over `minibatches` slices of consecutive rows, one
    optimizer step per slice. Returns the mean loss and the step's metrics (`combine`).

    The proximal log-probs are the policy's before the first optimizer step, so its ratio is
    1 there and the clip acts from the second step on. With one minibatch and one epoch they
    are the gradient pass's own log-probs, detached: one forward pass instead of two, and the
    same update (the ratio is exactly 1, its gradient that of the log-probs)."""
    if minibatches < 1 or epochs < 1:
        raise ValueError(f"minibatches and epochs must be >= 1, got {minibatches}, {epochs}")
    n = rows.tokens.shape[0]
    if n < minibatches:
        raise ValueError(f"{n} rows cannot be split into {minibatches} minibatches")
    bounds = [round(i * n / minibatches) for i in range(minibatches + 1)]
    parts = [(a, b, global_tokens(rows.slice(a, b), engine.device))
             for a, b in itertools.pairwise(bounds)]
    proximal = None
    if minibatches > 1 or epochs > 1:
        with torch.no_grad():
            proximal = objective.packed_log_probs(engine.module, rows)
    done: list[tuple[float, dict[str, float]]] = []
    for _ in range(epochs):
        for a, b, tokens in parts:
            part = rows.slice(a, b)
            new = objective.packed_log_probs(engine, part)
            prox = new.detach() if proximal is None else proximal[a:b]
            loss, metrics = objective.loss(new, part, prox, trainer_version=trainer_version,
                                           loss_tokens=tokens)
            engine.backward(loss)
            engine.step()
            done.append((float(loss.detach()), metrics))
    return sum(loss for loss, _ in done) / len(done), combine([m for _, m in done], minibatches)


def global_tokens(rows: Rows, device: torch.device | str = "cpu") -> float:
    """The loss-token count to divide `rows`' summed loss by: the count over every
    data-parallel rank, over the world size. DeepSpeed averages the ranks' gradients (it
    divides their sum by the world size), so each rank's loss sum over this count adds up to
    the loss sum of every rank's tokens over their global count: one token weighs the same on
    every rank. With one process (or torch.distributed not initialised) it is the local count.
    Ranks of one batch share train the same rows: each counts them, and the world size
    divides them back out."""
    count = torch.tensor([float(rows.loss_mask.sum())], dtype=torch.float64, device=device)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return float(count)
    dist.all_reduce(count)
    return float(count) / dist.get_world_size()


_SUMMED = ("loss_tokens", "mismatch_tokens")


def combine(updates: Sequence[Mapping[str, float]], minibatches: int) -> dict[str, float]:
    """One step's loss metrics from its updates' (`GRPOObjective.loss` metrics, in order):
    token counts summed over the first epoch's minibatches (each row once), `importance_max`
    its largest, the other metrics their loss-token-weighted means over every update (NaN
    where no update had tokens); `updates` counts the optimizer steps and
    `clip_fraction_first`/`clip_fraction_last` are the first and last update's."""
    if len(updates) == 1:
        return {**updates[0], "updates": 1.0, "clip_fraction_first": updates[0]["clip_fraction"],
                "clip_fraction_last": updates[0]["clip_fraction"]}
    out: dict[str, float] = {}
    first = updates[:minibatches]
    for key in updates[0]:
        if key in _SUMMED:
            out[key] = sum(u[key] for u in first)
        elif key == "importance_max":
            out[key] = max((u[key] for u in updates if u["loss_tokens"]), default=math.nan)
        else:
            weight = "mismatch_tokens" if key.startswith("mismatch_") else "loss_tokens"
            pairs = [(u[weight], u[key]) for u in updates if u[weight] and math.isfinite(u[key])]
            total = sum(w for w, _ in pairs)
            out[key] = sum(w * v for w, v in pairs) / total if total else math.nan
    out.update(updates=float(len(updates)), clip_fraction_first=updates[0]["clip_fraction"],
               clip_fraction_last=updates[-1]["clip_fraction"])
    return out


def _on(rows: Rows, device: torch.device) -> Rows:
    if rows.tokens.device == device:
        return rows
    return replace(rows, **{f.name: getattr(rows, f.name).to(device) for f in fields(rows)
                            if getattr(rows, f.name) is not None})
