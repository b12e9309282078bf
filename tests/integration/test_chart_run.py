"""`rollstream chart-run` (rollstream/chart_run.py): the Helm chart's workloads run as local
processes from their own rendered commands, environments, mounts, ports and probes, for the
chart's default values and for the production values docs/operations.md documents; and a
broken value fails naming the workload and the field.

Each run test starts a real Redis 7 (the chart's own start-up script and redis.conf, or a
stand-in for an external Redis with the documented ACL users over TLS), the admission
consumers, rollout consumers and DeepSpeed trainer ranks, and the `helm test` hook."""

from __future__ import annotations

import base64
import copy
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rollstream import chart_run
from rollstream.chart_run import ChartRunError
from pipeline.keys import Keys
from pipeline.processes import ROOT

pytestmark = pytest.mark.redis

STEPS = 3
OPERATIONS = ROOT / "docs" / "operations.md"


def _skip_without_redis7() -> None:
    try:
        chart_run.redis_programs(7)
    except ChartRunError as exc:
        pytest.skip(str(exc))


def rendered_workloads(values: dict, **kw) -> dict[str, dict]:
    docs, _ = chart_run.render(chart_run.merged(values, {"trainer": {"config": {"steps": STEPS}}}), **kw)
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs if d["kind"] in chart_run.WORKLOAD_KINDS}


def rendered_args(doc: dict, container) -> list[str]:
    """The container's rendered command line (with the image's ENTRYPOINT when it gives no
    command)."""
    spec = doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]
    (c,) = [c for c in spec["containers"] if c["name"] == container.name]
    return [*(c.get("command") or ["rollstream"]), *c["args"]]


def by_workload(result: chart_run.Result) -> dict[str, list[chart_run.Container]]:
    out: dict[str, list[chart_run.Container]] = {}
    for c in result.containers:
        out.setdefault(c.pod.workload, []).append(c)
    return out


def assert_ran(result: chart_run.Result, workloads: dict[str, dict], replicas: dict[str, int]) -> None:
    """Every rendered workload ran its own command with `replicas` pods; every long-running
    one passed its probes; the trainer ranks trained and exited 0; the hook passed; every
    process exited 0 when stopped."""
    ran = by_workload(result)
    assert set(ran) == set(workloads), "every rendered workload runs"
    for workload, containers in ran.items():
        assert len(containers) == replicas.get(workload, 1), workload
        for c in containers:
            root = str(c.pod.root)
            expected = rendered_args(workloads[workload], c)
            shard = c.pod.labels.get("apps.kubernetes.io/pod-index", "")
            mapped = [a.replace("$(ROLLSTREAM_SHARD)", shard).replace("/etc/rollstream/", root + "/etc/rollstream/")
                      for a in expected]
            if workload.startswith("StatefulSet/") and workload.endswith("-redis"):
                assert c.argv[:2] == ["/bin/sh", "-c"]
                assert f"exec redis-server {root}/etc/redis/redis.conf --include {root}/tmp/auth.conf" in c.argv[2]
            else:  # the rollstream containers and the helm test hook
                assert c.argv == mapped, workload
            assert c.process is not None and c.process.popen.returncode == 0, c.label
            if not c.pod.hook:
                assert c.ready_s is not None, c.label
    assert any(line.startswith("passed") and "(helm test)" in line and "'ok'" in line for line in result.lines)
    assert any(line.startswith("stopped:") for line in result.lines)


