"""Packing's segment table, its arrays computed on first access, and the best-fit rows."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import ready
from pipeline.packing import _Rows, pack
from pipeline.session_metrics import session_metrics
from tests.unit.test_packing import batches, group

_DENSE = ("tokens", "positions", "segments", "loss_mask", "advantages", "logprobs", "versions", "support",
          "segment_group", "segment_sample", "segment_chain")


@settings(max_examples=100, deadline=None)
@given(batches())
def test_the_segment_table_lists_each_rows_segments_in_column_order(case) -> None:
    groups, rows, width, estimator, truncation = case
    batch = pack(groups, rows=rows, width=width, estimator=estimator, truncation=truncation)
    table = batch.segment_table
    for r in range(rows):
        mine = table.row == r
        assert table.segment[mine].tolist() == list(range(1, int(mine.sum()) + 1))
        assert int(table.length[mine].sum()) == batch.row_tokens[r] == np.count_nonzero(batch.segments[r])
    assert (np.diff(table.row) >= 0).all() and (table.length >= 1).all()
    assert batch.segment_group[table.row, table.segment].tolist() == \
        batch.rollout_group[table.rollout].tolist()
    assert batch.segment_chain[table.row, table.segment].tolist() == table.chain.tolist()


def test_the_admissions_step_lays_out_no_row_array() -> None:
    """`compact` and the session metrics read the segment table and non-padding cells only."""
    groups = [group(0, 6, 3), group(1, 5, 4, 2)]
    batch = pack(groups, rows=3, width=8)
    ready.compact(batch)
    session_metrics(groups, batch, updates=1)
    assert not [name for name in _DENSE if name in vars(batch)]
    assert batch.tokens is batch.tokens  # computed once, then kept
    assert "tokens" in vars(batch)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12), st.integers(1, 40), st.lists(st.integers(1, 40), max_size=30))
def test_best_fit_picks_the_row_an_argmin_over_the_rows_picks(rows: int, width: int, lengths: list[int]) -> None:
    """The least room that fits, the lowest row among equals; a placement undone exactly."""
    placer, free = _Rows(rows, width), np.full(rows, width)
    for length in lengths:
        room = np.where(free >= length, free, width + 1)
        spot = placer.place(length)
        if room.min() > width:
            assert spot is None
            continue
        row = int(room.argmin())
        assert spot is not None and spot[:2] == (row, width - free[row])
        free[row] -= length
    assert placer.free == free.tolist()
    keys, spot = list(placer.keys), placer.place(1)
    if spot is not None:
        placer.unplace(spot[0], 1)
    assert placer.keys == keys and placer.free == free.tolist()
