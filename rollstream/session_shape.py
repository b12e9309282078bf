"""A running pipeline's workload, read from its Prometheus, for `rollstream tune`.

The sessions' shape comes from `rollstream_session_duration_seconds`, every session's slot
seconds by status. Its quantiles read straight off the histogram are biased short, because
the sessions a scheduler cancels are its stragglers: a cancelled session counts at the age
it was cut at, and the long sessions missing from the completed ones are exactly those.
So `fit_lognormal` fits the log-normal by maximum likelihood with the cut sessions as
right-censored: a session that ended by itself (completed, truncated, an agent error) lies
in its bucket, and one cut short (cancelled, an infra error) would have run past the
geometric middle of its bucket (`cut_at`; the bucket's lower bound reads the tail short,
its upper bound long: sessions of shape 1.2 cut at 8 s, or at ages drawn at random, fit
1.13 and 1.27 that way and 1.20 at the middle, where the completed sessions' own quantiles
give 0.91 to 0.98).

`from_prometheus` also reads the slots (`rollstream_consumer_slots`, over the shards) and
the trainer's step and push (`rollstream_trainer_step_seconds`,
`rollstream_weights_push_seconds`), each over the same window. It reads one run: the series
that `select` (PromQL label matchers) picks, and refuses to fit a mixture where those series
belong to several runs (several `namespace` and `release` labels, as the chart's monitors
give them).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from pipeline.errors import CommandError
from rollstream.prometheus import api

ENDED = ("completed", "truncated", "agent_error")
"""Statuses of sessions that ran to their own end: observed lengths."""
CUT = ("cancelled", "infra_error")
"""Statuses of sessions cut short: they ran at least as long as they are counted."""

Intervals = list[tuple[float, float, float]]
"""`(lower bound, upper bound, count)` of each bucket, seconds."""


def intervals(cumulative: list[tuple[float, float]]) -> Intervals:
    """A histogram's `(le, cumulative count)` pairs as `(lower, upper, count)` per bucket."""
    out, below, lower = [], 0.0, 0.0
    for le, count in sorted(cumulative):
        n = max(0.0, count - below)
        if n > 0:
            out.append((lower, le, n))
        below, lower = max(below, count), le
    return out


def _tail(x: float, mu: float, sigma: float) -> float:
    """P(X > x) for log-normal X."""
    if x <= 0:
        return 1.0
    if math.isinf(x):
        return 0.0
    return 0.5 * math.erfc((math.log(x) - mu) / (sigma * math.sqrt(2.0)))


def cut_at(lower: float, upper: float) -> float:
    """Where a session cut short in the bucket (lower, upper] counts as censored: the
    bucket's geometric middle (half the upper bound for the first bucket, the lower bound
    for the last)."""
    if math.isinf(upper):
        return lower
    return upper / 2 if lower <= 0 else math.sqrt(lower * upper)


def log_likelihood(ended: Intervals, cut: Intervals, mu: float, sigma: float) -> float:
    """Of sessions ending in their buckets (`ended`) and of sessions that would have run past
    `cut_at` of theirs (`cut`), log-normal with log-median `mu` and shape `sigma`."""
    total = 0.0
    for lower, upper, n in ended:
        total += n * math.log(max(_tail(lower, mu, sigma) - _tail(upper, mu, sigma), 1e-300))
    for lower, upper, n in cut:
        total += n * math.log(max(_tail(cut_at(lower, upper), mu, sigma), 1e-300))
    return total


