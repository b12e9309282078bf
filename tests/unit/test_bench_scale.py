from rollstream import bench_scale


def test_scale_bench_reports_cost_per_event_for_each_size():
    result = bench_scale.run(sizes=(200, 2_000), events=2_000, repeats=2)
    assert set(result) == {"per_event_us", "events", "repeats", "ratio"}
    assert set(result["per_event_us"]) == {"200", "2000"}
    assert all(v > 0 for v in result["per_event_us"].values())
    assert result["ratio"] == round(
        result["per_event_us"]["2000"] / result["per_event_us"]["200"], 3)


def test_scale_bench_keeps_the_in_flight_target_and_emits_steps():
    out = bench_scale.measure(1_000, events=3_000)
    assert 1_000 - bench_scale.GROUPS < out["in_flight"] <= 1_000
    assert out["steps"] >= 3_000 // (32 * bench_scale.GROUPS) - 1
