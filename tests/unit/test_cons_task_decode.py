"""A work entry's task decodes as it always did: the usual map (a non-empty str id and a map
payload) takes a shorter path, with the same Task; anything else is refused with the same
field and reason."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import wire
from pipeline.sessions import Task


def _reference(v, path):
    """The task checker without its shorter path."""
    d = wire._struct(v, path, ("id", "payload"))
    payload = wire._payload(d["payload"], f"{path}.payload")
    return Task(wire._str(d["id"], f"{path}.id", nonempty=True), payload)


def _outcome(check, v):
    try:
        task = check(v, "task")
    except wire.SchemaError as exc:
        return "SchemaError", str(exc)
    assert type(task) is Task
    return task.id, task.payload, hash(task)


TASKS = [
    {"id": "t1", "payload": {}},
    {"id": "t1", "payload": {"prompt": "2+2", "n": 3, "nested": {"a": [1, 2.5, None, True, b"x"]}}},
    {"payload": {}, "id": "x"},
    {"id": "", "payload": {}},
    {"id": 3, "payload": {}},
    {"id": "t", "payload": []},
    {"id": "t", "payload": None},
    {"id": "", "payload": []},
    {"id": "t", "payload": {1: "int key"}},
    {"id": "t", "payload": {"big": 2**70}},
    {"id": "t", "payload": {"deep": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}},
    {"id": "t"},
    {"payload": {}},
    {"id": "t", "payload": {}, "extra": 1},
    {"id": "t", "extra": 1},
    {},
    [],
    "t",
    None,
]


@pytest.mark.parametrize("v", TASKS, ids=[repr(t)[:40] for t in TASKS])
def test_a_task_decodes_as_before(v):
    assert _outcome(wire._task, v) == _outcome(_reference, v)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["id", "payload", "x"]),
                       st.one_of(st.text(max_size=3), st.integers(), st.none(),
                                 st.dictionaries(st.text(max_size=3), st.integers() | st.text(max_size=3),
                                                 max_size=3))))
def test_any_task_map_decodes_as_before(v):
    assert _outcome(wire._task, v) == _outcome(_reference, v)


def test_a_decoded_work_entry_has_its_task():
    work = wire.Work(0, 1, 2, 3, 4, Task("t7", {"q": [1, 2]}), 5)
    decoded = wire.from_fields(wire.to_fields(work), wire.Work)
    assert decoded == work and decoded.task == Task("t7", {"q": [1, 2]}) and hash(decoded.task) == hash("t7")
