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
(BENCHMARKS.md, "One group at a time"). `improvement_step` asks how far such a rule is from
the best policy: it takes one step of policy improvement from the rule, scoring every option
at every event on runs of the rule from there, and measures what that gains.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
import statistics
from collections.abc import Callable
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
    sessions = SessionLengths(workload)
    mean = sessions.mean
    push_s = push_interval(workload, share, mean)
    draw = sessions.drawer(rng)
    intervals = PushIntervals(rng, push_s, push_cv) if push_cv > 0 else None
    fixed = _fixed_ages_out(lag, push_s, pushes)

    def ages_out(group: _Group, landed_at: float) -> float:
        if intervals is None or group.pushes is None:
            return fixed(group, landed_at)
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


class SessionLengths:
    """The workload's session lengths: log-normal of median `median_ms` and shape `sigma`,
    capped at `cap` medians; drawn afresh, or given that a session has run `age` seconds."""

    def __init__(self, workload: dict) -> None:
        self.median, self.sigma = workload["median_ms"] / 1000, workload["sigma"]
        self.cap_s = workload["cap"] * self.median
        self.mean = capped_lognormal_mean(self.median, self.sigma, workload["cap"])

    def drawer(self, rng: random.Random) -> Callable[[], float]:
        return lambda: min(self.median * math.exp(rng.gauss(0.0, self.sigma)), self.cap_s)

    def given_age(self, rng: random.Random, age: float) -> float:
        """A length drawn given that it is longer than `age` (the normal's tail above
        `age`'s quantile, by its inverse distribution function)."""
        if age <= 0:
            return self.drawer(rng)()
        if age >= self.cap_s:
            return age  # no session runs longer: it lands now
        low = _NORMAL.cdf(math.log(age / self.median) / self.sigma)
        u = low + (1.0 - low) * rng.random()
        if u >= 1.0:
            return self.cap_s
        return max(age, min(self.median * math.exp(self.sigma * _NORMAL.inv_cdf(u)), self.cap_s))


_NORMAL = statistics.NormalDist()


def _fixed_ages_out(lag: int, push_s: float, pushes: bool) -> Callable[[_Group, float], float]:
    """When a result landed at `landed_at` ages out, the trainer pushing every `push_s` from
    the group's push 0: at push v + `lag` + 1, v the interval it landed in; or, with the
    window relaxed (`pushes=False`), (`lag` + 1) x `push_s` after it lands, the longest life
    steady pushes give a result."""
    def at_pushes(group: _Group, landed_at: float) -> float:
        interval = math.floor((landed_at - group.push_zero) / push_s)
        return group.push_zero + (interval + lag + 1) * push_s

    def after_landing(group: _Group, landed_at: float) -> float:
        return landed_at + (lag + 1) * push_s
    return at_pushes if pushes else after_landing


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
    _top_up(group, size, policy, draw, 0.0)
    return _run_rule(group, size, policy, draw, ages_out)


def _run_rule(group: _Group, size: int, policy: GroupPolicy, draw, ages_out) -> float:
    """`_run_group` from where `group` stands, its starts at the time in hand made."""
    while True:
        now, kind, i = heapq.heappop(group.events)
        trained = _handle(group, size, policy, ages_out, now, kind, i)
        if trained is not None:
            return trained
        _top_up(group, size, policy, draw, now)


def _to_start(group: _Group, size: int, policy: GroupPolicy) -> int:
    """How many attempts `policy` starts now: enough to keep its target alive."""
    target = size + (policy.extra if group.landed else policy.extra_first)
    return max(0, target - (len(group.running) + len(group.alive) - len(group.replaced)))


def _top_up(group: _Group, size: int, policy: GroupPolicy, draw, now: float) -> None:
    for _ in range(_to_start(group, size, policy)):
        _start(group, now, draw())


def _start(group: _Group, now: float, length: float) -> None:
    i = group.attempts  # an attempt's id: the attempts started before it
    group.running[i] = (now, length)
    group.attempts += 1
    heapq.heappush(group.events, (now + length, _LAND, i))