def _golden(f: Callable[[float], float], lo: float, hi: float, steps: int = 80) -> float:
    """The maximum of a unimodal `f` on [lo, hi]."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(steps):
        if fc > fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    return (a + b) / 2


def fit_lognormal(ended: Intervals, cut: Intervals) -> tuple[float, float]:
    """`(median, sigma)` of the log-normal most likely to have given `ended` and `cut` (see
    the module docstring). The likelihood of interval-censored log-normal data is
    log-concave in the log-median for a fixed shape, and the shape is searched around it."""
    if not ended:
        raise ValueError("no session ended by itself: the shape cannot be told")
    bounds = [b for lower, upper, _ in ended + cut for b in (lower, upper) if 0 < b < math.inf]
    lo, hi = math.log(min(bounds)) - 5.0, math.log(max(bounds)) + 5.0

    def best_mu(sigma: float) -> float:
        return _golden(lambda mu: log_likelihood(ended, cut, mu, sigma), lo, hi)

    sigma = math.exp(_golden(lambda s: log_likelihood(ended, cut, best_mu(math.exp(s)), math.exp(s)),
                             math.log(0.02), math.log(6.0), steps=50))
    return math.exp(best_mu(sigma)), sigma


def _query(url: str, expr: str, timeout_s: float) -> list[dict]:
    return api(url, "query", {"query": expr}, timeout_s)


def _scalar(url: str, expr: str, timeout_s: float) -> float | None:
    result = _query(url, expr, timeout_s)
    value = float(result[0]["value"][1]) if result else math.nan
    return value if math.isfinite(value) else None


RUN_LABELS = ("namespace", "release")
"""The labels that tell runs apart on one Prometheus (the chart's monitors set them)."""


def _one_run(url: str, window: str, runs: set[str]) -> None:
    """Raises a CommandError naming `runs` (each as its label matchers) where there are several."""
    if len(runs) > 1:
        names = sorted(runs)
        raise CommandError(f"Prometheus at {url} holds the sessions of {len(names)} runs over {window} "
                           f"({'; '.join(names)}): pick one with --select, e.g. --select '{names[0]}'")


def from_prometheus(url: str, window: str, timeout_s: float = 10.0, select: str = "") -> dict:
    """The workload a running pipeline shows over the last `window` (a PromQL duration):
    the sessions' fitted median (ms) and shape, the sessions counted by status, the slots
    per shard, and the trainer's step plus push (ms; None without a trainer's series); of
    the one run whose series `select` picks (PromQL label matchers; "": every series)."""
    sel = f"{{{select}}}"
    buckets: dict[str, list[tuple[float, float]]] = {}
    runs: set[str] = set()
    for series in _query(url, f"sum by (le, status, {', '.join(RUN_LABELS)}) (increase("
                         f"rollstream_session_duration_seconds_bucket{sel}[{window}]))", timeout_s):
        labels = series["metric"]
        runs.add(", ".join(f'{k}="{labels.get(k, "")}"' for k in RUN_LABELS))
        buckets.setdefault(labels.get("status", ""), []).append((float(labels["le"]), float(series["value"][1])))
    _one_run(url, window, runs)
    counts = {status: round(max((c for _, c in pairs), default=0.0)) for status, pairs in buckets.items()}
    ended = [iv for s in ENDED for iv in intervals(buckets.get(s, []))]
    cut = [iv for s in CUT for iv in intervals(buckets.get(s, []))]
    if not ended:
        raise CommandError(f"Prometheus at {url} has no session that ended by itself in the last "
                           f"{window} (rollstream_session_duration_seconds{sel}): is the admission "
                           "consumer scraped, has the run gone on that long, and does --select pick it?")
    median_s, sigma = fit_lognormal(ended, cut)
    slots = _scalar(url, f"sum(rollstream_consumer_slots{sel})", timeout_s)
    shards = _scalar(url, f"count(count by (shard) (rollstream_session_duration_seconds_count{sel}))", timeout_s)
    step = _scalar(url, f"sum(increase(rollstream_trainer_step_seconds_sum{sel}[{window}])) / "
                        f"sum(increase(rollstream_trainer_step_seconds_count{sel}[{window}]))", timeout_s)
    push = _scalar(url, f"sum(increase(rollstream_weights_push_seconds_sum{sel}[{window}])) / "
                        f"sum(increase(rollstream_weights_push_seconds_count{sel}[{window}]))", timeout_s)
    return {"url": url, "window": window, "sessions": counts,
            "median_ms": round(median_s * 1000, 3), "sigma": round(sigma, 4),
            "slots": None if not slots else max(1, round(slots / max(1.0, shards or 1.0))),
            "shards": round(shards) if shards else None,
            "train_ms": None if step is None else round((step + (push or 0.0)) * 1000, 3)}
