"""`rollstream.group_window`: one group at a time with unlimited slots, its results ageing
out at the pushes (or a fixed time after they land), under a family of simple policies."""

import math
import random

import numpy as np
import pytest

from rollstream.bench_schedule import push_interval, workload_for
from rollstream.group_window import (GroupPolicy, PushIntervals, SessionLengths, best_group_policy, group_waste,
                                     improvement_step, policy_grid)

W = workload_for(False, median_ms=1000.0)
SHARE = 0.598  # `batch`'s share at max_lag 1 in BENCHMARKS.md: a push every 2.74 s


def test_a_window_longer_than_any_session_wastes_nothing():
    push = push_interval(W, SHARE, W["mean_session_s"])
    lag = math.ceil(20.0 / push)  # every result lives at least lag pushes: longer than any session
    for pushes in (True, False):
        out = group_waste(W, lag, SHARE, GroupPolicy(), pushes, groups=2000)
        assert out["waste_share"] == 0.0
        assert out["attempts_per_group"] == W["groups"]
        assert abs(out["trained_length_vs_workload"] - 1.0) < 0.05


def test_an_extra_attempt_is_given_up_at_its_age_when_the_group_completes():
    # nine start together and nothing ages out: the ninth is given up as the eighth lands
    out = group_waste(W, 8, SHARE, GroupPolicy(extra_first=1), False, groups=20000, seed=3)
    assert out["attempts_per_group"] == 9
    draws = np.sort(np.minimum(np.exp(np.random.default_rng(7).normal(0.0, 1.0, (200000, 9))), 20.0), axis=1)
    trained, wasted = draws[:, :8].sum(axis=1).mean(), draws[:, 7].mean()
    assert abs(out["waste_share"] - wasted / (trained + wasted)) < 0.005


def test_results_ageing_out_at_the_pushes_waste_more_than_a_fixed_time_after_landing():
    at_pushes = group_waste(W, 1, SHARE, GroupPolicy(), True, groups=4000)["waste_share"]
    after_landing = group_waste(W, 1, SHARE, GroupPolicy(), False, groups=4000)["waste_share"]
    assert at_pushes > after_landing + 0.03 > 0.2


def test_a_replacement_started_ahead_and_a_start_at_a_push_each_waste_less():
    def waste(**policy):
        return group_waste(W, 1, SHARE, GroupPolicy(**policy), True, groups=4000, seed=1)["waste_share"]

    naive, ahead = waste(), waste(lead_s=0.5)
    assert ahead < naive - 0.05
    assert waste(lead_s=0.5, start_phase=0.0) < ahead - 0.01


def test_giving_up_stragglers_trains_shorter_sessions_and_wastes_their_time():
    def run(**policy):
        return group_waste(W, 1, SHARE, GroupPolicy(**policy), True, groups=2000, seed=2)

    kept, given_up = run(), run(give_up_after_s=2.0)
    assert given_up["trained_length_vs_workload"] < kept["trained_length_vs_workload"] - 0.2
    assert given_up["waste_share"] > kept["waste_share"]


def test_the_best_policy_of_the_grid_is_measured_on_other_groups_beside_the_naive_one():
    out = best_group_policy(W, 1, SHARE, pushes=True, groups=200)
    assert GroupPolicy(**out["policy"]) in policy_grid(True)
    assert out["waste_share"] < out["naive_waste_share"]
    assert out["max_lag"] == 1 and out["pushes"] is True
    assert len(policy_grid(False)) * 4 == len(policy_grid(True))


def test_a_lead_longer_than_a_result_lives_replaces_it_as_it_lands():
    # every result is replaced at once, so 8 attempts always run; no event goes back in time
    # (that would count slot-seconds twice and put the waste share above 1)
    long_lead = group_waste(W, 1, SHARE, GroupPolicy(lead_s=100.0), True, groups=2000, seed=4)
    at_half_a_second = group_waste(W, 1, SHARE, GroupPolicy(lead_s=0.5), True, groups=2000, seed=4)
    assert at_half_a_second["waste_share"] < long_lead["waste_share"] < 1.0
    assert long_lead["attempts_per_group"] > at_half_a_second["attempts_per_group"] + 2


def test_the_waste_is_split_by_where_it_went():
    def run(**policy):
        return group_waste(W, 1, SHARE, GroupPolicy(**policy), True, groups=3000, seed=5)

    for out in (run(), run(lead_s=0.75, start_phase=0.0), run(extra=1, give_up_after_s=3.0)):
        assert abs(sum(out["wasted_by"].values()) - out["waste_share"]) < 2e-4
    naive, ahead, extra = run(), run(lead_s=0.75, start_phase=0.0), run(extra=1, give_up_after_s=3.0)
    # replacing only what ages out wastes only what aged out
    assert naive["wasted_by"] == {"aged_out": naive["waste_share"], "running_at_training": 0.0,
                                  "given_up": 0.0}
    # a replacement started ahead turns most of it into replacements still running at training
    assert ahead["wasted_by"]["running_at_training"] > 5 * ahead["wasted_by"]["aged_out"] > 0
    assert extra["wasted_by"]["given_up"] > 0