@pytest.mark.timeout(240)
def test_the_default_values_run(tmp_path, monkeypatch):
    _skip_without_redis7()
    monkeypatch.setenv("ROLLSTREAM_CHART_RUN_LEAK", "from the caller")
    result = chart_run.run({}, folder=tmp_path, namespace="rl", steps=STEPS, say=print)
    workloads = rendered_workloads({}, namespace="rl")
    assert set(workloads) == {"StatefulSet/rs-rollstream-redis", "StatefulSet/rs-rollstream-admission",
                              "Deployment/rs-rollstream-consumer", "StatefulSet/rs-rollstream-trainer",
                              "Pod/rs-rollstream-test-redis"}
    assert_ran(result, workloads, {"Deployment/rs-rollstream-consumer": 2})
    ran = by_workload(result)
    (redis,) = ran["StatefulSet/rs-rollstream-redis"]
    (admission,) = ran["StatefulSet/rs-rollstream-admission"]
    (trainer,) = ran["StatefulSet/rs-rollstream-trainer"]
    # the pods' environments: the rendered Secret's password, the pod index, nothing of ours
    assert admission.env["ROLLSTREAM_REDIS_PASSWORD"] == redis.env["REDIS_PASSWORD"] != ""
    assert admission.env["ROLLSTREAM_SHARD"] == "0" and trainer.env["RANK"] == "0"
    assert all("ROLLSTREAM_CHART_RUN_LEAK" not in c.env for c in result.containers)
    # the trainer's config is the chart's, its addresses mapped: Redis through the Service
    config = json.loads((trainer.pod.root / "etc/rollstream/trainer.json").read_text())
    port = redis.pod.ports[6379]
    assert config["redis"]["url"] == f"redis://127.0.0.1:{port}/0"
    assert config["metrics_addr"] == f"0.0.0.0:{trainer.pod.ports[9400]}"
    assert config["steps"] == STEPS
    # its steps reached Redis: weights published, every consumer alive, nothing dead-lettered
    assert result.status is not None and result.status["published_version"] >= 1
    assert len(result.status["consumers_alive"]) == 2 and result.status["dead_lettered"] == 0
    # Redis ran from the chart's redis.conf: AOF persistence in its claim
    aof = tmp_path / "claims" / "data-rs-rollstream-redis-0" / "appendonlydir"
    assert any(f.stat().st_size > 0 for f in aof.iterdir())


# ------------------------------------------------------------------------------ the production values


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.DOTALL)


def documented_production() -> tuple[dict, list[dict]]:
    """docs/operations.md's production values: its `run.yaml`, the external Redis over TLS
    of its `helm install` and the per-role ACL users of its `helm upgrade`; and the Secrets
    its `kubectl create secret` lines make (the CA comes from the stand-in)."""
    text = OPERATIONS.read_text()
    import helm_python as helm

    (run_yaml,) = [b for b in _blocks(text, "yaml") if b.startswith("image:")]
    values = yaml.safe_load(run_yaml)
    (install,) = [b for b in _blocks(text, "bash") if "helm install rl" in b and "redis.enabled=false" in b]
    (upgrade,) = [b for b in _blocks(text, "bash") if "helm upgrade rl" in b and "external.roles" in b]
    for expression in re.findall(r"--set (\S+)", install + upgrade):
        values = chart_run.merged(values, helm.parse_set_string(expression))
    secrets = [{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
                "data": {key: base64.b64encode(f"{name} 'pa$$ w\"rd".encode()).decode()}}
               for name, key in re.findall(r"create secret generic (\S+) --from-literal=([\w.-]+)=", text)]
    return values, secrets


def runnable(values: dict) -> dict:
    """The production values as they can run on two CPU cores without a cluster, keeping the
    users, TLS, ranks, shards, consumers, ZeRO stage and shared checkpoint claim. What changes,
    and why:
    - the consumers' source: the documented HarnessSource drives the user's agent through a
      gateway and engines that are not part of the chart; SleepSource stands in (the chart's
      default source), so the run trains on its rollouts;
    - the model: GPT-2 of 12 layers x 768 would take minutes per step on a CPU; the same
      Hugging Face GPT-2, one layer of 32, with positions for the rows;
    - scheduler.width 4096 -> 256 (rows stay 8): the small model's positions, each step's
      attention cheap on a CPU.
    The image, the GPU count and the ServiceMonitor stay: the first two are not enforced on
    local processes (the trainer picks the CPU), the last runs nothing."""
    out = copy.deepcopy(values)
    out["consumer"]["source"] = "consumers.sources.sleep:SleepSource"
    out["consumer"]["config"]["source_args"] = {}
    out["trainer"]["config"]["trainer"]["model"]["hf"].update(n_layer=1, n_head=2, n_embd=32, n_positions=256)
    out["scheduler"]["width"] = 256
    return out


