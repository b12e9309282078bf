"""Simulations spread over worker processes, their inputs and reports passed as JSON lines.

`run_simulations` maps `bench_schedule.simulate_policy` over a list of (policy, workload)
jobs, under the garbage collector settings of the pipeline's long-running processes
(`pipeline.collector`). With one worker it runs them in this process; with more it starts
that many `python -m rollstream.sim_workers` processes and hands each a job as the one
before it comes back, so a slow setting does not hold up the rest. A job goes out as one
JSON line, `{"policy": ..., "workload": ...}`, and its report comes back as one,
`{"report": ...}`: JSON keeps every float exactly, so the reports equal the in-process
ones. A simulation that raises comes back as `{"error": ..., "message": ...}` and stops the
run with the same message (a `ConfigError` as one); a worker that dies stops it with its
last lines of stderr.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from pipeline.collector import collect_less, collecting_less
from pipeline.errors import ConfigError
from rollstream.bench_schedule import mean_over_seeds, simulate_policy

Job = tuple[str, dict]
"""A policy's name and the workload to simulate it on (`simulate_policy`'s arguments)."""


CGROUP = Path("/sys/fs/cgroup")


def default_workers(cgroup: Path = CGROUP) -> int:
    """The CPUs this process may use: those it may run on, within its cgroup's CPU quota (a
    Kubernetes pod's CPU limit) where one is set."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cpu_quota(cgroup)
    return max(1, min(cpus, math.ceil(quota))) if quota is not None else cpus


def cpu_quota(cgroup: Path = CGROUP) -> float | None:
    """The cgroup's CPU quota in CPUs (cgroup v2 `cpu.max`, or v1 `cpu.cfs_quota_us` over
    `cpu.cfs_period_us`), or None where none is set or none can be read."""
    v2, v1 = cgroup / "cpu.max", cgroup / "cpu"
    try:
        if v2.is_file():
            quota, period = v2.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        if (v1 / "cpu.cfs_quota_us").is_file():
            quota_us = int((v1 / "cpu.cfs_quota_us").read_text())
            return None if quota_us < 0 else quota_us / int((v1 / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None  # an unreadable or odd cgroup file: no quota known, the affinity stands
    return None


def run_simulations(jobs: Sequence[Job], workers: int = 1,
                    done: Callable[[int], None] | None = None) -> list[dict]:
    """`simulate_policy` on every job, the reports in the jobs' order; `done(i)` as job i
    comes back."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if workers == 1 or len(jobs) < 2:
        reports = []
        with collecting_less():  # as a worker process collects (`serve`)
            for i, (policy, workload) in enumerate(jobs):
                reports.append(simulate_policy(policy, workload))
                if done:
                    done(i)
        return reports
    return _Pool(min(workers, len(jobs))).run(jobs, done)


def simulate_over_seeds(cases: Sequence[Job], seeds: int, workers: int = 1,
                        done: Callable[[int], None] | None = None) -> list[dict]:
    """Each case on `seeds` seeds from its workload's, `mean_over_seeds` of its reports, the
    runs spread over `workers` processes; `done(i)` once case i's runs are all back."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    jobs = [(policy, {**workload, "seed": workload["seed"] + k}) for policy, workload in cases for k in range(seeds)]
    left = [seeds] * len(cases)

    def back(i: int) -> None:
        left[i // seeds] -= 1
        if done and not left[i // seeds]:
            done(i // seeds)

    reports = run_simulations(jobs, workers, back)
    return [mean_over_seeds(reports[k:k + seeds]) for k in range(0, len(reports), seeds)]


class WorkerError(RuntimeError):
    """A worker process died or sent back something that is not a report."""


class _Pool:
    def __init__(self, size: int) -> None:
        self.size = size
        self.lock = threading.Lock()
        self.failure: BaseException | None = None

    def run(self, jobs: Sequence[Job], done: Callable[[int], None] | None) -> list[dict]:
        todo: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(len(jobs)):
            todo.put(i)
        reports: list[dict | None] = [None] * len(jobs)

        def serve() -> None:
            try:
                with tempfile.TemporaryFile("w+") as err, _worker(err) as proc:
                    while self.failure is None:
                        try:
                            i = todo.get_nowait()
                        except queue.Empty:
                            return
                        reports[i] = _ask(proc, jobs[i], err)
                        if done:
                            with self.lock:
                                done(i)
            except BaseException as exc:  # handed to the caller's thread, which raises it
                with self.lock:
                    self.failure = self.failure or exc

        threads = [threading.Thread(target=serve, name=f"sim-worker-{k}") for k in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.failure is not None:
            raise self.failure
        assert all(r is not None for r in reports)
        return reports  # type: ignore[return-value]


@contextlib.contextmanager
def _worker(err) -> Iterator[subprocess.Popen]:
    """A worker process writing its stderr to `err`; its input closed and its exit awaited on
    leaving, a failed exit raised."""
    proc = subprocess.Popen([sys.executable, "-m", "rollstream.sim_workers"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        yield proc
    finally:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        proc.stdout.close()
        code = proc.wait(timeout=30)
    if code != 0:
        raise WorkerError(f"a simulation worker exited with {code}: {_tail(err)}")


def _ask(proc: subprocess.Popen, job: Job, err) -> dict:
    assert proc.stdin is not None and proc.stdout is not None
    policy, workload = job
    try:
        proc.stdin.write(json.dumps({"policy": policy, "workload": workload}) + "\n")
        proc.stdin.flush()
    except BrokenPipeError as exc:
        raise WorkerError(f"a simulation worker died: {_tail(err)}") from exc
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=30)
        raise WorkerError(f"a simulation worker died (exit {proc.returncode}) on {policy}: {_tail(err)}")
    answer = json.loads(line)
    if "error" in answer:  # the simulation raised: the same error here, a config's named as one
        kind = ConfigError if answer["error"] == ConfigError.__name__ else WorkerError
        raise kind(answer["message"])
    return answer["report"]


def _tail(err, lines: int = 5) -> str:
    err.flush()
    err.seek(0)
    return " | ".join(err.read().strip().splitlines()[-lines:]) or "no output on stderr"


def serve() -> None:
    """A worker: one report line on stdout for each job line on stdin, until stdin closes;
    anything else printed goes to stderr. It collects garbage as the admission process does
    (`collect_less`): under Python's defaults the collector's scans of the scheduler took 9
    s of a 52 s frontier simulation at 4,096 slots, under these 2 s (BENCHMARKS.md)."""
    collect_less()
    out, sys.stdout = sys.stdout, sys.stderr
    for line in sys.stdin:
        job = json.loads(line)
        answer: dict[str, object]
        try:
            answer = {"report": simulate_policy(job["policy"], job["workload"])}
        except Exception as exc:  # noqa: BLE001 (sent back whole: the caller raises it and stops)
            answer = {"error": type(exc).__name__, "message": f"{job['policy']}: {exc}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    serve()
