"""Packing, advantages, session metrics and the pack benchmark."""

from __future__ import annotations

from collections import Counter
from typing import get_args

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream import bench_pack
from pipeline.advantages import ESTIMATORS, TRUNCATIONS, Estimator, Truncation, group_advantages
from pipeline.config import SchedulerConfig, build
from pipeline.errors import ConfigError
from pipeline.chains import Chain
from pipeline.packing import Group, PackedBatch, Rollout, check_support, pack
from pipeline.session_metrics import session_metrics
from pipeline.sessions import Call, Session, Status

OK = Status.COMPLETED


def chain(n: int, *, seed: int = 0, completion: int | None = None, version: int = 0) -> Chain:
    """A chain of n tokens whose last `completion` tokens (default: half) are loss tokens."""
    rng = np.random.default_rng(seed)
    loss = np.zeros(n, dtype=bool)
    loss[n - (n // 2 if completion is None else completion) :] = True
    return Chain(
        tokens=rng.integers(1, 1000, n, dtype=np.int32),
        loss_mask=loss,
        logprobs=np.where(loss, -rng.random(n), 0).astype(np.float32),
        versions=np.where(loss, version, -1).astype(np.int32),
    )


def group(gid: int, *lengths: int, rewards: tuple[float, ...] | None = None) -> Group:
    """One rollout per length, rewards alternating 1, 0 unless given."""
    rewards = rewards or tuple(float(i % 2 == 0) for i in range(len(lengths)))
    return Group(
        gid,
        tuple(
            Rollout(i, OK, (chain(n, seed=gid * 100 + i),), reward=r)
            for i, (n, r) in enumerate(zip(lengths, rewards, strict=True))
        ),
    )


# ---------------------------------------------------------------- property tests


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[Group], int, int, str, str]:
    width = draw(st.integers(4, 16))
    rows = draw(st.integers(1, 4))
    groups = []
    for g in range(draw(st.integers(1, 6))):
        rollouts = []
        for s in range(draw(st.integers(1, 4))):
            chains = []
            for c, n in enumerate(draw(st.lists(st.integers(0, width + 2), max_size=3))):
                mask = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
                ids = np.arange(n, dtype=np.int32) + 1000 * (100 * g + 10 * s + c)
                chains.append(
                    Chain(
                        ids,
                        mask,
                        np.where(mask, -(ids % 997 + 1) / 997, 0).astype(np.float32),
                        np.where(mask, g, -1).astype(np.int32),
                    )
                )
            status = draw(st.sampled_from([Status.COMPLETED, Status.AGENT_ERROR, Status.TRUNCATED]))
            reward = draw(st.floats(-2, 2)) if status is Status.COMPLETED or draw(st.booleans()) else None
            rollouts.append(Rollout(10 + s, status, tuple(chains), reward=reward))
        groups.append(Group(7 * g + 3, tuple(rollouts)))
    estimator = draw(st.sampled_from(["group", "group_mean", "rloo"]))
    truncation = draw(st.sampled_from(["mask", "zero"]))
    return groups, rows, width, estimator, truncation


def _check_rows(batch: PackedBatch) -> list[tuple[int, int, int, int]]:
    """Row layout invariants; returns (row, segment, start, stop) of every segment."""
    spans = []
    for r in range(batch.rows):
        seg = batch.segments[r]
        used = int(np.count_nonzero(seg))
        assert (seg[:used] > 0).all() and (seg[used:] == 0).all(), "padding only at the row's end"
        assert (np.diff(seg[:used]) >= 0).all() and (np.diff(seg[:used]) <= 1).all()
        assert used == 0 or seg[0] == 1
        pad = slice(used, None)
        assert (batch.tokens[r, pad] == 0).all() and (batch.versions[r, pad] == -1).all()
        assert not batch.loss_mask[r, pad].any() and (batch.advantages[r, pad] == 0).all()
        for s in range(1, int(seg.max(initial=0)) + 1):
            where = np.flatnonzero(seg == s)
            start, stop = int(where[0]), int(where[-1]) + 1
            assert len(where) == stop - start, "a chain is contiguous"
            assert batch.positions[r, start:stop].tolist() == list(range(stop - start))
            spans.append((r, s, start, stop))
    return spans


@settings(max_examples=150, deadline=None)
@given(batches())
def test_every_admitted_token_is_packed_exactly_once(case: tuple[list[Group], int, int, str, str]) -> None:
    groups, rows, width, estimator, truncation = case
    batch = pack(groups, rows=rows, width=width, estimator=estimator, truncation=truncation)
    by_id = {g.group: g for g in groups}
    refused = {r.group for r in batch.refused}
    # every group is wholly packed, cut or refused, in order
    assert sorted([*batch.groups, *batch.cut_groups, *refused]) == sorted(by_id)
    assert list(batch.groups) == [g.group for g in groups if g.group in set(batch.groups)]
    assert batch.cut == len(batch.cut_groups)
    for g in groups:
        too_long = any(len(c) > width for r in g.rollouts for c in r.chains)
        assert too_long <= (g.group in refused)
    first = next((g for g in groups if g.group not in refused), None)
    assert first is None or first.group in batch.groups, "the first placeable group is never cut"

    seen: Counter[tuple[int, int, int]] = Counter()
    for r, s, start, stop in _check_rows(batch):
        gid, sample, ci = (
            int(a[r, s]) for a in (batch.segment_group, batch.segment_sample, batch.segment_chain)
        )
        g = by_id[gid]
        pos = next(i for i, ro in enumerate(g.rollouts) if ro.sample == sample)
        c = g.rollouts[pos].chains[ci]
        scores = group_advantages(
            [ro.status for ro in g.rollouts],
            [ro.reward for ro in g.rollouts],
            estimator=estimator,
            truncation=truncation,
        )
        cells = (r, slice(start, stop))
        np.testing.assert_array_equal(batch.tokens[cells], c.tokens)
        np.testing.assert_array_equal(batch.logprobs[cells], c.logprobs)
        np.testing.assert_array_equal(batch.versions[cells], c.versions)
        loss = c.loss_mask & bool(scores.trained[pos])
        np.testing.assert_array_equal(batch.loss_mask[cells], loss)
        expected = np.where(loss, np.float32(scores.advantages[pos]), np.float32(0))
        np.testing.assert_array_equal(batch.advantages[cells], expected)
        seen[(gid, sample, ci)] += 1
    expected_chains = Counter(
        (gid, ro.sample, ci)
        for gid in batch.groups
        for ro in by_id[gid].rollouts
        for ci, c in enumerate(ro.chains)
        if len(c)
    )
    assert seen == expected_chains
    packed_tokens = sum(by_id[gid].tokens for gid in batch.groups)
    assert batch.non_pad_share == pytest.approx(packed_tokens / (rows * width))
    assert len(batch.rollout_group) == sum(len(by_id[gid].rollouts) for gid in batch.groups)


# ---------------------------------------------------------------- cut and refused


def test_group_that_does_not_fit_is_cut_and_a_later_one_still_packs() -> None:
    batch = pack([group(0, 6), group(1, 3, 3), group(2, 4)], rows=1, width=10)
    assert batch.groups == (0, 2) and batch.cut_groups == (1,) and batch.cut == 1
    assert batch.segments[0].tolist() == [1] * 6 + [2] * 4
    assert batch.non_pad_share == 1.0


def test_groups_share_rows_and_a_group_spans_rows() -> None:
    batch = pack([group(0, 5, 5), group(1, 3, 2)], rows=2, width=8)
    assert batch.groups == (0, 1) and batch.cut == 0
    assert set(batch.segment_group[0, 1:]) == {0, 1} and set(batch.segment_group[1, 1:]) == {0, 1}


def test_chain_longer_than_width_is_refused_with_the_reason() -> None:
    batch = pack([group(0, 12), group(1, 4)], rows=2, width=10)
    assert batch.groups == (1,) and batch.cut == 0
    (refusal,) = batch.refused
    assert (
        refusal.group == 0 and "chain of 12 tokens" in refusal.reason and "exceeds width 10" in refusal.reason
    )


def test_group_larger_than_an_empty_batch_is_refused_not_cut() -> None:
    batch = pack([group(0, 8, 8, 8)], rows=2, width=10)
    assert batch.groups == () and batch.cut == 0
    assert "does not fit 2 rows of 10" in batch.refused[0].reason


def test_best_fit_fills_the_tightest_row() -> None:
    batch = pack([group(0, 6, 7), group(1, 3, 4)], rows=2, width=10)
    assert batch.non_pad_share == 1.0 and batch.cut == 0


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="rows and width"):
        pack([], rows=0, width=8)
    with pytest.raises(ValueError, match="estimator"):
        pack([], rows=1, width=8, estimator="ppo")
    with pytest.raises(ValueError, match="truncation"):
        pack([], rows=1, width=8, truncation="drop")
    empty = pack([], rows=2, width=4)
    assert empty.tokens.shape == (2, 4) and empty.non_pad_share == 0.0 and empty.groups == ()


