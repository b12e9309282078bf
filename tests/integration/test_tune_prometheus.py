"""`rollstream tune --prometheus` against a real Prometheus server scraping real `/metrics`
endpoints: the sessions' shape fitted with the cancelled stragglers as censored, the slots
per shard and the trainer's step and push, over the window asked; options given win; of
the one run `--select` picks where the Prometheus scrapes several, never a mixture."""

import json

import pytest

from pipeline.errors import CommandError
from rollstream.cli import main
from rollstream.prometheus import Prometheus
from rollstream.session_shape import from_prometheus
from tests.integration.run_metrics import MEDIAN_S, PUSH_S, SIGMA, SLOTS, STEP_S, scraped_run

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not Prometheus.available(),
                                 reason="no prometheus binary (Debian's prometheus package)")]


def test_tune_reads_the_workload_a_run_shows_in_prometheus(tmp_path, capsys):
    with scraped_run(tmp_path / "prometheus") as fed:
        url = fed.url
        read = from_prometheus(url, "5m")
        assert read["median_ms"] == pytest.approx(MEDIAN_S * 1000, rel=0.06)
        assert read["sigma"] == pytest.approx(SIGMA, abs=0.06)
        assert (read["slots"], read["shards"]) == (sum(SLOTS), 1)
        assert read["train_ms"] == pytest.approx((STEP_S + PUSH_S) * 1000, rel=0.01)
        # increase() extrapolates a young series' counts, alike for every status
        counts = read["sessions"]
        assert counts["cancelled"] / sum(counts.values()) == pytest.approx(
            fed.statuses.count("cancelled") / len(fed.statuses), rel=0.02)

        args = ["tune", "--max-lag", "1", "--prometheus", url, "--window", "5m", "--groups", "4",
                "--batch-size", "4", "--steps", "5", "--seeds", "1", "--json"]
        assert main(args) == 0
        w = json.loads(capsys.readouterr().out)["workload"]
        # read again, a moment later: increase() extrapolates over a slightly other span
        assert w["slots"] == sum(SLOTS) and w["train_ms"] == pytest.approx(read["train_ms"], rel=1e-3)
        assert (w["median_ms"], w["sigma"]) == pytest.approx((read["median_ms"], read["sigma"]), rel=1e-3)
        assert main([*args[:-1], "--slots", "32", "--sigma", "0.7"]) == 0  # the table
        shown = capsys.readouterr().out
        assert f"read from {url} over 5m: " in shown and "slots a shard over 1 shard(s)" in shown
        assert "workload: 32 slots" in shown and "shape 0.7)" in shown
        assert main([*args, "--slots", "32", "--sigma", "0.7"]) == 0
        w = json.loads(capsys.readouterr().out)["workload"]
        assert (w["slots"], w["sigma"]) == (32, 0.7)
        assert w["median_ms"] == pytest.approx(read["median_ms"], rel=1e-3)


def test_tune_reads_one_run_of_several_and_never_a_mixture(tmp_path, capsys):
    with scraped_run(tmp_path / "prometheus", sessions=5000, runs={"rs-a": 0.5, "rs-b": 4.0}) as fed:
        with pytest.raises(CommandError) as refused:
            from_prometheus(fed.url, "5m")
        assert "sessions of 2 runs" in str(refused.value)
        assert 'namespace="rl", release="rs-a"; namespace="rl", release="rs-b"' in str(refused.value)
        assert "--select 'namespace=\"rl\", release=\"rs-a\"'" in str(refused.value)
        for release, median_s in (("rs-a", 0.5), ("rs-b", 4.0)):
            read = from_prometheus(fed.url, "5m", select=f'namespace="rl", release="{release}"')
            assert read["median_ms"] == pytest.approx(median_s * 1000, rel=0.1)
            assert (read["slots"], read["shards"]) == (sum(SLOTS), 1)  # this run's consumers only
            assert read["train_ms"] == pytest.approx((STEP_S + PUSH_S) * 1000, rel=0.01)
        assert main(["tune", "--max-lag", "1", "--prometheus", fed.url, "--window", "5m", "--groups", "4",
                     "--batch-size", "4", "--steps", "5", "--seeds", "1", "--json"]) == 1
        assert "pick one with --select" in capsys.readouterr().err
        assert main(["tune", "--max-lag", "1", "--prometheus", fed.url, "--window", "5m", "--groups", "4",
                     "--batch-size", "4", "--steps", "5", "--seeds", "1", "--json",
                     "--select", 'release="rs-b"']) == 0
        w = json.loads(capsys.readouterr().out)["workload"]
        assert w["median_ms"] == pytest.approx(4000, rel=0.1)
