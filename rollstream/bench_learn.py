"""`rollstream bench learn`: does asynchronous training learn as well per sample as
synchronous training, and sooner per second?

    rollstream bench learn [--json] [--seeds 3] [--first-seed 0] [--steps 150]
                           [--policies sync batch stream]
                           [--max-lag 2] [--plot learn.png] [--out DIR]

The same task, model, optimizer and seeds as `rollstream demo` (rollstream/demo.py: copy one
digit, GRPO, one CPU rank, everything in one process on an embedded Redis), under three
schedules:

- ``sync``: batch admission, `ahead` 0, `max_lag` 0: every step's samples come from the
  weights it trains, and no sample runs while the trainer trains;
- ``batch``: batch admission, `ahead` 1, `max_lag` 1: the next batch runs during the step;
- ``stream``: stream admission, `ahead` 1, `max_lag` --max-lag: samples of any registered
  batch run while the trainer trains, a step takes the groups that completed first.

Each session is delayed by a log-normal draw (`PolicySource(delay_median_s=...)`, median
--delay-median-s, shape --delay-sigma: LLM decoding time varies with the output's length),
so that the schedules differ in wall time as they would on GPUs; the tiny model's own
sampling takes milliseconds. `--slots` sessions run at once (the engines' capacity, the same
for every schedule). Seeds run one after the other, each seed's schedules interleaved, so
a machine's load weighs on all of them alike.

Per schedule it reports the reward against trained samples and against wall seconds (the
mean over seeds of each step's 10-step running mean, and its spread, the standard deviation
over seeds), the final reward (mean reward of the last 10 steps; mean and spread over
seeds), the wall seconds, the seconds to reach sync's final reward (on the mean curve; None
if it never does), the mean lag and the importance weights' spread (the mean over steps of
`importance_max` and of |`importance_mean` - 1|). `--json` prints

    {"policies": {NAME: {"final_reward", "final_reward_spread", "seconds", "samples",
                         "seconds_to_sync_final", ...}},
     "speedup_to_sync_final": {NAME: sync's seconds / NAME's seconds to sync's final reward}}

and `--plot PNG` draws both curves (reward against samples, and against seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rollstream import demo
from trainer.loop import finite

POLICIES: dict[str, dict[str, Any]] = {
    "sync": {"admission": "batch", "ahead": 0, "max_lag": 0},
    "batch": {"admission": "batch", "ahead": 1, "max_lag": 1},
    "stream": {"admission": "stream", "ahead": 1},  # max_lag: --max-lag
}
WINDOW = 10  # steps of the running mean and of the final reward


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rollstream bench learn", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the JSON summary only")
    p.add_argument("--seeds", type=int, default=3, help="how many seeds (default 3)")
    p.add_argument("--first-seed", type=int, default=0, help="the first seed (default 0)")
    p.add_argument("--steps", type=int, default=150, help="training steps per run (default 150)")
    p.add_argument("--policies", nargs="+", choices=tuple(POLICIES), default=list(POLICIES))
    p.add_argument("--max-lag", type=int, default=2, help="stream's max_lag (default 2)")
    p.add_argument("--delay-median-s", type=float, default=0.1,
                   help="median of each session's log-normal generation time (default 0.1 s)")
    p.add_argument("--delay-sigma", type=float, default=1.0, help="its shape (default 1.0)")
    p.add_argument("--slots", type=int, default=128, help="sessions at once (default 128)")
    p.add_argument("--plot", default=None, help="write the reward curves to this PNG")
    p.add_argument("--out", default=None, help="keep each run's metrics.jsonl under this folder")
    args = p.parse_args(argv)
    if args.seeds < 1 or args.steps < 1:
        p.error("--seeds and --steps must be >= 1")
    if "sync" not in args.policies:
        p.error("--policies must include sync (the others are measured against it)")
    return args


def demo_args(args: argparse.Namespace, policy: str, seed: int) -> argparse.Namespace:
    """The demo's defaults, under `policy`'s schedule, with the bench's sessions."""
    schedule = {**POLICIES[policy], **({"max_lag": args.max_lag} if policy == "stream" else {})}
    return demo.parse(["--steps", str(args.steps), "--seed", str(seed), "--quiet",
                       "--slots", str(args.slots), "--delay-median-s", str(args.delay_median_s),
                       "--delay-sigma", str(args.delay_sigma), "--admission", schedule["admission"],
                       "--ahead", str(schedule["ahead"]), "--max-lag", str(schedule["max_lag"])])


def measure(args: argparse.Namespace) -> dict[str, list[list[dict[str, Any]]]]:
    """Each policy's runs (their step rows), seed by seed."""
    runs: dict[str, list[list[dict[str, Any]]]] = {p: [] for p in args.policies}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for policy in args.policies:
            start = time.monotonic()
            rows = demo.run(demo_args(args, policy, seed))
            runs[policy].append(rows)
            if args.out:
                folder = Path(args.out) / f"{policy}-seed{seed}"
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            if not args.json:
                print(f"{policy} seed {seed}: {len(rows)} steps in {time.monotonic() - start:.0f}s, "
                      f"final reward {final_reward(rows):.2f}", file=sys.stderr)
    return runs


def _reward(row: Mapping[str, Any]) -> float:
    return math.nan if row["reward_mean"] is None else float(row["reward_mean"])


