"""Fuzzing every reader of untrusted stream entries.

For every message kind: arbitrary bytes (alone and behind a valid header), arbitrary msgpack
maps with the kind's fields, valid messages mutated in their structure (a value replaced by
an edge value or another type, a field dropped or added, an array's bytes rewritten) and in
their bytes (bit flips, insertions, deletions, truncations). Each input either decodes to a
message of the expected kind, which encodes back to itself, or raises `SchemaError` naming a
field; never another exception (a numpy error, a MemoryError from a shape that claims more
than the message carries). The same for `from_fields`, `dead_letter_fields`, the admission
consumer's salvage of an invalid result and the result checks against the run's limits
(`wire.check_result`).

`ROLLSTREAM_PROPERTY_EXAMPLES=N` sets the examples per test (default 20: a quick run; raise
it for a soak run).
"""

from __future__ import annotations

import copy
import math
import os

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumers.admission import _named_attempt
from pipeline import wire
from pipeline.sessions import Status, Task
from pipeline.wire import SchemaError, decode, encode, from_fields
from tests.unit.test_wire import MESSAGES, msgpack_values, paths

EXAMPLES = int(os.environ.get("ROLLSTREAM_PROPERTY_EXAMPLES", "20"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
KINDS = sorted(MESSAGES, key=lambda cls: cls.KIND)

edge_ints = st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**40, 2**62, 2**63 - 1, -(2**63), 2**64 - 1])
edge_values = edge_ints | st.sampled_from(
    [math.nan, math.inf, -math.inf, 1e308, -0.0, "", b"", None, True, [], {}, [0, 2**40], "\x00"]
).map(copy.deepcopy)  # a fresh list or map each time: a mutation may add to it
any_value = msgpack_values | edge_values


def accepts_or_refuses(data: bytes, cls: type) -> wire.Message | None:
    """Decode `data` as `cls`: a message that round-trips, or a SchemaError naming a field."""
    try:
        msg = decode(data, cls)
    except SchemaError as err:
        assert isinstance(err.field, str) and err.field and err.reason, repr(err)
        assert str(err) == f"{err.field}: {err.reason}"
        return None
    assert isinstance(msg, cls)
    assert decode(encode(msg), cls) == msg, "what decode accepts, encode accepts and round-trips"
    assert from_fields({wire.FIELD: data}, cls) == msg
    return msg


def _mutate(tree, data) -> None:
    """One structural mutation of a decoded message, in place."""
    where = data.draw(st.sampled_from(list(paths(tree))[1:]), label="path")
    parent = tree
    for step in where[:-1]:
        parent = parent[step]
    old = parent[where[-1]]
    how = data.draw(st.sampled_from(["replace", "drop", "add", "rewrite bytes"]), label="how")
    if how == "drop" and isinstance(parent, dict):
        del parent[where[-1]]
    elif how == "add" and isinstance(old, dict):
        old[data.draw(st.text(max_size=6), label="key")] = data.draw(any_value, label="value")
    elif how == "add" and isinstance(old, list):
        old.append(data.draw(edge_ints, label="element"))
    elif how == "rewrite bytes" and isinstance(old, bytes):
        # same length (arrays stay well-formed, values become anything) or another length
        size = data.draw(st.sampled_from([len(old), len(old) + 1, max(0, len(old) - 4), len(old) + 8]))
        parent[where[-1]] = data.draw(st.binary(min_size=size, max_size=size), label="bytes")
    else:
        parent[where[-1]] = data.draw(any_value, label="value")


@pytest.mark.parametrize("cls", KINDS, ids=lambda cls: cls.KIND)
@FUZZ
@given(data=st.data())
def test_mutated_messages_decode_or_are_refused(cls, data):
    tree = msgpack.unpackb(encode(data.draw(MESSAGES[cls], label="message")), raw=False)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        _mutate(tree, data)
    accepts_or_refuses(msgpack.packb(tree, use_bin_type=True), cls)


