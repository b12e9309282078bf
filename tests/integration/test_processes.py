"""The production layout: `rollstream admission` and `rollstream consumer` processes from
config files, and a trainer's RolloutScheduler connected to them by URL."""

import json
import sys

import pytest

from pipeline.config import AdmissionConfig, ConsumerConfig, build
from tests.conftest import Proc
from trainer.rollout_scheduler import RolloutScheduler

pytestmark = pytest.mark.timeout(120)


class Publisher:
    def __init__(self):
        self.versions = []

    def load(self, variables, version):
        self.versions.append(version)


def _config_file(tmp_path, name, model, data):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(build(model, data).model_dump(mode="json")))
    return path


def test_cli_processes_serve_a_trainer_connected_by_url(tmp_path, redis_config, r):
    redis = redis_config.model_dump(mode="json")
    scheduler = {"groups": 2, "ahead": 1, "max_lag": 1, "width": 64, "rows": 4}
    adm = _config_file(tmp_path, "admission", AdmissionConfig,
                       {"redis": redis, "scheduler": scheduler, "block_ms": 50, "lease_s": 5.0})
    con = _config_file(tmp_path, "consumer", ConsumerConfig,
                       {"redis": redis, "slots": 4, "block_ms": 50, "lease_s": 5.0,
                        "source_args": {"median_s": 0.01, "seed": 1}})
    cli = [sys.executable, "-m", "rollstream.cli"]
    procs = [
        Proc([*cli, "admission", "--config", str(adm), "--shard", "0"], tmp_path / "adm.log"),
        Proc([*cli, "consumer", "--config", str(con), "--slots", "3",
              "--source", "consumers.sources.sleep:SleepSource"], tmp_path / "con.log"),
    ]
    records, pub = [], Publisher()
    try:
        with RolloutScheduler(None, None, pub, redis=redis_config.url,
                              namespace=redis_config.namespace, log=records.append,
                              step_timeout_s=60, **scheduler) as sched:
            for batch in sched.tasks([{"task_id": [3 * i, 3 * i + 1]} for i in range(3)]):
                rows = sched(batch, None)
                assert tuple(rows.tokens.shape) == (4, 64)
        assert [r.groups for r in records] == [2, 2, 2]
        assert pub.versions == [1, 2]
        assert all(p.alive for p in procs), [p.output()[-2000:] for p in procs]
    finally:
        codes = [p.terminate() for p in procs]
    assert codes == [0, 0], [p.output()[-2000:] for p in procs]
