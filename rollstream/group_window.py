"""One group at a time, with slots unlimited: what simple policies waste on the window alone.

Where a rollout's staleness counts from its end (`SleepSource` makes its one call as the
session ends), a result that lands between push v and push v + 1 carries version v, and its
group must be handed to the trainer by step v + `max_lag`, before push v + `max_lag` + 1
(`bench_schedule.least_waste_share_fixed_window`); a member that does not make it ages out
and must be run again. This module keeps that rule and drops the rest of the pipeline: one
group runs at a time, with as many slots as it likes, time costs nothing, and the trainer
pushes every P seconds, P the push interval at the share of capacity asked
(`bench_schedule.push_interval`). A group trains once `groups` of its results are alive
(landed and not aged out); every other slot-second it used is wasted. With `pushes=False`
the window is relaxed further: a result ages out (`max_lag` + 1) x P after it lands,
whatever the pushes. With `push_cv` > 0 the pushes come at random intervals instead, as
`stream`'s do (its step goes out when its groups are complete): independent gamma draws of
mean P and coefficient of variation `push_cv`, every push time told to the policy in advance
(which only helps it).

The pipeline, seen one group at a time, is one such policy (its choices hang on other
groups' sessions, which are independent of this group's), so with the trainer pushing at a
steady rate no pipeline policy wastes less than the best policy of this model. That best
policy is not known, so nothing here is a bound: `best_group_policy` gives the least waste
share of a family of simple policies (`GroupPolicy`), each attempt's length an independent
draw learnt only as it lands, to set beside what `stream` wastes in the pipeline
(BENCHMARKS.md, "One group at a time").
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from dataclasses import asdict, dataclass, field

from rollstream.bench_schedule import capped_lognormal_mean, push_interval

_LAND, _REPLACE, _AGE_OUT, _GIVE_UP = 0, 1, 2, 3

WASTE = ("aged_out", "running_at_training", "given_up")
"""Where a group's wasted slot-seconds go: results that aged out before the group trained,
attempts still running when it trained (replacements started ahead, extras, stragglers),
and stragglers given up."""


@dataclass(frozen=True)
class GroupPolicy:
    """A group keeps `groups + extra_first` attempts alive until its first result lands and
    `groups + extra` after; alive means running, or landed and more than `lead_s` from ageing
    out. So a result's replacement starts `lead_s` before it ages out (0: as it ages out), and
    if the group completes first the replacement is surplus. `give_up_lead_s` before a result
    ages out, every running attempt older than `give_up_after_s` is given up (its slot-seconds
    wasted) and replaced. With pushes, the group starts `start_phase` of a push interval after
    a push (None: anywhere, at random)."""

    extra_first: int = 0
    extra: int = 0
    lead_s: float = 0.0
    give_up_after_s: float = math.inf
    give_up_lead_s: float = 0.5
    start_phase: float | None = None


@dataclass
class _Group:
    """One group's run: attempts running (id -> start, length), results alive (id ->
    length) and those among them already replaced, the time of push 0 (the group starts at
    0), its busy slot-seconds and attempts so far, and its wasted slot-seconds by where they
    went (`WASTE`)."""

    push_zero: float
    pushes: list[float] | None = None  # pushes at random intervals: their times so far, from the group's first
    running: dict[int, tuple[float, float]] = field(default_factory=dict)
    alive: dict[int, float] = field(default_factory=dict)
    replaced: set[int] = field(default_factory=set)
    events: list[tuple[float, int, int]] = field(default_factory=list)
    busy: float = 0.0
    attempts: int = 0
    landed: bool = False
    wasted: dict[str, float] = field(default_factory=lambda: dict.fromkeys(WASTE, 0.0))


def group_waste(workload: dict, lag: int, share: float, policy: GroupPolicy, pushes: bool = True,
                groups: int = 4000, seed: int = 0, push_cv: float = 0.0) -> dict:
    """`policy`'s waste share (wasted over busy slot-seconds) over `groups` groups of
    `workload["groups"]` on `workload`'s sessions (log-normal: median `median_ms`, shape
    `sigma`, capped at `cap` medians) at `max_lag` `lag`, the trainer pushing at `share` of
    the capacity bound (with `push_cv` > 0, at random intervals of that mean and coefficient
    of variation); with that share split by where the wasted slot-seconds went (`wasted_by`,
    each over the busy slot-seconds; see `WASTE`), the trained sessions' mean length over the
    workload's and the attempts a group takes."""
    if push_cv < 0 or (push_cv > 0 and not pushes):
        raise ValueError(f"push_cv={push_cv}: it must be >= 0, and > 0 only with pushes")
    rng = random.Random(seed)
    median, sigma, cap = workload["median_ms"] / 1000, workload["sigma"], workload["cap"]
    mean = capped_lognormal_mean(median, sigma, cap)
    push_s = push_interval(workload, share, mean)

    def draw() -> float:
        return min(median * math.exp(rng.gauss(0.0, sigma)), cap * median)

    intervals = PushIntervals(rng, push_s, push_cv) if push_cv > 0 else None

    def ages_out(group: _Group, landed_at: float) -> float:
        if not pushes:
            return landed_at + (lag + 1) * push_s
        if intervals is None or group.pushes is None:
            interval = math.floor((landed_at - group.push_zero) / push_s)
            return group.push_zero + (interval + lag + 1) * push_s
        times = group.pushes
        while times[-1] <= landed_at:
            times.append(times[-1] + intervals.draw())
        interval = bisect.bisect_right(times, landed_at) - 1
        while len(times) <= interval + lag + 1:
            times.append(times[-1] + intervals.draw())
        return times[interval + lag + 1]

    size = workload["groups"]
    busy = trained = 0.0
    attempts = 0
    wasted = dict.fromkeys(WASTE, 0.0)
    for _ in range(groups):
        if intervals is None:
            phase = rng.random() if policy.start_phase is None else policy.start_phase
            group = _Group(push_zero=-phase * push_s)
        else:
            group = _Group(push_zero=0.0, pushes=intervals.around_start(policy.start_phase))
        trained += _run_group(group, size, policy, draw, ages_out)
        busy += group.busy
        attempts += group.attempts
        for where in WASTE:
            wasted[where] += group.wasted[where]
    return {"max_lag": lag, "share": share, "push_interval_s": round(push_s, 4),
            "pushes": pushes, "push_cv": push_cv, "waste_share": round((busy - trained) / busy, 4),
            "wasted_by": {where: round(w / busy, 4) for where, w in wasted.items()},
            "trained_length_vs_workload": round(trained / (groups * size) / mean, 4),
            "attempts_per_group": round(attempts / groups, 3)}