def test_the_documented_production_values_name_what_exists():
    values, secrets = documented_production()
    module, _, factory = values["consumer"]["source"].partition(":")
    assert hasattr(importlib.import_module(module), factory), "the documented consumer source exists"
    assert values["trainer"]["ranks"] >= 2 and values["consumer"]["autoscaling"]["minReplicas"] >= 2
    ext = values["redis"]["external"]
    assert ext["url"].startswith("rediss://") and ext["tlsCaSecret"] and not values["redis"]["enabled"]
    assert set(ext["roles"]) == {"consumer", "trainer"}
    assert {s["metadata"]["name"] for s in secrets} == {"redis-creds", "redis-consumer-creds", "redis-trainer-creds"}
    hf = values["trainer"]["config"]["trainer"]["model"]["hf"]
    assert hf.get("n_positions", 1024) >= values["scheduler"]["width"], "a packed row fits the model's positions"


@pytest.mark.timeout(300)
def test_the_production_values_run(tmp_path):
    _skip_without_redis7()
    if subprocess.run(["openssl", "version"], capture_output=True, check=False).returncode != 0:
        pytest.skip("the openssl CLI makes the stand-in's TLS certificates")
    documented, secrets = documented_production()
    values = runnable(documented)
    result = chart_run.run(values, folder=tmp_path, release="rl", namespace="rl", secrets=secrets, steps=STEPS,
                           say=print)
    ranks = documented["trainer"]["ranks"]
    consumers = documented["consumer"]["autoscaling"]["minReplicas"]  # what KEDA keeps
    workloads = rendered_workloads(values, release="rl", namespace="rl")
    assert_ran(result, workloads, {"StatefulSet/rl-rollstream-trainer": ranks,
                                   "StatefulSet/rl-rollstream-admission": ranks,  # share 1: a shard per rank
                                   "Deployment/rl-rollstream-consumer": consumers})
    ran = by_workload(result)
    # the operator's objects run nothing and are reported as such
    operator = {line.split(":")[0] for line in result.lines
                if line.startswith("not run  ") and ("Monitor/" in line or "PrometheusRule/" in line)}
    assert operator == {"not run  ServiceMonitor/rl-rollstream", "not run  PrometheusRule/rl-rollstream"}
    # one ACL user per role, each pod logged in as its own, over TLS with the mounted CA
    users = {"StatefulSet/rl-rollstream-admission": "rollstream", "Deployment/rl-rollstream-consumer": "rs-consumer",
             "StatefulSet/rl-rollstream-trainer": "rs-trainer"}
    for workload, user in users.items():
        for c in ran[workload]:
            config = json.loads((c.pod.root / "etc/rollstream" / c.argv[c.argv.index("--config") + 1].rsplit("/", 1)[1])
                                .read_text())
            assert config["redis"]["username"] == c.env["ROLLSTREAM_REDIS_USERNAME"] == user
            assert config["redis"]["url"].startswith("rediss://127.0.0.1:")
            ca = (tmp_path / "stand-in-redis" / "ca.crt").read_bytes()
            assert Path(config["redis"]["tls_ca_file"]).read_bytes() == ca
    assert any("users rollstream (admission), rs-consumer (consumer), rs-trainer (trainer)" in line
               for line in result.lines)
    assert result.status is not None and result.status["published_version"] >= 1
    assert len(result.status["consumers_alive"]) == consumers and result.status["dead_lettered"] == 0
    assert result.status["namespace"] == documented["run"]["namespace"]
    assert set(result.status["streams"]) >= {Keys(documented["run"]["namespace"]).ready(s) for s in range(ranks)}
    # every rank wrote its part of the checkpoint into the one claim they share
    step = tmp_path / "claims" / "rl-checkpoints" / f"step{STEPS:08d}"
    assert {f.name for f in step.glob("zero_pp_rank_*_optim_states.pt")} == {
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(ranks)}


# ------------------------------------------------------------------------------ what fails, named


MINE = [{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "mine"}, "stringData": {"password": "pw"}}]


