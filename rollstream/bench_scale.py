"""`rollstream bench scale`: the scheduling core's cost per event as samples in flight grow.

A stream-mode scheduler keeps N samples in flight (timeouts on, so the deadline heap is
live). Results arrive roughly in submission order (a random pick among the 64 oldest
running samples), so groups complete, new groups are backfilled and steps are emitted at
the same rate whatever N is: only the size of the state differs. A trainer handover follows
every emitted step. The wall time spent in `handle` is divided by the number of events. A
flat cost from 1k to 100k samples in flight is the claim; the ratio of the largest to the
smallest is reported (each size's best of `repeats` runs, the least disturbed by other
work; the sizes take turns, so that a slow spell of the host does not fall on one size
alone).
A handover's own cost (`handover_us`, the mean over the run's handovers; it is in the per-event
figure too) shows that a step's work does not grow with the samples in flight either.
`--stream-config` sets the stream policy's other fields (`oversample`, `oversample_start`, ...)
to measure a setting of one's own; `max_lag` stays out of reach (nothing goes stale), so what
is measured is the bookkeeping, not resubmissions.

The bench runs under the admission process's garbage collector settings
(`pipeline.collector.collect_less`), and holds Python's cyclic collector off while the
events are timed, after a full collection. A collection of the older generations scans
every object the scheduler holds (0.1 s or more at 100,000 in flight). Under Python's
defaults, whether one fell inside a timed call or between them (the untimed registration of
new tasks allocates the most) decided a run's figure: 10, or 18 to 24 us an event at
100,000 on a busy machine. What a full collection of the state costs is reported beside the
figures (`collect_ms`): a pause of the process that holds the scheduler. `--collector`
leaves the collector on and reports its cost spread over the events (`collector_us`), which
does grow with the state (`BENCHMARKS.md`).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from collections import deque

from pipeline.collector import collecting_less, collector_off, collector_time
from pipeline.config import SchedulerConfig, build
from pipeline.errors import CommandError
from pipeline.scheduler import Emit, Finish, Handover, Open, Register, Scheduler, Submit
from pipeline.sessions import Status, Task
from rollstream.bench_schedule import add_stream_config

GROUPS = 8
WINDOW = 64  # results arrive from among the oldest WINDOW running samples


def measure(inflight: int, events: int = 20_000, seed: int = 0,
            stream_config: dict | None = None, collector: bool = False) -> dict:
    """Microseconds per scheduling event with `inflight` samples in flight (`stream_config`:
    the stream policy's other fields), the mean microseconds of a handover, the milliseconds
    of a full garbage collection once set up, and the samples in flight and steps emitted at
    the end (to show the workload was what it claims). It runs under the admission process's
    collector settings (`collecting_less`: what exists before the scheduler is frozen out of
    the collector's generations), with the collector held off while the events run (the
    module's docstring says why); with `collector` it stays on, and its own seconds over the
    events' loop (new tasks registered included) are reported per event too
    (`collector_us_per_event`; what of it fell inside the timed calls is in `us_per_event`).
    The process's own settings are back after."""
    own = {"admission": "stream", "groups": GROUPS, "inflight_samples": inflight, "admit": 32,
           "max_lag": 10**6, "ahead": 1, "timeout_s": 3600.0}
    if clash := sorted(own.keys() & (stream_config or {}).keys()):
        raise CommandError(f"--stream-config: {', '.join(clash)} the bench sets itself")
    config = build(SchedulerConfig, {**(stream_config or {}), **own})
    with collecting_less():  # as the admission process, which holds the scheduler
        return _measure(Scheduler(config), inflight, events, random.Random(seed), collector)


def _measure(sched: Scheduler, inflight: int, events: int, rng: random.Random, collector: bool) -> dict:
    running: deque = deque()
    batch = 0

    def apply(actions: list) -> int:
        emitted = 0
        for a in actions:
            if isinstance(a, Submit):
                running.append(a.key)
            elif isinstance(a, Emit):
                emitted += 1
        return emitted

    def register() -> list:
        nonlocal batch
        tasks = tuple(Task(f"{batch}-{i}") for i in range(256))
        batch += 1
        return sched.handle(Register(batch - 1, tasks), 0.0)

    apply(sched.handle(Open(0), 0.0))
    # tasks for every credit (group_start="handover" starts most groups at the handover)
    while batch == 0 or (sched.credits >= sched.config.group_size and len(sched._tasks) < inflight):
        apply(register())
    step, now, spent, handovers, done = 0, 0.0, 0.0, 0.0, 0
    apply(sched.handle(Handover(step, step), now))
    collect_ms = _full_collection_ms()
    with collector_time() if collector else collector_off() as collecting:
        while done < events:
            if len(sched._tasks) < inflight:  # keep tasks available, outside the timing
                apply(register())
            i = rng.randrange(min(WINDOW, len(running)))
            key = running[i]
            del running[i]
            now += 0.001
            t0 = time.perf_counter()
            acts = sched.handle(Finish(key, Status.COMPLETED, 1.0, step), now)
            if apply(acts) and sched.pending_step is None:
                step += 1
                t1 = time.perf_counter()
                apply(sched.handle(Handover(step, step), now))
                handovers += time.perf_counter() - t1
                done += 1
            spent += time.perf_counter() - t0
            done += 1
    out = {"us_per_event": spent / done * 1e6, "us_per_handover": handovers / max(step, 1) * 1e6,
           "collect_ms": collect_ms, "in_flight": sched.in_flight, "steps": step}
    if collecting is not None:
        out["collector_us_per_event"] = collecting[0] / done * 1e6
    return out


def _full_collection_ms() -> float:
    """Milliseconds of one full collection of the cyclic garbage collector, now."""
    t0 = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - t0) * 1e3


def run(sizes: tuple[int, ...] = (1_000, 10_000, 100_000), events: int = 20_000,
        repeats: int = 3, stream_config: dict | None = None, collector: bool = False) -> dict:
    """The best of `repeats` runs per size (the least disturbed by other work on the
    machine; the sizes take turns), and the ratio of the largest size's cost to the
    smallest's; with `collector` (`measure`'s), the collector's microseconds per event, the
    mean over every run (the best run would be the one with the fewest collections)."""
    runs: dict[int, list[dict]] = {n: [] for n in sizes}
    for seed in range(repeats):  # the sizes in turn, so that a slow spell of the host hits them alike
        for n in sizes:
            runs[n].append(measure(n, events, seed, stream_config, collector))
    best = {n: min(r, key=lambda m: m["us_per_event"]) for n, r in runs.items()}
    per_event = {str(n): round(m["us_per_event"], 2) for n, m in best.items()}
    values = list(per_event.values())
    out = {
        "per_event_us": per_event,
        "handover_us": {str(n): round(m["us_per_handover"], 1) for n, m in best.items()},
        "collect_ms": {str(n): round(m["collect_ms"], 1) for n, m in best.items()},
        "events": events,
        "repeats": repeats,
        "stream_config": stream_config or {},
        "collector": collector,
        "ratio": round(values[-1] / values[0], 3),
    }
    if collector:
        out["collector_us"] = {str(n): round(sum(m["collector_us_per_event"] for m in r) / len(r), 3)
                               for n, r in runs.items()}
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.add_argument("--events", type=int, default=20_000)
    p.add_argument("--repeats", type=int, default=3, help="runs per size; the best counts")
    p.add_argument("--collector", action="store_true",
                   help="leave the garbage collector on, under the admission process's settings, and "
                        "report its microseconds per event (give --events 200000 or more, so that "
                        "its rarer collections fall inside the runs)")
    add_stream_config(p)


def run_from_args(args: argparse.Namespace) -> int:
    result = run(events=args.events, repeats=args.repeats, stream_config=args.stream_config,
                 collector=args.collector)
    if args.json:
        print(json.dumps(result))
    else:
        for n, us in result["per_event_us"].items():
            collector = f", {result['collector_us'][n]:6.2f} us/event collecting" if args.collector else ""
            print(f"{int(n):>7d} in flight: {us:8.2f} us/event, "
                  f"{result['handover_us'][n]:8.1f} us/handover, "
                  f"{result['collect_ms'][n]:7.1f} ms a full garbage collection{collector}")
        print(f"largest / smallest: {result['ratio']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rollstream bench scale", description=__doc__)
    add_arguments(p)
    return run_from_args(p.parse_args(argv))
