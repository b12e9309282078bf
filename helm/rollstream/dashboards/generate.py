"""Generate the Grafana dashboard `rollstream.json` beside this file.

    python helm/rollstream/dashboards/generate.py          # rewrite rollstream.json
    python helm/rollstream/dashboards/generate.py --check  # exit 1 if it is out of date

One panel per metric family of `pipeline/metrics.py`, in rows (Scheduler, Frontier,
Rollouts, Trainer, Consumers, Streams, Weights); the Frontier row's three numbers (share of
the slots' capacity trained, waste share, trained length bias) over the `$window` picked. Counters are shown as `rate()`, histograms as
`histogram_quantile()` over `sum by (le)`. Every query selects one run by the `$namespace` and
`$release` variables (the labels the chart's PodMonitor and ServiceMonitor give a scraped
pod), so runs that share a Prometheus stay apart; the runs' firing alerts are annotations.
`tests/unit/test_helm.py` checks that the JSON equals this script's output, that every
`rollstream_*` name in it is a defined metric and that every selector names the run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).with_name("rollstream.json")
UID = "rollstream-pipeline"
DS = {"type": "prometheus", "uid": "${datasource}"}
# one run: a release's series (the labels the chart's monitors give a scraped pod; `.*`, the
# variables' "All", also matches a series without them, as a Prometheus outside Kubernetes has)
RUN = 'namespace=~"$namespace", release=~"$release"'
SHARD = f'{RUN}, shard=~"$shard"'
RATE = "$__rate_interval"
WINDOW = "$window"  # the frontier's panels: a step's sessions can take minutes to hours


def per_s(metric: str, selector: str = SHARD) -> str:
    """`metric`'s rate over `WINDOW`, summed over every series `selector` picks."""
    return f"sum(rate({metric}{{{selector}}}[{WINDOW}]))"


def over_window(metric: str) -> str:
    """How much `metric` grew over `WINDOW`, summed over the shards picked."""
    return f"sum(increase({metric}{{{SHARD}}}[{WINDOW}]))"


TRAINED_S = per_s("rollstream_trained_session_seconds_sum")
TRAINED = per_s("rollstream_trained_session_seconds_count")
HELD = "rollstream_held_session_seconds"
# slot-seconds over the window: busy, trained, and the change in what is held for groups
WASTE = (f"1 - ({over_window('rollstream_trained_session_seconds_sum')} + sum({HELD}{{{SHARD}}}) "
         f"- (sum({HELD}{{{SHARD}}} offset {WINDOW}) or vector(0))) "
         f"/ clamp_min({over_window('rollstream_session_duration_seconds_sum')}, 1e-9)")
ENDED = f'{SHARD}, status!="cancelled"'  # sessions that ended by themselves
ENDED_MEAN = (f"({per_s('rollstream_session_duration_seconds_sum', ENDED)} / "
              f"{per_s('rollstream_session_duration_seconds_count', ENDED)})")


def rate(metric: str, by: str, selector: str = SHARD) -> str:
    return f"sum by ({by}) (rate({metric}{{{selector}}}[{RATE}]))"


def quantiles(metric: str, selector: str = SHARD, qs: tuple[float, ...] = (0.5, 0.9, 0.99),
              legend: str = "") -> list[tuple[str, str]]:
    return [
        (f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{selector}}}[{RATE}])))",
         f"{legend}p{int(q * 100)}")
        for q in qs
    ]


