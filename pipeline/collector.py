"""The cyclic garbage collector's settings of a long-running pipeline process (the admission
and rollout consumers call `collect_less` at start), and for the benchmarks: those settings
for a block (`collecting_less`), the collector held off (`collector_off`) or timed
(`collector_time`). Standard library only."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager

YOUNG_COLLECTION_EVERY = 50_000
"""Allocations between two collections of the cyclic garbage collector's youngest
generation once `collect_less` ran (Python's default is 700)."""


def collect_less() -> None:
    """Have Python's cyclic garbage collector scan less: the objects that exist now (the
    modules and what importing them built) are frozen out of its generations (`gc.freeze`),
    and its youngest generation is collected every `YOUNG_COLLECTION_EVERY` allocations,
    so the older generations, which hold every sample the admission tracks and every
    session a consumer holds, far more rarely. With the defaults the collector took 6% to
    20% of the admission loop's CPU and 15 to 24 us of a rollout consumer's session
    (`BENCHMARKS.md`). Reference counting frees what it always did, at once; only reference
    cycles wait longer for a collection."""
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_EVERY, *gc.get_threshold()[1:])


@contextmanager
def collecting_less() -> Iterator[None]:
    """`collect_less`'s settings while the block runs, and the collector's own back after:
    for running a process's loop inside another program (the benchmarks, the tests)."""
    threshold = gc.get_threshold()
    collect_less()
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


@contextmanager
def collector_off() -> Iterator[None]:
    """The cyclic garbage collector held off while the block runs, on again after if it was."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


@contextmanager
def collector_time() -> Iterator[list[float]]:
    """The seconds the cyclic garbage collector spends while the block runs, summed into the
    one-element list it yields (a collection under way as the block ends counts in full)."""
    spent, started = [0.0], [0.0]

    def timing(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            spent[0] += time.perf_counter() - started[0]

    gc.callbacks.append(timing)
    try:
        yield spent
    finally:
        gc.callbacks.remove(timing)
