"""`rollstream bench schedule`'s report without running the pipeline: the policies' configs
under `--max-lag`/`--inflight`, the summary over several rounds, and the plot."""

import pytest

from rollstream import bench_schedule
from pipeline.config import SchedulerConfig, build


def _policy(samples_per_s: float, utilization: float, vs_sync: float, vs_group: float) -> dict:
    return {"samples_per_s": samples_per_s, "utilization": utilization, "wait_share": 0.5,
            "capacity_samples_per_s": 100.0, "capacity_share": samples_per_s / 100.0,
            "lag_max": 1, "lag_mean": 0.5, "max_lag": 1, "wasted_slot_s": 1.0, "waste_share": 0.1,
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


def test_slot_accounting_splits_trained_wasted_and_pending_work():
    from rollstream.simulate import Span, slot_accounting

    spans = [
        Span(0, 0, 0, 2.0, 2.0, True),   # trained
        Span(0, 1, 0, 4.0, 4.0, True),   # finished, then discarded as stale: superseded
        Span(0, 1, 1, 1.0, 1.0, True),   # its resubmission, trained
        Span(0, 2, 0, 3.0, None, True),  # cancelled as surplus of a trained group
        Span(1, 0, 0, 5.0, 5.0, True),   # admitted into group 1, not trained yet: pending
        Span(1, 1, 0, 6.0, None, False),  # still running at the end: pending
        Span(2, 0, 0, 7.0, 7.0, True),   # a surplus finisher of trained group 2
        Span(2, 1, 0, 1.5, 1.5, True),   # trained
    ]
    out = slot_accounting(spans, {(0, 0, 0), (0, 1, 1), (2, 1, 0)})
    assert out["busy_slot_s"] == 29.5
    assert out["wasted_slot_s"] == 4.0 + 3.0 + 7.0
    assert out["waste_share"] == round(14.0 / 29.5, 4)
    finished = [2.0, 4.0, 1.0, 5.0, 7.0, 1.5]
    assert out["trained_length_s"] == pytest.approx(1.5)
    assert out["trained_length_bias"] == round(1.5 / (sum(finished) / len(finished)), 4)
    assert out["slot_s"] == {"trained": 2.0 + 1.0 + 1.5, "cancelled": 3.0, "superseded": 4.0,
                             "surplus": 7.0, "waiting": 5.0, "running": 6.0}
    assert slot_accounting([], set())["trained_length_bias"] is None


def test_slot_shares_add_up_to_one_with_the_idle_rest():
    shares = bench_schedule.slot_shares({"trained": 30.0, "cancelled": 10.0, "running": 20.0}, 80.0)
    assert shares == {"trained": 0.375, "cancelled": 0.125, "running": 0.25, "idle": 0.25}
    assert bench_schedule.slot_shares({"trained": 8.0}, 8.0)["idle"] == 0.0


def test_the_simulated_frontier_has_every_policy_at_every_lag_with_every_field(tmp_path):
    pytest.importorskip("matplotlib")
    w = bench_schedule.workload_for(True, steps=3, slots=16, procs=1, batch_size=4, groups=2,
                                    median_ms=5.0, train_ms=1.0)
    out = bench_schedule.simulate_frontier(w)
    assert list(out["frontier"]) == ["1", "2", "4"]
    assert out["workload"]["max_lags"] == [1, 2, 4] and "max_lag" not in out["workload"]
    for lag, policies in out["frontier"].items():
        assert list(policies) == list(bench_schedule.POLICIES)
        for name, p in policies.items():
            assert p["max_lag"] == int(lag) and p["lag_max"] <= int(lag), (lag, name)
            assert p["steps"] == 3 and p["trained_samples"] == 3 * 4 * 2
            assert 0 <= p["waste_share"] < 1 and 0 < p["capacity_share"] <= 1.0
            assert p["trained_length_bias"] > 0 and p["trained_length_vs_workload"] > 0
            # every slot-second has one fate, and the trained ones make the share
            assert sum(p["slot_shares"].values()) == pytest.approx(1.0, abs=1e-3)
            assert p["capacity_share"] == pytest.approx(
                p["slot_shares"]["trained"] / p["trained_length_vs_workload"], rel=2e-3)
            assert 0 < p["first_step_s"] and (p["step_s"] or 0) >= 0
        assert policies["sync"]["waste_share"] == 0.0
        assert policies["batch"]["waste_share"] > 0  # its oversampled surplus
    assert "stream" in bench_schedule.format_frontier(out)
    path = tmp_path / "frontier.png"
    bench_schedule.plot_frontier(out, path, simulated=out)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_least_waste_bound_matches_giving_up_at_the_window_on_sampled_sessions():
    import math
    import random

    w = bench_schedule.workload_for(False, median_ms=1000.0)
    out = bench_schedule.least_waste_share(w, 1, 0.584)
    mean = bench_schedule.capped_lognormal_mean(1.0, 1.0, 20.0)
    assert out["push_interval_s"] == pytest.approx(256 * mean / (0.584 * 256), rel=1e-3)
    # max_lag + 1 push intervals: from just after push v to the emission of step v + max_lag
    assert out["window_s"] == pytest.approx(2 * out["push_interval_s"], rel=1e-3)
    assert out["give_up_at_s"] == out["window_s"]
    rng, a = random.Random(0), out["window_s"]
    lengths = [min(rng.lognormvariate(0.0, 1.0), 20.0) for _ in range(200_000)]
    wasted = sum(a for d in lengths if d > a)
    busy = sum(min(d, a) for d in lengths)
    assert out["waste_share"] == pytest.approx(wasted / busy, abs=0.005)
    trained = [d for d in lengths if d <= a]
    assert out["trained_length_vs_workload"] == pytest.approx(sum(trained) / len(trained) / mean, abs=0.01)
    # a longer bound leaves less to waste; past the longest session nothing
    wider = bench_schedule.least_waste_share(w, 2, 0.584)
    assert wider["window_s"] == pytest.approx(1.5 * a, rel=1e-3) and wider["waste_share"] < out["waste_share"]
    assert bench_schedule.least_waste_share(w, 100, 0.584)["waste_share"] == 0.0
    assert math.isclose(out["longer_than_window"], sum(d > a for d in lengths) / len(lengths), abs_tol=0.005)


@pytest.mark.parametrize("lag", [1, 2])
def test_a_session_counted_from_its_start_trains_across_lag_pushes_and_no_more(lag):
    """The window `least_waste_share` gives a session, max_lag + 1 push intervals, is the
    scheduler's: in a simulated `stream` run whose sessions carry the version served as they
    start, a trained session has at most `lag` handovers (pushes) inside it, and some have
    exactly `lag`, lasting longer than `lag` push intervals."""
    from rollstream import simulate
    from consumers.sources.sleep import SleepSource

    w = bench_schedule.workload_for(False, median_ms=1000.0, slots=64, procs=1, batch_size=8,
                                    steps=40, ahead=lag, max_lag=lag)
    source = SleepSource(**bench_schedule._sleep_args(w))
    spans, handovers = {}, []  # key -> (start, end) of every attempt that ended by itself

    class Recorded(simulate.Simulation):
        def _finish(self, payload):
            entry = self._running.get(payload[0])  # (start, length); None: cancelled
            if entry is not None:
                spans[payload[0]] = (entry[0], self.now)
            return super()._finish(payload)

        def _trained(self, step):
            handovers.append(self.now)
            return super()._trained(step)

    sim = Recorded(bench_schedule._scheduler("stream", w), simulate.Workload(
        slots=w["slots"], batch_size=w["batch_size"], median_s=1.0, sigma=1.0, cap=20.0,
        train_s=w["train_ms"] / 1000, status_mix={"completed": 1.0}, call_at_end=False),
        durations=lambda sub: source.duration_for(sub.task.id, sub.key.group, sub.key.sample,
                                                  sub.key.attempt))
    list(sim.steps(w["steps"]))
    trained = [spans[k] for k in spans if (k.group, k.sample, k.attempt) in sim.trained]
    inside = [sum(start < h < end for h in handovers) for start, end in trained]
    push = (handovers[-1] - handovers[0]) / (len(handovers) - 1)
    assert len(trained) == w["steps"] * w["batch_size"] * w["groups"]
    assert max(inside) == lag
    assert max(end - start for start, end in trained) > lag * push


def _given_up_at(lengths, ages):
    """Busy, ended-by-itself and wasted slot-seconds of sessions given up at `ages`."""
    busy = sum(min(d, a) for d, a in zip(lengths, ages))
    ended = sum(d <= a for d, a in zip(lengths, ages))
    wasted = sum(a for d, a in zip(lengths, ages) if d > a)
    return busy, ended, wasted


def test_the_best_share_is_a_mixture_of_two_give_up_ages_met_on_sampled_sessions():
    import random

    w = bench_schedule.workload_for(False, median_ms=1000.0)
    mean = bench_schedule.capped_lognormal_mean(1.0, 1.0, 20.0)
    rng = random.Random(0)
    lengths = [min(rng.lognormvariate(0.0, 1.0), 20.0) for _ in range(200_000)]
    assert bench_schedule.best_share(w, 0.0)["share"] == 1.0  # no waste: no session given up
    out = bench_schedule.best_share(w, 0.16)
    high, low = out["give_up_at_s"]
    ages = [high if rng.random() < out["weight_of_first"] else low for _ in lengths]
    busy, ended, wasted = _given_up_at(lengths, ages)
    assert wasted / busy == pytest.approx(0.16, abs=0.005)
    assert out["share"] == pytest.approx(ended * mean / busy, abs=0.005)
    # no single give-up age within the waste does better, and more waste buys more share
    for a in (2.0, 4.0, 6.0, 8.0, 12.0):
        busy, ended, wasted = _given_up_at(lengths, [a] * len(lengths))
        if wasted / busy <= 0.16 - 0.005:
            assert ended * mean / busy <= out["share"] + 0.005
    shares = [bench_schedule.best_share(w, x)["share"] for x in (0.05, 0.1, 0.2, 0.3)]
    assert shares == sorted(shares) and shares[0] > 1.0


def test_the_simulated_frontier_reports_the_bound_at_batchs_share():
    w = bench_schedule.workload_for(True, steps=3, slots=16, procs=1, batch_size=4, groups=2,
                                    median_ms=5.0, train_ms=1.0)
    out = bench_schedule.simulate_frontier(w, ("batch", "stream"))
    for lag, bound in out["bound"].items():
        assert bound["share"] == out["frontier"][lag]["batch"]["capacity_share"]
        assert 0 <= bound["waste_share"] < 1
        best = out["best_share"][lag]
        assert best["waste_share"] == out["frontier"][lag]["batch"]["waste_share"] / 2
        assert best["share"] >= 1.0
    assert "bound" in bench_schedule.format_frontier(out)
    assert "the most any policy trains" in bench_schedule.format_frontier(out)
    for lag, fixed in out["bound_fixed_window"].items():
        assert fixed["share"] == out["frontier"][lag]["batch"]["capacity_share"]
        assert 0 <= fixed["waste_share"] < 1 and fixed["policies"] == "fixed window"
    assert "fix a group's step" in bench_schedule.format_frontier(out)
    assert "bound" not in bench_schedule.simulate_frontier(w, ("stream",))
    assert "bound_fixed_window" not in bench_schedule.simulate_frontier(w, ("stream",))


def test_the_mean_over_seeds_averages_every_figure_and_lists_the_main_ones():
    runs = [{**_policy(10.0, 0.2, 1.0, 1.0), "lag_max": 1, "trained_length_vs_workload": 0.5,
             "resubmitted": {"stale": 2}, "config": {"max_lag": 2}},
            {**_policy(30.0, 0.4, 1.0, 1.0), "lag_max": 2, "trained_length_vs_workload": None,
             "resubmitted": {"stale": 5}, "config": {"max_lag": 2}}]
    out = bench_schedule.mean_over_seeds(runs)
    assert out["samples_per_s"] == 20.0 and out["utilization"] == pytest.approx(0.3)
    assert out["capacity_share"] == 0.2 and out["resubmitted"] == {"stale": 3.5}
    assert out["lag_max"] == 2  # the largest, not a mean
    assert out["trained_length_vs_workload"] == 0.5  # not every seed has one: the first's
    assert out["config"] == {"max_lag": 2} and out["seeds"] == 2
    assert out["per_seed"]["capacity_share"] == [0.1, 0.3]
    assert bench_schedule.mean_over_seeds([runs[0]]) is runs[0]


def test_the_simulated_frontier_over_seeds_is_the_mean_of_each_seeds_frontier():
    w = bench_schedule.workload_for(True, steps=3, slots=16, procs=1, batch_size=4, groups=2,
                                    median_ms=5.0, train_ms=1.0)
    one = [bench_schedule.simulate_frontier({**w, "seed": s}, ("batch",), lags=(1,)) for s in (0, 1)]
    both = bench_schedule.simulate_frontier(w, ("batch",), lags=(1,), seeds=2)
    shares = [o["frontier"]["1"]["batch"]["capacity_share"] for o in one]
    assert shares[0] != shares[1]  # the seeds draw different sessions
    point = both["frontier"]["1"]["batch"]
    assert point["per_seed"]["capacity_share"] == shares
    assert point["capacity_share"] == pytest.approx(sum(shares) / 2, abs=1e-4)
    assert both["workload"]["seeds"] == 2
    with pytest.raises(ValueError, match="seeds"):
        bench_schedule.simulate_frontier(w, ("batch",), seeds=0)


def test_the_simulation_runs_the_sessions_sleepsource_sleeps(monkeypatch):
    """The frontier's simulation draws each attempt's duration as the bench's consumers do:
    `SleepSource.duration_for` of the attempt's key, the time `run` waits."""
    import threading

    from consumers.sources import sleep
    from pipeline.sessions import SessionRequest, Task
    from rollstream import simulate

    source = sleep.SleepSource(median_s=0.5, sigma=1.0, cap=20.0, seed=3)
    waited = []
    monkeypatch.setattr(sleep, "wait_cancelled", lambda request, s: waited.append(s) or False)
    for attempt in range(3):
        source.run(SessionRequest(Task(simulate.task_id(4, 1)), 7, 2, attempt, 0, None,
                                  threading.Event(), lambda: 0))
        assert waited[-1] == source.duration_for("4.1", 7, 2, attempt)
    assert len(set(waited)) == 3  # every attempt its own draw
    assert sleep.SleepSource(median_s=0.5, seed=4).duration_for("4.1", 7, 2, 0) != waited[0]

    drawn = []
    original = simulate.Simulation._fill

    def fill(self):
        before = set(self._running)
        original(self)
        drawn.extend((key, self._running[key][1]) for key in set(self._running) - before)

    monkeypatch.setattr(simulate.Simulation, "_fill", fill)
    w = bench_schedule.workload_for(True, steps=2, slots=16, procs=1, batch_size=4, groups=2,
                                    median_ms=5.0, train_ms=1.0, seed=3)
    bench_schedule.simulate_policy("batch", w)
    bench = sleep.SleepSource(**bench_schedule._sleep_args(w))
    tasks = {}  # batch mode: batch b's groups are b * batch_size .. in order, one per task
    assert len(drawn) > 8
    for key, length in drawn:
        b, i = divmod(key.group, w["batch_size"])
        tasks[key.group] = simulate.task_id(b, i)
        assert length == bench.duration_for(tasks[key.group], key.group, key.sample, key.attempt)


def _sessions(n: int, seed: int = 0):
    import numpy as np

    return np.minimum(np.random.default_rng(seed).lognormal(0.0, 1.0, n), 20.0)


def _fixed_window_groups(lengths, window: float, start: float, attempts: int, give_up: float | None = None):
    """Wasted and busy slot-seconds of groups of 8 whose `attempts` attempts all start `start`
    before their fixed window opens (the window is [start, start + window] of their ages);
    an attempt not ended when the window closes, or at `give_up` when that comes first and
    window time is left, is cancelled and (when given up early) restarted at once. A group
    trains its first 8 landings if 8 land, else all of it is wasted."""
    wasted = busy = 0.0
    close = start + window
    it = iter(lengths)
    for _ in range(len(lengths) // (4 * attempts)):
        landed, lost = [], 0.0
        for _ in range(attempts):
            t = 0.0  # this attempt's start, on the group's clock
            while True:
                d, stop = next(it), close - t
                if give_up is not None and t + give_up < close:
                    stop = min(stop, give_up)
                if d > stop:  # cancelled
                    lost += stop
                    t += stop
                    if t >= close or give_up is None:
                        break
                    continue
                if t + d < start:  # ended before the window opened
                    lost += d
                else:
                    landed.append(d)
                break
        trained = sorted(landed)[:8] if len(landed) >= 8 else []
        wasted += lost + sum(landed) - sum(trained)
        busy += lost + sum(landed)
    return wasted, busy


def test_no_fixed_window_policy_beats_the_least_waste_at_the_end_and_the_bound_is_nearly_met():
    w = bench_schedule.workload_for(False, median_ms=1000.0)
    out = bench_schedule.least_waste_share_fixed_window(w, 1, 0.598)
    mean = bench_schedule.capped_lognormal_mean(1.0, 1.0, 20.0)
    push = 256 * mean / (0.598 * 256)
    assert out["push_interval_s"] == pytest.approx(push, rel=1e-3)
    assert out["window_s"] == pytest.approx(2 * push, rel=1e-3)  # max_lag + 1 push intervals
    lengths = _sessions(200_000)
    # the bound's own attempt, every landing trained (no group to fill): it meets the bound
    u, a = out["start_before_s"], out["give_up_at_s"]
    wasted = lengths[lengths < u].sum() + a * (lengths > a).sum()
    busy = lengths.clip(max=a).sum()
    assert out["waste_share"] <= wasted / busy <= out["waste_share"] + 0.005
    # concrete fixed-window policies: groups of 8 with extras, an early start, restarts
    for start, attempts, give_up in ((0.0, 8, None), (0.0, 9, None), (0.0, 10, None),
                                     (0.5, 9, None), (0.0, 8, 3.0), (0.2, 9, 4.0)):
        wasted, busy = _fixed_window_groups(lengths, out["window_s"], start, attempts, give_up)
        assert wasted / busy >= out["waste_share"], (start, attempts, give_up, wasted / busy)
    # more share (pushes closer) leaves less time and wastes more; a larger max_lag less
    by_share = [bench_schedule.least_waste_share_fixed_window(w, 1, s)["waste_share"]
                for s in (0.3, 0.5, 0.7, 0.9)]
    assert by_share == sorted(by_share) and by_share[0] < by_share[-1]
    by_lag = [bench_schedule.least_waste_share_fixed_window(w, lag, 0.598)["waste_share"]
              for lag in (1, 2, 4, 8)]
    assert by_lag == sorted(by_lag, reverse=True) and by_lag[-1] < by_lag[0]
    assert bench_schedule.least_waste_share_fixed_window(w, 100, 0.598)["waste_share"] == 0.0


def test_the_simulated_batch_policy_wastes_at_least_the_fixed_window_bound():
    # `batch` trains batch b at step b: a fixed window. Its simulated waste share (a 12-step
    # run, pending work counted as busy) stays above the steady-state bound at its share.
    w = bench_schedule.workload_for(False, median_ms=1000.0, steps=12)
    for seed in (0, 1):
        for lag in (1, 2, 4):
            r = bench_schedule.simulate_policy("batch", bench_schedule._at_lag({**w, "seed": seed}, lag))
            bound = bench_schedule.least_waste_share_fixed_window(w, lag, r["capacity_share"])
            assert r["waste_share"] >= bound["waste_share"], (seed, lag, r["waste_share"], bound)


def test_frontier_figures_read_the_dashboard_s_numbers_from_a_scrape():
    """Busy slot-seconds are every status's, the population's mean is that of the sessions
    that ended by themselves, what is held for groups not trained yet is neither trained
    nor wasted, and every shard counts."""
    from prometheus_client import generate_latest

    from pipeline.metrics import Metrics
    from pipeline.sessions import Status
    from rollstream.bench_schedule import frontier_figures, slot_seconds

    m = Metrics()

    def scrape() -> dict:
        return slot_seconds(generate_latest(m.registry).decode())

    m.observe_finished_many(0, [Status.COMPLETED, Status.COMPLETED, Status.CANCELLED], [1.0, 3.0, 0.5])
    m.observe_finished_many(1, [Status.INFRA_ERROR], [2.0])
    m.observe_trained(0, [1.0])
    m.observe_trained(1, [2.0])
    m.set_held_seconds(0, 3.0)  # the second completed session waits for its group
    start = scrape()
    assert frontier_figures(start) == {
        "busy_slot_s": 6.5, "trained_slot_s": 3.0, "held_growth_s": 3.0, "trained": 2,
        "waste_share": round(0.5 / 6.5, 4), "trained_length_bias": round(1.5 / 2.0, 4)}
    m.observe_finished_many(0, [Status.COMPLETED, Status.CANCELLED], [4.0, 4.0])
    m.observe_trained(0, [3.0, 4.0])  # its group trains
    m.set_held_seconds(0, 0.0)
    assert frontier_figures(scrape(), start) == {
        "busy_slot_s": 8.0, "trained_slot_s": 7.0, "held_growth_s": -3.0, "trained": 2,
        "waste_share": 0.5, "trained_length_bias": round(3.5 / 4.0, 4)}
    assert frontier_figures(slot_seconds(""))["waste_share"] is None
