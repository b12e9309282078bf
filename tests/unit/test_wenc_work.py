"""`wire.encode(work, trusted=True)`, and `wire.work_bytes` of its values (the admission's
submissions), give, for every `Work`, exactly what the general path (`_wire`, then msgpack) gives: the same bytes, or the same
refusal (exception type and message), whatever the fields hold: listed odd values and
generated ones, every optional field set or not."""

from __future__ import annotations

import math
from collections import OrderedDict
from types import MappingProxyType
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import wire
from pipeline.scheduler import CAUSES
from pipeline.sessions import Status, Task


def _task(task_id: Any, payload: Any) -> Task:
    """A Task holding anything (its own checks bypassed, as an odd caller might)."""
    task = object.__new__(Task)
    object.__setattr__(task, "__dict__", {"id": task_id, "payload": payload})
    return task


def _work(*, shard: Any = 0, epoch: Any = 1, group: Any = 2, sample: Any = 3, attempt: Any = 0,
          task: Any = None, version: Any = 5, deadline: Any = None, cause: Any = None) -> wire.Work:
    task = Task("t-1", {"prompt": "2+2", "n": 4}) if task is None else task
    return wire.Work(shard, epoch, group, sample, attempt, task, version, deadline, cause)


def _outcome(work: wire.Work, **kw: Any) -> tuple:
    try:
        return ("bytes", wire.encode(work, trusted=True, **kw))
    except Exception as exc:  # noqa: BLE001 (compared, type and message)
        return ("raised", type(exc), str(exc))


def _general(work: wire.Work, **kw: Any) -> tuple:
    direct = wire._work_bytes
    wire._work_bytes = lambda w: None  # the general path alone
    try:
        return _outcome(work, **kw)
    finally:
        wire._work_bytes = direct


def _from_values(work: wire.Work, **kw: Any) -> tuple:
    """`wire.work_bytes` of the work's field values: the admission's path, without a Work."""
    try:
        return ("bytes", wire.work_bytes(*(getattr(work, name) for name in wire.Work.SPEC), **kw))
    except Exception as exc:  # noqa: BLE001 (compared, type and message)
        return ("raised", type(exc), str(exc))


def _same(work: wire.Work, **kw: Any) -> tuple:
    general = _general(work, **kw)
    assert _outcome(work, **kw) == general
    assert _outcome(work, **kw) == general  # and again, nothing kept between calls
    assert _from_values(work, **kw) == general
    return general


NESTED = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "é\u4e2d"}],
          "meta": {"tags": ["a", "b"], "score": 0.5, "n": -3, "ok": True, "none": None, "blob": b"\x00\xff"}}
USUAL = {
    "first attempt": _work(),
    "resubmission": _work(deadline=1_700_000_000.25, cause="timeout"),
    "every cause": _work(deadline=0.0, cause=CAUSES[0]),
    "empty payload": _work(task=Task("t", {})),
    "nested payload": _work(task=Task("t", NESTED), deadline=1e308, cause="stale"),
    "big numbers": _work(shard=2**63 - 1, epoch=2**40, group=10**12, sample=255, attempt=65536, version=2**31),
    "unicode id": _work(task=Task("\u00e9t\u00e9-" + "x" * 300, {"k" * 40: "v" * 70_000})),
    "negative zero deadline": _work(deadline=-0.0),
}


@pytest.mark.parametrize("name", list(USUAL))
def test_usual_works_encode_as_the_general_path_and_decode_back(name):
    work = USUAL[name]
    assert wire._work_bytes(work) is not None  # these take the direct encoder
    kind, data = _same(work)
    assert kind == "bytes"
    assert data == msgpack.packb(wire._wire(work), use_bin_type=True)
    assert wire.decode(data) == work


def _deep(n: int) -> dict:
    d: dict = {"x": 1}
    for _ in range(n):
        d = {"d": [d]}
    return d