@pytest.mark.parametrize("values, secrets, expected", [
    ({"redis": {"auth": {"existingSecret": "mine", "existingSecretPasswordKey": "passwd"}}}, MINE, [
        "StatefulSet/rs-rollstream-redis container redis: env[REDIS_PASSWORD].valueFrom.secretKeyRef.key: "
        "Secret mine has no key 'passwd' (it has: password)",
        "StatefulSet/rs-rollstream-trainer container trainer: env[ROLLSTREAM_REDIS_PASSWORD].valueFrom.secretKeyRef"
        ".key: Secret mine has no key 'passwd'",
        "Pod/rs-rollstream-test-redis container redis-cli: env[REDISCLI_AUTH].valueFrom.secretKeyRef.key"]),
    ({"redis": {"auth": {"existingSecret": "theirs"}}}, MINE, [
        "Deployment/rs-rollstream-consumer container consumer: env[ROLLSTREAM_REDIS_PASSWORD].valueFrom.secretKeyRef"
        ".name: Secret theirs is neither rendered nor given with --secrets"]),
    ({"trainer": {"config": {"checkpoint": {"dir": "/checkpoints"}}}}, [], [
        "StatefulSet/rs-rollstream-trainer container trainer: /etc/rollstream/trainer.json checkpoint.dir: "
        "/checkpoints is under no volume mount of the container and not in the image"]),
    ({"trainer": {"persistence": {"enabled": True, "mountPath": "/tmp"}}}, [], [
        "StatefulSet/rs-rollstream-trainer container trainer: volumeMounts[checkpoints].mountPath: /tmp is mounted "
        "twice"]),
    ({"trainer": {"config": {"record": "/records/{rank}.jsonl"}}}, [], [
        "StatefulSet/rs-rollstream-trainer container trainer: /etc/rollstream/trainer.json record: "
        "/records/{rank}.jsonl is under no volume mount"]),
    ({"consumer": {"extraEnv": [{"name": "GATEWAY", "value": "http://127.0.0.1:8000/v1"}]}}, [], [
        "Deployment/rs-rollstream-consumer container consumer: env[GATEWAY]: 127.0.0.1:8000: port 8000 is not a "
        "containerPort of the pod (it declares [9400])"]),
    ({"consumer": {"extraEnv": [{"name": "GATEWAY", "value": "http://gateway.default.svc.cluster.local:8000"}]}}, [], [
        "Deployment/rs-rollstream-consumer container consumer: env[GATEWAY]: names gateway.default.svc.cluster.local, "
        "which no rendered Service or pod answers"]),
], ids=["wrong-secret-key", "missing-secret", "unmounted-checkpoint-dir", "mount-path-taken", "unmounted-record",
        "undeclared-loopback-port", "unknown-service"])
def test_a_broken_value_names_the_workload_and_the_field(tmp_path, values, secrets, expected):
    with pytest.raises(ChartRunError) as failed:
        chart_run.plan(values, folder=tmp_path, secrets=secrets)
    message = str(failed.value)
    for line in expected:
        assert line in message, message


def test_a_wrong_role_secret_key_of_an_external_redis(tmp_path):
    values, secrets = documented_production()
    values = chart_run.merged(runnable(values), {"redis": {"external": {"roles": {"consumer": {
        "existingSecretPasswordKey": "passwort"}}}}})
    with pytest.raises(ChartRunError) as failed:
        chart_run.plan(values, folder=tmp_path, secrets=secrets, release="rl", namespace="rl")
    message = str(failed.value)
    assert ("Deployment/rl-rollstream-consumer container consumer: env[ROLLSTREAM_REDIS_PASSWORD].valueFrom"
            ".secretKeyRef.key: Secret redis-consumer-creds has no key 'passwort' (it has: password)") in message
    assert "stand-in Redis: redis.external.roles.consumer (or redis.external).existingSecretPasswordKey" in message


