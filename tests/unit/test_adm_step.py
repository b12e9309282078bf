"""A step's packing and metrics as the admission computes them: the same values as their
definitions written plainly (numpy's own mean and std, the metrics read off the dense
arrays), whatever the groups (masked rollouts, a group id admitted twice, refusals)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.advantages import group_advantages
from pipeline.chains import Chain
from pipeline.packing import Group, Rollout, pack
from pipeline.session_metrics import session_metrics
from pipeline.sessions import Status
from tests.unit.test_packing import batches, chain

STATUSES = (Status.COMPLETED, Status.AGENT_ERROR, Status.TRUNCATED)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(STATUSES), st.floats(-1e6, 1e6)), min_size=1, max_size=16),
       st.sampled_from(["mask", "zero"]), st.floats(1e-9, 1.0))
def test_group_advantages_are_numpys_own_expressions_bit_for_bit(members, truncation: str, eps: float) -> None:
    statuses = [s for s, _ in members]
    rewards = [r for _, r in members]
    for estimator in ("group", "group_mean"):
        scores = group_advantages(statuses, rewards, estimator=estimator, truncation=truncation, eps=eps)
        base = scores.rewards[scores.trained]
        expected = np.zeros(len(members))
        if len(base):
            expected[scores.trained] = ((base - base.mean()) / (base.std() + eps) if estimator == "group"
                                        else base - base.mean())
        assert scores.advantages.tobytes() == expected.tobytes()
    assert scores.trained.tolist() == [s is not Status.TRUNCATED or truncation != "mask" for s in statuses]


def test_a_status_given_as_its_value_counts_as_the_status() -> None:
    scores = group_advantages(["completed", "truncated"], [1.0, 0.5], truncation="zero")
    assert scores.rewards.tolist() == [1.0, 0.0] and scores.trained.all()
    with pytest.raises(ValueError, match="COMPLETED rollout has no reward"):
        group_advantages([Status.COMPLETED], [None])


def _plain_metrics(admitted: list[Group], batch, updates: int) -> dict[str, float]:
    """The masking and token-lag metrics from their definitions, off the dense arrays."""
    packed = set(batch.groups)
    rollouts = [(g.group, r) for g in admitted if g.group in packed for r in g.rollouts]
    trained = {(g, s): t for g, s, t in zip(batch.rollout_group.tolist(), batch.rollout_sample.tolist(),
                                             batch.rollout_trained.tolist())}
    masked = [r for g, r in rollouts if not trained.get((g, r.sample), True)]
    completion = sum(int(np.count_nonzero(c.loss_mask)) for _, r in rollouts for c in r.chains)
    out: dict[str, float] = {}
    if rollouts:
        out["masked_share"] = len(masked) / len(rollouts)
    if completion:
        out["masked_token_share"] = sum(int(np.count_nonzero(c.loss_mask)) for r in masked for c in r.chains) / completion
    versions = batch.versions[batch.loss_mask]
    if versions.size:
        out["token_lag_mean"] = float(np.mean(updates - versions.astype(np.int64)))
        out["token_lag_max"] = float(updates - versions.min())
    return out


@settings(max_examples=200, deadline=None)
@given(batches(), st.booleans(), st.integers(0, 9))
def test_session_metrics_are_their_definitions(case, twice: bool, updates: int) -> None:
    groups, rows, width, estimator, truncation = case
    if twice and len(groups) > 1:  # a group id admitted twice: one may be packed, the other not
        groups = [*groups, dataclasses.replace(groups[0], rollouts=groups[-1].rollouts)]
    batch = pack(groups, rows=rows, width=width, estimator=estimator, truncation=truncation)
    metrics = session_metrics(groups, batch, updates=updates)
    expected = _plain_metrics(groups, batch, updates)
    for name in ("masked_share", "masked_token_share", "token_lag_max"):
        assert metrics.get(name) == expected.get(name), name
    assert metrics.get("token_lag_mean") == pytest.approx(expected.get("token_lag_mean"))
    assert np.array_equal(batch.cells("loss_mask"), batch.loss_mask[batch.segments > 0])


def test_the_refusal_names_the_first_chain_in_order_not_the_longest() -> None:
    supported = Chain(np.arange(3, dtype=np.int32), np.array([False, True, True]), np.zeros(3, np.float32),
                      np.array([-1, 0, 0], np.int32), support=np.zeros((3, 2), np.int32))
    group = Group(5, (Rollout(0, Status.COMPLETED, (supported,), reward=1.0),
                      Rollout(1, Status.COMPLETED, (chain(12),), reward=0.0)))
    batch = pack([group], rows=2, width=8)
    assert [r.reason for r in batch.refused] == [
        "sample 0 carries sampling support but support_capacity is None: "
        "a filtered-sampling source requires support_capacity"]
    batch = pack([group], rows=2, width=8, support_capacity=2)
    assert [r.reason for r in batch.refused] == ["chain of 12 tokens (sample 1) exceeds width 8"]


def test_rollouts_have_their_own_maps_and_stay_frozen() -> None:
    a, b = Rollout(0, Status.COMPLETED, ()), Rollout(0, Status.COMPLETED, ())
    assert a == b and a.components == {} and a.timings == {}
    assert a.components is not b.components and a.timings is not b.timings
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.sample = 1  # type: ignore[misc]
    c = dataclasses.replace(a, reward=0.5, timings={"latency_s": 1.0})
    assert (c.sample, c.reward, c.timings, c.components) == (0, 0.5, {"latency_s": 1.0}, {})
    assert Rollout(1, Status.TRUNCATED, (), None, {"x": 1.0}, "width", {"t": 2.0}) == Rollout(
        sample=1, status=Status.TRUNCATED, chains=(), components={"x": 1.0}, truncation="width", timings={"t": 2.0})
