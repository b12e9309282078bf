"""`bench admission` reports the admission's own share of its loop, the trainer stub left out."""

import pytest

from rollstream import bench_admission


def test_the_admissions_own_time_is_inside_its_loop_and_gives_its_own_ratio(redis_config):
    out = bench_admission.run(redis_config.url, rollouts=128, admit=4, prompt=64, completion=192,
                              width=1024)
    adm = out["admission"]
    assert 0 < adm["own_seconds"] <= adm["seconds"] and 0 < adm["own_cpu_s"] <= adm["cpu_s"]
    # (own_seconds is rounded to the millisecond)
    assert 128 / (adm["own_seconds"] + 5e-4) <= out["own_per_s"] <= 128 / max(adm["own_seconds"] - 5e-4, 1e-6)
    assert out["own_ratio"] == pytest.approx(out["own_per_s"] / out["floor_per_s"], rel=0.01)
    assert out["own_ratio"] >= out["ratio"] * 0.99 and out["own_cpu_ratio"] >= out["cpu_ratio"] * 0.99