ODD = {
    "bool shard": _work(shard=True),
    "numpy shard": _work(shard=np.int64(3)),
    "negative group": _work(group=-1),
    "uint64 sample": _work(sample=2**64 - 1),
    "int past uint64": _work(attempt=2**64),
    "int below int64": _work(version=-(2**63) - 1),
    "int deadline": _work(deadline=5),
    "numpy deadline": _work(deadline=np.float64(2.5)),
    "nan deadline": _work(deadline=math.nan),
    "inf deadline": _work(deadline=-math.inf),
    "empty cause": _work(cause=""),
    "unknown cause": _work(cause="whatever"),
    "surrogate cause": _work(cause="\ud800"),
    "bytes cause": _work(cause=b"timeout"),
    "surrogate id": _work(task=_task("\ud800", {})),
    "bytes id": _work(task=_task(b"t", {})),
    "int id": _work(task=_task(7, {})),
    "empty id": _work(task=_task("", {})),
    "not a task": _work(task={"id": "t", "payload": {}}),
    "mapping payload": _work(task=Task("t", MappingProxyType({"a": 1}))),
    "ordered payload": _work(task=Task("t", OrderedDict(a=1, b=[1, 2]))),
    "int keys": _work(task=_task("t", {1: "a"})),
    "nested int keys": _work(task=Task("t", {"a": {1: "a"}})),
    "numpy value": _work(task=Task("t", {"a": np.int64(1), "b": np.arange(3, dtype="<i4")})),
    "status value": _work(task=Task("t", {"s": Status.COMPLETED})),
    "set value": _work(task=Task("t", {"s": {1, 2}})),
    "object value": _work(task=Task("t", {"o": object()})),
    "huge int value": _work(task=Task("t", {"a": [2**64]})),
    "surrogate value": _work(task=Task("t", {"a": {"b": "\udfff"}})),
    "surrogate key": _work(task=Task("t", {"\ud800": 1})),
    "nan value": _work(task=Task("t", {"a": math.nan, "b": [math.inf, -0.0]})),
    "deep payload": _work(task=Task("t", _deep(10))),
    "too deep payload": _work(task=Task("t", _deep(40))),
    "tuple value": _work(task=Task("t", {"a": (1, ("b", None))})),
    "list payload": _work(task=_task("t", [1, 2])),
    "none payload": _work(task=_task("t", None)),
}


@pytest.mark.parametrize("name", list(ODD))
def test_odd_works_give_the_general_paths_bytes_or_refusal(name):
    _same(ODD[name])


def test_the_size_limit_refuses_alike():
    work = USUAL["unicode id"]
    size = len(_general(work)[1])
    assert _same(work, max_bytes=size)[0] == "bytes"
    kind, exc_type, message = _same(work, max_bytes=size - 1)
    assert (kind, exc_type) == ("raised", wire.SchemaError) and "exceeds the limit" in message


def test_a_cancel_and_untrusted_work_are_unchanged():
    cancel = wire.Cancel(0, 1, 2, 3, 4, "superseded")
    assert wire.encode(cancel, trusted=True) == msgpack.packb(wire._wire(cancel), use_bin_type=True)
    with pytest.raises(wire.SchemaError, match="cause"):
        wire.encode(_work(cause="whatever"))  # checked when not trusted
    with pytest.raises(TypeError, match="unchecked"):
        wire.encode(wire.Handover(0, 0, 0, 0), trusted=True)


_any_text = st.text(st.characters(blacklist_categories=()), max_size=12)  # surrogates too
_scalars = st.none() | st.booleans() | st.integers(-(2**65), 2**65) | st.floats() | _any_text | st.binary(max_size=8)
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
                       | st.dictionaries(_any_text, inner, max_size=4), max_leaves=20)
_ints = st.integers(-(2**64), 2**65) | st.sampled_from([0, 1, 2**31, 2**63 - 1])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shard=_ints, epoch=_ints, group=_ints, sample=_ints, attempt=_ints, version=_ints,
       task_id=_any_text | st.binary(max_size=4), payload=st.dictionaries(_any_text | st.integers(), _values, max_size=5),
       deadline=st.none() | st.floats() | st.integers(0, 10), cause=st.none() | st.sampled_from(CAUSES) | _any_text)
def test_generated_works_encode_as_the_general_path(shard, epoch, group, sample, attempt, version, task_id,
                                                     payload, deadline, cause):
    work = _work(shard=shard, epoch=epoch, group=group, sample=sample, attempt=attempt, version=version,
                 task=_task(task_id, payload), deadline=deadline, cause=cause)
    _same(work)
