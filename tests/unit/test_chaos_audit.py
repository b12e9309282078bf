"""The chaos audit: the lineage of the final model across trainer restarts, and the counts
of tasks trained once, twice, abandoned and lost."""

import json

from pipeline.config import build
from trainer.chaos import audit, lineage, passed
from trainer.config import RunConfig

CONFIG = build(RunConfig, {"data": {"batch_size": 2}})


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
    report.update(faults={"consumer_kill": 1, "admission_kill": 1, "redis_restart": 1, "trainer_resume": 1},
                  trainer_exit=0)
    assert passed(report)


def test_a_task_trained_twice_a_lost_one_and_abandoned_ones_are_counted(tmp_path):
    rows = [row("a", 0, [0, 1]), row("a", 1, [1], abandoned=1),  # task 2 or 3: one abandoned, one lost
            row("a", 2, [4], cut_tasks=["5"])]
    report = audit(CONFIG, write(tmp_path, rows))
    assert report["trained_twice"] == 1 and report["twice"] == ["1"]
    assert report["abandoned_by_cause"] == {"attempts": 1, "cut": 1}
    assert report["lost"] == 1
    report.update(faults={"consumer_kill": 1, "admission_kill": 1, "redis_restart": 1, "trainer_resume": 1},
                  trainer_exit=0)
    assert not passed(report)


def test_a_missing_step_fails_the_audit(tmp_path):
    report = audit(CONFIG, write(tmp_path, [row("a", 0, [0, 1]), row("a", 2, [4, 5])]))
    assert not report["steps_in_order"]
