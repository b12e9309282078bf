"""A real Prometheus server scrapes a running pipeline of real processes (`rollstream
admission`, `rollstream consumer` and a `rollstream trainer` DeepSpeed rank, started by
`rollstream.local.LocalRun`): every metric is present and exported by the process that owns
it, the trainer's series agree with its own step records, every dashboard panel returns
data for the run's release and none for another's, and the chart's alerts evaluate on those
series: every metric they name is scraped, none is in error, the dead-letter alert goes off
for the poison entry (and the dashboard's alert annotation finds it by the run's labels) and
the component-down alert for the trainer once it has exited."""

import json
import re
import signal
import time

import pytest

from pipeline import wire
from pipeline.config import build
from pipeline.metrics import Metrics, families
from rollstream.chart_run import alert_rules
from rollstream.prometheus import DASHBOARD, Prometheus, panels, promql
from trainer.run_config import RunConfig
from rollstream.local import LocalRun, free_port

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(not Prometheus.available(),
                                 reason="no prometheus binary (Debian's prometheus package)")]

SERIES = {"counter": "_total", "histogram": "_bucket", "info": "_info", "gauge": ""}
# the one process that exports each family (docs/operations.md, "Metrics"); the rest are
# the admission consumer's
OWNER = {
    "rollstream_trainer_steps": "trainer", "rollstream_trainer_updates": "trainer",
    "rollstream_trainer_waited_seconds": "trainer", "rollstream_trainer_step_seconds": "trainer",
    "rollstream_trainer_tokens_per_second": "trainer", "rollstream_trainer_loss": "trainer",
    "rollstream_reward_mean": "trainer", "rollstream_importance_weight_mean": "trainer",
    "rollstream_importance_weight_max": "trainer", "rollstream_trainer_engine_mismatch_kl": "trainer",
    "rollstream_trainer_engine_mismatch_abs": "trainer", "rollstream_trainer_engine_mismatch_over": "trainer",
    "rollstream_weights_published_version": "trainer", "rollstream_weights_push_seconds": "trainer",
    "rollstream_consumer_slots_busy": "consumer", "rollstream_consumer_slots": "consumer",
    "rollstream_step_metric": "admission trainer",  # disjoint names: session vs loss metrics
    "rollstream_build": "admission consumer trainer",
}
STEPS = 12  # trainer steps seen before the checks


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("redis_url", ["server"], indirect=True)
def test_prometheus_scrapes_every_metric_from_its_owner_and_every_panel_has_data(tmp_path, redis_config, r, keys):
    ports = {role: free_port() for role in ("admission", "consumer", "trainer")}
    config = build(RunConfig, {
        "redis": redis_config.model_dump(mode="json"),
        "metrics_addr": f"127.0.0.1:{ports['trainer']}",
        "trainer": {"model": {"kind": "tiny", "tiny": {"vocab": 64, "d_model": 32, "n_layers": 1,
                                                       "n_heads": 2, "max_positions": 64}},
                    "optimizer": {"type": "AdamW", "lr": 1e-3}, "device": "cpu"},
        # oversample: surplus cancels; max_attempts 2 with 30% infra errors: resubmissions,
        # discards and now and then an abandoned group
        "scheduler": {"groups": 4, "oversample": 1, "ahead": 1, "max_lag": 1, "max_attempts": 2,
                      "width": 64, "rows": 4, "truncation": "score"},
        "data": {"env": "arithmetic", "env_args": {"op": "copy", "digits": 1}, "batch_size": 3},
        "steps": 1000, "step_timeout_s": 60.0, "record": str(tmp_path / "record.jsonl"),
    })
    # random tokens in the model's vocabulary with random behaviour log-probs: the trainer
    # trains on them like on any rollouts
    source = {"median_s": 0.03, "seed": 3, "vocab": 64, "prompt_tokens": 4, "completion_tokens": 4,
              "status_mix": {"completed": 0.7, "infra_error": 0.3}}
    run = LocalRun(config, tmp_path, ranks=1, consumers=1, slots=8,
                   source="consumers.sources.sleep:SleepSource", source_args=source,
                   admission={"block_ms": 50, "trim_every_s": 0.5,
                              "metrics_addr": f"127.0.0.1:{ports['admission']}"},
                   consumer={"block_ms": 50, "metrics_addr": f"127.0.0.1:{ports['consumer']}"})
    role = {f"127.0.0.1:{port}": name for name, port in ports.items()}
    records = tmp_path / "record.jsonl"
    rules = tmp_path / "rules.yml"  # the chart's alerts for release "rs" in namespace "rl"
    rules.write_text(json.dumps(alert_rules(release="rs", namespace="rl")))
    # the labels a PodMonitor's targets get in Kubernetes
    labels = {target: {"namespace": "rl", "release": "rs", "component": name} for target, name in role.items()}
    try:
        with Prometheus(tmp_path / "prometheus", list(role), labels=labels, rules=(rules,)) as prom:
            run.start()
            deadline = time.monotonic() + 150
            while len(_records(records)) < 2:  # a poison entry once the groups exist
                assert run.trainers[0].alive and time.monotonic() < deadline, run.logs()
                time.sleep(0.1)
            r.xadd(keys.results(0), {b"m": b"\xc1 not msgpack"})
            while len(_records(records)) < STEPS:
                assert run.trainers[0].alive and time.monotonic() < deadline, run.logs()
                time.sleep(0.1)
            prom.wait_scraped()
            done = time.time()
            while not prom.scraped_since(done + 2):  # a few scrapes past the checked steps
                assert time.monotonic() < deadline + 30, "Prometheus stopped scraping"
                time.sleep(0.1)

            missing, owners = [], {}
            for name, kind in families(Metrics()).items():
                if name.startswith("rollstream_engine_"):  # rollstream engine's: not in this run
                    continue
                found = prom.query(f"{name}{SERIES[kind]}")
                if not found:
                    missing.append(name)
                owners[name] = " ".join(sorted({role[s["metric"]["instance"]] for s in found}))
            assert missing == []
            assert owners == {name: OWNER.get(name, "admission") for name in owners}
            step_names = {
                who: {s["metric"]["name"] for s in prom.query("rollstream_step_metric")
                      if role[s["metric"]["instance"]] == who} for who in ("admission", "trainer")}
            assert {"merge_ratio", "reward_mean"} <= step_names["admission"]
            assert {"loss", "loss_tokens", "importance_mean"} <= step_names["trainer"]
            assert not step_names["admission"] & step_names["trainer"]

            # the trainer's series agree with its own step records (one scrape's values)
            trainer = {s["metric"]["__name__"]: float(s["value"][1]) for s in prom.query(
                '{__name__=~"rollstream_trainer_(steps_total|updates|loss|waited_seconds_sum)'
                '|rollstream_reward_mean", instance="127.0.0.1:%d"}' % ports["trainer"])}
            steps = int(trainer["rollstream_trainer_steps_total"])
            rows = _records(records)
            assert STEPS <= steps <= len(rows)
            last = rows[steps - 1]
            assert trainer["rollstream_trainer_updates"] == last["updates"] + 1 == steps
            assert trainer["rollstream_trainer_loss"] == pytest.approx(last["loss"], rel=1e-6)
            assert trainer["rollstream_reward_mean"] == pytest.approx(last["reward_mean"], rel=1e-6)
            assert trainer["rollstream_trainer_waited_seconds_sum"] == pytest.approx(
                sum(row["waited"] for row in rows[:steps]), rel=1e-6)
            published = max(wire.from_fields(f, wire.Weights).version for _, f in r.xrange(keys.weights))
            scraped = float(prom.query("rollstream_weights_published_version")[0]["value"][1])
            assert 1 <= scraped <= published
            assert prom.query('rollstream_samples_resubmitted_total{cause="infra_error"}')
            assert prom.query('rollstream_dead_letters_total{stream="results:0"}')

            empty = [t for panel in panels() for t, _ in panel.targets
                     if not prom.query(promql(t, namespace="rl", release="rs"))]
            assert empty == []
            # and none reads another release's series (here: none at all)
            leaked = [t for panel in panels() for t, _ in panel.targets
                      if prom.query(promql(t, namespace="rl", release="rs-b"))]
            assert leaked == []
            # the frontier's numbers are numbers: 30% infra errors and surplus oversamples waste
            frontier = {p.title: float(prom.query(promql(p.targets[0][0]))[0]["value"][1])
                        for p in panels() if p.row == "Frontier"}
            assert 0.05 < frontier["Waste share of slot-seconds"] < 1
            assert 0 < frontier["Share of the slots' capacity trained"] < 2
            assert 0 < frontier["Trained length over all sessions"] < 2

            _check_alerts(prom)

            run.trainers[0].signal(signal.SIGTERM)  # stops after the step in progress, exits 0
            assert run.wait_trainer(60) == [0], run.logs()
            # its target no longer answers: the alert names it by the labels a PodMonitor gives
            _wait_alert(prom, "RollstreamComponentDown", {"namespace": "rl", "release": "rs", "component": "trainer"})
    finally:
        codes = run.stop()
    assert all(code == 0 for code in codes.values()), (codes, run.logs())


