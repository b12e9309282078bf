"""Per-rollout rewards and advantages of one group (GRPO and its family).

`group_advantages(statuses, rewards, estimator=..., truncation=...)` returns, for each
rollout of a group, the reward it trains on, its advantage and whether it trains at all.

Rewards by status (the admission rules of `pipeline.scheduler`):

- COMPLETED trains on its verifier reward; a COMPLETED rollout without one is an error.
- AGENT_ERROR trains on its reward; a missing reward counts as 0.0 (the agent failed).
- TRUNCATED follows `truncation`:
  - ``mask`` (default): the rollout stays in the group (its tokens are packed, so the
    group keeps its shape) but it does not train: its loss mask is all False, its advantage
    is 0 and it does not enter the group baseline. Agentic limits (context, turns, wall
    clock) say nothing about the policy's answer, so the rollout neither scores nor shifts
    its siblings' baseline.
  - ``score``: trains on its verifier reward like a completed rollout (single-turn RLVR);
    a truncation without a reward is an error here (the scheduler resubmits those).
  - ``zero``: trains with reward 0.0, a length penalty.
- INFRA_ERROR and CANCELLED are never admitted; passing one is an error.

Estimators over the baseline set B (the rollouts that train), for rollout i in B with
reward r_i, n = |B|, mean m and population standard deviation s of the rewards in B:

- ``group``:      A_i = (r_i - m) / (s + eps)
- ``group_mean``: A_i = r_i - m                     (Dr. GRPO: no std normalisation)
- ``rloo``:       A_i = r_i - (sum_{j in B, j != i} r_j) / (n - 1)   (0 when n == 1)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from pipeline.sessions import Status

# The policies, each a row of a table: a new one is a Literal value and a row (test_packing
# checks that they agree), then its value in the chart's values.schema.json (test_helm).
Truncation = Literal["mask", "score", "zero"]
Estimator = Literal["group", "group_mean", "rloo"]


def _scored(reward: float | None) -> float:
    if reward is None:
        raise ValueError(
            "a TRUNCATED rollout without a reward cannot train under truncation='score' "
            "(the scheduler resubmits it with cause 'unscored')"
        )
    return float(reward)


TRUNCATIONS: dict[str, Callable[[float | None], float | None]] = {
    "mask": lambda reward: None,  # in the group, not trained, outside the baseline
    "score": _scored,  # its verifier reward
    "zero": lambda reward: 0.0,  # a length penalty
}
"""The reward a TRUNCATED rollout trains on (None: masked), by `truncation` (docstring)."""


def _rloo(base: np.ndarray, eps: float) -> np.ndarray:
    n = len(base)
    return base - (base.sum() - base) / (n - 1) if n > 1 else np.zeros(n)


def _mean(base: np.ndarray) -> np.float64:
    """`base.mean()` of a float64 vector, the same operations without numpy's dispatch."""
    return np.add.reduce(base) / len(base)


def _normalised(base: np.ndarray, eps: float) -> np.ndarray:
    """`(base - base.mean()) / (base.std() + eps)` of a float64 vector: numpy's own
    operations in its order (the mean: sum, divide; the population std: subtract, square,
    sum, divide, root), without its dispatch, the deviations from the mean computed once."""
    d = base - _mean(base)
    return d / (np.sqrt(np.add.reduce(d * d) / len(base)) + eps)


def _stacked_mean(base: np.ndarray) -> np.ndarray:
    """`_mean` of each row of `base`, as a column."""
    return (np.add.reduce(base, axis=1) / base.shape[1])[:, None]


def _stacked_normalised(base: np.ndarray, eps: float) -> np.ndarray:
    """`_normalised` of each row of `base`."""
    d = base - _stacked_mean(base)
    return d / (np.sqrt(np.add.reduce(d * d, axis=1) / base.shape[1]) + eps)[:, None]


def _stacked_rloo(base: np.ndarray, eps: float) -> np.ndarray:
    n = base.shape[1]
    return base - (np.add.reduce(base, axis=1)[:, None] - base) / (n - 1) if n > 1 else np.zeros(base.shape)


_STACKED: dict[str, Callable[[np.ndarray, float], np.ndarray]] = {
    "group": _stacked_normalised,
    "group_mean": lambda base, eps: base - _stacked_mean(base),
    "rloo": _stacked_rloo,
}
"""`ESTIMATORS` of groups of one size, a row each (`stacked_advantages`)."""