def _edit(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _host_path(docs):
    spec = _edit(docs, "StatefulSet", "rs-rollstream-trainer")["spec"]["template"]["spec"]
    (dshm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
    dshm.pop("emptyDir")
    dshm["hostPath"] = {"path": "/dev/shm"}


def _narrow_redis_policy(docs):
    rule = _edit(docs, "NetworkPolicy", "rs-rollstream-redis")["spec"]["ingress"][0]
    rule["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] = "admission"


def _wrong_target_port(docs):
    _edit(docs, "Service", "rs-rollstream-redis")["spec"]["ports"][0]["targetPort"] = "reddis"


def _wrong_service_name(docs):
    _edit(docs, "StatefulSet", "rs-rollstream-trainer")["spec"]["serviceName"] = "rs-rollstream-trainers"


def _command_over_entrypoint(docs):
    spec = _edit(docs, "Deployment", "rs-rollstream-consumer")["spec"]["template"]["spec"]
    spec["containers"][0]["command"] = ["python", "-m", "consumers.rollout"]


@pytest.mark.parametrize("edit, expected", [
    (_host_path, "StatefulSet/rs-rollstream-trainer container trainer: volumes[dshm]: a hostPath volume cannot be "
                 "mapped to a local process"),
    (_narrow_redis_policy, "Deployment/rs-rollstream-consumer: reaches StatefulSet/rs-rollstream-redis on port 6379, "
                           "which NetworkPolicy rs-rollstream-redis does not let in"),
    (_wrong_target_port, "Service/rs-rollstream-redis: spec.ports[redis].targetPort: reddis is not a containerPort of "
                         "StatefulSet/rs-rollstream-redis"),
    (_wrong_service_name, "StatefulSet/rs-rollstream-trainer: spec.serviceName: 'rs-rollstream-trainers' is not a "
                          "headless Service selecting its pods"),
    (_command_over_entrypoint, "Deployment/rs-rollstream-consumer container consumer: command: ['python', '-m', "
                               "'consumers.rollout'] replaces the image's ENTRYPOINT ['rollstream']"),
], ids=["host-path", "network-policy", "target-port", "service-name", "command"])
def test_what_cannot_be_mapped_or_would_not_work_in_a_cluster_fails(tmp_path, edit, expected):
    docs, values = chart_run.render({"trainer": {"ranks": 2}})
    edit(docs)
    with pytest.raises(ChartRunError) as failed:
        chart_run.plan_docs(docs, values, folder=tmp_path, namespace="default")
    assert expected in str(failed.value), str(failed.value)


@pytest.mark.timeout(120)
def test_a_process_that_fails_names_its_workload(tmp_path):
    _skip_without_redis7()
    with pytest.raises(ChartRunError) as failed:
        chart_run.run({"consumer": {"replicas": 1, "source": "consumers.sources.nowhere:Nothing"}}, folder=tmp_path)
    message = str(failed.value)
    assert "Deployment/rs-rollstream-consumer pod rs-rollstream-consumer-0 container consumer: exited with" in message
    assert "consumers.sources.nowhere" in message  # its output's last lines
    assert "the pods' files and logs are under" in message


def test_the_command_exits_non_zero_naming_the_workload_and_field(tmp_path):
    done = subprocess.run([sys.executable, "-m", "rollstream.cli", "chart-run", "--out", str(tmp_path),
                           "--set", "trainer.config.checkpoint.dir=/checkpoints"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()  # one line (pipeline.errors), every problem in it
    assert line.startswith("rollstream chart-run: StatefulSet/rs-rollstream-trainer container trainer: "
                           "/etc/rollstream/trainer.json checkpoint.dir: /checkpoints is under no volume mount"), line
    assert line.endswith(f"; the pods' files and logs are under {tmp_path}"), line
    unreadable = subprocess.run([sys.executable, "-m", "rollstream.cli", "chart-run", "--values", str(tmp_path / "no.yaml")],
                                cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert unreadable.returncode == 2 and unreadable.stderr.startswith(f"rollstream chart-run: --values {tmp_path}/no.yaml: ")


def test_gpus_are_handed_out_as_a_device_plugin_would(tmp_path):
    """Each trainer rank (trainer.gpu.count each) sees its own GPUs when there are enough for
    all of them, none sees any otherwise, and no other container sees one."""
    planned = chart_run.plan({"trainer": {"ranks": 2, "gpu": {"count": 2}}}, folder=tmp_path)
    containers = planned.containers + planned.hooks
    assert "4 asked for, 8 here: each container sees its own" in chart_run.allot_gpus(containers, 8)
    visible = {c.pod.name: c.env["CUDA_VISIBLE_DEVICES"] for c in containers}
    assert visible.pop("rs-rollstream-trainer-0") == "0,1" and visible.pop("rs-rollstream-trainer-1") == "2,3"
    assert set(visible.values()) == {""}
    assert "none is visible to any container" in chart_run.allot_gpus(containers, 3)
    assert {c.env["CUDA_VISIBLE_DEVICES"] for c in containers} == {""}
