"""`rollstream bench schedule`'s report without running the pipeline: the policies' configs
under `--max-lag`/`--inflight`, the summary over several rounds, and the plot."""

import pytest

from rollstream import bench_schedule
from pipeline.config import SchedulerConfig, build


def _policy(samples_per_s: float, utilization: float, vs_sync: float, vs_group: float) -> dict:
    return {"samples_per_s": samples_per_s, "utilization": utilization, "wait_share": 0.5,
            "capacity_samples_per_s": 100.0, "capacity_share": samples_per_s / 100.0,
            "lag_max": 1, "lag_mean": 0.5, "max_lag": 1, "wasted_slot_s": 1.0,
            "resubmitted": {"stale": 0}, "vs_sync": {"samples_per_s": vs_sync, "utilization": vs_sync},
            "vs_group": {"samples_per_s": vs_group, "utilization": vs_group}}


def test_every_policy_builds_under_the_lag_and_inflight_flags():
    for name in bench_schedule.POLICIES:
        config = build(SchedulerConfig, bench_schedule.policy_config(name, 8, 32, max_lag=2, inflight=256))
        assert config.max_lag == 2
        if name in ("stream", "group"):
            assert config.inflight_samples == 256
            assert config.backfill == ("group" if name == "group" else "sample")
    w = bench_schedule.workload_for(True, slots=64, procs=2)
    assert w["inflight"] == 64 and w["max_lag"] == 1
    assert bench_schedule.workload_for(True, inflight=96, max_lag=3)["inflight"] == 96


def test_several_rounds_report_the_median_round_the_median_ratios_and_the_spread():
    rounds = [_policy(30.0, 0.3, 1.5, 0.9), _policy(10.0, 0.1, 1.1, 1.3), _policy(20.0, 0.2, 1.2, 1.0)]
    out = bench_schedule._summary(rounds)
    assert out["samples_per_s"] == 20.0 and out["utilization"] == 0.2  # the median round
    assert out["vs_sync"] == {"samples_per_s": 1.2, "utilization": 1.2}  # median of the rounds' ratios
    assert out["vs_group"]["samples_per_s"] == 1.0
    assert out["spread"]["samples_per_s"] == [10.0, 20.0, 30.0]
    assert out["spread"]["vs_group"]["samples_per_s"] == [0.9, 1.0, 1.3]
    assert out["rounds"] == 3
    assert bench_schedule._summary([rounds[0]]) is rounds[0]  # one round: as measured
    assert bench_schedule._median([1.0, 2.0, None, 4.0, 3.0]) == 2.5


def test_the_plot_is_a_png_of_every_policy(tmp_path):
    pytest.importorskip("matplotlib")
    policies = {name: {**_policy(10.0 * (i + 1), 0.2 * (i + 1), 1.0, 1.0),
                       "spread": {"samples_per_s": [5.0, 10.0 * (i + 1), 50.0],
                                  "utilization": [0.1, 0.2 * (i + 1), 0.9]}}
                for i, name in enumerate(bench_schedule.POLICIES)}
    result = {"workload": {"slots": 8, "median_ms": 5.0, "sigma": 1.0, "max_lag": 1, "steps": 2,
                           "repeat": 3}, "policies": policies}
    path = tmp_path / "schedule.png"
    bench_schedule.plot(result, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 5000
