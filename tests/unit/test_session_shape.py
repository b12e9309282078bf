"""The sessions' shape fitted from a duration histogram, with the sessions cut short as
censored: what `rollstream tune --prometheus` reads."""

import bisect
import math
import random

import pytest

from pipeline.metrics import SESSION_BUCKETS
from rollstream import session_shape
from rollstream.cli import main

BOUNDS = [*SESSION_BUCKETS, math.inf]


def _buckets(values):
    counts = [0] * len(BOUNDS)
    for v in values:
        counts[bisect.bisect_left(BOUNDS, v)] += 1
    cumulative = [(le, float(sum(counts[:i + 1]))) for i, le in enumerate(BOUNDS)]
    return session_shape.intervals(cumulative)


def _cut_at(rng, n, median, sigma, cut_s):
    ended, cut = [], []
    for _ in range(n):
        d = rng.lognormvariate(math.log(median), sigma)
        (ended if d <= cut_s else cut).append(min(d, cut_s))
    return ended, cut


def test_a_cumulative_histogram_becomes_its_buckets():
    assert session_shape.intervals([(1.0, 2.0), (0.5, 0.0), (math.inf, 5.0), (2.5, 2.0)]) == [
        (0.5, 1.0, 2.0), (2.5, math.inf, 3.0)]


def test_the_fit_gives_back_the_shape_of_sessions_none_of_which_were_cut():
    ended, _ = _cut_at(random.Random(3), 20_000, 0.8, 0.6, math.inf)
    median, sigma = session_shape.fit_lognormal(_buckets(ended), [])
    assert median == pytest.approx(0.8, rel=0.03) and sigma == pytest.approx(0.6, abs=0.03)


def test_sessions_cut_short_count_as_censored_and_the_tail_is_not_lost():
    """A scheduler cancels its stragglers: the completed sessions' own quantiles read the
    shape far too light, the censored fit does not."""
    ended, cut = _cut_at(random.Random(1), 20_000, 2.0, 1.2, 8.0)
    median, sigma = session_shape.fit_lognormal(_buckets(ended), _buckets(cut))
    assert median == pytest.approx(2.0, rel=0.05) and sigma == pytest.approx(1.2, abs=0.05)
    ended.sort()
    naive = math.log(ended[int(0.9 * len(ended))] / ended[len(ended) // 2]) / 1.2815515655446004
    assert naive < 1.0  # what the Session duration panel's p50 and p90 of these would say
    ignored = session_shape.fit_lognormal(_buckets(ended), [])[1]
    assert ignored < 1.05  # the cut sessions left out


def test_no_session_that_ended_by_itself_cannot_be_fitted():
    with pytest.raises(ValueError, match="no session ended by itself"):
        session_shape.fit_lognormal([], [(1.0, 2.5, 10.0)])


def test_a_prometheus_that_does_not_answer_fails_the_command_naming_it(capsys):
    from pipeline.processes import free_port
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["tune", "--max-lag", "1", "--prometheus", url]) == 1
    assert url in capsys.readouterr().err