@pytest.mark.parametrize("cls", KINDS, ids=lambda cls: cls.KIND)
@FUZZ
@given(data=st.data())
def test_byte_level_damage_decodes_or_is_refused(cls, data):
    encoded = bytearray(encode(data.draw(MESSAGES[cls], label="message")))
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        i = data.draw(st.integers(0, len(encoded)), label="at")
        how = data.draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]), label="how")
        if how == "flip" and i < len(encoded):
            encoded[i] ^= 1 << data.draw(st.integers(0, 7))
        elif how == "set" and i < len(encoded):
            encoded[i] = data.draw(st.integers(0, 255))
        elif how == "insert":
            encoded[i:i] = data.draw(st.binary(min_size=1, max_size=9))
        elif how == "delete":
            del encoded[i:i + data.draw(st.integers(1, 9))]
        else:
            del encoded[i:]
    accepts_or_refuses(bytes(encoded), cls)


def _wire_like(name: str):
    """Values shaped like field `name`'s wire form, with arbitrary contents."""
    if name == "chains":
        arrays = {key: st.binary(max_size=24) for key in (*wire._CHAIN_DTYPES, "support")}
        return st.fixed_dictionaries({}, optional=arrays) | any_value
    if name == "arrays":
        array = st.fixed_dictionaries({"dtype": st.sampled_from(sorted(wire.ARRAY_DTYPES)) | any_value,
                                       "shape": st.lists(edge_ints | st.integers(0, 4), max_size=4),
                                       "data": st.binary(max_size=24)})
        return st.dictionaries(st.text(max_size=3), array, max_size=2) | any_value
    return any_value


@pytest.mark.parametrize("cls", KINDS, ids=lambda cls: cls.KIND)
@FUZZ
@given(data=st.data())
def test_arbitrary_maps_with_the_kinds_fields_decode_or_are_refused(cls, data):
    names = data.draw(st.lists(st.sampled_from(list(cls.SPEC)), unique=True), label="fields")
    tree = {"v": wire.SCHEMA_VERSION, "k": cls.KIND}
    tree.update({name: data.draw(_wire_like(name), label=name) for name in names})
    accepts_or_refuses(msgpack.packb(tree, use_bin_type=True), cls)


@pytest.mark.parametrize("cls", KINDS, ids=lambda cls: cls.KIND)
@FUZZ
@given(data=st.data())
def test_arbitrary_bytes_decode_or_are_refused(cls, data):
    header = msgpack.packb({"v": wire.SCHEMA_VERSION, "k": cls.KIND}, use_bin_type=True)[1:]
    tail = data.draw(st.binary(max_size=200), label="bytes")
    # alone, and after a map header and the kind's "v" and "k" (so decoding reaches the fields)
    accepts_or_refuses(tail, cls)
    accepts_or_refuses(bytes([0x80 | data.draw(st.integers(2, 15))]) + header + tail, cls)


@FUZZ
@given(st.sampled_from(KINDS).flatmap(lambda cls: MESSAGES[cls]), st.integers(0, 4096))
def test_the_size_limit_holds_on_both_ends(msg, limit):
    data = encode(msg)
    if len(data) <= limit:
        assert decode(data, max_bytes=limit) == msg and encode(msg, max_bytes=limit) == data
        return
    for refuse in (lambda: decode(data, max_bytes=limit), lambda: encode(msg, max_bytes=limit)):
        with pytest.raises(SchemaError, match=f"{len(data)} bytes exceeds the limit of {limit}") as info:
            refuse()
        assert info.value.field == "message"


entry_fields = st.one_of(
    st.dictionaries(st.binary(max_size=3) | st.text(max_size=3), msgpack_values | st.binary(max_size=40), max_size=3),
    msgpack_values,
)


@FUZZ
@given(entry_fields, st.sampled_from(KINDS))
def test_from_fields_of_anything(fields, cls):
    try:
        assert isinstance(from_fields(fields, cls), cls)
    except SchemaError as err:
        assert err.field and err.reason


@FUZZ
@given(st.text(max_size=20), st.binary(max_size=20) | st.text(max_size=20) | st.integers(),
       st.text(max_size=100), entry_fields)
