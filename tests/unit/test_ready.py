"""The Ready's compact arrays (a segment table) and its typed record."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings

from pipeline import ready, wire
from pipeline.chains import Chain
from pipeline.packing import Group, PackedBatch, Rollout, pack
from pipeline.scheduler import SchedulerRecord
from pipeline.sessions import Status
from tests.unit.test_packing import _support_group, batches

_FULL = ("tokens", "positions", "segments", "loss_mask", "advantages", "logprobs", "versions",
         "segment_group", "segment_sample", "segment_chain", "rollout_group", "rollout_sample",
         "rollout_advantage", "rollout_trained")


def _assert_expands_to(packed: PackedBatch) -> dict[str, np.ndarray]:
    arrays = ready.compact(packed)
    back = wire.decode(wire.encode(wire.Ready(0, 0, 0, 0, arrays, None))).arrays
    full = ready.expand(back)
    for name in _FULL:
        want = getattr(packed, name)
        assert full[name].dtype == want.dtype and full[name].shape == want.shape, name
        assert np.array_equal(full[name], want), name
    assert np.array_equal(full["rollout_reward"], np.nan_to_num(packed.rollout_reward, nan=0.0))
    if packed.support is None:
        assert "support" not in full
    else:
        assert np.array_equal(full["support"], packed.support)
    return arrays


@settings(max_examples=150, deadline=None)
@given(batches())
def test_the_segment_table_expands_to_the_packed_arrays(case) -> None:
    groups, rows, width, estimator, truncation = case
    _assert_expands_to(pack(groups, rows=rows, width=width, estimator=estimator, truncation=truncation))


def test_versions_that_change_within_a_chain_and_support_expand() -> None:
    loss = np.array([0, 0, 1, 1, 1, 1], bool)
    two = Chain(np.arange(1, 7, dtype=np.int32), loss, np.where(loss, -0.5, 0).astype(np.float32),
                np.array([-1, -1, 3, 3, 4, 4], np.int32))
    batch = pack([Group(1, (Rollout(0, Status.COMPLETED, (two,), reward=1.0),
                            Rollout(1, Status.COMPLETED, (two,), reward=0.0)))], rows=2, width=8)
    arrays = _assert_expands_to(batch)
    assert arrays["versions"].tolist() == [3, 4, 3, 4] and arrays["version_runs"].tolist() == [2] * 4
    _assert_expands_to(pack([_support_group(2)], rows=1, width=6, support_capacity=3))


def test_a_ready_is_no_bigger_than_the_tokens_it_packs() -> None:
    """Per 1k-token rollout (a quarter prompt) about 4 bytes a token and 4 a completion token."""
    rng = np.random.default_rng(0)
    loss = np.arange(1024) >= 256
    chain = Chain(rng.integers(0, 32_000, 1024).astype(np.int32), loss,
                  np.where(loss, -rng.random(1024), 0).astype(np.float32), np.where(loss, 0, -1).astype(np.int32))
    groups = [Group(g, tuple(Rollout(s, Status.COMPLETED, (chain,), reward=float(s % 2)) for s in range(8)))
              for g in range(4)]
    arrays = ready.compact(pack(groups, rows=10, width=4096))
    assert sum(a.nbytes for a in arrays.values()) < 32 * (1024 * 4 + 768 * 4 + 200)


def test_an_inconsistent_segment_table_is_refused() -> None:
    arrays = ready.compact(pack([Group(1, (Rollout(0, Status.COMPLETED, (Chain(
        np.arange(1, 5, dtype=np.int32), np.array([0, 0, 1, 1], bool), np.array([0, 0, -1, -1], np.float32),
        np.array([-1, -1, 0, 0], np.int32)),), reward=1.0),))], rows=1, width=8))
    with pytest.raises(ValueError, match="tokens has 4 entries, the segments 5"):
        ready.expand({**arrays, "seg_lengths": np.array([5], np.int32)})
    with pytest.raises(ValueError, match="missing tokens"):
        ready.expand({k: v for k, v in arrays.items() if k != "tokens"})
    with pytest.raises(ValueError, match="seg_rollout"):
        ready.expand({**arrays, "seg_rollout": np.array([1], np.int32)})


RECORD = ready.ReadyRecord(updates=3, version=2, lag=1, groups=1, resubmitted={"stale": 2}, cancelled=0,
                           abandoned=0, cut=0, waited=0.5, metrics={"reward_mean": 0.5}, refused=1,
                           admitted=((7, 1, "t1.0"),), packed=(7,), dropped=((8, 1, "t1.1", "surplus"),))


def test_the_record_is_typed_and_round_trips() -> None:
    got = wire.decode(wire.encode(wire.Ready(0, 0, 1, 3, {}, RECORD))).record
    assert got == RECORD and got.admitted[0] == (7, 1, "t1.0") and got.extra["refused"] == 1
    assert got.scheduler_record(waited=2.0) == SchedulerRecord(3, 2, 1, 1, {"stale": 2}, 0, 0, 0, 2.0,
                                                              {"reward_mean": 0.5})


@pytest.mark.parametrize("change, field", [
    ({"groups": "1"}, "groups"), ({"surprise": 1}, "surprise"), ({"updates": None}, "updates"),
    ({"metrics": {"x": float("nan")}}, "metrics.x"), ({"admitted": [[1, 2]]}, "admitted")])
def test_a_mistyped_record_is_refused_naming_the_field(change, field) -> None:
    raw = msgspec.msgpack.decode(wire.encode(wire.Ready(0, 0, 1, 3, {}, RECORD)))
    raw["record"] = {**raw["record"], **change}
    if change.get("updates", 0) is None:
        del raw["record"]["updates"]
    with pytest.raises(wire.SchemaError) as info:
        wire.decode(msgspec.msgpack.encode(raw))
    assert info.value.field == "record" and field in info.value.reason


def test_a_failed_step_carries_its_error_and_no_record() -> None:
    got = wire.decode(wire.encode(wire.Ready(0, 0, 1, 3, {}, None, error="boom")))
    assert got.record is None and got.error == "boom"


def test_the_records_stream_entry_has_the_ready_records_counts_field_for_field():
    """One definition: the Record message's fields are the SchedulerRecord's and the
    counts a ReadyRecord adds, so `Record.of` copies them all."""
    assert set(wire.Record.SPEC) - {"shard", "epoch", "step"} == \
        set(SchedulerRecord.__struct_fields__) | set(RECORD.extra)
    rec = wire.Record.of(0, 1, 5, RECORD)
    assert (rec.step, rec.groups, rec.refused, rec.resubmitted, rec.metrics) == (5, 1, 1, {"stale": 2},
                                                                              {"reward_mean": 0.5})
    assert wire.decode(wire.encode(rec)) == rec