# (row, [(title, type, unit, description, [(expr, legend), ...]), ...])
ROWS: list[tuple[str, list[tuple[str, str, str, str, list[tuple[str, str]]]]]] = [
    ("Scheduler", [
        ("Samples in flight", "timeseries", "short",
         "Samples submitted and not yet ended, per shard (admission consumer).",
         [(f"sum by (shard) (rollstream_samples_in_flight{{{SHARD}}})", "shard {{shard}}")]),
        ("Scheduler events / s", "timeseries", "ops",
         "Events handled by the scheduling state machine, by kind.",
         [(rate("rollstream_scheduler_events_total", "kind"), "{{kind}}")]),
        ("Groups / s", "timeseries", "ops",
         ("Complete groups admitted to the trainer, abandoned after max_attempts, cut "
         "because they did not fit the packed rows beside the others, refused because they "
         "can never fit them, and cut as surplus by admit."),
         [(rate("rollstream_groups_admitted_total", "shard"), "admitted {{shard}}"),
          (rate("rollstream_groups_abandoned_total", "shard"), "abandoned {{shard}}"),
          (rate("rollstream_groups_cut_total", "shard"), "cut {{shard}}"),
          (rate("rollstream_groups_refused_total", "shard"), "refused {{shard}}"),
          (rate("rollstream_groups_surplus_total", "shard"), "surplus {{shard}}")]),
        ("Straggler backups and replacements / s", "timeseries", "ops",
         ("Extra rollouts queued as backups of a group's stragglers (stream admission, "
         "oversample_start=straggler; backup_limit caps how many run at once), as "
         "replacements of its members about to go stale (oversample_start=replace), or as "
         "backups of every straggler in the run's last steps (end_backups), per shard."),
         [(rate("rollstream_samples_backed_up_total", "shard"), "shard {{shard}}")]),
        ("Over-long rollouts / s", "timeseries", "ops",
         ("Results with a chain longer than a packed row, cut to the row width and trained "
         "as truncations under the run's truncation policy."),
         [(rate("rollstream_rollouts_overlong_total", "shard"), "shard {{shard}}")]),
        ("Admitted lag (updates)", "timeseries", "short",
         ("Trainer updates minus the weight version of each step's oldest admitted call; "
         "never above max_lag."),
         quantiles("rollstream_admitted_lag_updates")),
        ("Step metrics", "timeseries", "short",
         ("Every finite metric of the latest step: the SchedulerRecord's session metrics from "
         "the admission consumers (merge ratio, non-pad share, latency percentiles, token lag, "
         "...) and the loss metrics from the trainer ranks (loss tokens, clip fraction, ...)."),
         [(f"avg by (name) (rollstream_step_metric{{{SHARD}}})", "{{name}}")]),
    ]),
    ("Frontier", [
        ("Share of the slots' capacity trained", "timeseries", "percentunit",
         ("Samples trained per second over what the slots could finish (all consumers' slots "
         "over the mean session, of those that ended by themselves), over $window: below 1 "
         "where slots idle or waste, above 1 only by training short sessions (the length "
         "panel). The slots are all shards'; pick every shard. A run younger than $window "
         "reads low: rate() spreads what it saw over the whole window."),
         [(f"{TRAINED} * {ENDED_MEAN} / clamp_min(sum(rollstream_consumer_slots{{{RUN}}}), 1)", "share")]),
        ("Waste share of slot-seconds", "timeseries", "percentunit",
         ("Slot-seconds of sessions that no step trained (cancelled, stale, superseded, "
         "surplus, failed, masked out of the loss) over all busy slot-seconds, over $window: "
         "busy minus trained minus the growth of what the admission consumers hold for "
         "groups not yet trained."),
         [(WASTE, "waste share")]),
        ("Trained length over all sessions", "timeseries", "short",
         ("Mean slot seconds of the trained sessions over those of every session that ended "
         "by itself, over $window: below 1, the steps lean toward short sessions (backups, "
         "replacements, oversampling train the first finishers)."),
         [(f"({TRAINED_S} / {TRAINED}) / {ENDED_MEAN}", "trained / all")]),
    ]),
    ("Rollouts", [
        ("Submitted and resubmitted / s", "timeseries", "ops",
         "Work entries submitted (all attempts), and resubmissions by cause.",
         [(rate("rollstream_samples_submitted_total", "shard"), "submitted {{shard}}"),
          (rate("rollstream_samples_resubmitted_total", "cause"), "resubmitted {{cause}}")]),
        ("Finished / s by status", "timeseries", "ops",
         "Results read by the admission consumers, by session status.",
         [(rate("rollstream_samples_finished_total", "status"), "{{status}}")]),
        ("Cancelled / s by reason", "timeseries", "ops",
         "Cancels sent to rollout consumers, by reason.",
         [(rate("rollstream_samples_cancelled_total", "reason"), "{{reason}}")]),
        ("Discarded / s by reason", "timeseries", "ops",
         "Results dropped without training (superseded attempts, stale, failures).",
         [(rate("rollstream_samples_discarded_total", "reason"), "{{reason}}")]),
        ("Session duration", "timeseries", "s",
         ("Seconds each rollout session held a consumer's slot (a cancelled one's to its "
         "cancel), and those of the sessions the steps trained."),
         quantiles("rollstream_session_duration_seconds")
         + quantiles("rollstream_trained_session_seconds", qs=(0.5, 0.9), legend="trained ")),
    ]),
    ("Trainer", [
        ("Trainer updates", "stat", "short",
         "Optimizer updates applied so far: the weight version the trainer holds.",
         [(f"max(rollstream_trainer_updates{{{SHARD}}})", "updates")]),
        ("Steps / s", "timeseries", "ops",
         "Optimizer steps per second of each shard (the ranks of one batch share step together).",
         [(f"max by (shard) (rate(rollstream_trainer_steps_total{{{SHARD}}}[{RATE}]))",
           "shard {{shard}}")]),
        ("Trainer waited", "timeseries", "s",
         ("Seconds each trainer call waited for its packed rows, as the trainer measures it "
         "(the pipeline's bubble)."),
         quantiles("rollstream_trainer_waited_seconds")),
        ("Step time", "timeseries", "s",
         "Seconds per optimizer step (rescore, loss, backward, step).",
         quantiles("rollstream_trainer_step_seconds")),
        ("Tokens / s", "timeseries", "short",
         ("Trained tokens per second of the latest step, summed over shards (the ranks of one "
         "batch share train the same rows, so each shard counts once)."),
         [(f"sum(max by (shard) (rollstream_trainer_tokens_per_second{{{SHARD}}}))", "tokens/s")]),
        ("Loss", "timeseries", "short", "Loss of the latest step, per shard.",
         [(f"avg by (shard) (rollstream_trainer_loss{{{SHARD}}})", "shard {{shard}}")]),
        ("Mean reward", "timeseries", "short",
         "Mean verifier reward of the rollouts the latest trainer step trained.",
         [(f"avg(rollstream_reward_mean{{{SHARD}}})", "reward")]),
        ("Importance weights", "timeseries", "short",
         "Behaviour importance weight (proximal / behaviour): mean and max before any cap.",
         [(f"avg(rollstream_importance_weight_mean{{{SHARD}}})", "mean"),
          (f"max(rollstream_importance_weight_max{{{SHARD}}})", "max")]),
        ("Trainer-engine mismatch", "timeseries", "short",
         ("k3 estimate of KL(behaviour || trainer) on tokens sampled by the trainer's own "
         "version."),
         [(f"avg by (shard) (rollstream_trainer_engine_mismatch_kl{{{SHARD}}})", "shard {{shard}}")]),
        ("Training-inference log-prob gap", "timeseries", "short",
         ("Mean |trainer log-prob - engine log-prob| and the share of tokens beyond 0.1 nats, "
         "on tokens sampled by the trainer's own version: near 0 when the engine computes what "
         "the trainer does; large under a wrong temperature or log-prob mode, a stale cache, or "
         "dtype drift."),
         [(f"avg by (shard) (rollstream_trainer_engine_mismatch_abs{{{SHARD}}})", "mean |gap| {{shard}}"),
          (f"avg by (shard) (rollstream_trainer_engine_mismatch_over{{{SHARD}}})", "share > 0.1 {{shard}}")]),
    ]),
    ("Consumers", [
        ("Slot utilisation", "stat", "percentunit",
         "Busy session slots over all slots of all rollout consumers.",
         [(f"sum(rollstream_consumer_slots_busy{{{RUN}}}) / clamp_min(sum(rollstream_consumer_slots{{{RUN}}}), 1)",
           "utilisation")]),
        ("Slots busy / total", "timeseries", "short",
         "Session slots running a rollout, and the capacity, over all consumers.",
         [(f"sum(rollstream_consumer_slots_busy{{{RUN}}})", "busy"),
          (f"sum(rollstream_consumer_slots{{{RUN}}})", "total")]),
        ("Consumers", "stat", "short", "Rollout consumers reporting.",
         [(f"count(rollstream_consumer_slots{{{RUN}}})", "consumers")]),
    ]),
    ("Streams", [
        ("Stream length", "timeseries", "short", "XLEN of every stream of the run.",
         [(f"max by (stream) (rollstream_stream_length{{{RUN}}})", "{{stream}}")]),
        ("Consumer-group lag", "timeseries", "short",
         "Entries not yet delivered to each consumer group (the autoscaling signal on work).",
         [(f"max by (stream, group) (rollstream_stream_group_lag{{{RUN}}})", "{{stream}} / {{group}}")]),
        ("Consumer-group pending", "timeseries", "short",
         "Entries delivered and not yet acknowledged (running work on the work stream).",
         [(f"max by (stream, group) (rollstream_stream_group_pending{{{RUN}}})", "{{stream}} / {{group}}")]),
        ("Dead letters / s", "timeseries", "ops",
         "Entries moved to the dead-letter stream, by source stream and reason.",
         [(rate("rollstream_dead_letters_total", "stream, reason", RUN), "{{stream}}: {{reason}}")]),
    ]),
    ("Weights", [
        ("Weight versions", "timeseries", "short",
         "Version the engines serve, and the latest version the trainer published.",
         [(f"max(rollstream_weights_served_version{{{RUN}}})", "served"),
          (f"max(rollstream_weights_published_version{{{RUN}}})", "published")]),
        ("Weight push time", "timeseries", "s", "Seconds per weight push.",
         quantiles("rollstream_weights_push_seconds", selector=RUN)),
        ("Builds", "table", "short",
         ("Running rollstream processes by run (Kubernetes namespace, Helm release, Redis key "
         "namespace), component and version."),
         [(f"count by (namespace, release, run, component, version) (rollstream_build_info{{{RUN}}})", "")]),
    ]),
]