# ---------------------------------------------------------------- advantages


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("group", [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6)] * 2),
        ("group_mean", [0.5, -0.5, 0.5, -0.5]),
        ("rloo", [2 / 3, -2 / 3, 2 / 3, -2 / 3]),
    ],
)
def test_estimators_by_hand(estimator: str, expected: list[float]) -> None:
    scores = group_advantages([OK] * 4, [1.0, 0.0, 1.0, 0.0], estimator=estimator)
    np.testing.assert_allclose(scores.advantages, expected, rtol=1e-9)
    assert scores.trained.all()


def test_each_policy_is_one_row_the_config_accepts_and_no_other() -> None:
    assert get_args(Estimator) == tuple(ESTIMATORS)
    assert get_args(Truncation) == tuple(TRUNCATIONS)
    for name in ESTIMATORS:
        assert build(SchedulerConfig, {"estimator": name}).estimator == name
    for name in TRUNCATIONS:
        assert build(SchedulerConfig, {"truncation": name}).truncation == name
    with pytest.raises(ConfigError, match="truncation"):
        build(SchedulerConfig, {"truncation": "clip"})


def test_single_member_baselines_give_zero() -> None:
    for estimator in ("group", "group_mean", "rloo"):
        assert group_advantages([OK], [3.0], estimator=estimator).advantages.tolist() == [0.0]


