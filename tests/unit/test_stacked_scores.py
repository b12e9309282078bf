"""A step's groups scored at once (`advantages.stacked_advantages`, what `pack` does when
every packed group has one size and all its rollouts train) give each group, bit for bit,
what `group_advantages` gives it alone; any other mix is scored group by group."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.advantages import ESTIMATORS, group_advantages, stacked_advantages
from pipeline.chains import Chain
from pipeline.packing import Group, Rollout, pack
from pipeline.sessions import Status

REWARDS = st.floats(-1e6, 1e6, allow_nan=False) | st.sampled_from([0.0, 1.0])


def chain(n: int = 4) -> Chain:
    return Chain(np.arange(n, dtype=np.int32), np.ones(n, bool), np.full(n, -0.5, np.float32), np.zeros(n, np.int32))


@settings(max_examples=80, deadline=None)
@given(rewards=st.lists(st.lists(REWARDS, min_size=8, max_size=8), min_size=1, max_size=6),
       estimator=st.sampled_from(sorted(ESTIMATORS)))
def test_stacked_groups_get_their_scores_alone_bit_for_bit(rewards, estimator):
    stacked = stacked_advantages(rewards, estimator=estimator, eps=1e-6)
    for row, group in zip(stacked, rewards):
        alone = group_advantages([Status.COMPLETED] * len(group), group, estimator=estimator)
        assert row.tobytes() == alone.advantages.tobytes()


@pytest.mark.parametrize("sizes, truncated", [((3, 3, 3), ()), ((3, 2, 4), ()), ((3, 3), ((1, 0),))])
@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_pack_scores_each_group_as_alone(sizes, truncated, estimator):
    rng = np.random.default_rng(len(sizes))
    groups = [Group(g, tuple(Rollout(s, Status.TRUNCATED if (g, s) in truncated else Status.COMPLETED,
                                     (chain(),), float(rng.normal())) for s in range(n)))
              for g, n in enumerate(sizes)]
    packed = pack(groups, rows=8, width=64, estimator=estimator)
    want = [group_advantages([r.status for r in g.rollouts], [r.reward for r in g.rollouts], estimator=estimator)
            for g in groups]
    for name, attr in (("rollout_advantage", "advantages"), ("rollout_trained", "trained")):
        got = getattr(packed, name)
        expected = np.concatenate([getattr(w, attr) for w in want])
        assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes()
    expected_rewards = np.concatenate([w.rewards for w in want])
    assert np.array_equal(packed.rollout_reward, expected_rewards, equal_nan=True)
