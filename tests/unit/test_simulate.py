"""The demo's simulation drives the real scheduling core; its records obey the rules."""

import json

import pytest

from rollstream.cli import main
from pipeline.config import SchedulerConfig
from rollstream.simulate import Workload, run


@pytest.mark.parametrize("admission", ["batch", "stream"])
def test_simulated_steps_respect_the_staleness_bound_and_batch_shape(admission):
    config = SchedulerConfig(admission=admission, groups=4, oversample=1, ahead=1, max_lag=1,
                             batch_size=8, timeout_s=300.0)
    records = []
    summary = run(config, Workload(slots=48, batch_size=8, seed=3), 15,
                  lambda r: records.append(r.record))
    assert len(records) == 15 and summary["steps"] == 15
    assert all(r.lag <= 1 for r in records)
    assert all(r.groups + r.abandoned <= 8 for r in records)
    assert sum(r.groups for r in records) >= 15 * 8 - sum(r.abandoned for r in records)
    assert 0 < summary["slot_utilization"] <= 1 and 0 <= summary["trainer_wait_share"] <= 1
    assert [r.updates for r in records] == list(range(15))


def test_the_simulation_is_deterministic_for_a_seed():
    config = SchedulerConfig(groups=2, batch_size=4)
    a = run(config, Workload(slots=8, batch_size=4, seed=1), 5)
    b = run(config, Workload(slots=8, batch_size=4, seed=1), 5)
    c = run(config, Workload(slots=8, batch_size=4, seed=2), 5)
    assert a == b and a != c


def test_simulate_prints_one_record_per_step_and_a_summary(capsys):
    assert main(["simulate", "--steps", "4", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["step"] for x in lines[:-1]] == [0, 1, 2, 3]
    assert set(lines[0]) >= {"updates", "version", "lag", "groups", "resubmitted", "cancelled",
                             "abandoned", "cut", "waited", "metrics"}
    assert lines[-1]["summary"]["steps"] == 4


def test_simulate_refuses_a_bad_config_naming_the_field(capsys):
    assert main(["simulate", "--groups", "0", "--steps", "1"]) == 2
    assert "groups" in capsys.readouterr().err