@pytest.mark.parametrize(
    ("truncation", "rewards", "advantages", "trained"),
    [
        # baseline over {1, 0, 0 (agent error without reward)}: mean 1/3; the truncation is out
        ("mask", [1.0, 0.0, 1.0, 0.0], [2 / 3, -1 / 3, 0.0, -1 / 3], [True, True, False, True]),
        ("score", [1.0, 0.0, 1.0, 0.0], [0.5, -0.5, 0.5, -0.5], [True] * 4),
        ("zero", [1.0, 0.0, 0.0, 0.0], [0.75, -0.25, -0.25, -0.25], [True] * 4),
    ],
)
def test_truncation_policies_by_hand(
    truncation: str, rewards: list[float], advantages: list[float], trained: list[bool]
) -> None:
    statuses = [OK, OK, Status.TRUNCATED, Status.AGENT_ERROR]
    scores = group_advantages(statuses, [1.0, 0.0, 1.0, None], estimator="group_mean", truncation=truncation)
    np.testing.assert_allclose(scores.rewards, rewards)
    np.testing.assert_allclose(scores.advantages, advantages, atol=1e-12)
    assert scores.trained.tolist() == trained


def test_rollouts_that_cannot_train_as_given_are_errors() -> None:
    with pytest.raises(ValueError, match="COMPLETED rollout has no reward"):
        group_advantages([OK, OK], [1.0, None])
    with pytest.raises(ValueError, match="INFRA_ERROR rollout is never admitted"):
        group_advantages([Status.INFRA_ERROR], [None])
    with pytest.raises(ValueError, match="truncation='score'"):
        group_advantages([Status.TRUNCATED], [None], truncation="score")
    bad = Group(4, (Rollout(0, OK, (chain(4),)),))
    with pytest.raises(ValueError, match="group 4: a COMPLETED rollout has no reward"):
        pack([bad], rows=1, width=8)


def test_masked_truncation_is_packed_without_loss() -> None:
    rollouts = (
        Rollout(0, OK, (chain(6),), reward=1.0),
        Rollout(1, Status.TRUNCATED, (chain(6),), reward=None),
        Rollout(2, OK, (chain(6),), reward=0.0),
    )
    batch = pack([Group(0, rollouts)], rows=3, width=6, estimator="group_mean")
    row_of = {int(batch.segment_sample[r, 1]): r for r in range(3)}
    assert not batch.loss_mask[row_of[1]].any() and (batch.advantages[row_of[1]] == 0).all()
    assert (batch.advantages[row_of[0]][batch.loss_mask[row_of[0]]] == 0.5).all()
    assert (batch.advantages[row_of[2]][batch.loss_mask[row_of[2]]] == -0.5).all()
    assert batch.rollout_trained.tolist() == [True, False, True]
    assert batch.rollout_advantage.tolist() == [0.5, 0.0, -0.5]


