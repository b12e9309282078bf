"""`rollstream bench learn` end to end on a few steps: every schedule trains, the JSON has
the documented fields, the plot is written."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.timeout(300)


def test_bench_learn_reports_every_policy_in_the_documented_json(tmp_path, capsys):
    from rollstream.bench_learn import main

    png = tmp_path / "learn.png"
    assert main(["--steps", "3", "--seeds", "1", "--json", "--delay-median-s", "0.005",
                 "--slots", "32", "--plot", str(png), "--out", str(tmp_path / "runs")]) == 0
    out = json.loads(capsys.readouterr().out)  # the JSON alone on stdout
    assert set(out["policies"]) == {"sync", "batch", "stream"} == set(out["speedup_to_sync_final"])
    for name, p in out["policies"].items():
        assert {"final_reward", "final_reward_spread", "seconds", "samples", "seconds_to_sync_final"} <= set(p)
        assert p["samples"] == 3 * 8 * 16 and p["seconds"] > 0 and 0 <= p["final_reward"] <= 1
        assert len(p["curve"]["reward"]) == len(p["curve"]["seconds"]) == 3
        assert (tmp_path / "runs" / f"{name}-seed0" / "metrics.jsonl").read_text().count("\n") == 3
    assert out["policies"]["sync"]["lag_max"] == 0  # ahead 0, max_lag 0: on-policy
    assert out["policies"]["stream"]["lag_max"] <= 2
    assert out["speedup_to_sync_final"]["sync"] >= 1.0
    pytest.importorskip("matplotlib")
    assert png.stat().st_size > 0
