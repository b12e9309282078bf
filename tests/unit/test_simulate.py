"""The demo's simulation drives the real scheduling core; its records obey the rules."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_replacements_run_stale_members_again_less_and_keep_the_bound():
    """`oversample_start="replace"` against straggler backups on the bench's heavy-tailed
    sessions at max_lag 2 (seed 0, one call as each session ends): members about to go stale
    are replaced ahead instead of run again after, and every trained member is within the
    bound."""
    from rollstream.bench_schedule import simulate_policy, workload_for

    def stream(inflight: int, **config) -> dict:
        w = workload_for(False, median_ms=1000.0, steps=12, seed=0, ahead=2, max_lag=2,
                         inflight=inflight, stream_config={"stale_running": "finish", **config})
        return simulate_policy("stream", w)

    replace = stream(256, oversample=4, oversample_start="replace", replace_ahead=0.55)
    backups = stream(264, oversample=1, oversample_start="straggler", supply=2, backup_limit=24)
    assert replace["resubmitted"]["stale"] * 3 < backups["resubmitted"]["stale"]
    assert replace["slot_shares"]["superseded"] < 0.75 * backups["slot_shares"]["superseded"]
    assert replace["lag_max"] <= 2 and replace["steps"] == 12


def test_groups_started_as_the_trainer_hands_over_go_stale_less_at_max_lag_1():
    """`group_start="handover"` on the bench's heavy-tailed sessions at max_lag 1 (seed 0, one
    call as each session ends): a group started as the weights are pushed lands its first
    results early in a push interval, so fewer members age out and run again, and less is
    wasted, against the same rule starting groups whenever credits allow; slots idle while
    credits wait for a handover, and every trained member is within the bound."""
    from rollstream.bench_schedule import simulate_policy, workload_for

    def stream(inflight: int, **config) -> dict:
        w = workload_for(False, median_ms=1000.0, steps=12, seed=0, ahead=1, max_lag=1, inflight=inflight,
                         stream_config={"stale_running": "finish", "oversample": 4,
                                        "oversample_start": "replace", "replace_ahead": 0.55, **config})
        return simulate_policy("stream", w)

    anytime, handover = stream(256), stream(384, group_start="handover")
    assert handover["resubmitted"]["stale"] * 2 < anytime["resubmitted"]["stale"]
    assert handover["waste_share"] < 0.9 * anytime["waste_share"]
    assert handover["capacity_share"] > 0.9 * anytime["capacity_share"]
    assert handover["slot_shares"]["idle"] > 0.2 > anytime["slot_shares"]["idle"]
    assert handover["lag_max"] <= 1 and handover["steps"] == 12


def test_backups_in_the_runs_last_two_steps_bring_its_end_sooner_and_leave_the_steps_before_alone():
    """`end_backups` 2 on heavy-tailed sessions at max_lag 4 (12 steps, one call as each
    session ends): the ten steps before the run's last two go exactly as without it; the
    last two back up every running member of the groups not yet complete, and the twelfth
    step comes sooner, every trained member within the bound."""
    from rollstream.simulate import Simulation

    def steps(end_backups: int) -> list:
        config = SchedulerConfig(admission="stream", groups=8, oversample=4, ahead=4, max_lag=4,
                                 batch_size=32, inflight_samples=272, oversample_start="replace",
                                 replace_ahead=0.4, stale_running="finish", end_backups=end_backups)
        work = Workload(slots=256, batch_size=32, median_s=1.0, sigma=1.0, train_s=0.02, seed=3,
                        status_mix={"completed": 1.0}, call_at_end=True)
        return list(Simulation(config, work).steps(12))

    plain, ending = steps(0), steps(2)
    assert [(r.time_s, r.record) for r in ending[:10]] == [(r.time_s, r.record) for r in plain[:10]]
    assert ending[11].time_s < plain[11].time_s - 0.3
    assert sum(r.record.backups for r in ending[10:]) > sum(r.record.backups for r in plain[10:]) + 100
    assert all(r.record.lag <= 4 for r in ending)


def test_a_scheduler_restored_mid_run_goes_on_replacing_exactly_like_the_original():
    from rollstream.simulate import Simulation

    config = SchedulerConfig(admission="stream", groups=4, oversample=2, ahead=1, max_lag=1,
                             batch_size=8, inflight_samples=48, oversample_start="replace",
                             replace_ahead=0.5, stale_running="finish")
    work = Workload(slots=48, batch_size=8, median_s=1.0, train_s=0.02, seed=5,
                    status_mix={"completed": 1.0}, call_at_end=True)
    original, restored = Simulation(config, work), Simulation(config, work)
    a = [r.record for r in original.steps(20)]
    b = []
    for report in restored.steps(20):
        b.append(report.record)
        if report.step % 4 == 1:  # as an admission consumer restarted from its snapshot
            restored.sched = type(restored.sched).restore(config, restored.sched.snapshot())
    assert a == b and sum(r.backups for r in a) > 0


@settings(max_examples=25, deadline=None)
@given(groups=st.integers(2, 4), oversample=st.integers(1, 3), lag=st.integers(1, 2),
       share=st.sampled_from([0.25, 0.5, 1.0]), seed=st.integers(0, 2**16))
def test_replacing_runs_keep_the_bound_whole_groups_and_the_in_flight_target(groups, oversample, lag,
                                                                           share, seed):
    from rollstream.simulate import Simulation

    config = SchedulerConfig(admission="stream", groups=groups, oversample=oversample, ahead=1,
                             max_lag=lag, batch_size=6, inflight_samples=36,
                             oversample_start="replace", replace_ahead=share, stale_running="finish")
    work = Workload(slots=36, batch_size=6, median_s=1.0, train_s=0.02, seed=seed,
                    status_mix={"completed": 0.9, "infra_error": 0.1}, call_at_end=True)
    sim = Simulation(config, work)
    for report in sim.steps(10):
        assert report.record.lag <= lag
        sched = sim.sched
        assert sched.in_flight + sched.credits == sched.target
    per_group: dict[int, set[int]] = {}
    for group, sample, _ in sim.trained:
        per_group.setdefault(group, set()).add(sample)
    assert all(len(samples) == groups for samples in per_group.values())


def test_simulate_frontier_runs_the_workload_it_is_given(capsys):
    """`--slots`, `--groups`, `--batch-size`, `--median-ms` and `--sigma` shape the frontier's
    workload (a user's own, to tune on), as they do `bench schedule`'s."""
    from rollstream.bench_schedule import capped_lognormal_mean

    assert main(["simulate", "--frontier", "--steps", "2", "--policies", "stream", "--slots", "48",
                 "--groups", "4", "--batch-size", "6", "--median-ms", "500", "--sigma", "0.5", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    w = result["workload"]
    assert (w["slots"], w["groups"], w["batch_size"], w["median_ms"], w["sigma"]) == (48, 4, 6, 500.0, 0.5)
    assert w["mean_session_s"] == pytest.approx(capped_lognormal_mean(0.5, 0.5, 20.0), abs=1e-5)
    for point in result["frontier"].values():
        assert point["stream"]["trained_samples"] == 2 * 4 * 6
        assert point["stream"]["config"]["inflight_samples"] == 48


def test_simulate_frontier_in_worker_processes_prints_what_one_process_does(capsys):
    argv = ["simulate", "--frontier", "--steps", "4", "--policies", "batch,stream", "--slots", "32",
            "--groups", "4", "--batch-size", "4", "--median-ms", "500", "--seeds", "2", "--json"]
    outputs = []
    for jobs in ("1", "2"):
        assert main([*argv, "--jobs", jobs]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0] == outputs[1]
    stream = outputs[0]["frontier"]["2"]["stream"]
    assert stream["seeds"] == 2 and len(set(stream["per_seed"]["capacity_share"])) == 2  # two draws


@pytest.mark.parametrize("argv, says", [
    (["--frontier", "--jobs", "0"], "--jobs must be >= 1"),
    (["--jobs", "2"], "--jobs: only with --frontier"),
    (["--frontier", "--oversample", "2"], "--oversample: not with --frontier"),
    (["--frontier", "--ahead", "2", "--admission", "stream"], "--admission, --ahead: not with --frontier"),
    (["--policies", "stream"], "--policies: only with --frontier"),
    (["--seeds", "2", "--plot", "x.png"], "--plot, --seeds: only with --frontier"),
])
def test_simulate_refuses_options_of_the_other_mode_naming_them(argv, says, capsys):
    assert main(["simulate", "--steps", "1", *argv]) == 2
    assert says in capsys.readouterr().err