# ---------------------------------------------------------------- support


def _support_group(k: int) -> Group:
    call = Call([1, 2], [3, 4], [-0.1, -0.2], 0, support=np.arange(2 * k).reshape(2, k))
    return Group.from_sessions(0, {0: Session(OK, reward=1.0, calls=[call])})


def test_support_is_packed_within_capacity() -> None:
    batch = pack([_support_group(2)], rows=1, width=6, support_capacity=3)
    assert batch.support is not None and batch.support.shape == (1, 6, 3)
    assert batch.support[0].tolist() == [[-1] * 3, [-1] * 3, [0, 1, -1], [2, 3, -1], [-1] * 3, [-1] * 3]


def test_support_without_or_beyond_capacity_is_refused() -> None:
    without = pack([_support_group(2)], rows=1, width=6)
    assert without.groups == () and "support_capacity is None" in without.refused[0].reason
    beyond = pack([_support_group(4)], rows=1, width=6, support_capacity=3)
    assert "above support_capacity 3" in beyond.refused[0].reason


def test_check_support_names_support_capacity() -> None:
    with pytest.raises(ValueError, match="support_capacity"):
        check_support(True, None)
    check_support(True, 8)
    check_support(False, None)
    with pytest.raises(ValueError, match="support_capacity"):
        check_support(False, 0)


# ---------------------------------------------------------------- session metrics


def test_session_metrics_by_hand() -> None:
    s0 = Session(
        OK,
        reward=1.0,
        components={"Format": 1.0},
        calls=[Call([1, 2], [3], [-0.1], 4), Call([1, 2, 3, 9], [5, 6], [-0.2, -0.3], 5)],
        timings={"submitted": 10.0, "finished": 14.0},
    )
    s1 = Session(
        Status.TRUNCATED, reward=None, calls=[Call([1], [2, 3], [-0.1, -0.1], 5)], timings={"latency_s": 2.0}
    )
    s2 = Session(
        Status.AGENT_ERROR, reward=None, components={"Format": 0.0}, calls=[Call([7], [8], [-0.1], 5)]
    )
    admitted = [Group.from_sessions(1, {0: s0, 1: s1, 2: s2}), group(2, 8, 8)]
    batch = pack(admitted, rows=1, width=16)
    assert batch.groups == (1,) and batch.cut == 1
    m = session_metrics(admitted, batch, updates=6)
    # call tokens 3 + 6 + 3 + 2 = 14; chain tokens 6 + 3 + 2 = 11
    assert m["merge_ratio"] == pytest.approx(1 - 11 / 14)
    assert m["rollouts"] == 3
    assert m["share_completed"] == m["share_truncated"] == m["share_agent_error"] == pytest.approx(1 / 3)
    assert m["masked_share"] == pytest.approx(1 / 3) and m["masked_token_share"] == pytest.approx(2 / 6)
    assert m["reward_mean"] == 1.0 and m["reward_format_mean"] == 0.5
    assert m["latency_s_max"] == 4.0 and m["latency_s_p50"] == pytest.approx(3.0)
    # loss tokens of s0 (versions 4, 5, 5) and s2 (5): lags 2, 1, 1, 1
    assert m["token_lag_mean"] == pytest.approx(5 / 4) and m["token_lag_max"] == 2.0
    assert m["non_pad_share"] == pytest.approx(11 / 16)


# ---------------------------------------------------------------- benchmark


def test_bench_pack_structure_and_density() -> None:
    result = bench_pack.run(rollouts=200)
    assert set(result["distributions"]) == set(bench_pack.DISTRIBUTIONS)
    for stats in result["distributions"].values():
        assert 0 < stats["non_pad_share"] <= 1 and stats["ms_per_1k"] > 0
    assert result["distributions"]["lognormal_short"]["non_pad_share"] >= 0.95
