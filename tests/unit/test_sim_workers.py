"""Simulations spread over worker processes: the same reports as in this process, in the jobs'
order, and a worker's failure raised with its own message."""

import os

import pytest

from pipeline.collector import YOUNG_COLLECTION_EVERY
from pipeline.errors import ConfigError
from pipeline.processes import child_env
from rollstream.bench_schedule import simulate_policy, workload_for
from rollstream.sim_workers import WorkerError, cpu_quota, default_workers, run_simulations


def _jobs():
    w = workload_for(False, slots=32, procs=1, groups=4, batch_size=4, steps=8, ahead=1, max_lag=1,
                     median_ms=1000.0)
    return [("batch", w), ("stream", {**w, "seed": 1}),
            ("stream", {**w, "stream_config": {"oversample": 1, "oversample_start": "straggler"}}),
            ("group", {**w, "seed": 2}), ("stream", {**w, "seed": 3, "max_lag": 2, "ahead": 2})]


def test_workers_report_exactly_what_the_simulation_does_here_in_the_jobs_order():
    jobs = _jobs()
    came_back = []
    reports = run_simulations(jobs, workers=2, done=came_back.append)
    assert reports == [simulate_policy(policy, w) for policy, w in jobs]
    assert sorted(came_back) == list(range(len(jobs)))
    assert len({r["capacity_share"] for r in reports}) > 1  # distinct jobs, not one report repeated


def test_a_failing_simulation_stops_the_run_with_the_workers_error():
    jobs = _jobs()
    jobs[3] = ("no-such-policy", jobs[3][1])
    with pytest.raises(WorkerError, match="unknown policy 'no-such-policy'"):
        run_simulations(jobs, workers=2)
    with pytest.raises(ValueError, match="unknown policy"):  # in this process, the error itself
        run_simulations(jobs, workers=1)


def test_a_bad_config_in_a_worker_is_the_same_config_error_as_here():
    jobs = _jobs()
    jobs[2] = ("stream", {**jobs[2][1], "inflight": 2})  # below one group
    with pytest.raises(ConfigError, match="inflight_samples=2 is below one group") as here:
        run_simulations(jobs, workers=1)
    with pytest.raises(ConfigError, match="stream: .*inflight_samples=2 is below one group"):
        run_simulations(jobs, workers=2)
    assert "inflight_samples=2" in str(here.value)


def test_a_worker_that_dies_stops_the_run_with_its_stderr(monkeypatch):
    import rollstream.sim_workers as sim_workers

    real = sim_workers.subprocess.Popen

    def dying(args, **kwargs):  # a worker whose interpreter cannot start the module
        return real([args[0], "-c", "import sys; sys.stderr.write('no such worker here\\n'); sys.exit(3)"],
                    **kwargs)

    monkeypatch.setattr(sim_workers.subprocess, "Popen", dying)
    with pytest.raises(WorkerError, match="no such worker here"):
        run_simulations(_jobs(), workers=2)


def test_simulations_run_under_the_pipeline_processes_collector_settings(monkeypatch):
    import gc
    import json
    import subprocess
    import sys

    import rollstream.sim_workers as sim_workers

    threshold = gc.get_threshold()
    seen = []
    monkeypatch.setattr(sim_workers, "simulate_policy", lambda policy, w: seen.append(gc.get_threshold()) or {})
    run_simulations(_jobs()[:2], workers=1)
    assert seen == [(YOUNG_COLLECTION_EVERY, *threshold[1:])] * 2
    assert gc.get_threshold() == threshold and gc.get_freeze_count() == 0  # this process's own back
    # a worker process: its simulation sees the same settings
    worker = ("import gc, rollstream.sim_workers as w; "
              "w.simulate_policy = lambda p, wl: {'young': gc.get_threshold()[0]}; w.serve()")
    job = json.dumps({"policy": "stream", "workload": {}}) + "\n"
    out = subprocess.run([sys.executable, "-c", worker], input=job, capture_output=True, text=True, check=True,
                         env=child_env())  # this tree's code, whatever is installed
    assert json.loads(out.stdout) == {"report": {"young": YOUNG_COLLECTION_EVERY}}


def test_no_workers_is_refused():
    with pytest.raises(ValueError, match="workers must be >= 1"):
        run_simulations(_jobs(), workers=0)


def test_the_default_workers_keep_within_a_cgroups_cpu_quota(tmp_path):
    cpus = len(os.sched_getaffinity(0))
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")  # a pod limited to 1.5 CPUs
    assert cpu_quota(v2) == 1.5 and default_workers(v2) == min(cpus, 2)
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(v2) is None and default_workers(v2) == cpus
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_quota(v1.parent) == 0.5 and default_workers(v1.parent) == 1
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_quota(v1.parent) is None
    assert cpu_quota(tmp_path / "none") is None and default_workers(tmp_path / "none") == cpus
