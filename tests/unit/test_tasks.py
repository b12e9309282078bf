"""The trainer's task stream: registration ahead of the step, and nothing beyond it."""

import pytest
import torch

from pipeline.sessions import Task
from trainer.tasks import TaskStream, task_ids


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
