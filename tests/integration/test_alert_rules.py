"""The chart's alerts (monitoring.prometheusRule, docs/operations.md "Alerts"), rendered with
Helm's own engine and run by Prometheus's own rule engine: `promtool check rules`, then
`promtool test rules` on made-up series, each alert silent before its condition has held
for its `for`, firing after, with its labels and annotations, and silent for another
namespace's series or another release's in the same namespace. A real Prometheus evaluates
the same rules against a running pipeline in test_prometheus.py."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from rollstream.chart_run import alert_rules

pytestmark = pytest.mark.skipif(shutil.which("promtool") is None,
                                reason="no promtool (Debian's prometheus package)")

NS, REL = "rl", "rs"  # the release's namespace and name
OWN = f'namespace="{NS}", release="{REL}"'  # its series' labels, as matchers
RUN = {"namespace": NS, "release": REL}  # and as an alert's labels


def _rules(tmp_path, values: dict | None = None) -> tuple[dict, str]:
    spec = alert_rules(values, release=REL, namespace=NS)
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(spec))
    return spec, str(path)


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, check=False)


def _annotations(spec: dict, alert: str, **subs: str) -> dict[str, str]:
    """`alert`'s annotations with each `{{ $labels.X }}` / `{{ $value }}` (the only templates
    left after the substitutions given) replaced as Prometheus would for this alert."""
    (rule,) = [r for g in spec["groups"] for r in g["rules"] if r.get("alert") == alert]
    out = {}
    for key, text in rule["annotations"].items():
        for name, value in subs.items():
            text = text.replace("{{ " + name + " }}", value)
        assert "{{" not in text, (alert, key, text)
        out[key] = text
    return out


def _alert(spec: dict, name: str, at: str, labels: dict | None = None, **subs: str) -> dict:
    exp = [] if labels is None else [{"exp_labels": labels,
                                      "exp_annotations": _annotations(spec, name, **subs)}]
    return {"eval_time": at, "alertname": name, "exp_alerts": exp}


def _case(series: dict[str, str], *checks: dict) -> dict:
    return {"interval": "1m", "input_series": [{"series": s, "values": v} for s, v in series.items()],
            "alert_rule_test": list(checks)}


def _run(tmp_path, rules: str, cases: list[dict]) -> None:
    test = tmp_path / "tests.yml"
    test.write_text(yaml.safe_dump({"rule_files": [rules], "evaluation_interval": "1m", "tests": cases}))
    result = _promtool("test", "rules", str(test))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_rules_load(tmp_path):
    spec, rules = _rules(tmp_path)
    result = _promtool("check", "rules", rules)
    assert result.returncode == 0, result.stdout + result.stderr
    names = [r["alert"] for g in spec["groups"] for r in g["rules"]]
    assert names == ["RollstreamComponentDown", "RollstreamTrainerStalled", "RollstreamNoRolloutSlots",
                     "RollstreamSlotsIdle", "RollstreamDeadLetters", "RollstreamGroupsAbandoned"]
    for group in spec["groups"]:
        for rule in group["rules"]:
            assert OWN in rule["expr"], rule["alert"]  # this release's series only
            assert rule["labels"]["severity"] in ("critical", "warning")
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_each_alert_fires_when_its_condition_has_held_for_its_for(tmp_path):
    spec, rules = _rules(tmp_path)
    down = {**RUN, "component": "consumer", "pod": "c-1", "job": "rollstream"}
    up = 'up{namespace="%s", release="%s", component="%s", pod="%s", job="rollstream"}'
    up_at = 'up{namespace="%s", release="%s", component="%s", instance="%s", job="rollstream"}'
    cases = [
        # a consumer stops answering at 10m; another namespace's, another release's in this
        # namespace, and a healthy admission, do not count
        _case({up % (NS, REL, "consumer", "c-1"): "1x9 0x20", up % (NS, REL, "admission", "a-0"): "1x30",
               up % ("other", REL, "consumer", "c-1"): "0x30", up % (NS, "rs-b", "consumer", "c-1"): "0x30"},
              _alert(spec, "RollstreamComponentDown", "14m"),
              _alert(spec, "RollstreamComponentDown", "16m", {**down, "severity": "critical"},
                     **{"$labels.component": "consumer", "or $labels.pod $labels.instance": "c-1"})),
        # outside Kubernetes (metrics_targets): no pod, the summary names the target instead
        _case({up_at % (NS, REL, "trainer", "node-3:9500"): "0x10"},
              _alert(spec, "RollstreamComponentDown", "6m", {**RUN, "component": "trainer", "instance": "node-3:9500",
                                                             "job": "rollstream", "severity": "critical"},
                     **{"$labels.component": "trainer", "or $labels.pod $labels.instance": "node-3:9500"})),
        # steps for an hour, then none: the window (1h) empties at 120m, fires 5m later
        _case({f'rollstream_trainer_steps_total{{{OWN}, shard="0", pod="t-0"}}': "0+1x60 60x80"},
              _alert(spec, "RollstreamTrainerStalled", "119m"),
              _alert(spec, "RollstreamTrainerStalled", "124m"),
              _alert(spec, "RollstreamTrainerStalled", "126m",
                     {**RUN, "shard": "0", "severity": "critical"}, **{"$labels.shard": "0"})),
        # a trainer started 50 minutes ago still waiting for its first rows: not stalled yet
        _case({f'rollstream_trainer_steps_total{{{OWN}, shard="0", pod="t-0"}}': "0x50"},
              _alert(spec, "RollstreamTrainerStalled", "50m")),
        # the last consumer goes away at 11m with 10 samples in flight
        _case({f'rollstream_samples_in_flight{{{OWN}, shard="0"}}': "10x40",
               f'rollstream_consumer_slots{{{OWN}, consumer="c-1"}}': "8x10 stale"},
              _alert(spec, "RollstreamNoRolloutSlots", "10m"),
              _alert(spec, "RollstreamNoRolloutSlots", "20m"),
              _alert(spec, "RollstreamNoRolloutSlots", "22m", {**RUN, "severity": "critical"},
                     **{"$value": "10"})),
        # scaled to zero with nothing in flight: as it should be
        _case({f'rollstream_samples_in_flight{{{OWN}, shard="0"}}': "0x40"},
              _alert(spec, "RollstreamNoRolloutSlots", "30m")),
        # two consumers, 2 of their 16 slots busy, then 12 from 40m
        _case({f'rollstream_consumer_slots_busy{{{OWN}, consumer="c-1"}}': "1x39 6x30",
               f'rollstream_consumer_slots_busy{{{OWN}, consumer="c-2"}}': "1x39 6x30",
               f'rollstream_consumer_slots{{{OWN}, consumer="c-1"}}': "8x70",
               f'rollstream_consumer_slots{{{OWN}, consumer="c-2"}}': "8x70"},
              _alert(spec, "RollstreamSlotsIdle", "29m"),
              _alert(spec, "RollstreamSlotsIdle", "31m", {**RUN, "severity": "warning"},
                     **{"$value | humanizePercentage": "12.5%"}),
              _alert(spec, "RollstreamSlotsIdle", "45m")),
        # three entries dead-lettered at 6m (read by each of two admission shards); the work
        # stream's length is not a dead letter, nor another release's dead letters
        _case({f'rollstream_stream_length{{namespace="{NS}", release="rs-b", stream="dead", pod="b-0"}}': "5x15",
               f'rollstream_stream_length{{{OWN}, stream="dead", pod="a-0"}}': "0x5 3x10",
               f'rollstream_stream_length{{{OWN}, stream="dead", pod="a-1"}}': "0x5 3x10",
               f'rollstream_stream_length{{{OWN}, stream="work", pod="a-0"}}': "100x15"},
              _alert(spec, "RollstreamDeadLetters", "6m"),
              _alert(spec, "RollstreamDeadLetters", "8m", {**RUN, "severity": "warning"},
                     **{"$value": "3"})),
        # one group given up at 11m: an alert for the hour after it
        _case({f'rollstream_groups_abandoned_total{{{OWN}, shard="1", pod="a-1"}}': "0x10 1x100"},
              _alert(spec, "RollstreamGroupsAbandoned", "10m"),
              _alert(spec, "RollstreamGroupsAbandoned", "30m", {**RUN, "shard": "1", "severity": "warning"},
                     **{"$labels.shard": "1", "$value | humanize": "1"}),
              _alert(spec, "RollstreamGroupsAbandoned", "75m")),
    ]
    _run(tmp_path, rules, cases)


def test_thresholds_come_from_the_values(tmp_path):
    spec, rules = _rules(tmp_path, {"monitoring": {"prometheusRule": {
        "trainerStalledAfter": "30m", "idleSlotsBelow": 0.1, "idleSlotsFor": "10m"}}})
    steps = f'rollstream_trainer_steps_total{{{OWN}, shard="0", pod="t-0"}}'
    busy = {f'rollstream_consumer_slots_busy{{{OWN}, consumer="c-1"}}': "1x10 0x20",
            f'rollstream_consumer_slots{{{OWN}, consumer="c-1"}}': "8x30"}
    _run(tmp_path, rules, [
        # flat from 60m: the 30m window empties at 90m, fires at 95m
        _case({steps: "0+1x60 60x50"},
              _alert(spec, "RollstreamTrainerStalled", "94m"),
              _alert(spec, "RollstreamTrainerStalled", "96m", {**RUN, "shard": "0", "severity": "critical"},
                     **{"$labels.shard": "0"})),
        # 1 of 8 busy (0.125) is not below 0.1; none busy from 11m is, for 10m from then
        _case(busy, _alert(spec, "RollstreamSlotsIdle", "10m"), _alert(spec, "RollstreamSlotsIdle", "20m"),
              _alert(spec, "RollstreamSlotsIdle", "22m", {**RUN, "severity": "warning"},
                     **{"$value | humanizePercentage": "0%"})),
    ])


@pytest.mark.parametrize("field, value", [("trainerStalledAfter", "1.5h"), ("idleSlotsFor", "soon"),
                                          ("idleSlotsBelow", 0), ("idleSlotsBelow", 1.5)])
def test_the_schema_refuses_what_prometheus_would(field, value):
    from rollstream.chart_run import ChartRunError

    with pytest.raises(ChartRunError, match=field):
        alert_rules({"monitoring": {"prometheusRule": {field: value}}}, release=REL, namespace=NS)
