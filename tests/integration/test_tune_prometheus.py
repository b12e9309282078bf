"""`rollstream tune --prometheus` against a real Prometheus server scraping real `/metrics`
endpoints: the sessions' shape fitted with the cancelled stragglers as censored, the slots
per shard and the trainer's step and push, over the window asked; options given win."""

import json
import math
import random
import time

import pytest

from pipeline.metrics import Metrics, serve
from rollstream.cli import main
from rollstream.prometheus import Prometheus
from rollstream.session_shape import from_prometheus

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not Prometheus.available(),
                                 reason="no prometheus binary (Debian's prometheus package)")]


def _scraped_after(prom: Prometheus, t: float, targets: int, timeout_s: float = 30.0) -> None:
    """Until Prometheus has scraped every target at a time after `t` (unix seconds)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        up = prom.query('timestamp(up{job="rollstream"})')
        if len(up) == targets and all(float(s["value"][1]) > t for s in up):
            return
        time.sleep(0.2)
    raise AssertionError(f"not every target was scraped after {t}")


def test_tune_reads_the_workload_a_run_shows_in_prometheus(tmp_path, capsys):
    admission, consumers, trainer = Metrics(component="admission"), Metrics(component="consumer"), \
        Metrics(component="trainer")
    # every series exists before the window's sessions, so increase() counts them all
    admission.observe_finished_many(0, ["completed", "cancelled"], [0.001, 0.001])
    consumers.set_slots("c0", busy=0, total=48)
    consumers.set_slots("c1", busy=0, total=16)
    trainer.trainer_step.labels("0")  # at 0 (the push histogram is unlabelled: at 0 already)
    servers = [serve(m) for m in (admission, consumers, trainer)]
    try:
        with Prometheus(tmp_path / "prometheus", [f"127.0.0.1:{s.port}" for s in servers]) as prom:
            prom.wait_scraped()
            _scraped_after(prom, time.time(), 3)
            rng = random.Random(0)
            statuses, durations = [], []
            for _ in range(20_000):  # median 2 s, shape 1.2; stragglers cancelled at 8 s
                d = rng.lognormvariate(math.log(2.0), 1.2)
                statuses.append("completed" if d <= 8.0 else "cancelled")
                durations.append(min(d, 8.0))
            admission.observe_finished_many(0, statuses, durations)
            for version in range(2, 12):
                trainer.observe_train(0, step_s=0.4, tokens=1, metrics={})
                trainer.observe_push(version, 0.1)
            _scraped_after(prom, time.time(), 3)
            url = f"http://127.0.0.1:{prom.port}"

            read = from_prometheus(url, "5m")
            assert read["median_ms"] == pytest.approx(2000, rel=0.06)
            assert read["sigma"] == pytest.approx(1.2, abs=0.06)
            assert (read["slots"], read["shards"]) == (64, 1)
            assert read["train_ms"] == pytest.approx(500, rel=0.01)
            # increase() extrapolates a young series' counts, alike for every status
            counts = read["sessions"]
            assert counts["cancelled"] / sum(counts.values()) == pytest.approx(
                statuses.count("cancelled") / len(statuses), rel=0.02)

            args = ["tune", "--max-lag", "1", "--prometheus", url, "--window", "5m", "--groups", "4",
                    "--batch-size", "4", "--steps", "5", "--seeds", "1", "--json"]
            assert main(args) == 0
            w = json.loads(capsys.readouterr().out)["workload"]
            # read again, a moment later: increase() extrapolates over a slightly other span
            assert w["slots"] == 64 and w["train_ms"] == pytest.approx(read["train_ms"], rel=1e-3)
            assert (w["median_ms"], w["sigma"]) == pytest.approx((read["median_ms"], read["sigma"]), rel=1e-3)
            assert main([*args[:-1], "--slots", "32", "--sigma", "0.7"]) == 0  # the table
            shown = capsys.readouterr().out
            assert f"read from {url} over 5m: " in shown and "slots a shard over 1 shard(s)" in shown
            assert "workload: 32 slots" in shown and "shape 0.7)" in shown
            assert main([*args, "--slots", "32", "--sigma", "0.7"]) == 0
            w = json.loads(capsys.readouterr().out)["workload"]
            assert (w["slots"], w["sigma"]) == (32, 0.7)
            assert w["median_ms"] == pytest.approx(read["median_ms"], rel=1e-3)
    finally:
        for s in servers:
            s.stop()