def running_mean(rows: Sequence[Mapping[str, Any]], window: int = WINDOW) -> list[float]:
    """Each step's mean reward over it and the `window - 1` steps before it (NaNs skipped)."""
    values = [_reward(r) for r in rows]
    out = []
    for i in range(len(values)):
        part = [v for v in values[max(0, i - window + 1):i + 1] if not math.isnan(v)]
        out.append(sum(part) / len(part) if part else math.nan)
    return out


def final_reward(rows: Sequence[Mapping[str, Any]]) -> float:
    return running_mean(rows)[-1] if rows else math.nan


def _mean(values: Sequence[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def _spread(values: Sequence[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.pstdev(values) if len(values) > 1 else 0.0


def curves(runs: Sequence[Sequence[Mapping[str, Any]]]) -> dict[str, list[float]]:
    """Over the steps every run reached: samples trained, mean and spread over seeds of the
    running-mean reward, and the mean wall seconds."""
    steps = min(len(r) for r in runs)
    rewards = [running_mean(r)[:steps] for r in runs]
    samples, seconds = [], []
    for i in range(steps):
        samples.append(_mean([float(sum(int(row["groups"]) for row in r[:i + 1])) for r in runs]))
        seconds.append(_mean([float(r[i]["wall_s"]) for r in runs]))
    return {"samples_groups": samples, "seconds": seconds,
            "reward": [_mean([rw[i] for rw in rewards]) for i in range(steps)],
            "reward_spread": [_spread([rw[i] for rw in rewards]) for i in range(steps)]}


def seconds_to(curve: Mapping[str, Sequence[float]], target: float) -> float | None:
    """The wall seconds at which the mean curve first reaches `target` (None if never)."""
    for reward, seconds in zip(curve["reward"], curve["seconds"], strict=True):
        if not math.isnan(reward) and reward >= target - 1e-9:
            return seconds
    return None


def summarize(runs: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]], groups: int) -> dict[str, Any]:
    """The JSON summary (module docstring); `groups`: samples per group."""
    out: dict[str, Any] = {"policies": {}, "speedup_to_sync_final": {}}
    all_curves = {name: curves(r) for name, r in runs.items()}
    finals = {name: [final_reward(r) for r in rs] for name, rs in runs.items()}
    sync_final = _mean(finals["sync"])
    sync_seconds = _mean([float(r[-1]["wall_s"]) for r in runs["sync"]])
    for name, rs in runs.items():
        curve = all_curves[name]
        reach = seconds_to(curve, sync_final)
        rows = [row for r in rs for row in r]
        train = [row.get("train") or {} for row in rows]
        seconds = _mean([float(r[-1]["wall_s"]) for r in rs])
        out["policies"][name] = {
            "final_reward": _mean(finals[name]),
            "final_reward_spread": _spread(finals[name]),
            "final_rewards": finals[name],
            "seconds": seconds,
            "samples": _mean([float(sum(int(row["groups"]) for row in r) * groups) for r in rs]),
            "seconds_to_sync_final": reach,
            "lag_mean": _mean([float(row["lag"]) for row in rows]),
            "lag_max": max(int(row["lag"]) for row in rows),
            "importance_max_mean": _mean([float(t.get("importance_max") or math.nan) for t in train]),
            "importance_dev_mean": _mean([abs(float(t.get("importance_mean") or math.nan) - 1.0)
                                          for t in train]),
            "curve": {"samples": [s * groups for s in curve["samples_groups"]],
                      "seconds": curve["seconds"], "reward": curve["reward"],
                      "reward_spread": curve["reward_spread"]},
        }
        out["speedup_to_sync_final"][name] = None if not reach else sync_seconds / reach
    return out


def plot(summary: Mapping[str, Any], path: Path) -> bool:
    """Reward against trained samples and against wall seconds, one line per policy with its
    spread over seeds shaded; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (by_samples, by_seconds) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for name, policy in summary["policies"].items():
        c = policy["curve"]
        low = [r - s for r, s in zip(c["reward"], c["reward_spread"], strict=True)]
        high = [r + s for r, s in zip(c["reward"], c["reward_spread"], strict=True)]
        for ax, x in ((by_samples, c["samples"]), (by_seconds, c["seconds"])):
            ax.plot(x, c["reward"], label=name)
            ax.fill_between(x, low, high, alpha=0.2)
    by_samples.set_xlabel("samples trained")
    by_samples.set_ylabel(f"mean reward ({WINDOW}-step mean)")
    by_seconds.set_xlabel("wall seconds")
    by_seconds.legend()
    for ax in (by_samples, by_seconds):
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    fig.suptitle("rollstream bench learn: copy one digit, GRPO, heavy-tailed sessions "
                 "(mean over seeds, one standard deviation shaded)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        runs = measure(args)  # (DeepSpeed prints to stdout)
    summary = summarize(runs, demo.parse([]).groups)
    if args.plot:
        plot(summary, Path(args.plot))
    if args.json:
        print(json.dumps(finite(summary), allow_nan=False))
        return 0
    for name, p in summary["policies"].items():
        reach = p["seconds_to_sync_final"]
        print(f"{name:>6}: final reward {p['final_reward']:.2f} +- {p['final_reward_spread']:.2f} "
              f"in {p['seconds']:.0f}s ({p['samples']:.0f} samples); sync's final "
              + (f"at {reach:.0f}s (x{summary['speedup_to_sync_final'][name]:.2f})" if reach else "never")
              + f"; lag {p['lag_mean']:.2f} (max {p['lag_max']}); importance max "
              f"{p['importance_max_mean']:.3f}, |mean - 1| {p['importance_dev_mean']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
