"""`rollstream bench pack`: non-pad token share and speed of `pipeline.packing.pack`.

For each length distribution, `rollouts` synthetic rollouts in groups of `group_size` are
packed into rows of `width` tokens. The number of rows is sized so that the admitted groups
hold `overfill` times the batch's capacity: the batch is full and the tail is cut, the
regime a scheduler that admits whole groups runs in. Reported per distribution:

- ``non_pad_share``: packed non-padding tokens / (rows * width);
- ``ms_per_1k``: wall milliseconds `pack` takes per 1000 input rollouts (advantages and the
  vectorised fill included; median of `repeats` runs);
- ``rows``, ``width``, ``groups``, ``cut``: the shape and how many groups were cut.

Distributions (token counts per chain, clipped to [16, width]):

- ``uniform``: one chain per rollout, uniform in [64, width / 2];
- ``lognormal_short``: one chain per rollout, log-normal with median 384 and sigma 0.9
  (short-heavy, a long tail: single-turn RLVR);
- ``bimodal_agentic``: 60% short failures (one chain, log-normal median 600) and 40% long
  agentic sessions of 1-3 chains (each log-normal median 2000, sigma 0.5): a session whose
  harness rewrote the context more than once has several chains.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

from pipeline.chains import Chain
from pipeline.packing import Group, Rollout, pack
from pipeline.sessions import Status

DISTRIBUTIONS = ("uniform", "lognormal_short", "bimodal_agentic")


def _lengths(name: str, rng: np.random.Generator, width: int) -> list[int]:
    """Chain lengths of one rollout under distribution `name`."""
    lengths: list[float]
    if name == "uniform":
        lengths = [float(rng.integers(64, width // 2 + 1))]
    elif name == "lognormal_short":
        lengths = [rng.lognormal(np.log(384), 0.9)]
    elif name == "bimodal_agentic":
        if rng.random() < 0.6:
            lengths = [rng.lognormal(np.log(600), 0.7)]
        else:
            lengths = list(rng.lognormal(np.log(2000), 0.5, size=rng.integers(1, 4)))
    else:
        raise ValueError(f"unknown distribution {name!r}; known: {DISTRIBUTIONS}")
    return [int(np.clip(n, 16, width)) for n in lengths]


def _chain(rng: np.random.Generator, n: int, version: int) -> Chain:
    """A chain of n tokens whose last third is completion."""
    loss = np.zeros(n, dtype=bool)
    loss[n - max(1, n // 3) :] = True
    return Chain(
        tokens=rng.integers(0, 32000, size=n, dtype=np.int32),
        loss_mask=loss,
        logprobs=np.where(loss, -rng.random(n, dtype=np.float32), 0).astype(np.float32),
        versions=np.where(loss, version, -1).astype(np.int32),
    )


def synthetic_groups(name: str, *, rollouts: int, group_size: int, width: int, seed: int) -> list[Group]:
    """`rollouts` synthetic rollouts under distribution `name`, in groups of `group_size`."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(max(1, rollouts // group_size)):
        members = []
        for s in range(group_size):
            chains = tuple(_chain(rng, n, version=3) for n in _lengths(name, rng, width))
            members.append(Rollout(s, Status.COMPLETED, chains, reward=float(rng.random() < 0.5)))
        groups.append(Group(g, tuple(members)))
    return groups


def _timed(fn: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of `repeats` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(
    seed: int = 0,
    rollouts: int = 1000,
    *,
    width: int = 4096,
    group_size: int = 8,
    overfill: float = 1.25,
    repeats: int = 3,
    distributions: Sequence[str] = DISTRIBUTIONS,
) -> dict:
    """`{"distributions": {name: {"non_pad_share", "ms_per_1k", "rows", "width", "groups",
    "cut"}}}` (module docstring)."""
    out: dict[str, dict] = {}
    for name in distributions:
        groups = synthetic_groups(name, rollouts=rollouts, group_size=group_size, width=width, seed=seed)
        total = sum(g.tokens for g in groups)
        rows = max(1, int(total / (width * overfill)))
        batch = pack(groups, rows=rows, width=width)
        n_rollouts = sum(len(g.rollouts) for g in groups)
        seconds = _timed(functools.partial(pack, groups, rows=rows, width=width), repeats)
        out[name] = {
            "non_pad_share": round(batch.non_pad_share, 4),
            "ms_per_1k": round(seconds * 1e3 * 1000 / n_rollouts, 3),
            "rows": rows,
            "width": width,
            "groups": len(groups),
            "cut": batch.cut,
        }
    return {"distributions": out}


def main(argv: Sequence[str] | None = None) -> int:
    """Print the benchmark; `--json` prints the JSON document only."""
    parser = argparse.ArgumentParser(prog="rollstream bench pack", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rollouts", type=int, default=1000)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="print the JSON document only")
    args = parser.parse_args(argv)
    result = run(args.seed, args.rollouts, width=args.width, group_size=args.group_size)
    if args.json:
        print(json.dumps(result))
        return 0
    for name, r in result["distributions"].items():
        print(
            f"{name:>16}: non-pad {r['non_pad_share']:.1%}, {r['ms_per_1k']:.2f} ms per 1k rollouts "
            f"({r['rows']} x {r['width']}, {r['cut']}/{r['groups']} groups cut)"
        )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
