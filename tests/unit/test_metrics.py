"""pipeline/metrics.py: the registry, the observe_* helpers, and the HTTP endpoint, scraped
for real over a socket and parsed with prometheus_client's own parser."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pipeline.metrics import (
    LAG_BUCKETS,
    SESSION_BUCKETS,
    Metrics,
    families,
    parse_addr,
    sample_names,
    serve,
    serving,
)
from pipeline.errors import CommandError
from pipeline.scheduler import (
    Cancel,
    Discard,
    Handover,
    SampleKey,
    SchedulerRecord,
    Submit,
)
from pipeline.sessions import Status, Task

# every family the pipeline defines, with its Prometheus type (counters without _total)
EXPECTED = {
    "rollstream_scheduler_events": "counter",
    "rollstream_samples_in_flight": "gauge",
    "rollstream_samples_submitted": "counter",
    "rollstream_samples_resubmitted": "counter",
    "rollstream_samples_finished": "counter",
    "rollstream_samples_cancelled": "counter",
    "rollstream_samples_discarded": "counter",
    "rollstream_groups_admitted": "counter",
    "rollstream_groups_abandoned": "counter",
    "rollstream_groups_cut": "counter",
    "rollstream_groups_refused": "counter",
    "rollstream_groups_surplus": "counter",
    "rollstream_samples_backed_up": "counter",
    "rollstream_rollouts_overlong": "counter",
    "rollstream_admitted_lag_updates": "histogram",
    "rollstream_session_duration_seconds": "histogram",
    "rollstream_trained_session_seconds": "histogram",
    "rollstream_held_session_seconds": "gauge",
    "rollstream_step_metric": "gauge",
    "rollstream_trainer_steps": "counter",
    "rollstream_trainer_updates": "gauge",
    "rollstream_trainer_waited_seconds": "histogram",
    "rollstream_trainer_step_seconds": "histogram",
    "rollstream_trainer_tokens_per_second": "gauge",
    "rollstream_trainer_loss": "gauge",
    "rollstream_reward_mean": "gauge",
    "rollstream_importance_weight_mean": "gauge",
    "rollstream_importance_weight_max": "gauge",
    "rollstream_trainer_engine_mismatch_kl": "gauge",
    "rollstream_trainer_engine_mismatch_abs": "gauge",
    "rollstream_trainer_engine_mismatch_over": "gauge",
    "rollstream_consumer_slots_busy": "gauge",
    "rollstream_consumer_slots": "gauge",
    "rollstream_stream_length": "gauge",
    "rollstream_stream_group_lag": "gauge",
    "rollstream_stream_group_pending": "gauge",
    "rollstream_dead_letters": "counter",
    "rollstream_weights_served_version": "gauge",
    "rollstream_weights_published_version": "gauge",
    "rollstream_weights_push_seconds": "histogram",
    "rollstream_engine_weights_following": "gauge",
    "rollstream_engine_weights_version": "gauge",
    "rollstream_engine_weights_failures": "counter",
    "rollstream_build": "info",
}


def record(**overrides) -> SchedulerRecord:
    fields = {
        "updates": 7, "version": 5, "lag": 2, "groups": 3,
        "resubmitted": {"stale": 2, "timeout": 1, "cancelled": 0},
        "cancelled": 4, "abandoned": 1, "cut": 1, "waited": 0.75,
        "metrics": {"reward_mean": 0.5, "merge_ratio": 0.25, "loss": 1.5, "latency_s_p90": float("nan")},
    }
    fields.update(overrides)
    return SchedulerRecord(**fields)


def scrape(url: str) -> dict:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict, family: str, sample: str, **labels) -> float:
    for s in fams[family].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no sample {sample}{labels} in {family}")


@pytest.fixture
def metrics() -> Metrics:
    return Metrics(CollectorRegistry())


@pytest.fixture
def server(metrics):
    state = {"healthy": True, "ready": True}
    srv = serve(metrics, "127.0.0.1:0", health=lambda: state["healthy"], ready=lambda: state["ready"])
    srv.state = state
    yield srv
    srv.stop()


def test_registry_defines_every_family_with_its_type(metrics):
    assert families(metrics) == EXPECTED
    for name in EXPECTED:
        assert name.startswith("rollstream_")


def test_registries_are_independent():
    a, b = Metrics(CollectorRegistry()), Metrics(CollectorRegistry())
    a.groups_admitted.labels("0").inc(5)
    assert b.registry.get_sample_value("rollstream_groups_admitted_total", {"shard": "0"}) is None
    assert a.registry.get_sample_value("rollstream_groups_admitted_total", {"shard": "0"}) == 5


def test_buckets():
    assert LAG_BUCKETS == tuple(float(b) for b in range(17))
    assert SESSION_BUCKETS[0] == 0.01 and SESSION_BUCKETS[-1] == 4 * 3600
    assert list(SESSION_BUCKETS) == sorted(SESSION_BUCKETS)


def test_scrape_has_every_family_with_its_type(metrics, server):
    metrics.set_build(component="admission", run="exp1")
    fams = scrape(server.url)
    for name, kind in EXPECTED.items():
        family = name + "_info" if kind == "info" else name
        assert family in fams, f"{family} missing from /metrics"
        assert fams[family].type == ("gauge" if kind == "info" else kind), family
    assert value(fams, "rollstream_build_info", "rollstream_build_info", component="admission", run="exp1") == 1


def test_observe_record_moves_the_right_series(metrics, server):
    metrics.observe_record(record(), shard=3)
    metrics.observe_record(record(lag=0, groups=2, resubmitted={"stale": 1}, abandoned=0, cut=0, waited=12.0,
                                  metrics={}, backups=4), shard=3)
    fams = scrape(server.url)
    s = {"shard": "3"}
    assert value(fams, "rollstream_samples_backed_up", "rollstream_samples_backed_up_total", **s) == 4
    assert value(fams, "rollstream_groups_admitted", "rollstream_groups_admitted_total", **s) == 5
    assert value(fams, "rollstream_groups_abandoned", "rollstream_groups_abandoned_total", **s) == 1
    assert value(fams, "rollstream_groups_cut", "rollstream_groups_cut_total", **s) == 1
    resub = "rollstream_samples_resubmitted_total"
    assert value(fams, "rollstream_samples_resubmitted", resub, cause="stale", **s) == 3
    assert value(fams, "rollstream_samples_resubmitted", resub, cause="timeout", **s) == 1
    # zero counts create no series
    assert not [x for x in fams["rollstream_samples_resubmitted"].samples if x.labels.get("cause") == "cancelled"]
    # the lag histogram: one observation at 2, one at 0
    lag = "rollstream_admitted_lag_updates"
    assert value(fams, lag, lag + "_count", **s) == 2
    assert value(fams, lag, lag + "_sum", **s) == 2
    assert value(fams, lag, lag + "_bucket", le="0.0", **s) == 1
    assert value(fams, lag, lag + "_bucket", le="1.0", **s) == 1
    assert value(fams, lag, lag + "_bucket", le="2.0", **s) == 2
    # record.metrics: the catch-all only; NaN is skipped
    assert value(fams, "rollstream_step_metric", "rollstream_step_metric", name="merge_ratio", **s) == 0.25
    assert value(fams, "rollstream_step_metric", "rollstream_step_metric", name="reward_mean", **s) == 0.5
    assert not [x for x in fams["rollstream_step_metric"].samples if x.labels["name"] == "latency_s_p90"]
    # record.cancelled is counted by observe_actions, with reasons, not here
    assert not fams["rollstream_samples_cancelled"].samples
    # the trainer's side of the step is the trainer's: one owner per series
    for family in ("rollstream_trainer_steps", "rollstream_trainer_updates", "rollstream_trainer_waited_seconds",
                   "rollstream_reward_mean", "rollstream_trainer_loss"):
        assert not fams[family].samples, family


def test_observe_train_with_the_record_owns_the_trainer_side_of_the_step(metrics):
    train = {"loss": 0.3, "loss_tokens": 96.0, "mismatch_kl": float("nan")}
    metrics.observe_train(2, step_s=0.5, tokens=96, metrics=train, record=record())
    metrics.observe_train(2, step_s=1.0, tokens=64, metrics=train,
                          record=record(updates=8, waited=12.0, metrics={"merge_ratio": 1.0}))
    metrics.observe_train(2, step_s=1.0, tokens=64, metrics=train)  # no record: steps and loss only
    get = metrics.registry.get_sample_value
    s = {"shard": "2"}
    assert get("rollstream_trainer_steps_total", s) == 3
    assert get("rollstream_trainer_updates", s) == 9  # updates after the second step
    assert get("rollstream_trainer_waited_seconds_count", s) == 2
    assert get("rollstream_trainer_waited_seconds_sum", s) == pytest.approx(12.75)
    assert get("rollstream_trainer_waited_seconds_bucket", {**s, "le": "1.0"}) == 1
    assert get("rollstream_reward_mean", s) == 0.5  # the second record had none: kept
    assert get("rollstream_trainer_loss", s) == 0.3
    assert get("rollstream_trainer_tokens_per_second", s) == 64
    assert get("rollstream_step_metric", {**s, "name": "loss_tokens"}) == 96
    assert get("rollstream_trainer_engine_mismatch_kl", s) is None  # NaN: no series
    # the record's session metrics are the admission consumer's series, not the trainer's
    assert get("rollstream_step_metric", {**s, "name": "merge_ratio"}) is None
    assert get("rollstream_step_metric", {**s, "name": "reward_mean"}) is None
    assert get("rollstream_groups_admitted_total", s) is None


def test_observe_actions_events_and_finished(metrics):
    key = SampleKey(0, 1, 0, 0)
    task = Task(id="t")
    metrics.observe_actions(0, [
        Submit(key, task, 0, None, None), Submit(key, task, 0, None, "stale"),
        Cancel(key, "surplus"), Cancel(key, "surplus"), Cancel(key, "timeout"),
        Discard(key, "superseded"),
    ])
    metrics.observe_event(0, Handover(step=1, updates=0))
    metrics.observe_finished(0, Status.COMPLETED, 12.0)
    metrics.observe_finished(0, "infra_error", None)
    metrics.observe_finished_many(0, [Status.CANCELLED, Status.COMPLETED, Status.CANCELLED], [0.5, 3.0, 1.5])
    metrics.observe_trained(0, [12.0, None, 3.0])
    metrics.set_in_flight(0, 17)
    get = metrics.registry.get_sample_value
    assert get("rollstream_samples_submitted_total", {"shard": "0"}) == 2
    assert get("rollstream_samples_cancelled_total", {"shard": "0", "reason": "surplus"}) == 2
    assert get("rollstream_samples_cancelled_total", {"shard": "0", "reason": "timeout"}) == 1
    assert get("rollstream_samples_discarded_total", {"shard": "0", "reason": "superseded"}) == 1
    assert get("rollstream_scheduler_events_total", {"shard": "0", "kind": "handover"}) == 1
    assert get("rollstream_samples_finished_total", {"shard": "0", "status": "completed"}) == 2
    assert get("rollstream_samples_finished_total", {"shard": "0", "status": "infra_error"}) == 1
    assert get("rollstream_samples_finished_total", {"shard": "0", "status": "cancelled"}) == 2
    done = {"shard": "0", "status": "completed"}
    assert get("rollstream_session_duration_seconds_count", done) == 2
    assert get("rollstream_session_duration_seconds_sum", done) == 15.0
    assert get("rollstream_session_duration_seconds_bucket", {**done, "le": "10.0"}) == 1
    assert get("rollstream_session_duration_seconds_bucket", {**done, "le": "25.0"}) == 2
    cancelled = {"shard": "0", "status": "cancelled"}
    assert get("rollstream_session_duration_seconds_count", cancelled) == 2
    assert get("rollstream_session_duration_seconds_sum", cancelled) == 2.0
    assert get("rollstream_session_duration_seconds_count", {"shard": "0", "status": "infra_error"}) is None
    assert get("rollstream_trained_session_seconds_count", {"shard": "0"}) == 2
    assert get("rollstream_trained_session_seconds_sum", {"shard": "0"}) == 15.0
    assert get("rollstream_samples_in_flight", {"shard": "0"}) == 17


def test_trainer_consumer_stream_and_weight_helpers(metrics):
    metrics.observe_train(1, step_s=2.0, tokens=8192, metrics={
        "loss": 0.3, "importance_mean": 1.01, "importance_max": 3.5, "mismatch_kl": 0.002,
        "mismatch_abs": 0.03, "mismatch_over": 0.125})
    metrics.set_slots("consumer-a", busy=5, total=8)
    metrics.observe_stream("work", 40, {"rollout": (12, 28)})
    metrics.observe_stream("results:0", 3, {"admission:0": (None, 3)})
    metrics.dead_letter("results:0", "decode")
    metrics.served_version.set(4)
    metrics.observe_push(5, 1.5)
    get = metrics.registry.get_sample_value
    assert get("rollstream_trainer_tokens_per_second", {"shard": "1"}) == 4096
    assert get("rollstream_trainer_step_seconds_count", {"shard": "1"}) == 1
    assert get("rollstream_importance_weight_max", {"shard": "1"}) == 3.5
    assert get("rollstream_trainer_engine_mismatch_kl", {"shard": "1"}) == 0.002
    assert get("rollstream_trainer_engine_mismatch_abs", {"shard": "1"}) == 0.03
    assert get("rollstream_trainer_engine_mismatch_over", {"shard": "1"}) == 0.125
    assert get("rollstream_consumer_slots_busy", {"consumer": "consumer-a"}) == 5
    assert get("rollstream_consumer_slots", {"consumer": "consumer-a"}) == 8
    assert get("rollstream_stream_length", {"stream": "work"}) == 40
    assert get("rollstream_stream_group_lag", {"stream": "work", "group": "rollout"}) == 12
    assert get("rollstream_stream_group_pending", {"stream": "work", "group": "rollout"}) == 28
    assert get("rollstream_stream_group_lag", {"stream": "results:0", "group": "admission:0"}) is None
    assert get("rollstream_dead_letters_total", {"stream": "results:0", "reason": "decode"}) == 1
    assert get("rollstream_weights_served_version") == 4
    assert get("rollstream_weights_published_version") == 5
    assert get("rollstream_weights_push_seconds_count") == 1


def test_healthz_and_readyz_follow_their_callables(server):
    def status(path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(server.url + path, timeout=5) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    assert status("/healthz") == (200, "ok\n")
    assert status("/readyz") == (200, "ok\n")
    server.state["healthy"] = False
    assert status("/healthz")[0] == 503
    server.state["ready"] = False
    assert status("/readyz")[0] == 503
    server.state["healthy"] = True
    assert status("/healthz") == (200, "ok\n")
    assert status("/nope")[0] == 404


def test_a_probe_that_raises_is_unhealthy_not_fatal(metrics):
    def broken() -> bool:
        raise RuntimeError("redis unreachable")

    srv = serve(metrics, "127.0.0.1:0", health=broken)
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(srv.url + "/healthz", timeout=5)
        assert err.value.code == 503
        assert "redis unreachable" in err.value.read().decode()
        scrape(srv.url)  # the server still answers
    finally:
        srv.stop()


def test_openmetrics_on_request(metrics, server):
    req = urllib.request.Request(server.url + "/metrics",
                                 headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
        assert resp.read().decode().rstrip().endswith("# EOF")


def test_serve_binds_port_zero_and_stops(metrics):
    srv = serve(metrics)  # 127.0.0.1:0 by default
    assert srv.host == "127.0.0.1" and srv.port > 0
    scrape(srv.url)
    srv.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(srv.url + "/metrics", timeout=2)


def _listing(folder: Path) -> dict[str, list[dict]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(folder.iterdir())}


def test_a_process_lists_its_metrics_for_prometheus_file_discovery_while_it_serves(tmp_path):
    folder = tmp_path / "targets" / "local"  # made at start
    with serving("consumer", "run-a", "127.0.0.1:0", health=lambda: True, targets=str(folder)), \
            serving("admission", "run-a", "127.0.0.1:0", health=lambda: True, targets=str(folder)):
        listing = _listing(folder)
        assert sorted(listing) == sorted(f"{e[0]['labels']['component']}-{e[0]['targets'][0].replace(':', '-')}.json"
                                         for e in listing.values())
        for name, [entry] in listing.items():  # one target each, with the labels the dashboard selects by
            component = name.split("-")[0]
            assert entry["labels"] == {"component": component, "release": "run-a"}
            (target,) = entry["targets"]
            assert target.startswith("127.0.0.1:") and target != "127.0.0.1:0"  # the port bound
            build = value(scrape(f"http://{target}"), "rollstream_build_info", "rollstream_build_info",
                          component=component, run="run-a")
            assert build == 1  # the listed address is the process's own /metrics
        with serving("consumer", "run-a", "127.0.0.1:0", health=lambda: True, targets=str(folder)):
            assert len(_listing(folder)) == 3
        assert _listing(folder) == listing  # a process that exits takes only its own entry away
    assert _listing(folder) == {}  # nothing half-written left behind either


def test_a_listing_on_every_interface_names_the_machine_and_goes_on_an_error_too(tmp_path):
    with pytest.raises(RuntimeError, match="the block failed"):
        with serving("trainer", "run-b", "0.0.0.0:0", health=lambda: True, targets=str(tmp_path)):
            [[entry]] = _listing(tmp_path).values()
            host, _, port = entry["targets"][0].rpartition(":")
            assert host == socket.gethostname() and int(port) > 0
            raise RuntimeError("the block failed")
    assert _listing(tmp_path) == {}


def test_a_folder_that_cannot_be_written_names_metrics_targets(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with pytest.raises(CommandError, match=f"metrics_targets {blocked}/targets: cannot list"):
        with serving("consumer", "run-c", "127.0.0.1:0", health=lambda: True, targets=str(blocked / "targets")):
            pytest.fail("served without its listing")


@pytest.mark.parametrize("addr, expected", [
    ("127.0.0.1:9400", ("127.0.0.1", 9400)),
    ("0.0.0.0:0", ("0.0.0.0", 0)),
    ("[::]:9400", ("::", 9400)),
    (":9400", ("127.0.0.1", 9400)),
])
def test_parse_addr(addr, expected):
    assert parse_addr(addr) == expected


@pytest.mark.parametrize("addr", ["9400", "host:", "host:port", "host:70000"])
def test_parse_addr_refuses(addr):
    with pytest.raises(ValueError):
        parse_addr(addr)


def test_sample_names_cover_suffixes(metrics):
    names = sample_names(metrics)
    assert {"rollstream_groups_admitted_total", "rollstream_admitted_lag_updates_bucket",
            "rollstream_admitted_lag_updates_sum", "rollstream_admitted_lag_updates_count",
            "rollstream_build_info", "rollstream_samples_in_flight"} <= names
    assert "rollstream_groups_admitted" not in names


def test_every_family_is_documented(metrics):
    text = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    for name, kind in families(metrics).items():
        if not name.startswith("rollstream_"):
            continue
        shown = {"counter": name + "_total", "info": name + "_info"}.get(kind, name)
        assert f"| `{shown}` | {kind}" in text, f"{shown} missing from docs/operations.md"


def test_unlabelled_families_are_exported_only_by_their_owner():
    exported = {}
    for component in ("admission", "consumer", "trainer"):
        metrics = Metrics(CollectorRegistry(), component=component)
        metrics.served_version.set(3)  # calls on a family another process owns still work
        metrics.observe_push(4, 0.5)
        exported[component] = {s.name for f in metrics.registry.collect() for s in f.samples}
    assert "rollstream_weights_served_version" in exported["admission"]
    assert "rollstream_weights_published_version" in exported["trainer"]
    assert "rollstream_weights_push_seconds_count" in exported["trainer"]
    assert not {n for n in exported["consumer"] if n.startswith(("rollstream_weights", "rollstream_engine"))}
    assert not {n for c in exported.values() for n in c if n.startswith("rollstream_engine")}
    assert not {n for n in exported["admission"] if n.startswith("rollstream_weights_p")}
    assert "rollstream_weights_served_version" not in exported["trainer"]