def _handle(group: _Group, size: int, policy: GroupPolicy, ages_out, now: float, kind: int,
            i: int) -> float | None:
    """One event of `group`'s run; the trained slot-seconds if the group trains with it."""
    if kind == _LAND:
        if i not in group.running:
            return None  # given up before it landed
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
        heapq.heappush(group.events, (out, _AGE_OUT, i))
        heapq.heappush(group.events, (max(now, out - policy.lead_s), _REPLACE, i))
        if policy.give_up_after_s < math.inf:
            heapq.heappush(group.events, (max(now, out - policy.give_up_lead_s), _GIVE_UP, i))
    elif kind == _REPLACE and i in group.alive:
        group.replaced.add(i)
    elif kind == _AGE_OUT:
        group.wasted["aged_out"] += group.alive.pop(i, 0.0)
        group.replaced.discard(i)
    elif kind == _GIVE_UP and i in group.alive:
        _give_up_old(group, now, policy.give_up_after_s)
    return None


def _give_up_old(group: _Group, now: float, older_than: float) -> None:
    for j, (start, _) in list(group.running.items()):
        if now - start > older_than:
            _give_up(group, j, now)


def _give_up(group: _Group, i: int, now: float) -> None:
    """Gives up running attempt `i`: its slot-seconds so far are busy, and wasted."""
    start, _ = group.running.pop(i)
    group.busy += now - start
    group.wasted["given_up"] += now - start


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


@dataclass(frozen=True)
class _Option:
    """What a policy may do at an event: start `starts` attempts (then none until the next
    event), or give up the oldest running attempt and then start what the rule starts."""

    starts: int
    give_up: bool = False


def improvement_step(workload: dict, lag: int, share: float, rule: GroupPolicy, groups: int = 1000,
                     continuations: int = 60, seed: int = 0, theta: float | None = None,
                     pushes: bool = True) -> dict:
    """One step of policy improvement from `rule`, the trainer pushing every P seconds (P at
    `share`, as in `group_waste`; with `pushes=False` the window relaxed as there), on
    `groups` groups, each run under `rule` and under the improved policy from the same draws.

    At each event (the start, a landing, a replacement's time, an age-out) the improved
    policy scores every option (`_Option`: 2 fewer to 3 more starts than `rule` makes, or
    the oldest running attempt given up) on `continuations` runs of `rule` from there, the
    running attempts' lengths drawn afresh given their ages, the same draws for every
    option. The score of a run is (1 - `theta`) x its slot-seconds minus its trained
    slot-seconds: a policy wastes at most a `theta` share exactly when its expected score is
    at most 0, so with `theta` the rule's waste share (measured on 4 x `groups` other groups
    when None) a lower score is a lower waste share. An option other than the rule's is
    taken only where its mean gain over the rule's is more than twice its standard error.

    The improved policy is not the best policy: it sees only one step ahead of `rule`. Where
    it gains little, `rule` is near a local optimum of the model; the result bounds nothing.
    Returns both waste shares, the gain with its standard error (the groups paired), and how
    often each kind of option was taken."""
    if groups < 2 or continuations < 2:
        raise ValueError(f"groups={groups}, continuations={continuations}: each must be >= 2")
    sessions = SessionLengths(workload)
    push_s = push_interval(workload, share, sessions.mean)
    if theta is None:
        theta = group_waste(workload, lag, share, rule, pushes, 4 * groups, seed + 1)["waste_share"]
    ages_out = _fixed_ages_out(lag, push_s, pushes)
    size = workload["groups"]
    runs: list[tuple[float, float, float, float]] = []  # rule's wasted, busy; improved's
    taken = {"rule": 0, "fewer": 0, "more": 0, "give_up": 0}
    for g in range(groups):
        phase = random.Random(f"{seed}:{g}:phase").random() if rule.start_phase is None else rule.start_phase
        base = _Group(push_zero=-phase * push_s)
        trained = _run_group(base, size, rule, sessions.drawer(random.Random(f"{seed}:{g}")), ages_out)
        group = _Group(push_zero=-phase * push_s)
        better = _Improver(sessions, size, rule, ages_out, theta, continuations, f"{seed}:{g}", taken)
        improved = better.run(group, sessions.drawer(random.Random(f"{seed}:{g}")))
        runs.append((base.busy - trained, base.busy, group.busy - improved, group.busy))
    return {"max_lag": lag, "share": share, "push_interval_s": round(push_s, 4), "pushes": pushes,
            "rule": asdict(rule), "groups": groups, "continuations": continuations, "theta": theta, **_paired(runs),
            "options_taken": taken}


