"""A run's metrics as a real Prometheus sees them, without the run: the admission,
consumer and trainer registries served on real `/metrics` endpoints, fed known sessions,
slots and trainer steps, and scraped (`rollstream tune --prometheus`'s tests)."""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeline.metrics import Metrics, serve
from rollstream.prometheus import Prometheus

MEDIAN_S, SIGMA, CUT_S = 2.0, 1.2, 8.0
"""The sessions fed: log-normal, stragglers cancelled at `CUT_S`."""
SLOTS = (48, 16)
"""Two consumers' slots, one shard."""
STEP_S, PUSH_S = 0.4, 0.1


@dataclass
class Fed:
    url: str
    statuses: list[str]
    """The first run's sessions' statuses."""


@contextlib.contextmanager
def scraped_run(folder: Path, sessions: int = 20_000, runs: dict[str, float] | None = None) -> Iterator[Fed]:
    """A Prometheus that has scraped `sessions` sessions, the slots and ten trainer steps;
    of one run with no run labels, or of each of `runs` (release name -> the sessions'
    median, s), its targets labelled with namespace "rl" and that release as the chart's
    monitors label them."""
    medians = runs or {"": MEDIAN_S}
    registries = {name: [Metrics(component=c) for c in ("admission", "consumer", "trainer")] for name in medians}
    for admission, consumers, trainer in registries.values():
        # every series exists before what is fed, so increase() over a window counts all of it
        admission.observe_finished_many(0, ["completed", "cancelled"], [0.001, 0.001])
        for i, slots in enumerate(SLOTS):
            consumers.set_slots(f"c{i}", busy=0, total=slots)
        trainer.trainer_step.labels("0")  # at 0 (the push histogram is unlabelled: at 0 already)
    servers = {name: [serve(m) for m in triple] for name, triple in registries.items()}
    labels = {f"127.0.0.1:{s.port}": {"namespace": "rl", "release": name}
              for name, group in servers.items() if runs for s in group}
    try:
        targets = [f"127.0.0.1:{s.port}" for group in servers.values() for s in group]
        with Prometheus(folder, targets, labels=labels) as prom:
            prom.wait_scraped()
            prom.wait_scraped_since(time.time())
            statuses = [_feed(registries[name], median, sessions, seed)
                        for seed, (name, median) in enumerate(medians.items())]
            prom.wait_scraped_since(time.time())
            yield Fed(prom.url, statuses[0])
    finally:
        for group in servers.values():
            for s in group:
                s.stop()


def _feed(registries: list[Metrics], median_s: float, sessions: int, seed: int) -> list[str]:
    """One run's sessions (log-normal, stragglers cut at `CUT_S`) and ten trainer steps; the
    sessions' statuses."""
    admission, _, trainer = registries
    rng = random.Random(seed)
    durations = [rng.lognormvariate(math.log(median_s), SIGMA) for _ in range(sessions)]
    statuses = ["completed" if d <= CUT_S else "cancelled" for d in durations]
    admission.observe_finished_many(0, statuses, [min(d, CUT_S) for d in durations])
    for version in range(2, 12):
        trainer.observe_train(0, step_s=STEP_S, tokens=1, metrics={})
        trainer.observe_push(version, PUSH_S)
    return statuses
