import contextlib
import gc

import pytest

from pipeline.collector import YOUNG_COLLECTION_EVERY
from pipeline.errors import CommandError
from rollstream import bench_scale

REPLACE = {"oversample": 4, "oversample_start": "replace", "replace_ahead": 0.55,
           "stale_running": "finish"}


def test_scale_bench_reports_cost_per_event_for_each_size():
    result = bench_scale.run(sizes=(200, 2_000), events=2_000, repeats=2)
    assert set(result) == {"per_event_us", "handover_us", "collect_ms", "events", "repeats",
                           "stream_config", "collector", "ratio"}
    assert set(result["per_event_us"]) == set(result["handover_us"]) == set(result["collect_ms"]) == {"200", "2000"}
    assert all(v > 0 for v in result["per_event_us"].values())
    assert all(v > 0 for v in result["handover_us"].values())
    assert result["ratio"] == round(
        result["per_event_us"]["2000"] / result["per_event_us"]["200"], 3)


def test_scale_bench_keeps_the_in_flight_target_and_emits_steps():
    out = bench_scale.measure(1_000, events=3_000)
    assert 1_000 - bench_scale.GROUPS < out["in_flight"] <= 1_000
    assert out["steps"] >= 3_000 // (32 * bench_scale.GROUPS) - 1


@pytest.mark.parametrize("config", [REPLACE, {**REPLACE, "group_start": "handover"},
                                    {"oversample": 1, "oversample_start": "straggler", "backup_limit": 8}])
def test_scale_bench_runs_a_stream_setting_of_ones_own(config):
    # a setting that starts groups only at handovers has them all started at the first, and
    # later leaves at most a step's worth of credits waiting for the next
    out = bench_scale.measure(1_000, events=3_000, stream_config=config)
    assert 1_000 - 32 * bench_scale.GROUPS < out["in_flight"] <= 1_000
    assert out["steps"] >= 3_000 // (32 * bench_scale.GROUPS) - 1


def test_scale_bench_refuses_a_setting_of_what_it_fixes_itself():
    with pytest.raises(CommandError, match="inflight_samples, max_lag the bench sets itself"):
        bench_scale.measure(1_000, events=10, stream_config={"max_lag": 2, "inflight_samples": 5})


def test_scale_bench_times_events_with_the_collector_held_off_and_restores_it(monkeypatch):
    enabled = []  # the collector's state at each of the scheduler's events
    handle = bench_scale.Scheduler.handle
    monkeypatch.setattr(bench_scale.Scheduler, "handle",
                        lambda self, *event: enabled.append(gc.isenabled()) or handle(self, *event))
    out = bench_scale.measure(500, events=500)
    assert gc.isenabled()  # on again after
    assert out["collect_ms"] > 0
    # the set-up runs with the collector on, as the process's; every timed event with it off
    timed = enabled[-500:]
    assert enabled[0] and not any(timed)
    gc.disable()
    try:
        bench_scale.measure(500, events=100)
        assert not gc.isenabled()  # left off, as it was
    finally:
        gc.enable()


def test_scale_bench_with_the_collector_on_reports_its_time_per_event(monkeypatch):
    threshold = gc.get_threshold()
    settings = []  # the collector's threshold as each run's events start

    @contextlib.contextmanager
    def collector_time():
        settings.append(gc.get_threshold())
        yield [0.003]  # 3 ms spent collecting in every run

    monkeypatch.setattr(bench_scale, "collector_time", collector_time)
    result = bench_scale.run(sizes=(200, 2_000), events=1_500, repeats=2, collector=True)
    assert settings == [(YOUNG_COLLECTION_EVERY, *threshold[1:])] * 4  # the admission process's
    assert gc.get_threshold() == threshold and gc.isenabled()  # the process's own back after
    assert result["collector"] is True
    assert result["collector_us"] == {"200": 2.0, "2000": 2.0}  # 3 ms over 1,500 events
