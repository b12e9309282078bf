"""`rollstream chaos`, the short variant, in both admission modes: a real run (its own Redis
with AOF, admission, three rollout consumers, a DeepSpeed trainer) under consumer and
admission kills and pauses (a paused admission consumer replaced, then fenced), a Redis
restart and a trainer kill and resume; the audit finds nothing lost or trained twice."""

import json

import pytest

from rollstream import chaos

pytestmark = [pytest.mark.redis, pytest.mark.timeout(600)]


@pytest.mark.parametrize("admission", ["batch", "stream"])
def test_a_run_under_every_fault_loses_nothing_and_trains_nothing_twice(tmp_path, capsys, admission):
    code = chaos.main(["--json", "--minutes", "1", "--seed", "1", "--admission", admission,
                       "--keep", str(tmp_path)])
    report = json.loads(capsys.readouterr().out)
    assert report["admission"] == admission
    assert report["lost"] == 0 and report["trained_twice"] == 0, report
    assert report["steps_in_order"] and report["steps"] > 0
    assert report["registered"] == report["trained_once"] + report["abandoned"] + report["outstanding"]
    assert all(report["faults"][kind] >= 1 for kind in chaos.KINDS), report["faults"]
    assert report["fenced"] == report["faults"]["admission_pause"]  # each paused one was fenced
    assert report["trainer_runs"] >= 2  # the trainer was killed and resumed
    assert report["crashes"] == {}, report  # every client rode the faults out by itself
    assert report["trainer_exit"] == 0 and code == 0
    if admission == "batch":
        assert report["outstanding"] == 0 and report["trained_ahead"] == 0
