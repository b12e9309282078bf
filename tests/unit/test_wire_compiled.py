"""The compiled decoder (msgspec structs derived from each kind's SPEC) against the checks
in Python (`wire._parse`), which it stands in front of: on valid messages, on messages
damaged in their structure or bytes, and on arbitrary maps with a kind's fields, whatever
the structs accept `_parse` accepts, as the same message. (What they refuse is parsed again
by `_parse`, so refusals read the same by construction; `test_fuzz_wire` checks those.)"""

from __future__ import annotations

import dataclasses
import msgpack
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline import wire
from pipeline.sessions import Status, Task
from tests.unit.test_fuzz_wire import FUZZ, KINDS, _mutate, _wire_like
from tests.unit.test_wire import MESSAGES


def same_as_parsed(data: bytes) -> bool:
    """True when the structs accept `data`, after checking `_parse` gives the same message."""
    try:
        fast = wire._compiled(wire._DECODER.decode(data))
    except wire._REFUSED:
        return False
    slow = wire._parsed(data, None, wire.MAX_MESSAGE_BYTES)
    assert type(fast) is type(slow) and fast == slow
    return True


def checked_as_parsed(tree) -> None:
    """What the encoder's compiled check accepts of a wire form, `_parse` accepts."""
    try:
        wire._compiled(msgspec.convert(tree, wire._ANY_KIND, strict=True))
    except wire._REFUSED:
        return
    wire._parse(tree)


@pytest.mark.parametrize("cls", KINDS, ids=lambda cls: cls.KIND)
@FUZZ
@given(data=st.data())
def test_valid_messages_take_the_compiled_path(cls, data):
    msg = data.draw(MESSAGES[cls], label="message")
    assert same_as_parsed(wire.encode(msg))
    checked_as_parsed(wire._wire(msg))


@pytest.mark.parametrize("cls", KINDS, ids=lambda cls: cls.KIND)
@FUZZ
@given(data=st.data())
def test_decoded_messages_hold_what_their_constructor_sets(cls, data):
    """A decoded message holds exactly what the kind's constructor builds of the same values
    (and a Result's chains know their oldest version)."""
    sent = data.draw(MESSAGES[cls], label="message")
    msg = wire.decode(wire.encode(sent))
    built = cls(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(cls)})
    assert type(msg) is cls and list(vars(msg)) == list(vars(built)) and msg == built
    if isinstance(sent, wire.Result):  # the decoder's chains know their oldest version
        assert msg.oldest_version == sent.oldest_version


def damaged(cls, data):
    """The wire form of a valid message damaged in its structure, or a map of some of the
    kind's fields holding arbitrary values."""
    if data.draw(st.booleans(), label="from a valid message"):
        tree = msgpack.unpackb(wire.encode(data.draw(MESSAGES[cls], label="message")), raw=False)
        for _ in range(data.draw(st.integers(1, 3), label="mutations")):
            _mutate(tree, data)
        return tree
    names = data.draw(st.lists(st.sampled_from(list(cls.SPEC)), unique=True), label="fields")
    return {"v": wire.SCHEMA_VERSION, "k": cls.KIND, **{name: data.draw(_wire_like(name), label=name)
                                                      for name in names}}


@pytest.mark.parametrize("cls", KINDS, ids=lambda cls: cls.KIND)
@FUZZ
@given(data=st.data())
def test_damaged_messages_are_accepted_only_as_parsed(cls, data):
    tree = damaged(cls, data)
    same_as_parsed(msgpack.packb(tree, use_bin_type=True))
    checked_as_parsed(tree)


@pytest.mark.parametrize("value, accepted", [
    (2**63 - 1, True), (2**63, False), (-1, False), (True, False), (1.0, False)])
def test_an_int_field_refuses_exactly_what_the_checks_refuse(value, accepted):
    tree = msgpack.unpackb(wire.encode(wire.Handover(0, 0, 1, 1)), raw=False)
    tree["step"] = value
    assert same_as_parsed(msgpack.packb(tree, use_bin_type=True)) is accepted


@pytest.mark.parametrize("value, accepted", [
    (0.5, True), (3, True), (float("nan"), False), (float("inf"), False), (False, False), ("1", False)])
def test_a_float_field_refuses_exactly_what_the_checks_refuse(value, accepted):
    tree = msgpack.unpackb(wire.encode(wire.Result(0, 0, 0, 0, 0, "c", Status.COMPLETED)), raw=False)
    tree["reward"] = value
    assert same_as_parsed(msgpack.packb(tree, use_bin_type=True)) is accepted


@pytest.mark.parametrize("field, value, error", [
    ("task", {"id": "t", "payload": {"x": msgpack.ExtType(1, b"x")}}, "message: not msgpack (ValueError: 2 exceeds max_ext_len(0))"),
    ("task", {"id": "t", "payload": {"x": msgpack.ExtType(1, b"")}},
     "task.payload.x: ExtType is not a msgpack-native value"),
    ("task", {"id": "", "payload": {}}, "task.id: must not be empty"),
    ("deadline", -1.0, "deadline: must be >= 0, got -1.0"),
    ("cause", "why", "cause: must be one of infra_error, cancelled, stale, timeout, unscored, got 'why'"),
    ("sample", 2**64 - 1, f"sample: {2**64 - 1} is out of the int64 range"),
    ("", 0, "message: unknown field ''")])  # a refusal always names a field
def test_a_refusal_names_the_field_as_before(field, value, error):
    tree = msgpack.unpackb(wire.encode(wire.Work(0, 0, 0, 0, 0, Task("t"), 0)), raw=False)
    tree[field] = value
    with pytest.raises(wire.SchemaError) as refused:
        wire.decode(msgpack.packb(tree, use_bin_type=True))
    assert str(refused.value) == error


def _map_of(items: list[tuple]) -> bytes:
    """A msgpack map of `items` in order, repeated keys kept."""
    return bytes([0x80 | len(items)]) + b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in items)


HANDOVER = [("v", 2), ("k", "handover"), ("shard", 0), ("epoch", 0), ("step", 1), ("updates", 1),
            ("published", None)]


@pytest.mark.parametrize("items", [
    HANDOVER + [("step", 5)], HANDOVER + [("step", -1)], [("step", -1)] + HANDOVER,
    HANDOVER + [("k", "open")], [("k", "open")] + HANDOVER, HANDOVER + [("v", 1)],
    HANDOVER + [("k", "handover")]], ids=range(7))
def test_a_repeated_key_decodes_as_the_checks_read_it(items):
    """msgpack maps may repeat a key; the last one counts, whichever path decodes it."""
    data = _map_of(items)
    same_as_parsed(data)
    try:
        expected = wire._parsed(data, None, wire.MAX_MESSAGE_BYTES)
    except wire.SchemaError as refused:
        with pytest.raises(wire.SchemaError) as also:
            wire.decode(data)
        assert str(also.value) == str(refused)
    else:
        assert wire.decode(data) == expected
