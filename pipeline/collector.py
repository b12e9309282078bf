"""The cyclic garbage collector's settings of a long-running pipeline process (the admission
and rollout consumers call `collect_less` at start). Standard library only."""

from __future__ import annotations

import gc

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
