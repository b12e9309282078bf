"""`wire.Work`'s own constructor (its fields set at once) behaves as the dataclass's: the same
fields in the same order, positional or by keyword, the defaults, frozen, equal after a round
trip and through `dataclasses.replace`; and its direct encoder (a struct of the map's fields)
packs the bytes of the general path."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from pipeline import wire
from pipeline.sessions import Task

TASK = Task("t-1", {"prompt": "2+2", "n": 4, "nested": {"a": [1, 2.5, None, True, b"\x00"]}})


def test_the_fields_are_the_dataclass_fields_in_order():
    work = wire.Work(1, 2, 3, 4, 5, TASK, 6, 7.5, "timeout")
    names = [f.name for f in dataclasses.fields(wire.Work)]
    assert list(vars(work)) == names == list(wire.Work.SPEC)
    assert [getattr(work, name) for name in names] == [1, 2, 3, 4, 5, TASK, 6, 7.5, "timeout"]


def test_keywords_and_defaults():
    work = wire.Work(shard=1, epoch=2, group=3, sample=4, attempt=5, task=TASK, submitted_version=6)
    assert work.deadline is None and work.cause is None
    assert work == wire.Work(1, 2, 3, 4, 5, TASK, 6)
    with pytest.raises(TypeError):
        wire.Work(1, 2, 3, 4, 5, TASK)  # type: ignore[call-arg]


def test_frozen_and_replaced():
    work = wire.Work(1, 2, 3, 4, 5, TASK, 6)
    with pytest.raises(dataclasses.FrozenInstanceError):
        work.shard = 9  # type: ignore[misc]
    again = dataclasses.replace(work, attempt=7, cause="stale")
    assert (again.attempt, again.cause, again.task) == (7, "stale", TASK)
    assert list(vars(again)) == list(vars(work))


@pytest.mark.parametrize("deadline, cause", [(None, None), (0.0, "timeout"), (1e308, "stale"), (-0.0, None)])
def test_direct_bytes_are_the_general_paths_and_decode_back(deadline, cause):
    work = wire.Work(2**63 - 1, 0, 10**12, 255, 65536, TASK, 2**31, deadline, cause)
    data = wire._work_bytes(work)
    assert data is not None
    assert data == msgpack.packb(wire._wire(work), use_bin_type=True)
    assert wire.to_fields(work, trusted=True) == {wire.FIELD: data}
    assert wire.decode(data, wire.Work) == work


def test_a_payload_msgspec_cannot_pack_takes_the_general_path():
    work = wire.Work(0, 0, 0, 0, 0, Task("t", {"s": "\ud800"}), 0)
    assert wire._work_bytes(work) is None
    with pytest.raises(wire.SchemaError, match="cannot pack"):
        wire.encode(work, trusted=True)
