"""`rollstream tune`: every stream setting simulated on the workload given, one chosen by the
frontier's rule, its scheduler fields valid where a user puts them."""

import json
import math
import random
from pathlib import Path

import pytest

from pipeline.config import AdmissionConfig, load
from rollstream import sim_workers, tune
from rollstream.bench_schedule import simulate_policy, workload_for
from rollstream.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "local"
SMALL = ["--slots", "32", "--groups", "4", "--batch-size", "4", "--steps", "10", "--seeds", "1"]


def _row(name, share, waste):
    return {"name": name, "capacity_share": share, "waste_share": waste}


def test_the_shape_from_the_quantiles_gives_back_their_ratio():
    sigma = tune.sigma_from_quantiles(1000.0, 1000.0 * math.exp(1.2815515655446004))
    assert sigma == pytest.approx(1.0)
    rng = random.Random(0)
    draws = sorted(rng.lognormvariate(0.0, 0.7) for _ in range(40_000))
    p50, p90 = draws[len(draws) // 2], draws[int(len(draws) * 0.9)]
    assert tune.sigma_from_quantiles(p50, p90) == pytest.approx(0.7, rel=0.03)


def test_the_least_waste_at_batchs_share_or_more_is_chosen():
    ref = {"capacity_share": 0.6, "waste_share": 0.34}
    rows = [_row("a", 0.59, 0.10), _row("b", 0.61, 0.25), _row("c", 0.70, 0.20), _row("d", 0.60, 0.30)]
    assert tune.choose(ref, rows)["name"] == "c" and not tune.dominates(ref, rows[2])
    assert tune.dominates(ref, _row("e", 0.62, 0.17)) and not tune.dominates(ref, _row("f", 0.59, 0.17))
    # waste shares within NOISE of the least are equal: then the most share wins
    assert tune.choose(ref, [*rows, _row("g", 0.75, 0.204)])["name"] == "g"
    assert tune.choose(ref, [*rows, _row("h", 0.75, 0.206)])["name"] == "c"


def test_below_batchs_share_the_setting_nearest_the_goal_is_chosen():
    ref = {"capacity_share": 0.6, "waste_share": 0.34}
    rows = [_row("a", 0.59, 0.30), _row("b", 0.51, 0.17), _row("c", 0.55, 0.19)]
    # distances: a 1.765 (waste over half batch's), b 1.176 (share short), c 1.118
    assert [round(tune.distance(ref, r), 3) for r in rows] == [1.765, 1.176, 1.118]
    assert tune.choose(ref, rows)["name"] == "c"


def test_a_waste_cap_takes_the_most_share_within_it_or_else_the_least_waste():
    ref = {"capacity_share": 0.6, "waste_share": 0.34}
    rows = [_row("a", 0.59, 0.10), _row("b", 0.65, 0.12), _row("c", 0.70, 0.20)]
    assert tune.choose(ref, rows, max_waste=0.12)["name"] == "b"
    assert tune.choose(ref, rows, max_waste=0.05)["name"] == "a"
    # shares within NOISE of the most are equal: then the least waste wins
    assert tune.choose(ref, [*rows, _row("d", 0.646, 0.11)], max_waste=0.12)["name"] == "d"
    assert tune.choose(ref, [*rows, _row("e", 0.644, 0.11)], max_waste=0.12)["name"] == "b"


def test_tune_reports_every_setting_as_simulate_would_and_picks_by_its_rule(capsys):
    assert main(["tune", "--max-lag", "1", *SMALL, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    ref, rows = result["reference"], result["settings"]
    grid = rows[:len(tune.SETTINGS)]
    assert [r["name"] for r in grid] == [s.name for s in tune.SETTINGS]
    # then one round around the grid's pick, marked as such
    around = tune.neighbours(next(s for s in tune.SETTINGS if s.name == tune.choose(ref, grid)["name"]),
                             tune.SETTINGS)
    assert [r["name"] for r in rows[len(grid):]] == [s.name for s in around]
    assert all(r.get("refined") for r in rows[len(grid):]) and not any(r.get("refined") for r in grid)
    chosen = next(r for r in rows if r["name"] == result["chosen"])
    assert chosen == tune.choose(ref, rows)
    assert result["dominates_batch"] == tune.dominates(ref, chosen)
    # one place per fact: a setting's figures are the simulation's on that config
    w = workload_for(False, slots=32, procs=1, groups=4, batch_size=4, steps=10, ahead=1, max_lag=1,
                     median_ms=1000.0)
    setting = tune.SETTINGS[5]
    alone = simulate_policy("stream", {**w, "stream_config": setting.fields, "inflight": 32})
    assert rows[5]["capacity_share"] == alone["capacity_share"]
    assert rows[5]["waste_share"] == alone["waste_share"]
    assert ref["capacity_share"] == simulate_policy("batch", w)["capacity_share"]


def _named(name):
    return next(s for s in tune.SETTINGS if s.name == name)


def test_a_pick_is_refined_halfway_to_its_neighbours_or_one_step_past_the_grids_end():
    def values(settings):
        return [(s.name, s.value) for s in settings]

    assert values(tune.neighbours(_named("replace-0.55/finish"), tune.SETTINGS)) == [
        ("replace-0.475/finish", 0.475), ("replace-0.625/finish", 0.625)]
    assert values(tune.neighbours(_named("handover-1.7x/cancel"), tune.SETTINGS)) == [
        ("handover-1.6x/cancel", 1.6), ("handover-1.9x/cancel", 1.9)]
    assert values(tune.neighbours(_named("replace-0.85/finish"), tune.SETTINGS)) == [
        ("replace-0.775/finish", 0.775), ("replace-1/finish", 1.0)]  # replace_ahead stops at 1
    assert values(tune.neighbours(_named("replace-0.2/cancel"), tune.SETTINGS)) == [
        ("replace-0.1/cancel", 0.1), ("replace-0.25/cancel", 0.25)]
    # in flight below the slots would idle them: handover stops at 1x
    assert values(tune.neighbours(_named("handover-1.1x/finish"), tune.SETTINGS)) == [
        ("handover-1x/finish", 1.0), ("handover-1.15x/finish", 1.15)]
    edge = tune.KNOBS["handover"].setting("handover", 1.0, "finish")
    assert values(tune.neighbours(edge, [*tune.SETTINGS, edge])) == [("handover-1.05x/finish", 1.05)]
    assert tune.neighbours(_named("backups/finish"), tune.SETTINGS) == []
    tried = [*tune.SETTINGS, *tune.neighbours(_named("replace-0.55/finish"), tune.SETTINGS)]
    assert values(tune.neighbours(tried[-1], tried)) == [("replace-0.5875/finish", 0.5875),
                                                         ("replace-0.6625/finish", 0.6625)]
    refined = tune.neighbours(_named("handover-1.3x/finish"), tune.SETTINGS)[0]
    assert refined.inflight == 1.25 and refined.fields == _named("handover-1.3x/finish").fields


def test_each_round_of_refinement_walks_the_pick_towards_the_knobs_best_value(monkeypatch):
    """Figures made up as a function of `replace_ahead` (the least waste at 0.6) through the
    real choice and refinement: the grid picks 0.55, one round 0.625, two rounds 0.5875."""
    def figures(policy, workload):
        ahead = (workload.get("stream_config") or {}).get("replace_ahead")
        share, waste = (0.6, 0.34) if policy == "batch" else (0.61, 0.1 + abs(ahead - 0.6)) if ahead else (0.5, 0.1)
        return {"capacity_share": share, "waste_share": waste, "trained_length_vs_workload": 1.0, "lag_max": 1}

    monkeypatch.setattr(sim_workers, "run_simulations", lambda jobs, workers, done: [figures(*j) for j in jobs])
    w = {**workload_for(False, slots=256, procs=1, ahead=1, max_lag=1), "call_at_end": True}
    picks = [tune.tune(w, seeds=1, refine=n)["chosen"] for n in (0, 1, 2)]
    assert picks == ["replace-0.55/cancel", "replace-0.625/cancel", "replace-0.5875/cancel"]
    result = tune.tune(w, seeds=1, refine=2)
    assert result["scheduler"]["replace_ahead"] == 0.5875
    assert len(result["settings"]) == len(tune.SETTINGS) + 4


def test_the_chosen_fields_make_a_valid_admission_config(tmp_path):
    w = {**workload_for(False, slots=256, procs=1, ahead=2, max_lag=2), "call_at_end": True}
    handover = next(s for s in tune.SETTINGS if s.name == "handover-1.5x/finish")
    fields = tune.scheduler_fields(handover, w)
    assert fields["admission"] == "stream" and fields["max_lag"] == fields["ahead"] == 2
    assert fields["inflight_samples"] == 384 and fields["group_start"] == "handover"
    small = tune.scheduler_fields(handover, {**w, "groups": 4, "batch_size": 8})
    assert (small["groups"], small["batch_size"], small["admit"]) == (4, 8, 8)  # defaults kept: merged over a config
    assert "sync_every" not in small and "backfill" not in small
    text = (EXAMPLES / "admission.yaml").read_text()
    config = tmp_path / "admission.yaml"
    config.write_text(text.replace("{groups: 16, ahead: 1, max_lag: 1, sync_every: 1,",
                                   "{" + json.dumps(fields)[1:-1] + ", sync_every: 1,"))
    scheduler = load(AdmissionConfig, config).scheduler
    assert (scheduler.admission, scheduler.replace_ahead, scheduler.inflight_samples) == ("stream", 0.55, 384)


def test_a_session_versioned_at_its_start_makes_running_work_past_the_bound_waste():
    """With a first call at once, a sample left to finish past the bound is stale however it
    ends, so `stale_running: finish` wastes more than where the one call comes at the end."""
    w = workload_for(False, slots=64, procs=1, groups=4, batch_size=8, steps=30, ahead=1, max_lag=1,
                     stream_config={"stale_running": "finish"})
    at_end = simulate_policy("stream", {**w, "call_at_end": True})
    at_start = simulate_policy("stream", {**w, "call_at_end": False})
    assert at_start["waste_share"] > at_end["waste_share"] + 0.05


@pytest.mark.parametrize("args, named", [
    (["--max-lag", "0"], "--max-lag"),
    (["--max-lag", "1", "--sigma", "1", "--p90-ms", "3000"], "--sigma and --p90-ms"),
    (["--max-lag", "1", "--p90-ms", "500"], "--p90-ms must exceed --median-ms"),
    (["--max-lag", "1", "--max-waste", "1.5"], "--max-waste"),
    (["--max-lag", "1", "--slots", "0"], "--slots"),
    (["--max-lag", "1", "--jobs", "0"], "--jobs"),
    (["--max-lag", "1", "--refine", "-1"], "--refine"),
])
def test_bad_options_fail_at_once_naming_them(args, named, capsys):
    assert main(["tune", *args]) == 2
    assert named in capsys.readouterr().err


def test_the_command_is_listed(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "tune" in capsys.readouterr().out


def test_the_options_reach_the_simulated_workload():
    args = tune.parser().parse_args(["--max-lag", "2", "--calls", "start", "--median-ms", "2000",
                                     "--p90-ms", "4000", "--slots", "96", "--train-ms", "500"])
    w, _ = tune._workload(args)
    assert w["call_at_end"] is False and w["max_lag"] == w["ahead"] == 2
    assert w["sigma"] == pytest.approx(math.log(2) / 1.2815515655446004)
    assert (w["slots"], w["median_ms"], w["train_ms"]) == (96, 2000.0, 500.0)
    assert tune._workload(tune.parser().parse_args(["--max-lag", "1"]))[0]["call_at_end"] is True


def _config(tmp_path, text, name="trainer.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


CURRENT = """scheduler: {groups: 4, ahead: 1, max_lag: 1, admission: stream, oversample: 1,
            oversample_start: straggler, stale_running: finish, inflight_samples: 32}
data: {batch_size: 4}
"""


def test_the_runs_own_setting_is_simulated_beside_the_others_and_compared_with_the_pick(tmp_path, capsys):
    path = _config(tmp_path, CURRENT)
    small = ["--slots", "32", "--steps", "10", "--seeds", "1", "--refine", "0"]
    assert main(["tune", "--current", path, *small, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    w = result["workload"]
    # group size and max_lag from the scheduler section, the step size from the trainer's data
    assert (w["groups"], w["batch_size"], w["max_lag"], w["current_config"]) == (4, 4, 1, path)
    rows = {r["name"]: r for r in result["settings"]}
    # the same fields as a setting tune knows at 1x the slots: the same figures
    assert rows["current"]["capacity_share"] == rows["backups/finish"]["capacity_share"]
    assert rows["current"]["waste_share"] == rows["backups/finish"]["waste_share"]
    assert main(["tune", "--current", path, *small]) == 0
    out = capsys.readouterr().out
    pick, now = rows[result["chosen"]], rows["current"]
    assert (f"against the run's own setting (--current): share {pick['capacity_share']:.3f} against "
            f"{now['capacity_share']:.3f} ({pick['capacity_share'] / now['capacity_share']:.3f}x), waste share "
            f"{pick['waste_share']:.3f} against {now['waste_share']:.3f} "
            f"({pick['waste_share'] / now['waste_share']:.3f}x)") in out


def test_where_the_runs_own_setting_does_best_it_is_kept(tmp_path, monkeypatch, capsys):
    def figures(policy, workload):
        best = (workload.get("stream_config") or {}).get("backup_limit") == 3
        share, waste = (0.6, 0.34) if policy == "batch" else (0.7, 0.1) if best else (0.5, 0.3)
        return {"capacity_share": share, "waste_share": waste, "trained_length_vs_workload": 1.0, "lag_max": 1}

    monkeypatch.setattr(sim_workers, "run_simulations", lambda jobs, workers, done: [figures(*j) for j in jobs])
    path = _config(tmp_path, CURRENT.replace("inflight_samples: 32", "inflight_samples: 32, backup_limit: 3"))
    assert main(["tune", "--current", path, "--seeds", "1"]) == 0
    out = capsys.readouterr().out
    assert "chosen: current; it meets" in out
    assert "keep its scheduler section" in out and "scheduler fields to merge" not in out


@pytest.mark.parametrize("text, args, named", [
    (CURRENT, ["--max-lag", "2"], "--max-lag 2 differs from max_lag 1 in"),
    (CURRENT, ["--groups", "8"], "--groups 8 differs from groups 4"),
    (CURRENT, ["--batch-size", "8"], "--batch-size 8 differs from batch_size 4"),
    ("data: {batch_size: 4}\n", [], "needs a scheduler section"),
    ("scheduler: {groups: 4, max_lag: 1, oversample: -1}\n", [], "oversample"),
])
def test_a_current_config_that_does_not_fit_fails_at_once_naming_what(tmp_path, text, args, named, capsys):
    assert main(["tune", "--current", _config(tmp_path, text), *args]) == 2
    assert named in capsys.readouterr().err


def test_without_current_max_lag_is_required(capsys):
    assert main(["tune", "--slots", "32"]) == 2
    assert "--max-lag is required (or --current CONFIG" in capsys.readouterr().err


def test_the_pick_is_checked_draw_by_draw(monkeypatch, capsys):
    ref = {"capacity_share": 0.6, "waste_share": 0.3,
           "per_seed": {"capacity_share": [0.58, 0.62, 0.60], "waste_share": [0.30, 0.32, 0.28]}}
    row = {"capacity_share": 0.6, "waste_share": 0.15,
           "per_seed": {"capacity_share": [0.59, 0.61, 0.60], "waste_share": [0.15, 0.17, 0.13]}}
    # share: 0.59 >= 0.58, 0.61 < 0.62, 0.60 >= 0.60; waste: 0.30 <= 0.30, 0.34 > 0.32, 0.26 <= 0.28
    assert tune.draws(ref, row) == {"seeds": 3, "share_at_least_batch": 2, "waste_at_most_half_batch": 2}
    assert tune.draws({k: v for k, v in ref.items() if k != "per_seed"}, row) is None  # one seed

    def figures(policy, workload):  # batch and one setting vary with the draw, the rest lose
        seed = workload["seed"]
        fields = workload.get("stream_config") or {}
        best = fields.get("replace_ahead") == 0.55 and fields.get("stale_running") == "finish" \
            and fields.get("group_start") != "handover"
        share, waste = ((0.58, 0.62, 0.60)[seed], 0.3) if policy == "batch" else \
            ((0.59, 0.61, 0.60)[seed], 0.14) if best else (0.5, 0.3)
        return {"capacity_share": share, "waste_share": waste, "trained_length_vs_workload": 1.0, "lag_max": 1}

    monkeypatch.setattr(sim_workers, "run_simulations", lambda jobs, workers, done: [figures(*j) for j in jobs])
    assert main(["tune", "--max-lag", "1", "--seeds", "3", "--refine", "0", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["chosen"] == "replace-0.55/finish"
    assert result["chosen_draws"] == {"seeds": 3, "share_at_least_batch": 2, "waste_at_most_half_batch": 3}
    assert main(["tune", "--max-lag", "1", "--seeds", "3", "--refine", "0"]) == 0
    assert ("  draw by draw, against batch on the same sessions: at least its share on 2 of 3, at most half "
            "its waste share on 3 of 3 (near the edge: more --seeds tell how often)") in capsys.readouterr().out
