"""The trainer's task stream: registration ahead of the step, and nothing beyond it."""

import pytest
import torch

from pipeline.sessions import Task
from domain.batches import task_ids
from trainer.task_stream import TaskStream


def test_task_ids_names_one_task_per_integer_row_by_its_decimal_id():
    assert task_ids({"task_id": [3, 10]}) == [Task("3"), Task("10")]
    assert task_ids({"task_id": torch.tensor([7, 0])}) == [Task("7"), Task("0")]
    with pytest.raises(ValueError, match="integers"):
        task_ids({"task_id": [1.5]})
    with pytest.raises(ValueError, match="task_id"):
        task_ids({"other": [1]})


class Recorder:
    def __init__(self):
        self.log = []
        self.epoch = -1

    def open(self):
        self.epoch += 1
        self.log.append(("open", self.epoch))
        return self.epoch

    def register(self, epoch, index, tasks):
        self.log.append(("register", epoch, index, [t.id for t in tasks]))


class CountingDataset:
    def __init__(self, n):
        self.n, self.read = n, 0

    def __iter__(self):
        for i in range(self.n):
            self.read += 1
            yield {"task_id": [i]}


@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_each_batch_is_registered_ahead_batches_before_the_trainer_gets_it(ahead):
    rec, data = Recorder(), CountingDataset(5)
    stream = TaskStream(data, ahead=ahead, tasks=task_ids, open=rec.open, register=rec.register)
    seen = []
    for i, batch in enumerate(stream):
        seen.append(batch["task_id"][0])
        # the trainer holds batch i: batches up to i + ahead are read, nothing beyond
        assert data.read == min(i + ahead + 1, 5)
        registered = [e[2] for e in rec.log if e[0] == "register"]
        assert registered == list(range(min(i + ahead + 1, 5)))
    assert seen == [0, 1, 2, 3, 4]


def test_reopening_the_stream_opens_a_new_epoch_and_registers_from_the_start():
    rec = Recorder()
    stream = TaskStream([{"task_id": [1]}, {"task_id": [2]}], ahead=1, tasks=task_ids,
                        open=rec.open, register=rec.register)
    next(iter(stream))
    list(stream)
    assert rec.log == [("open", 0), ("register", 0, 0, ["1"]), ("register", 0, 1, ["2"]),
                       ("open", 1), ("register", 1, 0, ["1"]), ("register", 1, 1, ["2"])]


def _ids(start, n):
    return [{"task_id": list(range(10 * b, 10 * b + 3))} for b in range(start, start + n)]


def _run(data, ahead, steps, ends, resume=None):
    """Iterate a stream over `data` for `steps` trainer steps; before each next step the
    trainer learns which tasks ended (`ends[step]`: (registration index, id) pairs)."""
    rec = Recorder()
    stream = TaskStream(data, ahead=ahead, tasks=task_ids, open=rec.open, register=rec.register,
                        resume=resume)
    for step, _ in enumerate(stream):
        for index, task in ends.get(step, ()):
            stream.ended(index, task)
        if step + 1 == steps:
            break
    return stream, rec


def test_a_stream_position_carries_what_is_outstanding_and_skips_what_ended_ahead():
    # steps 0 and 1 train tasks from batches 0..2 out of order (stream admission): batch 0's
    # "1" is still running, batch 2's "20" and "22" are already trained
    ends = {0: [(0, "0"), (2, "20")], 1: [(0, "2"), (1, "10"), (1, "11"), (1, "12"), (2, "22")]}
    stream, _ = _run(_ids(0, 10), ahead=2, steps=2, ends=ends)
    pos = stream.position()
    assert [t.id for t in pos.carry] == ["1"]  # before the data position (2), unfinished
    assert dict(pos.done) == {0: ["20", "22"]}  # batch 2 is read again from the position
    # the resumed run restarts the data at its position (step 2): "1" first, then batch 2
    # without what already trained, then batch 3 on
    resumed, rec = _run(_ids(2, 8), ahead=2, steps=1, ends={},
                        resume=type(pos).from_data(pos.to_data()))
    registered = [e[3] for e in rec.log if e[0] == "register"]
    assert registered[:3] == [["1"], ["21"], ["30", "31", "32"]]


def test_a_batch_mode_position_is_empty_at_every_step():
    ends = {s: [(s, str(10 * s + i)) for i in range(3)] for s in range(4)}
    stream, _ = _run(_ids(0, 6), ahead=2, steps=4, ends=ends)
    pos = stream.position()
    assert pos.carry == () and dict(pos.done) == {}


def test_a_task_ending_twice_or_unknown_is_an_error():
    stream, _ = _run(_ids(0, 3), ahead=0, steps=1, ends={0: [(0, "0")]})
    with pytest.raises(ValueError, match="not outstanding"):
        stream.ended(0, "0")
    with pytest.raises(ValueError, match="not outstanding"):
        stream.ended(5, "x")


def test_a_fully_trained_prefetched_batch_is_skipped_on_resume_but_still_yielded():
    ends = {0: [(0, "0"), (0, "1"), (0, "2"), (1, "10"), (1, "11"), (1, "12")]}
    stream, _ = _run(_ids(0, 4), ahead=1, steps=1, ends=ends)
    pos = stream.position()
    assert pos.carry == () and dict(pos.done) == {0: ["10", "11", "12"]}
    rec = Recorder()
    resumed = TaskStream(_ids(1, 3), ahead=1, tasks=task_ids, open=rec.open, register=rec.register,
                         resume=pos)
    got = [b["task_id"][0] for b in resumed]
    assert got == [10, 20, 30]  # the trainer still gets a batch per step
    assert [e[3] for e in rec.log if e[0] == "register"] == [["20", "21", "22"], ["30", "31", "32"]]
