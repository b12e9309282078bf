"""`rollstream bench learn`'s summary: running means, the seconds to reach sync's final
reward and the speedup, on made-up step rows."""

from __future__ import annotations

import math

import pytest

from rollstream.bench_learn import running_mean, seconds_to, summarize


def steps(rewards, seconds_per_step, lag=0):
    return [{"reward_mean": r, "groups": 8, "wall_s": (i + 1) * seconds_per_step, "lag": lag,
             "train": {"importance_max": 1.0 + lag, "importance_mean": 1.0}}
            for i, r in enumerate(rewards)]


def test_running_mean_skips_steps_without_a_reward():
    assert running_mean(steps([0.0, 1.0, None, 0.5], 1.0), window=2) == [0.0, 0.5, 1.0, 0.5]


def test_a_policy_twice_as_fast_per_step_with_the_same_curve_reaches_sync_s_final_in_half_the_time():
    ramp = [min(1.0, i / 20) for i in range(30)]
    runs = {"sync": [steps(ramp, 2.0), steps(ramp, 2.0)],
            "stream": [steps(ramp, 1.0, lag=1), steps([r * 0.5 for r in ramp], 1.0, lag=1)]}
    out = summarize(runs, groups=16)
    sync, stream = out["policies"]["sync"], out["policies"]["stream"]
    assert sync["final_reward"] == pytest.approx(1.0) and sync["final_reward_spread"] == 0
    assert stream["final_reward"] == pytest.approx(0.75) and stream["final_reward_spread"] == pytest.approx(0.25)
    assert sync["seconds"] == 60 and sync["samples"] == 30 * 8 * 16
    # the mean stream curve tops out at 0.75 < sync's 1.0: it never reaches it
    assert stream["seconds_to_sync_final"] is None and out["speedup_to_sync_final"]["stream"] is None
    assert out["speedup_to_sync_final"]["sync"] == pytest.approx(60 / sync["seconds_to_sync_final"])
    assert stream["lag_mean"] == 1 and stream["importance_max_mean"] == 2.0

    runs["stream"] = [steps(ramp, 1.0, lag=1)] * 2
    out = summarize(runs, groups=16)
    reach = out["policies"]["stream"]["seconds_to_sync_final"]
    assert reach == pytest.approx(out["policies"]["sync"]["seconds_to_sync_final"] / 2)
    assert out["speedup_to_sync_final"]["stream"] == pytest.approx(60 / reach)


def test_seconds_to_is_the_first_time_the_curve_reaches_the_target():
    curve = {"reward": [0.1, math.nan, 0.5, 0.4, 0.9], "seconds": [1.0, 2.0, 3.0, 4.0, 5.0]}
    assert seconds_to(curve, 0.5) == 3.0 and seconds_to(curve, 0.95) is None
