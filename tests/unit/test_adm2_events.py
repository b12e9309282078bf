"""`Finish` and `Submit` set their fields without a frozen dataclass's per-field
`object.__setattr__`: they are made, compared, hashed, shown, replaced and refused as the
generated frozen dataclasses were."""

import dataclasses

import pytest

from pipeline.scheduler import Finish, SampleKey, Submit
from pipeline.sessions import Status, Task


@dataclasses.dataclass(frozen=True)
class _Finish:
    key: SampleKey
    status: Status
    reward: float | None = None
    oldest_version: int | None = None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class _Submit:
    key: SampleKey
    task: Task
    submitted_version: int
    deadline: float | None
    cause: str | None


def _same(made, reference) -> None:
    assert dataclasses.astuple(made) == dataclasses.astuple(reference)
    assert [f.name for f in dataclasses.fields(made)] == [f.name for f in dataclasses.fields(reference)]
    assert repr(made).removeprefix(type(made).__name__) == repr(reference).removeprefix(type(reference).__name__)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.key = None  # type: ignore[misc]


KEY = SampleKey(0, 1, 2, 3)


@pytest.mark.parametrize("args, kwargs", [
    ((KEY, Status.COMPLETED), {}),
    ((KEY, Status.COMPLETED, 0.5), {}),
    ((KEY, Status.TRUNCATED, None, 7, "trace"), {}),
    ((KEY,), {"status": Status.INFRA_ERROR, "error": "x"}),
    ((), {"key": KEY, "status": Status.AGENT_ERROR, "oldest_version": 2, "reward": 1.0}),
])
def test_a_finish_is_the_frozen_dataclass_it_was(args, kwargs):
    made, reference = Finish(*args, **kwargs), _Finish(*args, **kwargs)
    _same(made, reference)
    assert made == Finish(*args, **kwargs) and hash(made) == hash(Finish(*args, **kwargs))
    assert made != Finish(KEY, Status.CANCELLED)
    changed = dataclasses.replace(made, status=Status.TRUNCATED)
    assert dataclasses.astuple(changed) == dataclasses.astuple(dataclasses.replace(reference, status=Status.TRUNCATED))


def test_a_submit_is_the_frozen_dataclass_it_was():
    for args in [(KEY, Task("a"), 0, None, None), (KEY, Task("b", {"x": 1}), 3, 12.5, "stale")]:
        made, reference = Submit(*args), _Submit(*args)
        _same(made, reference)
        assert made == Submit(*args) and made != Submit(KEY, Task("c"), 0, None, None)
    with pytest.raises(TypeError):
        Submit(KEY, Task("a"), 0, None)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Finish(KEY)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Finish(KEY, Status.COMPLETED, nope=1)  # type: ignore[call-arg]
