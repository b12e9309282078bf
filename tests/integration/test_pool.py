"""A trainer pool as real processes (torchrun, gloo): a share's later readers sample nothing
and log nothing (specification: "a share's later readers sample none and log nothing")."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from consumers.sources.sleep import SleepSource

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]
SERVER = pytest.mark.parametrize("redis_url", ["server"], indirect=True)


@SERVER
def test_a_share_s_later_reader_trains_the_first_reader_s_rows_and_logs_nothing(
        tmp_path, redis_config, r, threads):
    threads.admission(shard=0, scheduler={"groups": 2, "width": 64, "rows": 2, "ahead": 0,
                                          "max_lag": 0}, block_ms=20)
    threads.consumer(SleepSource(median_s=0.002, seed=0, vocab=64), slots=4, block_ms=20)
    torchrun = shutil.which("torchrun") or pytest.skip("torchrun is not on PATH")
    done = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "2", "-m", "tests.integration.pool_ranks",
         json.dumps(redis_config.model_dump(mode="json")), str(tmp_path), "3"],
        capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    first, later = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert [rec["updates"] for rec in first["logged"]] == [0, 1, 2]
    assert later["logged"] == []  # no duplicate record of the share's step
    assert later["rows"] == first["rows"] and all(first["rows"])  # the same rows, trained