def test_dead_letter_fields_of_anything_are_writable(stream, entry_id, reason, raw):
    dead = wire.dead_letter_fields(stream, entry_id, reason, raw)
    assert all(isinstance(k, bytes) and isinstance(v, bytes) for k, v in dead.items())
    assert len(dead[b"m"]) <= wire.DEAD_LETTER_BYTES and len(dead[b"reason"]) <= wire.DEAD_LETTER_BYTES


@FUZZ
@given(st.one_of(entry_fields, MESSAGES[wire.Result].map(lambda m: {wire.FIELD: encode(m)}),
                 st.dictionaries(st.sampled_from(["shard", "epoch", "group", "sample", "attempt", "v"]),
                                 edge_ints | msgpack_values).map(
                     lambda d: {wire.FIELD: msgpack.packb(d, use_bin_type=True)})),
       st.integers(0, 3))
def test_salvaging_an_invalid_result_never_raises(fields, shard):
    key = _named_attempt(fields, shard)
    assert key is None or all(type(x) is int and x >= 0 for x in (key.epoch, key.group, key.sample, key.attempt))


@FUZZ
@given(MESSAGES[wire.Result], st.none() | st.integers(1, 2**31))
def test_result_checks_accept_or_refuse_with_a_field(result, vocab):
    try:
        wire.check_result(result, vocab=vocab)
    except SchemaError as err:
        assert err.field.split(".")[0] in ("chains", "timings"), str(err)
        return
    for chain in result.chains:
        assert vocab is None or not len(chain) or int(chain.tokens.max()) < vocab
        assert vocab is None or chain.support is None or not chain.support.size or chain.support.max() < vocab


@FUZZ
@given(MESSAGES[wire.Result], st.integers(1, 64))
def test_a_result_cut_to_the_row_width_still_encodes_and_fits(result, width):
    cut = wire.fit_width(result, width)
    if cut is None:
        assert all(len(chain) <= width for chain in result.chains)
        return
    assert all(len(chain) <= width for chain in cut.chains)
    assert [c.tokens[:width].tolist() for c in result.chains] == [c.tokens.tolist() for c in cut.chains]
    assert wire.decode(encode(cut), wire.Result) == cut
    if result.status in (Status.INFRA_ERROR, Status.CANCELLED):
        assert cut.status is result.status
    else:
        assert cut.status is Status.TRUNCATED and cut.truncation == wire.OVERLONG


def test_a_shape_claiming_more_than_the_message_carries_is_refused():
    """Found by the fuzzing: an empty array whose other sides are huge, or a support as wide
    as 2**40 tokens over chains without completion tokens, made numpy raise (or try to
    allocate terabytes) instead of refusing the message."""
    ready = msgpack.unpackb(encode(wire.Ready(0, 0, 0, 0, {}, None)), raw=False)
    ready["arrays"] = {"a": {"dtype": "<i4", "shape": [0, 2**62], "data": b""}}
    with pytest.raises(SchemaError) as info:
        decode(msgpack.packb(ready, use_bin_type=True))
    assert info.value.field == "arrays.a.data"
    ints = {name: np.array(v, dtype).tobytes() for (name, dtype), v in zip(
        {k: wire._CHAIN_DTYPES[k] for k in ("lengths", "calls", "call_tokens", "tokens")}.items(),
        ([3], [1], [3], [1, 2, 3]))}
    result = msgpack.unpackb(encode(wire.Result(0, 0, 0, 0, 0, "c", Status.COMPLETED)), raw=False)
    result["chains"] = {**ints, "loss_mask": b"\x00", "logprobs": b"", "versions": b"", "version_runs": b"",
                        "support": {"shape": [0, 2**40], "data": b""}}
    with pytest.raises(SchemaError) as info:
        decode(msgpack.packb(result, use_bin_type=True))
    assert info.value.field.startswith("chains.support")


def test_nan_in_free_form_data_round_trips():
    """Found by the fuzzing: a NaN inside a task payload or a step's record decoded, but the
    message then compared unequal to itself."""
    msg = wire.Registration(0, 0, 0, (Task("t", {"x": [math.nan], "y": {"z": math.nan}}),))
    assert decode(encode(msg)) == msg
    assert wire.Open(0, 0, {"x": 1.0}) != wire.Open(0, 0, {"x": math.nan})
