"""The chaos audit: the lineage of the final model across trainer restarts, and the counts
of tasks trained once, twice, abandoned, outstanding and lost."""

import json

import msgpack

from pipeline.config import build
from rollstream.chaos import KINDS, audit, lineage, passed
from trainer.run_config import RunConfig

CONFIG = build(RunConfig, {"data": {"batch_size": 2}})
ALL_FAULTS = {kind: 1 for kind in KINDS}


def row(run, step, tasks, **extra):
    return {"run": run, "step": step, "tasks": [str(t) for t in tasks], **extra}


def write(tmp_path, rows):
    path = tmp_path / "record.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_lineage_drops_the_steps_a_resumed_run_trained_again():
    rows = [row("a", 0, [0, 1]), row("a", 1, [2, 3]), row("a", 2, [4, 5]),
            row("b", 1, [2, 3]), row("b", 2, [4, 5]), row("c", 3, [6, 7])]
    assert [(r["run"], r["step"]) for r in lineage(rows)] == [("a", 0), ("b", 1), ("b", 2), ("c", 3)]


def test_a_clean_history_passes(tmp_path):
    rows = [row("a", 0, [0, 1]), row("a", 1, [2, 3]), row("b", 1, [2, 3]), row("b", 2, [4, 5])]
    report = audit(CONFIG, write(tmp_path, rows))
    assert (report["registered"], report["trained_once"], report["trained_twice"], report["lost"]) == (6, 6, 0, 0)
    report.update(faults=ALL_FAULTS, trainer_exit=0)
    assert passed(report)


def test_a_task_trained_twice_a_lost_one_and_abandoned_ones_are_counted(tmp_path):
    rows = [row("a", 0, [0, 1]), row("a", 1, [1], dropped_tasks=[["2", "infra_error"]]),  # 3 lost
            row("a", 2, [4], cut_tasks=["5"])]
    report = audit(CONFIG, write(tmp_path, rows))
    assert report["trained_twice"] == 1 and report["twice"] == ["1"]
    assert report["abandoned_by_cause"] == {"attempts": 1, "surplus": 0, "cut": 1}
    assert report["lost"] == 1 and report["lost_tasks"] == ["3"]
    report.update(faults=ALL_FAULTS, trainer_exit=0)
    assert not passed(report)


def test_stream_tasks_trained_ahead_or_outstanding_in_the_final_checkpoint_are_not_lost(tmp_path):
    """Stream steps train tasks of later batches (5 is batch 2's) and leave some in flight
    at the end (3), which the final checkpoint carries for a resumed run."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "step00000002").mkdir(parents=True)
    (ckpt / "latest").write_text("step00000002")
    (ckpt / "step00000002" / "rollstream-rank0.msgpack").write_bytes(
        msgpack.packb({"carry": [["3", {}]], "done": [[0, ["5"]]]}))
    config = build(RunConfig, {"data": {"batch_size": 2}, "checkpoint": {"dir": str(ckpt)},
                               "scheduler": {"admission": "stream"}})
    rows = [row("a", 0, [0, 2]), row("a", 1, [1, 5])]
    report = audit(config, write(tmp_path, rows))
    assert (report["registered"], report["trained_once"], report["outstanding"]) == (4, 3, 1)
    assert report["trained_ahead"] == 1 and report["lost"] == 0 and report["admission"] == "stream"


def test_a_missing_step_fails_the_audit(tmp_path):
    report = audit(CONFIG, write(tmp_path, [row("a", 0, [0, 1]), row("a", 2, [4, 5])]))
    assert not report["steps_in_order"]