def _check_alerts(prom: Prometheus) -> None:
    """The chart's alerts on the live series: each names only scraped metrics and evaluates
    without an error, and the poison entry's dead letter sets its alert off (pending for its
    minute, or firing). (Silence where nothing is wrong is promtool's part,
    test_alert_rules.py: here a scrape that times out on a loaded machine would set off an
    alert's pending state.)"""
    rules = prom.rules_state()
    named = {m for r in rules.values() for m in re.findall(r"\b(?:rollstream_\w+|up)\b", r["query"])}
    assert len(rules) == 6 and len(named) == 7, (rules.keys(), named)
    assert [m for m in sorted(named) if not prom.query(m)] == []
    _wait_alert(prom, "RollstreamDeadLetters", {"namespace": "rl", "release": "rs", "severity": "warning"})
    # the dashboard's annotation finds it by the run's labels (once it fires; pending here).
    # Its ALERTS sample is written after the evaluation that the rules API already shows.
    (annotation,) = json.loads(DASHBOARD.read_text())["annotations"]["list"]
    expr = annotation["expr"].replace('alertstate="firing"', 'alertstate=~"pending|firing"')
    deadline = time.monotonic() + 30
    while "RollstreamDeadLetters" not in {s["metric"]["alertname"] for s in prom.query(
            promql(expr, namespace="rl", release="rs"))}:
        assert time.monotonic() < deadline, prom.query("ALERTS")
        time.sleep(0.2)
    assert prom.query(promql(expr, namespace="rl", release="rs-b")) == []
    rules = prom.rules_state()
    assert {name: r["lastError"] for name, r in rules.items() if r["health"] != "ok"} == {}


def _wait_alert(prom: Prometheus, name: str, labels: dict[str, str], timeout_s: float = 30) -> None:
    """Until alert `name` is pending or firing with `labels` among its labels."""
    deadline = time.monotonic() + timeout_s
    while not any(labels.items() <= a["labels"].items() for a in prom.rules_state()[name]["alerts"]):
        assert time.monotonic() < deadline, prom.rules_state()[name]
        time.sleep(0.5)
