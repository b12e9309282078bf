"""A `Ready`'s arrays passed by `wire._arrays_fine` skip the check of their wire form when the
`Ready` is encoded: the test must never pass arrays that check refuses, and the encoded bytes
and the refusals must be those of the full check."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline import wire
from pipeline.config import MAX_MESSAGE_BYTES


def _bools_of(byte_values: list[int]) -> np.ndarray:
    return np.array(byte_values, np.uint8).view(bool)


def _cases(rng: np.random.Generator) -> list[dict]:
    """Maps of arrays, valid and not: every dtype numpy offers here in both byte orders,
    layouts, sizes, non-finite floats, booleans that are not 0 or 1, odd names."""
    dtypes = [np.dtype(c) for c in "?bBhHiIlLqQefdgFDUSOmM"]
    dtypes += [d.newbyteorder(">") for d in dtypes if d.byteorder in "=<"]
    cases: list[dict] = []
    for dt in dtypes:
        base = np.zeros(6, dt) if dt.kind not in "USO" else np.array(["a"] * 6, dt)
        cases += [{"a": base}, {"a": base[::2]}, {"a": base.reshape(2, 3).T}, {"a": base[:0]}]
    for dt in (np.float16, np.float32, np.float64):
        for bad in (np.nan, np.inf, -np.inf):
            cases.append({"logprobs": np.array([0.0, bad], dt)})
        cases.append({"logprobs": -rng.random(50).astype(dt)})
    cases += [
        {"bits": _bools_of([0, 1, 1])}, {"bits": _bools_of([0, 2])}, {"bits": _bools_of([255])},
        {"deep": np.zeros((1,) * 33, np.int32)}, {"deep": np.zeros((1,) * 32, np.int32)},
        {"huge_empty": np.zeros((0, MAX_MESSAGE_BYTES), np.int8)},
        {"big": np.lib.stride_tricks.as_strided(np.zeros(1, np.int64), (MAX_MESSAGE_BYTES // 8 + 1,), (0,))},
        {"scalar": np.array(3, np.int64)}, {"": np.arange(3)}, {1: np.arange(3)},
        {"list": [1, 2]}, {"sub": np.arange(3).view(np.ma.MaskedArray)},
        {"tokens": np.arange(5, dtype=np.uint16), "rollout_trained": np.array([True, False])},
        {},
    ]
    return cases


def _full_check(arrays: dict) -> str | None:
    """What the check of the wire form says of `arrays`: None (passed) or the refusal."""
    ready = wire.Ready(0, 1, 2, 3, arrays)
    try:
        wire._check(wire._wire(ready), wire.Ready)
    except wire.SchemaError as exc:
        return str(exc)
    return None


def test_arrays_it_passes_are_passed_by_the_full_check():
    passed = 0
    for arrays in _cases(np.random.default_rng(0)):
        if wire._arrays_fine(arrays):
            passed += 1
            assert _full_check(arrays) is None, arrays
    assert passed >= 20  # the valid dtypes and layouts above, not a vacuous pass


@pytest.mark.parametrize("arrays", [
    {"logprobs": np.array([0.0, np.nan], np.float32)}, {"bits": _bools_of([0, 2])},
    {"deep": np.zeros((1,) * 33, np.int32)}, {"a": np.zeros(3, np.complex64)},
    {"a": np.zeros(3, ">i4")}, {"a": np.array(["x"])}, {1: np.arange(3)},
])
def test_it_passes_nothing_odd(arrays):
    assert not wire._arrays_fine(arrays)


def test_encoding_gives_the_full_checks_bytes_and_refusals(monkeypatch):
    cases = _cases(np.random.default_rng(1))

    def outcome(arrays: dict) -> bytes | str:
        try:
            return wire.encode(wire.Ready(0, 1, 2, 3, arrays))
        except (wire.SchemaError, TypeError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"

    fast = [outcome(a) for a in cases]
    monkeypatch.setattr(wire, "_arrays_fine", lambda arrays: False)
    assert fast == [outcome(a) for a in cases]
    assert sum(isinstance(x, bytes) for x in fast) >= 20 and sum(isinstance(x, str) for x in fast) >= 10
