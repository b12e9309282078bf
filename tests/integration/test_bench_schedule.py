"""Smoke tests of `rollstream bench schedule` and `rollstream bench admission` with tiny
parameters: the documented JSON structure and sane values (speed claims live in
BENCHMARKS.md, not here)."""

import math

import pytest

from rollstream import bench_admission, bench_schedule

pytestmark = pytest.mark.timeout(60)

FIELDS = {"samples_per_s", "utilization", "wait_share", "capacity_samples_per_s", "capacity_share",
          "lag_max", "lag_mean", "max_lag", "wasted_slot_s", "resubmitted", "vs_sync", "vs_group",
          "waste_share", "trained_length_bias", "trained_length_vs_workload"}


def test_capped_lognormal_mean_matches_monte_carlo():
    import random

    rng = random.Random(0)
    xs = [min(rng.lognormvariate(math.log(0.02), 1.0), 0.4) for _ in range(200_000)]
    assert bench_schedule.capped_lognormal_mean(0.02, 1.0, 20.0) == pytest.approx(sum(xs) / len(xs), rel=0.01)
    assert bench_schedule.capped_lognormal_mean(0.02, 0.0, 20.0) == 0.02


@pytest.mark.redis
def test_bench_schedule_reports_every_policy():
    w = bench_schedule.workload_for(True, steps=2, slots=8, procs=1, batch_size=4, groups=2,
                                    median_ms=5.0, train_ms=1.0)
    out = bench_schedule.run(w)
    assert set(out["policies"]) == {"sync", "group", "batch", "stream"}
    assert out["workload"]["slots"] == 8 and out["workload"]["steps"] == 2
    for name, p in out["policies"].items():
        assert FIELDS <= set(p), name
        assert p["steps"] == 2 and p["trained_samples"] == 2 * 4 * 2
        assert p["samples_per_s"] > 0 and 0 < p["utilization"] <= 1.0
        assert 0 <= p["wait_share"] <= 1.0 and p["capacity_share"] > 0
        assert 0 <= p["lag_mean"] <= p["lag_max"] <= p["max_lag"]
        assert p["wasted_slot_s"] >= 0 and 0 <= p["waste_share"] < 1
        assert p["trained_length_bias"] > 0
        assert set(p["resubmitted"]) >= {"infra_error", "stale"}
        # the admission's own series count every sample trained after the first step
        assert p["live"]["trained"] == p["trained_samples"] // 2, name
        assert p["live"]["trained_slot_s"] > 0
    assert out["policies"]["sync"]["vs_sync"]["samples_per_s"] == 1.0
    assert out["policies"]["group"]["vs_group"]["samples_per_s"] == 1.0
    assert out["policies"]["sync"]["wasted_slot_s"] == 0.0
    assert out["policies"]["sync"]["waste_share"] == 0.0
    assert out["policies"]["sync"]["live"]["waste_share"] == 0.0
    assert out["policies"]["group"]["config"]["backfill"] == "group"


def test_bench_admission_against_the_floor(redis_config):
    out = bench_admission.run(redis_config.url, rollouts=128, admit=4, prompt=64, completion=192,
                              width=1024)
    assert out["admission"]["steps_emitted"] == 128 // 8 // 4
    assert out["admission"]["held_after"] == 0
    # every step's Ready counted, each smaller than the results it packs
    assert 0.2 < out["ready_over_results"] <= 1.5
    assert out["admission"]["rollouts_per_s"] > 0 and out["floor"]["rollouts_per_s"] > 0
    assert out["ratio"] == pytest.approx(
        out["admission"]["rollouts_per_s"] / out["floor"]["rollouts_per_s"], rel=0.01)
    assert out["workload"]["metrics"] is True  # the admission keeps its metrics, as its process does


def test_bench_admission_without_metrics_says_so(capsys):
    import json

    assert bench_admission.main(["--json", "--rollouts", "128", "--no-metrics"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workload"]["metrics"] is False and out["admission"]["steps_emitted"] == 2


def test_bench_schedule_frontier_prints_every_policy_at_every_lag(capsys):
    import json

    args = ["--frontier", "--json", "--steps", "2", "--slots", "8", "--procs", "1",
            "--batch-size", "4", "--groups", "2", "--median-ms", "5", "--train-ms", "1",
            "--policies", "sync,stream"]
    p = __import__("argparse").ArgumentParser()
    bench_schedule.add_arguments(p)
    assert bench_schedule.run_from_args(p.parse_args(args)) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workload"]["median_ms"] == 5.0 and out["workload"]["steps"] == 2
    assert list(out["frontier"]) == ["1", "2", "4"]
    for lag, policies in out["frontier"].items():
        assert set(policies) == {"sync", "stream"}
        for p in policies.values():
            assert FIELDS - {"vs_group"} <= set(p) and p["max_lag"] == int(lag)
            assert p["config"]["max_lag"] == int(lag)


def test_bench_schedule_frontier_over_seeds_averages_the_draws(capsys):
    import json

    args = ["--frontier", "--json", "--steps", "2", "--slots", "8", "--procs", "1",
            "--batch-size", "4", "--groups", "2", "--median-ms", "5", "--train-ms", "1",
            "--policies", "batch", "--seed", "5", "--seeds", "2"]
    p = __import__("argparse").ArgumentParser()
    bench_schedule.add_arguments(p)
    assert bench_schedule.run_from_args(p.parse_args(args)) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workload"]["seed"] == 5 and out["workload"]["seeds"] == 2
    for point in (out["frontier"][lag]["batch"] for lag in ("1", "2", "4")):
        shares = point["per_seed"]["capacity_share"]
        assert point["seeds"] == 2 and len(shares) == 2
        assert point["capacity_share"] == pytest.approx(sum(shares) / 2, abs=1e-4)


def test_bench_consumer_against_the_floor_with_and_without_its_source(redis_config):
    from rollstream import bench_consumer

    out = bench_consumer.run(redis_config.url, sessions=256, slots=16, prompt=64, completion=192)
    assert out["consumer"]["results"] == {"results_completed": 256}
    assert out["workload"]["tokens_per_session"] == 256 and out["workload"]["result_bytes_mean"] > 256 * 6
    assert out["ratio"] == pytest.approx(out["consumer_per_s"] / out["floor_per_s"], rel=0.01)
    assert out["source_us"] > 0 and out["own_per_s"] > out["consumer_per_s"]
    own_s = out["consumer"]["seconds"] - out["source_us"] * 256 / 1e6
    assert out["own_per_s"] == pytest.approx(256 / own_s, rel=0.1)  # seconds rounded to the ms
    assert out["own_ratio"] == pytest.approx(out["own_per_s"] / out["floor_per_s"], rel=0.01)
