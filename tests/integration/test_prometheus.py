"""A real Prometheus server scrapes a running pipeline (`rollstream admission` and
`rollstream consumer` processes driven by a trainer's RolloutScheduler): every pipeline
metric is present, and every dashboard panel over them returns data."""

import json
import re
import sys
import time
from pathlib import Path

import pytest

from pipeline import wire
from pipeline.config import AdmissionConfig, ConsumerConfig, build
from pipeline.metrics import Metrics, families
from tests.conftest import Proc
from tests.integration.prometheus import Prometheus, free_port
from trainer.rollout_scheduler import RolloutScheduler

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not Prometheus.available(),
                                 reason="no prometheus binary (Debian's prometheus package)")]

DASHBOARD = Path(__file__).parents[2] / "helm/rollstream/dashboards/rollstream.json"
TRAINER_ONLY = {  # set by the DeepSpeed trainer's processes, not by the pipeline's
    "rollstream_importance_weight_max", "rollstream_importance_weight_mean",
    "rollstream_trainer_engine_mismatch_kl", "rollstream_trainer_loss",
    "rollstream_trainer_step_seconds", "rollstream_trainer_tokens_per_second",
    "rollstream_weights_published_version", "rollstream_weights_push_seconds",
}
SERIES = {"counter": "_total", "histogram": "_bucket", "info": "_info", "gauge": ""}


class Publisher:
    def load(self, variables, version):
        pass


def _config_file(tmp_path, name, model, data):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(build(model, data).model_dump(mode="json")))
    return path


def _panel_queries():
    dash = json.loads(DASHBOARD.read_text())
    out = []

    def walk(panel):
        out.extend(t["expr"] for t in panel.get("targets", []))
        for inner in panel.get("panels", []):
            walk(inner)
    for panel in dash["panels"]:
        walk(panel)
    return out


@pytest.mark.parametrize("redis_url", ["server"], indirect=True)
def test_prometheus_scrapes_every_pipeline_metric_and_every_panel_has_data(tmp_path, redis_config, r):
    redis = redis_config.model_dump(mode="json")
    scheduler = {"groups": 2, "oversample": 1, "ahead": 1, "max_lag": 1, "width": 64, "rows": 6}
    adm_port, con_port = free_port(), free_port()
    adm = _config_file(tmp_path, "admission", AdmissionConfig, {
        "redis": redis, "scheduler": scheduler, "block_ms": 50, "lease_s": 5.0,
        "trim_every_s": 0.5, "metrics_addr": f"127.0.0.1:{adm_port}"})
    con = _config_file(tmp_path, "consumer", ConsumerConfig, {
        "redis": redis, "slots": 4, "block_ms": 50, "lease_s": 5.0,
        "metrics_addr": f"127.0.0.1:{con_port}",
        "source_args": {"median_s": 0.02, "seed": 3,
                        "status_mix": {"completed": 0.8, "infra_error": 0.2}}})
    cli = [sys.executable, "-m", "pipeline.cli"]
    procs = [Proc([*cli, "admission", "--config", str(adm)], tmp_path / "adm.log"),
             Proc([*cli, "consumer", "--config", str(con)], tmp_path / "con.log")]
    try:
        with Prometheus(tmp_path, [f"127.0.0.1:{adm_port}", f"127.0.0.1:{con_port}"]) as prom, \
                RolloutScheduler(None, None, Publisher(), redis=redis_config.url,
                                 namespace=redis_config.namespace, step_timeout_s=60,
                                 **scheduler) as sched:
            # a poison entry: dead-lettered and counted
            r.xadd(sched.keys.results(0), {b"m": b"\xc1 not msgpack"})
            for batch in sched.tasks([{"task_id": [4 * i + j for j in range(3)]} for i in range(6)]):
                sched(batch, None)
            prom.wait_scraped()
            time.sleep(3)  # scrapes after the last step
            missing = []
            for name, kind in families(Metrics()).items():
                if name in TRAINER_ONLY:
                    continue
                if not prom.query(f"{name}{SERIES[kind]}"):
                    missing.append(name)
            assert missing == []
            empty = []
            for expr in _panel_queries():
                names = set(re.findall(r"rollstream_\w+?(?=_total|_bucket|_info|\b)", expr))
                if names and names <= TRAINER_ONLY:
                    continue
                q = expr.replace('"$shard"', '".*"').replace("$__rate_interval", "1m")
                if not prom.query(q):
                    empty.append(expr)
            assert empty == []
            in_flight = prom.query("rollstream_samples_in_flight")
            assert in_flight and float(in_flight[0]["value"][1]) >= 0
            admitted = prom.query("rollstream_groups_admitted_total")
            assert float(admitted[0]["value"][1]) == 6 * 3
    finally:
        for p in procs:
            p.terminate()
    assert all(p.popen.returncode == 0 for p in procs), [p.output()[-3000:] for p in procs]