ESTIMATORS: dict[str, Callable[[np.ndarray, float], np.ndarray]] = {
    "group": _normalised,
    "group_mean": lambda base, eps: base - _mean(base),
    "rloo": _rloo,
}
"""The advantages of the rewards of a group's baseline set, by `estimator` (docstring)."""


@dataclass(frozen=True)
class GroupScores:
    """What one group trains on: per rollout `rewards` (NaN for a masked rollout without a
    reward), `advantages` (0 for masked rollouts) and `trained` (False when masked)."""

    rewards: np.ndarray
    advantages: np.ndarray
    trained: np.ndarray


def check_policy(estimator: str, truncation: str) -> None:
    """Raise ValueError for an unknown estimator or truncation policy."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {tuple(ESTIMATORS)}, got {estimator!r}")
    if truncation not in TRUNCATIONS:
        raise ValueError(f"truncation must be one of {tuple(TRUNCATIONS)}, got {truncation!r}")


_COMPLETED = Status.COMPLETED


def training_reward(status: Status, reward: float | None, truncation: str) -> float | None:
    """The reward a rollout trains on, or None when it is masked (does not train).

    Raises ValueError for rollouts that cannot be admitted as they are.
    """
    if type(status) is not Status:  # a value of the enum, or its name's string
        status = Status(status)
    if status is Status.COMPLETED:
        if reward is None:
            raise ValueError("a COMPLETED rollout has no reward: its verifier must score it")
        return float(reward)
    if status is Status.AGENT_ERROR:
        return 0.0 if reward is None else float(reward)
    if status is Status.TRUNCATED:
        return TRUNCATIONS[truncation](reward)
    raise ValueError(f"a {status.name} rollout is never admitted, so it cannot be packed")


def group_advantages(
    statuses: Sequence[Status],
    rewards: Sequence[float | None],
    *,
    estimator: str = "group",
    truncation: str = "mask",
    eps: float = 1e-6,
) -> GroupScores:
    """Rewards, advantages and trained flags of one group's rollouts (module docstring)."""
    check_policy(estimator, truncation)
    return scores_of(training_rewards(statuses, rewards, truncation), rewards, estimator=estimator, eps=eps)


def training_rewards(statuses: Sequence[Status], rewards: Sequence[float | None],
                     truncation: str) -> list[float | None]:
    """`training_reward` of each rollout of a group (ValueError as it raises)."""
    if len(statuses) != len(rewards):
        raise ValueError(f"{len(statuses)} statuses for {len(rewards)} rewards")
    # a COMPLETED rollout with its reward (usually all of them) trains on it, as `training_reward` says
    return [float(r) if s is _COMPLETED and r is not None else training_reward(s, r, truncation)
            for s, r in zip(statuses, rewards, strict=True)]


def stacked_advantages(used: Sequence[Sequence[float]], *, estimator: str, eps: float) -> np.ndarray:
    """The advantages of several groups of one size whose rollouts all train (`used`: each
    group's training rewards), `[groups, size]`: the estimator's operations applied to all
    the groups at once, row by row, which gives each group what `scores_of` gives it."""
    return _STACKED[estimator](np.array(used, dtype=np.float64), eps)


def scores_of(used: Sequence[float | None], rewards: Sequence[float | None], *, estimator: str,
              eps: float) -> GroupScores:
    """The scores of one group whose training rewards (`training_rewards`) are `used`."""
    if None not in used:  # every rollout trains: the baseline set is the group
        reported = np.array(used, dtype=np.float64)
        return GroupScores(rewards=reported, advantages=ESTIMATORS[estimator](reported, eps),
                           trained=np.ones(len(used), dtype=bool))
    trained = np.array([u is not None for u in used], dtype=bool)
    reported = np.array(
        [
            u if u is not None else (np.nan if r is None else float(r))
            for u, r in zip(used, rewards, strict=True)
        ],
        dtype=np.float64,
    )
    adv = np.zeros(len(used), dtype=np.float64)
    base = reported[trained]
    if len(base):
        adv[trained] = ESTIMATORS[estimator](base, eps)
    return GroupScores(rewards=reported, advantages=adv, trained=trained)
