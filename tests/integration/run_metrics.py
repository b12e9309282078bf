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


@contextlib.contextmanager
def scraped_run(folder: Path, sessions: int = 20_000) -> Iterator[Fed]:
    """A Prometheus that has scraped `sessions` sessions, the slots and ten trainer steps."""
    admission, consumers, trainer = (Metrics(component=c) for c in ("admission", "consumer", "trainer"))
    # every series exists before what is fed, so increase() over a window counts all of it
    admission.observe_finished_many(0, ["completed", "cancelled"], [0.001, 0.001])
    for i, slots in enumerate(SLOTS):
        consumers.set_slots(f"c{i}", busy=0, total=slots)
    trainer.trainer_step.labels("0")  # at 0 (the push histogram is unlabelled: at 0 already)
    servers = [serve(m) for m in (admission, consumers, trainer)]
    try:
        with Prometheus(folder, [f"127.0.0.1:{s.port}" for s in servers]) as prom:
            prom.wait_scraped()
            prom.wait_scraped_since(time.time())
            rng = random.Random(0)
            durations = [rng.lognormvariate(math.log(MEDIAN_S), SIGMA) for _ in range(sessions)]
            statuses = ["completed" if d <= CUT_S else "cancelled" for d in durations]
            admission.observe_finished_many(0, statuses, [min(d, CUT_S) for d in durations])
            for version in range(2, 12):
                trainer.observe_train(0, step_s=STEP_S, tokens=1, metrics={})
                trainer.observe_push(version, PUSH_S)
            prom.wait_scraped_since(time.time())
            yield Fed(prom.url, statuses)
    finally:
        for s in servers:
            s.stop()