def _paired(runs: list[tuple[float, float, float, float]]) -> dict:
    """Both waste shares over `runs` (per group: the rule's wasted and busy slot-seconds, then
    the improved policy's) and the gain's standard error, each share's ratio linearized
    group by group."""
    n = len(runs)
    wasted_0, busy_0, wasted_1, busy_1 = (sum(r[k] for r in runs) for k in range(4))
    share_0, share_1 = wasted_0 / busy_0, wasted_1 / busy_1
    diffs = [(w0 - share_0 * b0) / (busy_0 / n) - (w1 - share_1 * b1) / (busy_1 / n) for w0, b0, w1, b1 in runs]
    return {"rule_waste_share": round(share_0, 4), "improved_waste_share": round(share_1, 4),
            "gain": round(share_0 - share_1, 4), "gain_se": round(statistics.stdev(diffs) / math.sqrt(n), 4)}


class _Improver:
    """The improved policy of `improvement_step` for one group: at each event, the option
    whose continuations under `rule` score clearly lowest."""

    def __init__(self, sessions: SessionLengths, size: int, rule: GroupPolicy, ages_out, theta: float,
                 continuations: int, key: str, taken: dict[str, int]) -> None:
        self.sessions, self.size, self.rule, self.ages_out = sessions, size, rule, ages_out
        self.theta, self.continuations, self.key, self.taken = theta, continuations, key, taken
        self.decisions = 0

    def run(self, group: _Group, draw: Callable[[], float]) -> float:
        """Runs `group` to training; its trained slot-seconds."""
        now = 0.0
        while True:
            self._apply(group, self._choose(group, now), now, draw)
            now, kind, i = heapq.heappop(group.events)
            trained = _handle(group, self.size, self.rule, self.ages_out, now, kind, i)
            if trained is not None:
                return trained

    def _choose(self, group: _Group, now: float) -> _Option:
        ruled = _to_start(group, self.size, self.rule)
        rules = _Option(ruled)
        options = [_Option(n) for n in sorted({max(0, ruled + k) for k in range(-2, 4)})]
        if group.running:
            options.append(_Option(ruled, give_up=True))
        self.decisions += 1
        scores = {o: self._scores(group, now, o) for o in options}
        base = scores[rules]
        best, gain, se = rules, 0.0, 0.0
        for option, score in scores.items():
            diffs = [b - s for b, s in zip(base, score)]
            mean = statistics.fmean(diffs)
            if mean > gain:
                best, gain, se = option, mean, statistics.stdev(diffs) / math.sqrt(len(diffs))
        if best == rules or gain <= 2 * se:
            self.taken["rule"] += 1
            return rules
        self.taken["give_up" if best.give_up else "fewer" if best.starts < ruled else "more"] += 1
        return best

    def _scores(self, group: _Group, now: float, option: _Option) -> list[float]:
        """`option`'s score on each continuation (the same draws, continuation by
        continuation, for every option)."""
        scores = []
        for c in range(self.continuations):
            rng = random.Random(f"{self.key}:{self.decisions}:{c}")
            sim = _redrawn(group, now, self.sessions, rng)
            draw = self.sessions.drawer(rng)
            busy = sim.busy
            self._apply(sim, option, now, draw)
            trained = _run_rule(sim, self.size, self.rule, draw, self.ages_out)
            scores.append((1.0 - self.theta) * (sim.busy - busy) - trained)
        return scores

    def _apply(self, group: _Group, option: _Option, now: float, draw: Callable[[], float]) -> None:
        if option.give_up:
            _give_up(group, min(group.running, key=lambda i: group.running[i][0]), now)
            _top_up(group, self.size, self.rule, draw, now)
            return
        for _ in range(option.starts):
            _start(group, now, draw())


def _redrawn(group: _Group, now: float, sessions: SessionLengths, rng: random.Random) -> _Group:
    """A copy of `group` whose running attempts' lengths are drawn afresh given their ages
    at `now` (what a policy knows of them)."""
    running = {i: (start, sessions.given_age(rng, now - start)) for i, (start, _) in sorted(group.running.items())}
    events = [e for e in group.events if e[1] != _LAND] + [(s + n, _LAND, i) for i, (s, n) in running.items()]
    heapq.heapify(events)
    return _Group(push_zero=group.push_zero, running=running, alive=dict(group.alive),
                  replaced=set(group.replaced), events=events, busy=group.busy, attempts=group.attempts,
                  landed=group.landed, wasted=dict(group.wasted))