def panel(pid: int, title: str, kind: str, unit: str, description: str,
          targets: list[tuple[str, str]], x: int, y: int) -> dict:
    body: dict = {
        "id": pid,
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DS, "expr": expr,
             "legendFormat": legend, **({"format": "table", "instant": True} if kind == "table" else {})}
            for i, (expr, legend) in enumerate(targets)
        ],
    }
    if kind == "timeseries":
        body["options"] = {"legend": {"displayMode": "list", "placement": "bottom"},
                           "tooltip": {"mode": "multi", "sort": "desc"}}
    elif kind == "stat":
        body["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                           "colorMode": "value", "graphMode": "area"}
    return body


def label_variable(name: str, label: str, series: str, multi: bool, sort: int = 1) -> dict:
    """A variable over the values of label `name` on `series` ("All": any, or none)."""
    query = f"label_values({series}, {name})"
    everything = ["$__all"] if multi else "$__all"
    return {"name": name, "label": label, "type": "query", "datasource": DS,
            "query": {"query": query, "refId": name}, "definition": query,
            "includeAll": True, "multi": multi, "allValue": ".*",
            "current": {"selected": True, "text": ["All"] if multi else "All", "value": everything},
            "refresh": 2, "sort": sort, "hide": 0, "regex": ""}


# the chart's alerts (monitoring.prometheusRule) as they fire, for the run picked
ALERTS = {"name": "Alerts", "datasource": DS, "enable": True, "hide": False, "iconColor": "red",
          "expr": f'ALERTS{{alertname=~"Rollstream.+", alertstate="firing", {RUN}}}',
          "step": "1m", "titleFormat": "{{alertname}}", "tagKeys": "severity,component,shard",
          "textFormat": "{{severity}}: {{alertname}} {{component}}{{shard}}"}


def dashboard() -> dict:
    panels: list[dict] = []
    pid, y = 1, 0
    for row, members in ROWS:
        panels.append({"id": pid, "type": "row", "title": row, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        for i, (title, kind, unit, description, targets) in enumerate(members):
            x = (i % 3) * 8
            if i and i % 3 == 0:
                y += 8
            panels.append(panel(pid, title, kind, unit, description, targets, x, y))
            pid += 1
        y += 8
    return {
        "uid": UID,
        "title": "rollstream pipeline",
        "description": "Scheduler, rollouts, trainer, consumers, streams and weights of a "
                       "rollstream run (generated by dashboards/generate.py).",
        "tags": ["rollstream", "rl"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "timezone": "browser",
        "annotations": {"list": [ALERTS]},
        "links": [],
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource",
             "query": "prometheus", "current": {}, "hide": 0, "refresh": 1, "regex": ""},
            label_variable("namespace", "Namespace", 'rollstream_build_info', multi=False),
            label_variable("release", "Release", 'rollstream_build_info{namespace=~"$namespace"}', multi=False),
            label_variable("shard", "Shard", f"rollstream_samples_in_flight{{{RUN}}}", multi=True, sort=3),
            {"name": "window", "label": "Frontier window", "type": "interval",
             "query": "5m,15m,1h,6h,24h", "auto": False, "hide": 0, "refresh": 2,
             "current": {"selected": True, "text": "1h", "value": "1h"},
             "options": [{"selected": w == "1h", "text": w, "value": w}
                         for w in ("5m", "15m", "1h", "6h", "24h")]},
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python {Path(__file__).as_posix()}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
