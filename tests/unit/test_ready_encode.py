"""A `Ready`'s arrays are packed from views of their data, not copies: the bytes are those of
each array's little-endian bytes, whatever its layout, and the checks before packing refuse
what decoding refuses, naming the array."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from pipeline import wire
from pipeline.ready import ReadyRecord

ARRAYS = {
    "plain": np.arange(6, dtype=np.int32),
    "strided": np.arange(12, dtype=np.float32)[::3],
    "big_endian": np.arange(4, dtype=">i8"),
    "matrix": np.arange(12, dtype=np.uint16).reshape(3, 4).T,
    "scalar": np.array(7, dtype=np.int64),
    "empty": np.zeros((0, 3), dtype=np.float64),
    "bits": np.array([True, False, True]),
}


def copied(v: np.ndarray) -> dict:
    dt = v.dtype.newbyteorder("<")
    return {"dtype": dt.str, "shape": list(v.shape), "data": np.ascontiguousarray(v, dt).tobytes()}


def test_arrays_pack_to_the_bytes_of_their_copies_and_decode_back():
    ready = wire.Ready(0, 1, 2, 3, dict(ARRAYS))
    data = wire.encode(ready)
    assert msgpack.unpackb(data)["arrays"] == {name: copied(v) for name, v in ARRAYS.items()}
    back = wire.decode(data, wire.Ready)
    for name, v in ARRAYS.items():
        assert back.arrays[name].shape == v.shape and (back.arrays[name] == v).all()


@pytest.mark.parametrize("name, bad, reason", [
    ("logprobs", np.array([0.0, np.nan], np.float32), "must be finite"),
    ("tokens", np.array(["a"]), "must be one of"),
])
def test_an_array_decoding_would_refuse_is_refused_at_encoding_by_name(name, bad, reason):
    with pytest.raises(wire.SchemaError, match=reason) as err:
        wire.encode(wire.Ready(0, 1, 2, 3, {"tokens": np.arange(3, dtype=np.int32), name: bad}))
    assert err.value.field.startswith(f"arrays.{name}")


def test_a_ready_is_packed_as_msgpack_packs_its_wire_form():
    record = ReadyRecord(updates=3, version=2, lag=1, groups=1, resubmitted={"stale": 2}, cancelled=0,
                         abandoned=0, cut=0, waited=0.25, metrics={"reward_mean": 0.5, "latency_s_p50": 1e-300},
                         backups=1, refused=1, surplus=2, overlong=3, admitted=((1, 0, "t\u00e9"),), packed=(1,),
                         refused_groups=((4, "too long"),), dropped=((5, 0, "u", "abandoned"),))
    for ready in (wire.Ready(0, 1, 2, 3, dict(ARRAYS), record), wire.Ready(7, 2**40, 0, 2**63 - 1, {}, None, "boom")):
        assert wire.encode(ready) == msgpack.packb(wire._wire(ready), use_bin_type=True)
