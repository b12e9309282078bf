"""`rollstream bench scale`: the scheduling core's cost per event as samples in flight grow.

A stream-mode scheduler keeps N samples in flight (timeouts on, so the deadline heap is
live). Results arrive roughly in submission order (a random pick among the 64 oldest
running samples), so groups complete, new groups are backfilled and steps are emitted at
the same rate whatever N is: only the size of the state differs. A trainer handover follows
every emitted step. The wall time spent in `handle` is divided by the number of events. A
flat cost from 1k to 100k samples in flight is the claim; the ratio of the largest to the
smallest is reported (each size's best of `repeats` runs, the least disturbed by other work).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import deque

from pipeline.config import SchedulerConfig
from pipeline.scheduler import Emit, Finish, Handover, Open, Register, Scheduler, Submit
from pipeline.sessions import Status, Task

GROUPS = 8
WINDOW = 64  # results arrive from among the oldest WINDOW running samples


def measure(inflight: int, events: int = 20_000, seed: int = 0) -> dict:
    """Microseconds per scheduling event with `inflight` samples in flight, and the samples
    in flight and steps emitted at the end (to show the workload was what it claims)."""
    rng = random.Random(seed)
    admit = 32
    config = SchedulerConfig(admission="stream", groups=GROUPS, inflight_samples=inflight,
                             admit=admit, max_lag=10**6, ahead=1, timeout_s=3600.0)
    sched = Scheduler(config)
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
    while sched.credits >= GROUPS or batch == 0:
        apply(register())
    step, now, spent, done = 0, 0.0, 0.0, 0
    apply(sched.handle(Handover(step, step), now))
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
            acts = sched.handle(Handover(step, step), now)
            apply(acts)
            done += 1
        spent += time.perf_counter() - t0
        done += 1
    return {"us_per_event": spent / done * 1e6, "in_flight": sched.in_flight, "steps": step}


def run(sizes: tuple[int, ...] = (1_000, 10_000, 100_000), events: int = 20_000,
        repeats: int = 3) -> dict:
    """The best of `repeats` runs per size (the least disturbed by other work on the
    machine), and the ratio of the largest size's cost to the smallest's."""
    per_event = {str(n): round(min(measure(n, events, seed)["us_per_event"]
                                   for seed in range(repeats)), 2) for n in sizes}
    values = list(per_event.values())
    return {
        "per_event_us": per_event,
        "events": events,
        "repeats": repeats,
        "ratio": round(values[-1] / values[0], 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rollstream bench scale", description=__doc__)
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.add_argument("--events", type=int, default=20_000)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    result = run(events=args.events, repeats=args.repeats)
    if args.json:
        print(json.dumps(result))
    else:
        for n, us in result["per_event_us"].items():
            print(f"{int(n):>7d} in flight: {us:8.2f} us/event")
        print(f"largest / smallest: {result['ratio']}")
    return 0