def test_pushes_at_random_intervals_have_the_mean_and_spread_asked():
    push = push_interval(W, SHARE, W["mean_session_s"])
    rng = random.Random(0)
    for cv in (0.2, 1.0):
        intervals = PushIntervals(rng, push, cv)
        draws = np.array([intervals.draw() for _ in range(40000)])
        assert abs(draws.mean() / push - 1) < 0.02
        assert abs(draws.std() / draws.mean() - cv) < 0.03
    # exponential intervals (cv 1): from a random time, the last push and the next are each
    # an interval's mean away, so the interval under way is twice as long as most
    starts = np.array([PushIntervals(rng, push, 1.0).around_start(None) for _ in range(40000)])
    assert abs(-starts[:, 0].mean() / push - 1) < 0.03
    assert abs(starts[:, 1].mean() / push - 1) < 0.03
    at_push = np.array([PushIntervals(rng, push, 1.0).around_start(0.0) for _ in range(40000)])
    assert (at_push[:, 0] == 0).all() and abs(at_push[:, 1].mean() / push - 1) < 0.03


def test_results_age_out_lag_plus_one_random_pushes_after_they_land():
    push = push_interval(W, SHARE, W["mean_session_s"])
    # intervals of cv 0.2 are almost never under 0.3 of their mean: a window of this many
    # pushes outlives every session, and a lag too short for it wastes
    lag = math.ceil(20.0 / (0.3 * push))
    out = group_waste(W, lag, SHARE, GroupPolicy(), True, groups=2000, seed=6, push_cv=0.2)
    assert out["waste_share"] == 0.0 and out["attempts_per_group"] == W["groups"]
    assert out["push_cv"] == 0.2
    assert group_waste(W, 1, SHARE, GroupPolicy(), True, groups=2000, seed=6, push_cv=0.2)["waste_share"] > 0.2


def test_irregular_pushes_cost_a_group_started_at_a_push():
    def waste(cv: float, phase: float | None) -> float:
        policy = GroupPolicy(lead_s=0.5, start_phase=phase)
        return group_waste(W, 1, SHARE, policy, True, groups=6000, seed=1, push_cv=cv)["waste_share"]

    steady = waste(0.0, 0.0)
    assert waste(1.0, 0.0) > steady + 0.01
    # started anywhere, a long interval's start gains a little, and never reaches the steady start
    assert steady < waste(1.0, None) < waste(0.0, None)


def test_push_cv_needs_pushes_and_cannot_be_negative():
    for pushes, cv in ((True, -0.1), (False, 0.5)):
        with pytest.raises(ValueError, match="push_cv"):
            group_waste(W, 1, SHARE, GroupPolicy(), pushes, groups=10, push_cv=cv)


def test_a_running_attempts_length_is_drawn_given_its_age():
    sessions = SessionLengths(W)
    rng = random.Random(0)
    population = np.minimum(np.exp(np.random.default_rng(8).normal(0.0, 1.0, 400000)), 20.0)
    for age in (0.0, 0.5, 2.0, 6.0):
        draws = np.array([sessions.given_age(rng, age) for _ in range(40000)])
        assert draws.min() >= age and draws.max() <= 20.0
        tail = population[population > age]
        assert abs(draws.mean() / tail.mean() - 1) < 0.03
        assert abs(np.median(draws) / np.median(tail) - 1) < 0.03
    assert sessions.given_age(rng, 25.0) == 25.0  # past the cap it should have landed: no draw is shorter


def test_the_improvement_step_leaves_a_rule_that_wastes_nothing_as_it_is():
    push = push_interval(W, SHARE, W["mean_session_s"])
    lag = math.ceil(20.0 / push)  # every result outlives every session: the rule wastes nothing
    out = improvement_step(W, lag, SHARE, GroupPolicy(start_phase=0.0), groups=20, continuations=8)
    assert out["theta"] == 0.0
    assert out["rule_waste_share"] == out["improved_waste_share"] == 0.0
    # an extra attempt or a give-up only adds waste and fewer starts gain nothing, so the
    # rule's option is taken at every event: the start and each landing but the last
    assert out["options_taken"] == {"rule": 20 * W["groups"], "fewer": 0, "more": 0, "give_up": 0}


def test_the_improvement_step_gains_clearly_on_a_rule_that_only_replaces_what_ages_out():
    out = improvement_step(W, 1, SHARE, GroupPolicy(start_phase=0.0), groups=120, continuations=24, seed=2)
    # the groups' waste is heavy-tailed, so 120 of them measure the gain only roughly
    assert out["gain"] > max(0.02, out["gain_se"])
    # what it gains by: attempts started before their results age out, as `lead_s` does
    assert out["options_taken"]["more"] > 10 * out["options_taken"]["fewer"]


def test_the_improvement_step_needs_groups_and_continuations_to_compare():
    with pytest.raises(ValueError, match="continuations=1"):
        improvement_step(W, 1, SHARE, GroupPolicy(), groups=10, continuations=1)


def test_the_improvement_step_runs_on_the_relaxed_window_too():
    steady = improvement_step(W, 1, SHARE, GroupPolicy(), groups=60, continuations=4, seed=5)
    relaxed = improvement_step(W, 1, SHARE, GroupPolicy(), groups=60, continuations=4, seed=5, pushes=False)
    assert steady["pushes"] is True and relaxed["pushes"] is False
    assert relaxed["theta"] == group_waste(W, 1, SHARE, GroupPolicy(), False, 4 * 60, 6)["waste_share"]
    # the same sessions, each result living as long as steady pushes let any: the rule wastes less
    assert relaxed["rule_waste_share"] < steady["rule_waste_share"] - 0.03