class PushIntervals:
    """Push intervals drawn from a gamma distribution of mean `mean_s` and coefficient of
    variation `cv`, and the pushes around a group's start at time 0."""

    def __init__(self, rng: random.Random, mean_s: float, cv: float) -> None:
        self.rng, self.shape, self.scale = rng, 1.0 / cv**2, mean_s * cv**2

    def draw(self, biased: bool = False) -> float:
        """One interval; `biased`: drawn by its length, as the interval under way at a
        random time is (a gamma one shape larger)."""
        return self.rng.gammavariate(self.shape + (1.0 if biased else 0.0), self.scale)

    def around_start(self, phase: float | None) -> list[float]:
        """The pushes just before and after the start: `phase` of an interval after a push,
        or (None) at a random time, uniformly within the interval then under way."""
        length = self.draw(biased=phase is None)
        into = length * (self.rng.random() if phase is None else phase)
        return [-into, length - into]


def _run_group(group: _Group, size: int, policy: GroupPolicy, draw, ages_out) -> float:
    """Runs one group until `size` results are alive; returns their slot-seconds (the
    attempts still running then are given up and count as busy, and wasted)."""
    ids = itertools.count()
    events = group.events

    def top_up(now: float) -> None:
        target = size + (policy.extra if group.landed else policy.extra_first)
        while len(group.running) + len(group.alive) - len(group.replaced) < target:
            i, length = next(ids), draw()
            group.running[i] = (now, length)
            group.attempts += 1
            heapq.heappush(events, (now + length, _LAND, i))

    top_up(0.0)
    while True:
        now, kind, i = heapq.heappop(events)
        if kind == _LAND:
            if i not in group.running:
                continue  # given up before it landed
            _, length = group.running.pop(i)
            group.busy += length
            group.alive[i] = length
            group.landed = True
            if len(group.alive) >= size:
                still = sum(now - start for start, _ in group.running.values())
                group.busy += still
                group.wasted["running_at_training"] += still
                return sum(group.alive.values())
            out = ages_out(group, now)
            heapq.heappush(events, (out, _AGE_OUT, i))
            heapq.heappush(events, (max(now, out - policy.lead_s), _REPLACE, i))
            if policy.give_up_after_s < math.inf:
                heapq.heappush(events, (max(now, out - policy.give_up_lead_s), _GIVE_UP, i))
        elif kind == _REPLACE and i in group.alive:
            group.replaced.add(i)
        elif kind == _AGE_OUT:
            group.wasted["aged_out"] += group.alive.pop(i, 0.0)
            group.replaced.discard(i)
        elif kind == _GIVE_UP and i in group.alive:
            _give_up_old(group, now, policy.give_up_after_s)
        top_up(now)


def _give_up_old(group: _Group, now: float, older_than: float) -> None:
    for j, (start, _) in list(group.running.items()):
        if now - start > older_than:
            group.busy += now - start
            group.wasted["given_up"] += now - start
            del group.running[j]


def policy_grid(pushes: bool) -> tuple[GroupPolicy, ...]:
    """The family `best_group_policy` searches: no extra attempt or one, before and after the
    first result lands; replacements 0 to 1 s ahead; stragglers never given up, or given
    up past 4 s; and, with pushes, groups started at a push, 0.3 or 0.6 of an interval
    after one, or anywhere."""
    phases = (None, 0.0, 0.3, 0.6) if pushes else (None,)
    return tuple(GroupPolicy(first, extra, lead, after, 0.5, phase)
                 for first, extra, lead, after, phase in itertools.product(
                     (0, 1), (0, 1), (0.0, 0.25, 0.5, 0.75, 1.0), (math.inf, 4.0), phases))


def best_group_policy(workload: dict, lag: int, share: float, pushes: bool = True,
                      groups: int = 1500, seed: int = 0) -> dict:
    """The policy of `policy_grid` that wastes least at `max_lag` `lag` and `share`, chosen
    over `groups` groups and then measured on four times as many others (seed + 1), beside
    the policy that only replaces what ages out (`naive_waste_share`, the same groups)."""
    def waste(policy: GroupPolicy, n: int, s: int) -> dict:
        return group_waste(workload, lag, share, policy, pushes, n, s)

    best = min(policy_grid(pushes), key=lambda p: waste(p, groups, seed)["waste_share"])
    naive = waste(GroupPolicy(), 4 * groups, seed + 1)
    return {**waste(best, 4 * groups, seed + 1), "policy": asdict(best),
            "naive_waste_share": naive["waste_share"]}
