"""`rollstream chart-run`: every workload the Helm chart renders, run as local processes.

    rollstream chart-run                                          # the chart's defaults
    rollstream chart-run --values run.yaml --set trainer.ranks=2 --steps 3
    rollstream chart-run --values prod.yaml --secrets secrets.yaml --out /tmp/chart-run

The chart is rendered with Helm's own engine (helm-python-sdk: no helm binary, no cluster),
with `trainer.config.steps` set to `--steps`. Every Deployment and StatefulSet pod (replicas
from the workload, or the least an HPA or KEDA ScaledObject keeps) and the `helm test` hook
Pod then runs the way a cluster would run it, as a local process per container:

- **command**: the container's `command` and `args`, else the image's ENTRYPOINT and CMD;
  `$(VAR)` expanded from the container's environment as Kubernetes does. The rollstream
  image is the repository's Dockerfile (its final stage's ENTRYPOINT, ENV, WORKDIR; its
  `rollstream` program runs this source tree); a `redis`/`valkey` image is a local
  redis-server and redis-cli of at least the image tag's major version. Other images fail.
- **environment**: the image's ENV, then the container's `env` and `envFrom`, `valueFrom`
  resolved from the rendered Secrets and ConfigMaps (and those given with `--secrets`: the
  Secrets the values name but the chart does not create), the pod's own fields (name,
  namespace, labels such as `apps.kubernetes.io/pod-index`). Nothing of the caller's
  environment leaks in but PATH entries for the image's programs and PYTHONPATH.
- **volumes**: each pod gets a folder standing for its filesystem: a ConfigMap or Secret is
  written there (its `items`, `defaultMode`), an emptyDir is a fresh folder, a
  volumeClaimTemplate a folder per pod, a persistentVolumeClaim one folder every pod naming
  the claim shares. Each absolute path under a mount point in the container's command,
  args, environment and mounted ConfigMap files is rewritten to that folder (Secrets are
  data and are never rewritten). A path under no mount in a config file, the environment or
  an argument, which the image does not hold either, fails: the root filesystem is
  read-only. Any other volume type (hostPath, nfs, csi, ...) fails.
- **network**: each declared containerPort of a pod gets a free local port; the pod's own
  bind and loopback addresses (`0.0.0.0:P`, `127.0.0.1:P`, a `port P` directive, `-p P`)
  use it. A Service's and a StatefulSet pod's DNS names (`svc`, `svc.ns`,
  `svc.ns.svc.<clusterDomain>`, `pod.svc.ns.svc...`) become 127.0.0.1 and the port of the
  pod the Service selects (its targetPort); a variable `X_HOST` / `X_ADDR` naming one gets
  its port from `X_PORT`. A cluster name left unmapped, or a loopback port no container
  declares, fails.
- **Redis**: the in-chart Redis runs its own rendered start-up script and `redis.conf`
  (persistence, password). An external Redis (`redis.enabled=false`) gets a local stand-in
  at the address the values name: one ACL user per role as docs/operations.md tells the
  operator to create them (`redis.external.roles`, falling back to `redis.external.username`
  and `existingSecret`; the rules of `acl_args(keys, role)`, the passwords read from the
  Secrets), and for `rediss://` TLS with a certificate of a CA it generates, handed to the
  pods as the Secret `redis.external.tlsCaSecret` names.

Then: each wave of workloads starts after the workloads it reaches are ready (Redis first);
every container's startup, readiness and liveness probes (`/healthz`, `/readyz`, or the
exec probes) must pass, in that order, on the same paths; the trainer ranks must train
their steps and exit 0; `rollstream status` runs in the first admission pod (as `kubectl
exec` would); the `helm test` hook's script must exit 0; then every process gets SIGTERM
and must exit 0 within its pod's terminationGracePeriodSeconds. What cannot be mapped, or
any failure, raises `ChartRunError` naming the workload and the field (the command prints
every problem in one line and exits 1; an unreadable `--values` or `--secrets` file is a
`ConfigError`, exit 2: `pipeline.errors`).

Checked before anything starts: the image runs the chart's command (`image_problems`: the
Dockerfile's ENTRYPOINT, USER and layout); every Service selects a pod and reaches a
declared port of it; every StatefulSet's `serviceName` is a headless Service selecting its
pods (their DNS names); every connection the pods' configs make is let in by the
NetworkPolicies selecting its target (not enforced on local processes, but checked).

GPUs are handed out as a device plugin would (CUDA_VISIBLE_DEVICES) when this machine has
enough for every pod that asks, else to none (`device: auto` is then the CPU). The local
pods share this machine's cores (OMP_NUM_THREADS split among them) and DeepSpeed's compiled
ops (TORCH_EXTENSIONS_DIR; each trainer pod of a cluster compiles them into its `/tmp`).
Not emulated, and said in the report: CPU and memory requests, security contexts (the
processes run as the caller), PodDisruptionBudgets, ServiceMonitors and the like (no
process runs for them); a KEDA ScaledObject's `minReplicaCount: 0` runs one replica.
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from pipeline.errors import CommandError, ConfigError
from pipeline.processes import ROOT, Process, child_env, free_port

CHART = ROOT / "helm" / "rollstream"
DOCKERFILE = ROOT / "Dockerfile"
PYPROJECT = ROOT / "pyproject.toml"
REDIS_SERVERS = ("/usr/bin/redis-server", "/usr/local/bin/redis-server")
"""Where a Redis of the right version is looked for, before `redis-server` on PATH."""

IGNORED_KINDS = {
    "ServiceAccount": "no process; the processes run as the caller",
    "NetworkPolicy": "not enforced; checked against every connection the pods' configs make",
    "PodDisruptionBudget": "no voluntary disruptions here",
    "HorizontalPodAutoscaler": "its minReplicas consumers run",
    "ScaledObject": "its minReplicaCount consumers run (at least one)",
    "ServiceMonitor": "no Prometheus Operator here",
    "PodMonitor": "no Prometheus Operator here",
    "PrometheusRule": "no Prometheus Operator here (promtool runs its rules in the tests)",
}
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Pod")
BASE_DIRS = ("/bin", "/sbin", "/lib", "/lib64", "/usr", "/dev", "/proc", "/sys")
"""Paths any image holds (read-only): a process may name them without a mount."""
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HOST_SUFFIXES = ("_HOST", "_ADDR", "_ADDRESS", "_HOSTNAME")
DEFAULT_PORTS = {"redis": 6379, "rediss": 6379, "http": 80, "https": 443}


class ChartRunError(CommandError):
    """What could not be mapped or did not work: `problems`, each naming the workload and the
    field; the message holds them all, `; ` between them."""

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems = list(dict.fromkeys(problems))
        super().__init__("; ".join(self.problems))


class Problems:
    """Problems found while planning, each `<workload>: <field>: <reason>`, in order, once."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, where: str, what: str, reason: str) -> None:
        line = f"{where}: {what}: {reason}" if what else f"{where}: {reason}"
        if line not in self.lines:
            self.lines.append(line)

    def check(self) -> None:
        if self.lines:
            raise ChartRunError(self.lines)


# ------------------------------------------------------------------------------ values and rendering


def merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` on `base`, mappings merged key by key (as Helm merges values files)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def load_values(files: Iterable[str | os.PathLike[str]] = (), sets: Iterable[str] = ()) -> dict[str, Any]:
    """Values files merged in order, then `--set` expressions (Helm's own parser)."""
    import helm_python as helm

    values: dict[str, Any] = {}
    for path in files:
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"--values {path}: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"--values {path}: must be a mapping, got {type(data).__name__}")
        values = merged(values, data)
    for expression in sets:
        values = merged(values, helm.parse_set_string(expression))
    return values


def render(values: Mapping[str, Any], *, chart: Path = CHART, release: str = "rs",
           namespace: str = "default") -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The chart's manifests (NOTES left out) and the values it rendered them with."""
    import helm_python as helm

    with helm.Chart.load(chart) as loaded:
        try:
            rendered = loaded.render(values=dict(values), name=release, namespace=namespace)
        except helm.HelmError as exc:
            raise ChartRunError([f"helm render: {exc}"]) from None
        effective = loaded.merge_values(dict(values))
    docs = []
    for path, text in sorted(rendered.items()):
        if not path.endswith(".txt"):
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs, effective


def alert_rules(values: Mapping[str, Any] | None = None, *, release: str = "rs",
                namespace: str = "default") -> dict[str, Any]:
    """The chart's alerts (its PrometheusRule's spec, rendered with `values` for `release` in
    `namespace`): a Prometheus rule file, as `promtool` and `rule_files` take it."""
    docs, _ = render(merged(values or {}, {"monitoring": {"prometheusRule": {"enabled": True}}}),
                     release=release, namespace=namespace)
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    return rule["spec"]


def secrets_from(paths: Iterable[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    """The Secret manifests of YAML files (what `kubectl create secret ... -o yaml` writes)."""
    out = []
    for path in paths:
        try:
            docs = [d for d in yaml.safe_load_all(Path(path).read_text(encoding="utf-8")) if d]
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"--secrets {path}: {exc}") from None
        for doc in docs:
            if not isinstance(doc, dict) or doc.get("kind") != "Secret":
                what = doc.get("kind") if isinstance(doc, dict) else repr(doc)
                raise ConfigError(f"--secrets {path}: holds a {what}, not a Secret")
            out.append(doc)
    return out


# ------------------------------------------------------------------------------ the image (Dockerfile)


@dataclass(frozen=True)
class ImageSpec:
    """What the final stage of a Dockerfile sets up: the program and its environment, and the
    directories the image holds (besides BASE_DIRS)."""

    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    env: dict[str, str]
    workdir: str
    user: str
    dirs: tuple[str, ...]


def _logical_lines(text: str) -> list[str]:
    lines, current = [], ""
    for raw in text.splitlines():
        if not current and raw.lstrip().startswith("#"):
            continue
        if raw.rstrip().endswith("\\"):
            current += raw.rstrip()[:-1] + " "
            continue
        current += raw
        if current.strip():
            lines.append(current.strip())
        current = ""
    return lines


def _exec_form(value: str) -> tuple[str, ...]:
    value = value.strip()
    if value.startswith("["):
        return tuple(json.loads(value))
    return ("/bin/sh", "-c", value)


def _expand(value: str, env: Mapping[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), ""), value)


def read_dockerfile(path: Path = DOCKERFILE) -> ImageSpec:
    """The final stage of the Dockerfile at `path` (stages inherit from the stage they name)."""
    stages: dict[str, dict[str, Any]] = {}
    stage: dict[str, Any] = {}
    args: dict[str, str] = {}
    for line in _logical_lines(path.read_text(encoding="utf-8")):
        word, _, rest = line.partition(" ")
        word, rest = word.upper(), rest.strip()
        if word == "ARG" and not stage:
            name, _, default = rest.partition("=")
            args[name] = default
        elif word == "FROM":
            parts = rest.split()
            base = _expand(parts[0], args)
            stage = dict(stages.get(base) or {"env": {"PATH": BASE_PATH}, "entrypoint": (), "cmd": (),
                                               "workdir": "/", "user": "root", "dirs": []})
            stage = {**stage, "env": dict(stage["env"]), "dirs": list(stage["dirs"])}
            if len(parts) >= 3 and parts[1].upper() == "AS":
                stages[parts[2]] = stage
        elif word == "ENV":
            for key, value in _env_pairs(rest):
                stage["env"][key] = _expand(value, stage["env"])
        elif word == "WORKDIR":
            stage["workdir"] = str(PurePosixPath(stage["workdir"]) / rest)
            stage["dirs"].append(stage["workdir"])
        elif word == "USER":
            stage["user"] = rest
        elif word == "ENTRYPOINT":
            stage["entrypoint"], stage["cmd"] = _exec_form(rest), ()
        elif word == "CMD":
            stage["cmd"] = _exec_form(rest)
        elif word == "COPY":
            stage["dirs"].append(rest.split()[-1])
        elif word == "RUN":
            stage["dirs"].extend(_run_dirs(rest))
    return ImageSpec(tuple(stage["entrypoint"]), tuple(stage["cmd"]), dict(stage["env"]), stage["workdir"],
                     stage["user"], tuple(dict.fromkeys(stage["dirs"])))


def _env_pairs(rest: str) -> list[tuple[str, str]]:
    words = shlex.split(rest)
    if words and "=" not in words[0]:  # the legacy `ENV KEY value`
        return [(words[0], " ".join(words[1:]))]
    return [tuple(w.split("=", 1)) for w in words]  # type: ignore[misc]


def _run_dirs(command: str) -> list[str]:
    """Directories a RUN line creates: a venv, a user's home, `mkdir -p`."""
    dirs = re.findall(r"-m venv\s+(\S+)", command)
    dirs += re.findall(r"--home-dir\s+(\S+)", command) if "--create-home" in command else []
    dirs += re.findall(r"mkdir\s+-p\s+(\S+)", command)
    return dirs


def console_script(name: str, pyproject: Path = PYPROJECT) -> str:
    """`module:function` of the `[project.scripts]` entry `name`."""
    section = re.search(r"^\[project\.scripts\]\s*$(.*?)(?=^\[|\Z)", pyproject.read_text(encoding="utf-8"),
                        flags=re.MULTILINE | re.DOTALL)
    entry = section and re.search(rf"^{re.escape(name)}\s*=\s*\"([\w.]+:[\w.]+)\"", section.group(1), re.MULTILINE)
    if not entry:
        raise ChartRunError([f"{pyproject}: no [project.scripts] entry {name!r}"])
    return entry.group(1)


def image_problems(docs: list[dict[str, Any]], image: ImageSpec, *, image_name: str = "rollstream") -> list[str]:
    """What the rollstream containers of `docs` need from the image that it does not give:
    its ENTRYPOINT is the `rollstream` program (a console script of this project, on the
    image's PATH) and every container runs it (no `command`) with arguments its parser
    takes; the pods run as the image's USER; no mount hides what the image installed; every
    absolute path in the args and environment is under a mount or in the image; and the
    variables naming a place to write (HOME, TMPDIR, *_HOME, *_CACHE_DIR) point under a
    writable mount (the root filesystem is read-only)."""
    from rollstream.cli import parser

    out = []
    if image.entrypoint[:1] != ("rollstream",):
        out.append(f"Dockerfile: ENTRYPOINT is {list(image.entrypoint)}, not the rollstream program")
    else:
        console_script("rollstream")
        venv_bins = [d + "/bin" for d in image.dirs if d + "/bin" in image.env.get("PATH", "").split(":")]
        if not venv_bins:
            out.append(f"Dockerfile: no virtualenv's bin/ (where `rollstream` is installed) is on the image's "
                       f"PATH {image.env.get('PATH')!r}")
    for workload, spec in _pod_specs(docs):
        for c in spec.get("containers") or []:
            if _image_kind(c.get("image", "")) != image_name:
                continue
            where = f"{workload} container {c['name']}"
            if c.get("command"):
                out.append(f"{where}: command: {c['command']} replaces the image's ENTRYPOINT {list(image.entrypoint)}")
            args = [re.sub(r"\$\((\w+)\)", "0", a) for a in c.get("args", image.cmd)]
            try:
                parser().parse_args(args)
            except SystemExit:
                out.append(f"{where}: args: `rollstream {' '.join(args)}` is not a command line the image's "
                           "rollstream accepts")
            out.extend(f"{where}: {p}" for p in _security_problems(spec, c, image))
            out.extend(f"{where}: {p}" for p in _mount_problems(spec, c, image))
    return out


def _security_problems(spec: Mapping[str, Any], c: Mapping[str, Any], image: ImageSpec) -> list[str]:
    uid, _, gid = image.user.partition(":")
    context = {**spec.get("securityContext", {}), **c.get("securityContext", {})}
    out = []
    for key, want in (("runAsUser", uid), ("runAsGroup", gid)):
        if want and str(context.get(key, want)) != want:
            out.append(f"securityContext.{key}: {context.get(key)} is not the image's USER {image.user}")
    return out


def _mount_problems(spec: Mapping[str, Any], c: Mapping[str, Any], image: ImageSpec) -> list[str]:
    """Mounts that hide what the image installed; absolute paths in the args and env under
    no mount and not in the image; places to write under no writable mount."""
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    mounts = {m["mountPath"]: m for m in c.get("volumeMounts") or []}
    out = []
    for path, mount in mounts.items():
        hidden = [d for d in (*image.dirs, *BASE_DIRS, "/etc") if d != image.workdir and _under(d, [path])]
        if hidden:
            out.append(f"volumeMounts[{mount['name']}].mountPath: {path} hides the image's {hidden[0]}")
    held = [*mounts, *image.dirs, *BASE_DIRS]
    given = [(f"args[{i}]", a) for i, a in enumerate(c.get("args") or [])]
    given += [(f"env[{e['name']}]", e["value"]) for e in c.get("env") or [] if e.get("value")]
    out += [f"{what}: {value} is under no mount and not in the image" for what, value in given
            if value.startswith("/") and " " not in value and not _under(value, held)]
    writable = [p for p, m in mounts.items() if not m.get("readOnly")
                and not {"configMap", "secret", "projected"} & set(volumes.get(m["name"], {}))]
    for e in c.get("env") or []:
        name, value = e["name"], e.get("value")
        if (value and value.startswith("/") and (name in ("HOME", "TMPDIR") or name.endswith(("_HOME", "_CACHE_DIR")))
                and not _under(value, writable)):
            out.append(f"env[{name}]: {value} is not under a writable mount (the root filesystem is read-only)")
    return out


def _under(path: str, prefixes: Iterable[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in prefixes)


# ------------------------------------------------------------------------------ manifests and pods


def _pod_specs(docs: Iterable[Mapping[str, Any]]) -> Iterable[tuple[str, Mapping[str, Any]]]:
    for d in docs:
        if d["kind"] in WORKLOAD_KINDS:
            spec = d["spec"] if d["kind"] == "Pod" else d["spec"]["template"]["spec"]
            yield f"{d['kind']}/{d['metadata']['name']}", spec


def _image_kind(image: str) -> str:
    """`rollstream`, `redis` (also valkey) or the image's name (which cannot run here)."""
    name = image.split("@")[0].rsplit("/", 1)[-1].split(":")[0]
    return "redis" if name in ("redis", "valkey") else name


def _is_hook(doc: Mapping[str, Any]) -> bool:
    hooks = doc["metadata"].get("annotations", {}).get("helm.sh/hook", "")
    return "test" in [h.strip() for h in hooks.split(",")]


@dataclass
class Pod:
    """One pod of a workload, with its local ports and the folder standing for its filesystem."""

    workload: str
    name: str
    labels: dict[str, str]
    annotations: dict[str, str]
    spec: dict[str, Any]
    root: Path
    hook: bool = False
    claims: dict[str, Path] = field(default_factory=dict)  # volumeClaimTemplate name -> folder
    ports: dict[int, int] = field(default_factory=dict)  # containerPort -> local port
    port_names: dict[str, int] = field(default_factory=dict)

    @property
    def grace_s(self) -> float:
        return float(self.spec.get("terminationGracePeriodSeconds", 30))


@dataclass
class Manifests:
    """The rendered objects by kind, and what runs no process."""

    secrets: dict[str, dict[str, bytes]]
    configmaps: dict[str, dict[str, bytes]]
    services: dict[str, dict[str, Any]]
    workloads: list[dict[str, Any]]
    replicas: dict[str, int]
    policies: list[dict[str, Any]]
    ignored: list[str]
    notes: list[str]


def index(docs: Iterable[dict[str, Any]], secrets: Iterable[dict[str, Any]], problems: Problems) -> Manifests:
    """The rendered objects and the given Secrets by kind; a kind no process can stand for
    and that cannot be left out is a problem."""
    m = Manifests({}, {}, {}, [], {}, [], [], [])
    for doc in [*secrets, *docs]:
        kind, name = doc["kind"], doc["metadata"]["name"]
        if kind == "Secret":
            m.secrets[name] = {**{k: base64.b64decode(v) for k, v in (doc.get("data") or {}).items()},
                               **{k: str(v).encode() for k, v in (doc.get("stringData") or {}).items()}}
        elif kind == "ConfigMap":
            m.configmaps[name] = {**{k: str(v).encode() for k, v in (doc.get("data") or {}).items()},
                                  **{k: base64.b64decode(v) for k, v in (doc.get("binaryData") or {}).items()}}
        elif kind == "Service":
            m.services[name] = doc
        elif kind in WORKLOAD_KINDS:
            m.workloads.append(doc)
        elif kind in IGNORED_KINDS:
            m.ignored.append(f"{kind}/{name}: {IGNORED_KINDS[kind]}")
            _autoscaled(doc, m)
            if kind == "NetworkPolicy":
                m.policies.append(doc)
        else:
            problems.add(f"{kind}/{name}", "", f"a {kind} cannot be run as local processes")
    return m


def _autoscaled(doc: Mapping[str, Any], m: Manifests) -> None:
    spec = doc.get("spec", {})
    if doc["kind"] == "HorizontalPodAutoscaler":
        m.replicas[spec["scaleTargetRef"]["name"]] = int(spec.get("minReplicas", 1))
    elif doc["kind"] == "ScaledObject":
        least = int(spec.get("minReplicaCount", 0))
        if least == 0:
            m.notes.append(f"ScaledObject/{doc['metadata']['name']}: minReplicaCount 0 (scaled on demand): "
                           "one replica runs")
        m.replicas[spec["scaleTargetRef"]["name"]] = max(1, least)


def expand_pods(m: Manifests, folder: Path) -> list[Pod]:
    """The pods of every workload, in the order rendered; each containerPort gets a free port."""
    pods = []
    for doc in m.workloads:
        kind, name = doc["kind"], doc["metadata"]["name"]
        workload = f"{kind}/{name}"
        if kind == "Pod":
            pods.append(Pod(workload, name, dict(doc["metadata"].get("labels", {})),
                            dict(doc["metadata"].get("annotations", {})), doc["spec"], folder / "pods" / name,
                            hook=_is_hook(doc)))
            continue
        template = doc["spec"]["template"]
        count = m.replicas.get(name, doc["spec"].get("replicas", 1))
        for i in range(count):
            pod_name = f"{name}-{i}"
            labels = dict(template["metadata"].get("labels", {}))
            if kind == "StatefulSet":
                labels.update({"apps.kubernetes.io/pod-index": str(i), "statefulset.kubernetes.io/pod-name": pod_name})
            else:
                labels["pod-template-hash"] = "local"
            pod = Pod(workload, pod_name, labels, dict(template["metadata"].get("annotations", {})),
                      template["spec"], folder / "pods" / pod_name)
            for claim in doc["spec"].get("volumeClaimTemplates", []) if kind == "StatefulSet" else []:
                claim_name = claim["metadata"]["name"]
                pod.claims[claim_name] = folder / "claims" / f"{claim_name}-{pod_name}"
            pods.append(pod)
    _assign_ports(pods)
    return pods


def _assign_ports(pods: list[Pod]) -> None:
    """A free local port for each declared containerPort, none given twice."""
    taken: set[int] = set()
    for pod in pods:
        for c in pod.spec.get("containers") or []:
            for p in c.get("ports") or []:
                port = free_port()
                while port in taken:
                    port = free_port()
                taken.add(port)
                pod.ports[int(p["containerPort"])] = port
                if p.get("name"):
                    pod.port_names[p["name"]] = int(p["containerPort"])


# ------------------------------------------------------------------------------ the network


@dataclass
class Target:
    """What a cluster DNS name reaches: a Service, one pod, or a local stand-in."""

    kind: str
    name: str
    service: dict[str, Any] | None = None
    pod: Pod | None = None
    ports: dict[int, int] = field(default_factory=dict)  # a stand-in's port -> local port


class Network:
    """Cluster DNS names and ports, mapped onto 127.0.0.1 and the pods' local ports. A
    StatefulSet pod has a name only under a headless Service (its `serviceName`) that
    selects it; every Service must select a pod and reach a declared port of it."""

    def __init__(self, m: Manifests, pods: list[Pod], *, namespace: str, domain: str,
                 stand_ins: Mapping[str, Mapping[int, int]], problems: Problems) -> None:
        self.pods = [p for p in pods if not p.hook]
        self.names: dict[str, Target] = {}
        self.edges: list[tuple[Pod, Pod, int]] = []  # who reaches which pod on which containerPort
        for name, svc in m.services.items():
            self._check_service(name, svc, problems)
            target = Target("service", name, service=svc)
            for n in (name, f"{name}.{namespace}", f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.{domain}"):
                self.names[n] = target
        for doc in m.workloads:
            if doc["kind"] == "StatefulSet":
                self._pod_names(doc, m, namespace, domain, problems)
        for host, ports in stand_ins.items():
            self.names[host] = Target("stand-in", host, ports=dict(ports))
        self.leftover = re.compile(rf"[\w-]+(?:\.[\w-]+)*\.svc(?:\.{re.escape(domain)})?\b|"
                                   rf"[\w-]+\.{re.escape(namespace)}\.svc\b")
        dotted = sorted((n for n in self.names if "." in n), key=len, reverse=True)
        short = sorted((n for n in self.names if "." not in n), key=len, reverse=True)
        alt = "|".join(map(re.escape, dotted)) or r"(?!x)x"
        self.dotted = re.compile(rf"(?<![\w.-])(?P<scheme>[a-z][a-z0-9+.-]*://)?(?P<host>{alt})"
                                 rf"(?![\w-]|\.[\w-])(?::(?P<port>\d+))?")
        alt = "|".join(map(re.escape, short)) or r"(?!x)x"
        self.short = re.compile(rf"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<host>{alt})(?![\w.-])(?::(?P<port>\d+))?|"
                                rf"(?<![\w.-])(?P<host2>{alt}):(?P<port2>\d+)(?!\d)")

    def _check_service(self, name: str, svc: Mapping[str, Any], problems: Problems) -> None:
        selected = self.selected(svc)
        if not selected:
            problems.add(f"Service/{name}", "spec.selector", "selects no pod")
        for entry in svc["spec"].get("ports") or []:
            wanted = entry.get("targetPort", entry["port"])
            for pod in selected:
                if _container_port(pod, wanted) is None:
                    problems.add(f"Service/{name}", f"spec.ports[{entry.get('name', entry['port'])}].targetPort",
                                 f"{wanted} is not a containerPort of {pod.workload}")

    def _pod_names(self, doc: Mapping[str, Any], m: Manifests, namespace: str, domain: str,
                   problems: Problems) -> None:
        workload, governing = f"StatefulSet/{doc['metadata']['name']}", doc["spec"].get("serviceName")
        svc = m.services.get(governing or "")
        pods = [p for p in self.pods if p.workload == workload]
        if svc is None or svc["spec"].get("clusterIP") != "None" or not set(map(id, pods)) <= set(
                map(id, self.selected(svc))):
            problems.add(workload, "spec.serviceName", f"{governing!r} is not a headless Service selecting its pods: "
                         "they have no DNS names")
            return
        for pod in pods:
            base = f"{pod.name}.{governing}"
            for n in (base, f"{base}.{namespace}", f"{base}.{namespace}.svc", f"{base}.{namespace}.svc.{domain}"):
                self.names[n] = Target("pod", pod.name, pod=pod)

    def selected(self, svc: Mapping[str, Any]) -> list[Pod]:
        selector = svc["spec"].get("selector") or {}
        return [p for p in self.pods if selector and all(p.labels.get(k) == v for k, v in selector.items())]

    def local_port(self, target: Target, port: int) -> tuple[int, Pod | None, int]:
        """The local port that `port` of `target` reaches, and the pod and containerPort
        behind it (none for a stand-in); raises LookupError saying why there is none."""
        if target.kind == "stand-in":
            if port not in target.ports:
                raise LookupError(f"{target.name}:{port}: the stand-in listens on {sorted(target.ports)}")
            return target.ports[port], None, port
        if target.kind == "pod":
            assert target.pod is not None
            if port not in target.pod.ports:
                raise LookupError(f"pod {target.pod.name} declares no containerPort {port}")
            return target.pod.ports[port], target.pod, port
        assert target.service is not None
        pods = self.selected(target.service)
        if not pods:
            raise LookupError(f"Service {target.name} selects no pod")
        spec = target.service["spec"]
        entry = next((p for p in spec.get("ports") or [] if int(p["port"]) == port), None)
        if entry is None and spec.get("clusterIP") != "None":
            raise LookupError(f"Service {target.name} has no port {port}")
        wanted = entry.get("targetPort", port) if entry else port
        for pod in pods:
            number = _container_port(pod, wanted)
            if number is not None:
                return pod.ports[number], pod, number
        raise LookupError(f"Service {target.name} port {port} targets {wanted}, which no pod it selects declares")


def _container_port(pod: Pod, port: int | str) -> int | None:
    number = pod.port_names.get(port) if isinstance(port, str) else int(port)
    return number if number in pod.ports else None


def _selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A label selector (matchLabels, matchExpressions) against `labels`; {} selects all."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        has, value, values = e["key"] in labels, labels.get(e["key"]), e.get("values") or []
        if not {"In": has and value in values, "NotIn": not has or value not in values,
                "Exists": has, "DoesNotExist": not has}[e["operator"]]:
            return False
    return True


def policy_problems(policies: Iterable[Mapping[str, Any]], edges: Iterable[tuple[Pod, Pod, int]],
                    namespace: str) -> list[str]:
    """The connections the pods make that the NetworkPolicies selecting their target do not
    let in (Ingress rules; the release's own namespace; no ipBlock matches a pod)."""
    out = []
    for src, dst, port in edges:
        applicable = [p for p in policies if _selects(p["spec"].get("podSelector"), dst.labels)
                      and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
        if applicable and not any(_lets_in(rule, src, dst, port, namespace)
                                  for p in applicable for rule in p["spec"].get("ingress") or []):
            names = ", ".join(p["metadata"]["name"] for p in applicable)
            out.append(f"{src.workload}: reaches {dst.workload} on port {port}, which NetworkPolicy {names} "
                       "does not let in")
    return list(dict.fromkeys(out))


def _lets_in(rule: Mapping[str, Any], src: Pod, dst: Pod, port: int, namespace: str) -> bool:
    names = {name for name, number in dst.port_names.items() if number == port}
    ports = rule.get("ports") or []
    if ports and not any(p.get("protocol", "TCP") == "TCP" and (p.get("port") is None or p["port"] == port
                                                               or p["port"] in names) for p in ports):
        return False
    peers = rule.get("from") or []
    ns_labels = {"kubernetes.io/metadata.name": namespace}
    return not peers or any(
        ("podSelector" in peer or "namespaceSelector" in peer)
        and ("namespaceSelector" not in peer or _selects(peer["namespaceSelector"], ns_labels))
        and ("podSelector" not in peer or _selects(peer["podSelector"], src.labels))
        for peer in peers)


# ------------------------------------------------------------------------------ rewriting one pod's strings


OWN_ADDR = re.compile(r"(?<![\w.:\]-])(?P<host>0\.0\.0\.0|127\.0\.0\.1|localhost|\[::1?\]):(?P<port>\d+)(?!\d)")
OWN_DIRECTIVE = re.compile(r"(?m)^(?P<lead>[ \t]*port[ \t]+)(?P<port>\d+)(?=[ \t]*$)")
OWN_FLAG = re.compile(r"(?<![\w-])(?P<lead>(?:-p|--port)(?:[ \t]+|=))(?P<port>\d+)(?!\d)")


class Rewriter:
    """A pod's view of the local machine, applied to one container's strings: its own ports,
    the cluster's names and its mount points (module docstring). Problems go to `problems`
    under `where`; `reached` collects the workloads its strings reach."""

    def __init__(self, pod: Pod, network: Network, prefixes: Iterable[str], where: str, problems: Problems) -> None:
        self.pod, self.network, self.where, self.problems = pod, network, where, problems
        self.reached: set[str] = set()
        mounts = sorted(set(prefixes), key=len, reverse=True)
        alt = "|".join(re.escape(p.rstrip("/")) for p in mounts if p != "/") or r"(?!x)x"
        self.paths = re.compile(rf"(?<![\w.~/:$-])(?:{alt})(?=/|$|[^\w.-])")
        self.prefixes = mounts

    def text(self, value: str, what: str) -> str:
        value = self._own_ports(value, what)
        value = self.network.dotted.sub(lambda m: self._host(m, what, m["host"], m["port"]), value)
        value = self.network.short.sub(lambda m: self._host(m, what, m["host"] or m["host2"],
                                                            m["port"] or m["port2"]), value)
        for left in self.network.leftover.findall(value):
            self.problems.add(self.where, what, f"names {left}, which no rendered Service or pod answers")
        return self.path(value)

    def path(self, value: str) -> str:
        """`value` with each path under a mount point moved under the pod's folder."""
        return self.paths.sub(lambda m: str(self.pod.root) + m.group(0), value)

    def _own_ports(self, value: str, what: str) -> str:
        def own(m: re.Match[str], lead: str) -> str:
            port = int(m["port"])
            if port not in self.pod.ports:
                self.problems.add(self.where, what, f"{m.group(0).strip()}: port {port} is not a containerPort of "
                                  f"the pod (it declares {sorted(self.pod.ports) or 'none'})")
                return m.group(0)
            return f"{lead}{self.pod.ports[port]}"

        value = OWN_ADDR.sub(lambda m: own(m, m["host"] + ":"), value)
        value = OWN_DIRECTIVE.sub(lambda m: own(m, m["lead"]), value)
        return OWN_FLAG.sub(lambda m: own(m, m["lead"]), value)

    def _host(self, m: re.Match[str], what: str, host: str, port: str | None) -> str:
        target = self.network.names[host]
        scheme = m.groupdict().get("scheme") or ""
        number = int(port) if port else DEFAULT_PORTS.get(scheme[:-3])
        if number is None:
            self.problems.add(self.where, what, f"names {host} without a port: cannot map it")
            return m.group(0)
        try:
            local = self._reach(target, number)
        except LookupError as exc:
            self.problems.add(self.where, what, str(exc))
            return m.group(0)
        return f"{scheme}127.0.0.1:{local}"

    def _reach(self, target: Target, port: int) -> int:
        local, pod, number = self.network.local_port(target, port)
        if pod is not None:
            self.reached.add(pod.workload)
            self.network.edges.append((self.pod, pod, number))
        return local

    def env_hosts(self, env: dict[str, str], fields: Mapping[str, str]) -> None:
        """`X_HOST`-style variables naming a cluster host become 127.0.0.1, and their `X_PORT`
        partner the local port; applied before `text` to every other value."""
        for name, value in list(env.items()):
            if value not in self.network.names:
                continue
            suffix = next((s for s in HOST_SUFFIXES if name.endswith(s)), "")
            partner = name[: len(name) - len(suffix)] + "_PORT"
            if not suffix or not env.get(partner, "").isdigit():
                self.problems.add(self.where, fields[name], f"names {value}, but no variable {partner} gives its "
                                  "port: cannot map it")
                continue
            try:
                local = self._reach(self.network.names[value], int(env[partner]))
            except LookupError as exc:
                self.problems.add(self.where, fields[partner], str(exc))
                continue
            env[name], env[partner] = "127.0.0.1", str(local)


# ------------------------------------------------------------------------------ one container


@dataclass
class Probe:
    """A startup or readiness probe, as a local check."""

    name: str
    describe: str
    check: Callable[[], bool]
    budget_s: float


@dataclass
class Container:
    """One container of one pod, as the local process that runs it."""

    pod: Pod
    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    probes: list[Probe]
    job: bool  # runs to completion (a trainer rank)
    reached: set[str]
    gpus: int = 0
    process: Process | None = None
    ready_s: float | None = None

    @property
    def label(self) -> str:
        return f"{self.pod.workload} pod {self.pod.name} container {self.name}"


@dataclass
class Context:
    """What planning a container needs besides its pod."""

    manifests: Manifests
    network: Network
    images: dict[str, tuple[ImageSpec, Path]]  # kind -> (spec, folder of its programs)
    namespace: str
    folder: Path
    problems: Problems
    notes: list[str]
    shared_env: dict[str, str]  # variables every rollstream container gets (the build cache)


def plan_container(pod: Pod, c: Mapping[str, Any], ctx: Context) -> Container | None:
    where = f"{pod.workload} container {c['name']}"
    kind = _image_kind(c.get("image", ""))
    if kind not in ctx.images:
        ctx.problems.add(where, "image", f"{c.get('image')}: no local stand-in (runs: the rollstream image, "
                         "built from this repository's Dockerfile, and redis/valkey)")
        return None
    image, programs = ctx.images[kind]
    mounts = _mounts(pod, c, where, ctx.problems)
    prefixes = [path for path, _, _ in mounts] + [d for d in image.dirs if d.startswith("/home") or d == image.workdir]
    rewriter = Rewriter(pod, ctx.network, prefixes, where, ctx.problems)
    files = _write_volumes(pod, mounts, rewriter, ctx, where)
    for d in prefixes:
        if not (pod.root / d.lstrip("/")).exists():
            (pod.root / d.lstrip("/")).mkdir(parents=True, exist_ok=True)
    raw, fields, secret = _env(pod, c, ctx, where)
    argv = _argv(c, image, raw, where, ctx.problems)
    given = " ".join([*argv, *raw.values()])  # the config files it is given: named in its args or env
    _check_paths([*((fields[k], v) for k, v in raw.items() if k not in secret),
                  *((f"args[{i}]", a) for i, a in enumerate(argv) if "\n" not in a and " " not in a),
                  *_config_paths({p: v for p, v in files.items() if p in given})],
                 prefixes, image, where, ctx.problems)
    env = _local_env(pod, image, programs, rewriter, raw, fields, secret, ctx, kind)
    argv = [rewriter.text(a, f"args[{i}]") for i, a in enumerate(argv)]
    if argv and argv[0].startswith("/") and not Path(argv[0]).exists():
        ctx.problems.add(where, "command", f"{argv[0]} does not exist here")
    probes = [p for p in (_probe(pod, c, name, env, rewriter, where, ctx.problems)
                          for name in ("startupProbe", "readinessProbe", "livenessProbe")) if p is not None]
    cwd = pod.root / image.workdir.lstrip("/")
    cwd.mkdir(parents=True, exist_ok=True)
    job = kind == "rollstream" and (c.get("args") or [None])[0] == "trainer"
    gpus = sum(int(v) for k, v in _resources(c).items() if k.endswith("/gpu"))
    return Container(pod, c["name"], argv, env, cwd, probes, job, rewriter.reached, gpus=gpus)


def _mounts(pod: Pod, c: Mapping[str, Any], where: str, problems: Problems) -> list[tuple[str, dict, dict]]:
    """(mountPath, mount, volume) of every mount the container has, its problems reported."""
    volumes = {v["name"]: v for v in pod.spec.get("volumes") or []}
    out: list[tuple[str, dict, dict]] = []
    for mount in c.get("volumeMounts") or []:
        what, path = f"volumeMounts[{mount['name']}].mountPath", mount["mountPath"]
        if not path.startswith("/"):
            problems.add(where, what, f"{path!r} is not an absolute path")
            continue
        if path in [p for p, _, _ in out]:
            problems.add(where, what, f"{path} is mounted twice")
            continue
        volume = volumes.get(mount["name"]) or ({"name": mount["name"], "claimTemplate": {}}
                                                if mount["name"] in pod.claims else None)
        if volume is None:
            problems.add(where, f"volumeMounts[{mount['name']}].name",
                         "no volume and no volumeClaimTemplate of that name")
            continue
        kind = next(iter(set(volume) - {"name"}), "?")
        if kind not in ("configMap", "secret", "emptyDir", "persistentVolumeClaim", "projected", "claimTemplate"):
            problems.add(where, f"volumes[{mount['name']}]", f"a {kind} volume cannot be mapped to a local process")
            continue
        out.append((path, mount, volume))
    return sorted(out, key=lambda e: e[0].count("/"))


def _write_volumes(pod: Pod, mounts: list[tuple[str, dict, dict]], rewriter: Rewriter, ctx: Context,
                   where: str) -> dict[str, bytes]:
    """Each volume's folder, linked at its mount path under the pod's root; returns the
    ConfigMap files written, as rendered (before rewriting)."""
    files: dict[str, bytes] = {}
    for path, mount, volume in mounts:
        name = volume["name"]
        if "persistentVolumeClaim" in volume:
            folder = ctx.folder / "claims" / volume["persistentVolumeClaim"]["claimName"]
        elif "claimTemplate" in volume:
            folder = pod.claims[name]
        else:
            folder = ctx.folder / "volumes" / pod.name / name
        if not folder.exists():
            folder.mkdir(parents=True)
            for source in _sources(volume):
                written = _write_source(folder, source, rewriter, ctx, where, f"volumes[{name}]")
                files.update({path if mount.get("subPath") else f"{path}/{k}": v for k, v in written.items()
                              if not mount.get("subPath") or k == mount["subPath"]})
        target = folder / mount["subPath"] if mount.get("subPath") else folder
        link = Path(str(pod.root) + path)
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to(target)
    return files


def _sources(volume: Mapping[str, Any]) -> list[tuple[str, dict]]:
    if "projected" in volume:
        return [(k, v) for s in volume["projected"].get("sources") or [] for k, v in s.items()]
    return [(k, v) for k, v in volume.items() if k in ("configMap", "secret")]


def _write_source(folder: Path, source: tuple[str, dict], rewriter: Rewriter, ctx: Context, where: str,
                  what: str) -> dict[str, bytes]:
    kind, spec = source
    if kind not in ("configMap", "secret"):
        ctx.problems.add(where, f"{what}.projected", f"a {kind} source cannot be mapped to a local process")
        return {}
    name = spec.get("name") if kind == "configMap" else spec.get("secretName", spec.get("name"))
    store = ctx.manifests.configmaps if kind == "configMap" else ctx.manifests.secrets
    data = store.get(name)
    if data is None:
        if not spec.get("optional"):
            ctx.problems.add(where, f"{what}.{kind}", f"{_kind_name(kind)} {name} is neither rendered nor given"
                             f"{' with --secrets' if kind == 'secret' else ''}")
        return {}
    written: dict[str, bytes] = {}
    items = spec.get("items") or [{"key": k, "path": k} for k in data]
    for item in items:
        if item["key"] not in data:
            ctx.problems.add(where, f"{what}.{kind}.items[{item['key']}]", _no_key(kind, name, item["key"], data))
            continue
        content = data[item["key"]]
        if kind == "configMap":
            written[item["path"]] = content
            content = _rewrite_file(content, rewriter, f"{name}/{item['key']}")
        path = folder / item["path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        path.chmod(item.get("mode", spec.get("defaultMode", 0o644)))
    return written


def _rewrite_file(content: bytes, rewriter: Rewriter, what: str) -> bytes:
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        return content
    return rewriter.text(text, what).encode("utf-8")


def _kind_name(kind: str) -> str:
    return {"configMap": "ConfigMap", "secret": "Secret"}[kind]


def _no_key(kind: str, name: str, key: str, data: Mapping[str, Any]) -> str:
    return f"{_kind_name(kind)} {name} has no key {key!r} (it has: {', '.join(sorted(data)) or 'none'})"


def _env(pod: Pod, c: Mapping[str, Any], ctx: Context, where: str) -> tuple[dict[str, str], dict[str, str], set[str]]:
    """The container's variables as the container sees them (`envFrom`, then `env` with
    `$(VAR)` expanded), the field each came from, and which came from a Secret."""
    env: dict[str, str] = {}
    fields: dict[str, str] = {}
    secret: set[str] = set()
    for i, source in enumerate(c.get("envFrom") or []):
        for kind in ("configMapRef", "secretRef"):
            if kind in source:
                short = "configMap" if kind == "configMapRef" else "secret"
                store = ctx.manifests.configmaps if short == "configMap" else ctx.manifests.secrets
                data = store.get(source[kind]["name"])
                if data is None and not source[kind].get("optional"):
                    ctx.problems.add(where, f"envFrom[{i}].{kind}", f"{_kind_name(short)} {source[kind]['name']} is "
                                     "neither rendered nor given")
                for key, value in (data or {}).items():
                    name = source.get("prefix", "") + key
                    env[name], fields[name] = value.decode("utf-8", "replace"), f"envFrom[{i}].{kind}"
                    if short == "secret":
                        secret.add(name)
    for e in c.get("env") or []:
        name, what = e["name"], f"env[{e['name']}]"
        fields[name] = what
        if "valueFrom" not in e:
            env[name] = _expand_vars(e.get("value", ""), env)
            continue
        value = _value_from(pod, e["valueFrom"], ctx, where, what)
        if value is not None:
            env[name] = value
            if "secretKeyRef" in e["valueFrom"]:
                secret.add(name)
    return env, fields, secret


def _expand_vars(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)`: a defined variable's value, `$$` a `$`, anything else as written."""
    return re.sub(r"\$\$|\$\((\w+)\)", lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value)


def _value_from(pod: Pod, source: Mapping[str, Any], ctx: Context, where: str, what: str) -> str | None:
    for kind, short in (("secretKeyRef", "secret"), ("configMapKeyRef", "configMap")):
        if kind in source:
            ref = source[kind]
            store = ctx.manifests.secrets if short == "secret" else ctx.manifests.configmaps
            data = store.get(ref["name"])
            if data is None:
                if not ref.get("optional"):
                    ctx.problems.add(where, f"{what}.valueFrom.{kind}.name", f"{_kind_name(short)} {ref['name']} is "
                                     f"neither rendered nor given{' with --secrets' if short == 'secret' else ''}")
                return None
            if ref["key"] not in data:
                if not ref.get("optional"):
                    ctx.problems.add(where, f"{what}.valueFrom.{kind}.key",
                                     _no_key(short, ref["name"], ref["key"], data))
                return None
            return data[ref["key"]].decode("utf-8", "replace")
    if "fieldRef" in source:
        value = _pod_field(pod, source["fieldRef"]["fieldPath"], ctx.namespace)
        if value is None:
            ctx.problems.add(where, f"{what}.valueFrom.fieldRef", f"{source['fieldRef']['fieldPath']} cannot be "
                             "given to a local process")
        return value
    ctx.problems.add(where, f"{what}.valueFrom", f"{', '.join(source)} cannot be given to a local process")
    return None


def _pod_field(pod: Pod, path: str, namespace: str) -> str | None:
    found = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if found:
        return (pod.labels if found.group(1) == "labels" else pod.annotations).get(found.group(2), "")
    return {"metadata.name": pod.name, "metadata.namespace": namespace, "metadata.uid": f"local-{pod.name}",
            "spec.nodeName": socket.gethostname(),
            "spec.serviceAccountName": pod.spec.get("serviceAccountName", "default"),
            "status.podIP": "127.0.0.1", "status.hostIP": "127.0.0.1", "status.podIPs": "127.0.0.1"}.get(path)


def _argv(c: Mapping[str, Any], image: ImageSpec, env: Mapping[str, str], where: str, problems: Problems) -> list[str]:
    """command + args as Kubernetes composes them with the image's ENTRYPOINT and CMD."""
    command, args = c.get("command"), c.get("args")
    if command is None and not image.entrypoint:
        problems.add(where, "command", "none given, and the image's entrypoint is not emulated here")
        return []
    if command is not None:
        argv = [*command, *(args or [])]
    else:
        argv = [*image.entrypoint, *(args if args is not None else image.cmd)]
    return [_expand_vars(a, env) for a in argv]


def _check_paths(values: Iterable[tuple[str, str]], prefixes: list[str], image: ImageSpec, where: str,
                 problems: Problems) -> None:
    """Absolute paths a process is given must be under a mount, or in the image."""
    held = [*prefixes, *image.dirs, *BASE_DIRS]
    for what, value in values:
        if value.startswith("/") and len(value) > 1 and not _under(value, held):
            problems.add(where, what, f"{value} is under no volume mount of the container and not in the image "
                         "(the root filesystem is read-only)")


def _config_paths(files: Mapping[str, bytes]) -> list[tuple[str, str]]:
    """(`file field.path`, value) of every string of the JSON and YAML files."""
    out: list[tuple[str, str]] = []

    def walk(node: Any, at: str, name: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{at}.{k}" if at else str(k), name)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{at}[{i}]", name)
        elif isinstance(node, str):
            out.append((f"{name} {at}", node))

    for name, content in files.items():
        if name.endswith((".json", ".yaml", ".yml")):
            try:
                walk(yaml.safe_load(content.decode("utf-8")), "", name)
            except (UnicodeDecodeError, yaml.YAMLError):
                continue
    return out


def _local_env(pod: Pod, image: ImageSpec, programs: Path, rewriter: Rewriter, raw: Mapping[str, str],
               fields: Mapping[str, str], secret: set[str], ctx: Context, kind: str) -> dict[str, str]:
    """The process's environment: the image's ENV (its PATH led by the folder of its programs),
    TMPDIR when /tmp is mounted, the build cache, then the container's variables mapped."""
    path = ":".join(str(programs) if p in image.dirs or any(p.startswith(d + "/") for d in image.dirs) else p
                    for p in image.env.get("PATH", BASE_PATH).split(":"))
    if str(programs) not in path.split(":"):
        path = f"{programs}:{path}"
    env = {**{k: rewriter.path(v) for k, v in image.env.items()}, "PATH": path, "HOSTNAME": pod.name}
    if "/tmp" in rewriter.prefixes:
        env["TMPDIR"] = str(pod.root) + "/tmp"
    if kind == "rollstream":
        env.update(ctx.shared_env)
    mapped = {k: v for k, v in raw.items() if k not in secret}  # a Secret's value is data: as it is
    rewriter.env_hosts(mapped, fields)
    for k, v in raw.items():
        env[k] = v if k in secret else mapped[k] if mapped[k] != v else rewriter.text(v, fields[k])
    return env


def _probe(pod: Pod, c: Mapping[str, Any], name: str, env: Mapping[str, str], rewriter: Rewriter, where: str,
           problems: Problems) -> Probe | None:
    """The container's probe `name` (httpGet, tcpSocket or exec) as a local check; its budget
    is what the kubelet allows: initialDelaySeconds + periodSeconds * failureThreshold."""
    spec = c.get(name)
    if not spec:
        return None
    timeout = float(spec.get("timeoutSeconds", 1))
    budget = float(spec.get("initialDelaySeconds", 0)) + float(spec.get("periodSeconds", 10)) * int(
        spec.get("failureThreshold", 3))
    if "exec" in spec:
        argv = [rewriter.text(a, f"{name}.exec.command") for a in spec["exec"]["command"]]
        return Probe(name, f"{name} exec {spec['exec']['command'][-1]!r}",
                     lambda: _exec(argv, env, pod.root, timeout), budget)
    action = spec.get("httpGet") or spec.get("tcpSocket")
    if action is None:
        problems.add(where, name, "only httpGet, tcpSocket and exec probes run here")
        return None
    number = _container_port(pod, action["port"])
    if number is None:
        problems.add(where, f"{name}.port", f"{action['port']} is not a containerPort of the pod")
        return None
    local = pod.ports[number]
    if "tcpSocket" in spec:
        return Probe(name, f"{name} tcp :{number}", lambda: _tcp(local, timeout), budget)
    path = action.get("path", "/")
    return Probe(name, f"{name} GET {path} :{number}", lambda: _http(f"http://127.0.0.1:{local}{path}", timeout),
                 budget)


def _http(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:  # noqa: S310 (a local http URL)
            return 200 <= reply.status < 400
    except (urllib.error.URLError, OSError):
        return False


def _tcp(port: int, timeout: float) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout):
            return True
    except OSError:
        return False


def _exec(argv: list[str], env: Mapping[str, str], cwd: Path, timeout: float) -> bool:
    try:
        return subprocess.run(argv, env=child_env(env, inherit_env=False), cwd=cwd, capture_output=True, timeout=timeout,
                              check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# ------------------------------------------------------------------------------ Redis: binaries and the stand-in


def _redis_major(binary: str) -> int:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=False).stdout
    except OSError:
        return 0
    found = re.search(r"v=(\d+)\.", out)
    return int(found.group(1)) if found else 0


def redis_programs(major: int, explicit: str | None = None) -> tuple[str, str]:
    """A redis-server of at least version `major` (`explicit`, else the first found) and
    the redis-cli beside it."""
    candidates = [explicit] if explicit else [*REDIS_SERVERS, shutil.which("redis-server")]
    seen = []
    for server in candidates:
        if not server or not Path(server).exists():
            continue
        found = _redis_major(server)
        seen.append(f"{server} ({found or '?'})")
        if found >= major:
            cli = Path(server).with_name("redis-cli")
            return server, str(cli) if cli.exists() else (shutil.which("redis-cli") or "redis-cli")
    raise ChartRunError([f"redis: no redis-server {major} or later here (found: {', '.join(seen) or 'none'}); "
                         "name one with --redis-server"])


def _image_major(image: str) -> int:
    found = re.search(r":(\d+)", image.split("@")[0].rsplit("/", 1)[-1])
    return int(found.group(1)) if found else 7


@dataclass
class RedisUser:
    password: str | None
    rules: list[str]
    roles: list[str]


class RedisStandIn:
    """A local Redis at the address of the external one the values name: its ACL users, TLS
    with a certificate of a CA made here, no persistence (module docstring)."""

    ADMIN = "chart-run-admin"

    def __init__(self, url: str, users: dict[str, RedisUser], server: str, folder: Path) -> None:
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        self.url, self.host, self.tls = url, parts.hostname or "", parts.scheme == "rediss"
        self.port = parts.port or 6379
        self.users, self.server, self.folder = users, server, folder
        self.local = free_port()
        self.admin_password = base64.b32encode(os.urandom(20)).decode().rstrip("=")
        self.process: Process | None = None
        self.ca: bytes | None = None
        folder.mkdir(parents=True, exist_ok=True)
        if self.tls:
            self.ca = self._certificates()

    def _certificates(self) -> bytes:
        def openssl(*args: str) -> None:
            try:
                subprocess.run(["openssl", *args], cwd=self.folder, check=True, capture_output=True, timeout=60)
            except (OSError, subprocess.CalledProcessError) as exc:
                raise ChartRunError([f"stand-in Redis: openssl {args[0]} failed ({exc}); TLS needs the "
                                     "openssl CLI"]) from None

        ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
        openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=chart-run CA")
        openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", f"/CN={self.host}")
        (self.folder / "san.ext").write_text(f"subjectAltName=DNS:{self.host},IP:127.0.0.1,DNS:localhost\n")
        openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", "server.crt", "-days", "2", "-extfile", "san.ext")
        return (self.folder / "ca.crt").read_bytes()

    def start(self, timeout_s: float = 20.0) -> None:
        listen = (["--port", "0", "--tls-port", str(self.local), "--tls-cert-file", "server.crt",
                   "--tls-key-file", "server.key", "--tls-ca-cert-file", "ca.crt", "--tls-auth-clients", "no"]
                  if self.tls else ["--port", str(self.local)])
        self.process = Process("redis", [self.server, "--bind", "127.0.0.1", *listen, "--dir", str(self.folder),
                                         "--save", "", "--appendonly", "no", "--requirepass", self.admin_password],
                               self.folder / "redis.log", cwd=self.folder, inherit_env=False)
        deadline = time.monotonic() + timeout_s
        while not self._answers():
            if not self.process.alive or time.monotonic() > deadline:
                raise ChartRunError([f"stand-in Redis for {self.url}: did not start: {self.process.output()[-1500:]}"])
            time.sleep(0.05)
        self._users()

    def _client(self, username: str | None, password: str) -> Any:
        import redis

        kw: dict[str, Any] = {"ssl": True, "ssl_ca_certs": str(self.folder / "ca.crt")} if self.tls else {}
        return redis.Redis(host="127.0.0.1", port=self.local, username=username, password=password,
                           socket_timeout=5, **kw)

    def _answers(self) -> bool:
        import redis

        try:
            with self._client(None, self.admin_password) as r:
                return bool(r.ping())
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
            return False

    def _users(self) -> None:
        with self._client(None, self.admin_password) as r:
            r.execute_command("ACL", "SETUSER", self.ADMIN, "on", f">{self.admin_password}", "~*", "&*", "+@all")
        with self._client(self.ADMIN, self.admin_password) as r:
            for name, user in self.users.items():
                secret = [f">{user.password}"] if user.password else ["nopass"]
                r.execute_command("ACL", "SETUSER", name, "reset", "on", *secret, *user.rules)
            if "default" not in self.users:
                r.execute_command("ACL", "SETUSER", "default", "off")

    def stop(self) -> int | None:
        return self.process.stop(10.0) if self.process is not None else None


def external_redis(values: Mapping[str, Any], m: Manifests, folder: Path, problems: Problems,
                   server: str) -> RedisStandIn | None:
    """The stand-in for `redis.external`, its users as docs/operations.md has the operator
    create them; the CA Secret the pods mount is added to `m`."""
    from pipeline.keys import Keys
    from pipeline.redis_io import acl_args

    redis_values = values["redis"]
    if redis_values.get("enabled"):
        return None
    ext = redis_values["external"]
    keys = Keys(values["run"]["namespace"])
    roles: dict[str, list[tuple[str, str | None]]] = {}
    for role in ("admission", "consumer", "trainer"):
        own = (ext.get("roles") or {}).get(role) or {}
        user = own.get("username") or ext.get("username") or "default"
        secret = own.get("existingSecret") or ext.get("existingSecret")
        key = own.get("existingSecretPasswordKey") or ext.get("existingSecretPasswordKey")
        roles.setdefault(user, []).append((role, _stand_in_password(m, secret, key, role, problems)))
    users = {}
    for user, entries in roles.items():
        passwords = {p for _, p in entries}
        names = [r for r, _ in entries]
        if len(passwords) > 1:
            problems.add("stand-in Redis", f"redis.external.roles ({', '.join(names)})",
                         f"give user {user} different passwords")
        users[user] = RedisUser(passwords.pop(), acl_args(keys, names[0] if len(names) == 1 else "run"), names)
    stand_in = RedisStandIn(ext["url"], users, server, folder / "stand-in-redis")
    if stand_in.tls:
        if not ext.get("tlsCaSecret"):
            problems.add("stand-in Redis", "redis.external.tlsCaSecret", "empty: the pods trust the system CAs, "
                         "which no local stand-in can satisfy")
        else:
            if ext["tlsCaSecret"] in m.secrets:
                m.notes.append(f"Secret {ext['tlsCaSecret']}: replaced by the stand-in's CA")
            m.secrets[ext["tlsCaSecret"]] = {ext.get("tlsCaKey", "ca.crt"): stand_in.ca or b""}
    return stand_in


def _stand_in_password(m: Manifests, secret: str | None, key: str | None, role: str,
                       problems: Problems) -> str | None:
    if not secret:
        return None
    field = f"redis.external.roles.{role} (or redis.external)"
    if secret not in m.secrets:
        problems.add("stand-in Redis", f"{field}.existingSecret", f"Secret {secret} is neither rendered nor given "
                     "with --secrets")
        return None
    if key not in m.secrets[secret]:
        problems.add("stand-in Redis", f"{field}.existingSecretPasswordKey", _no_key("secret", secret, str(key),
                                                                                     m.secrets[secret]))
        return None
    return m.secrets[secret][str(key)].decode()


# ------------------------------------------------------------------------------ the plan


@dataclass
class Plan:
    """Everything to run, in waves of workloads, and what is not run or not enforced."""

    containers: list[Container]
    hooks: list[Container]
    waves: list[list[str]]
    stand_in: RedisStandIn | None
    ignored: list[str]
    notes: list[str]
    folder: Path


def _programs(folder: Path, docs: list[dict[str, Any]], spec: ImageSpec, redis_server: str | None,
              problems: Problems) -> dict[str, tuple[ImageSpec, Path]]:
    """The images the containers name, each as its spec and a folder of its programs."""
    module, _, function = console_script(spec.entrypoint[0] if spec.entrypoint else "rollstream").partition(":")
    rollstream = folder / "images" / "rollstream" / "bin"
    rollstream.mkdir(parents=True, exist_ok=True)
    program = rollstream / (spec.entrypoint[0] if spec.entrypoint else "rollstream")
    program.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -c "
                       f"'import sys; from {module} import {function}; sys.exit({function}())' \"$@\"\n")
    program.chmod(0o755)
    images = {"rollstream": (spec, rollstream)}
    redis_images = [c.get("image", "") for _, s in _pod_specs(docs) for c in s.get("containers") or []
                    if _image_kind(c.get("image", "")) == "redis"]
    if redis_images:
        try:
            server, cli = redis_programs(max(map(_image_major, redis_images)), redis_server)
        except ChartRunError as exc:
            problems.add(f"image {redis_images[0]}", "", str(exc))
            return images
        bin_dir = folder / "images" / "redis" / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        for name, target in (("redis-server", server), ("redis-cli", cli)):
            (bin_dir / name).symlink_to(target)
        images["redis"] = (ImageSpec((), (), {"PATH": BASE_PATH}, "/data", "999", ()), bin_dir)
    return images


def plan(values: Mapping[str, Any], *, folder: Path, chart: Path = CHART, release: str = "rs",
         namespace: str = "default", secrets: Iterable[dict[str, Any]] = (), steps: int | None = 3,
         redis_server: str | None = None) -> Plan:
    """Render (with `trainer.config.steps` = `steps`), map every workload onto local
    processes and write their files under `folder`; raises ChartRunError with every
    problem found."""
    if steps is not None:
        values = merged(values, {"trainer": {"config": {"steps": steps}}})
    docs, effective = render(values, chart=chart, release=release, namespace=namespace)
    return plan_docs(docs, effective, folder=folder, namespace=namespace, secrets=secrets, redis_server=redis_server)


def plan_docs(docs: list[dict[str, Any]], values: Mapping[str, Any], *, folder: Path, namespace: str,
              secrets: Iterable[dict[str, Any]] = (), redis_server: str | None = None) -> Plan:
    """`plan` of rendered manifests and the values they were rendered with."""
    problems = Problems()
    image = read_dockerfile()
    problems.lines.extend(image_problems(docs, image))
    m = index(docs, secrets, problems)
    images = _programs(folder, docs, image, redis_server, problems)
    stand_in = None
    if not values["redis"].get("enabled"):
        try:
            stand_in = external_redis(values, m, folder, problems, redis_programs(7, redis_server)[0])
        except ChartRunError as exc:
            problems.lines.extend(f"stand-in Redis: {line}" for line in exc.problems)
    pods = expand_pods(m, folder)
    network = Network(m, pods, namespace=namespace, domain=values.get("clusterDomain", "cluster.local"),
                      stand_ins={stand_in.host: {stand_in.port: stand_in.local}} if stand_in else {},
                      problems=problems)
    cache = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions")
    ctx = Context(m, network, images, namespace, folder, problems, list(m.notes), {"TORCH_EXTENSIONS_DIR": cache})
    planned = []
    for pod in pods:
        if pod.spec.get("initContainers"):
            problems.add(pod.workload, "initContainers", "not run here")
        for c in pod.spec.get("containers") or []:
            container = plan_container(pod, c, ctx)
            if container is not None:
                planned.append(container)
            ctx.notes.extend(_resource_notes(pod, c))
    problems.lines.extend(policy_problems(m.policies, network.edges, namespace))
    problems.check()
    ctx.notes.append(_share_cores(planned))
    ctx.notes.append(allot_gpus(planned, gpus_here()))
    ctx.notes.append(f"TORCH_EXTENSIONS_DIR={cache} for the rollstream containers: DeepSpeed's compiled ops are "
                     "shared across the local pods (each trainer pod of a cluster compiles them into its /tmp)")
    if stand_in:
        ctx.notes.append(f"{stand_in.url}: a local stand-in on 127.0.0.1:{stand_in.local}"
                         f"{' (TLS, a CA made here)' if stand_in.tls else ''} with users "
                         + ", ".join(f"{n} ({'/'.join(u.roles)})" for n, u in stand_in.users.items()))
    services = [c for c in planned if not c.pod.hook]
    return Plan(services, [c for c in planned if c.pod.hook], waves(services), stand_in, m.ignored,
                list(dict.fromkeys(ctx.notes)), folder)


def _share_cores(containers: list[Container]) -> str:
    """OMP_NUM_THREADS for the containers that do not set it: this machine's cores shared
    among them, as the pods of a cluster would each have their own."""
    threads = max(1, (os.cpu_count() or 1) // max(1, len(containers)))
    for c in containers:
        c.env.setdefault("OMP_NUM_THREADS", str(threads))
    return (f"OMP_NUM_THREADS={threads} where a container sets none: {len(containers)} containers share "
            f"{os.cpu_count()} cores here")


def _resources(c: Mapping[str, Any]) -> dict[str, Any]:
    resources = c.get("resources") or {}
    return {**(resources.get("requests") or {}), **(resources.get("limits") or {})}


def _resource_notes(pod: Pod, c: Mapping[str, Any]) -> list[str]:
    extended = {k: v for k, v in _resources(c).items()
                if k not in ("cpu", "memory", "ephemeral-storage") and not k.endswith("/gpu")}
    if not extended:
        return []
    return [f"{pod.workload} container {c['name']}: resources {extended} are not enforced here"]


def gpus_here() -> int:
    """The GPUs `nvidia-smi -L` lists (0 without it)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def allot_gpus(containers: list[Container], available: int) -> str:
    """CUDA_VISIBLE_DEVICES of every container, as a device plugin would: each its own GPUs
    when there are enough for all of them, else none for any (a pod that could not be
    scheduled; with `device: auto` every trainer rank then runs on the CPU, none on a GPU
    while another has none)."""
    wanted = sum(c.gpus for c in containers)
    fits = 0 < wanted <= available
    first = 0
    for c in containers:
        c.env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(first, first + c.gpus))) if fits else ""
        first += c.gpus if fits else 0
    if not wanted:
        return f"GPUs: none asked for, none visible ({available} here)"
    return (f"GPUs: {wanted} asked for, {available} here: "
            + ("each container sees its own (CUDA_VISIBLE_DEVICES)" if fits
               else "none is visible to any container, so their device auto is the CPU"))


def waves(containers: list[Container]) -> list[list[str]]:
    """Workloads in start order: each after the workloads its strings reach (its own and
    cycles aside)."""
    deps: dict[str, set[str]] = {}
    for c in containers:
        deps.setdefault(c.pod.workload, set()).update(c.reached - {c.pod.workload})
    out, done = [], set()
    while len(done) < len(deps):
        ready = [w for w in deps if w not in done and deps[w] <= done] or [w for w in deps if w not in done]
        out.append(ready)
        done.update(ready)
    return out


# ------------------------------------------------------------------------------ running the plan


POLL_S = 0.1
"""How often a waiting loop looks at the processes and probes again."""


@dataclass
class Result:
    """A run that passed: what ran, what it showed, what was not run or not enforced."""

    lines: list[str]
    status: dict[str, Any] | None  # `rollstream status --json` once the trainer finished
    containers: list[Container]
    folder: Path


class Runner:
    """Starts the plan's waves, waits for readiness, the trainer and the `helm test` hook,
    then stops everything; any failure raises ChartRunError naming the workload."""

    def __init__(self, plan: Plan, timeout_s: float, say: Callable[[str], None] = lambda line: None) -> None:
        self.plan, self.say = plan, say
        self.deadline = time.monotonic() + timeout_s
        self.started = time.monotonic()
        self.running: list[Container] = []
        self.lines: list[str] = []
        (plan.folder / "logs").mkdir(parents=True, exist_ok=True)

    def note(self, line: str) -> None:
        self.lines.append(line)
        self.say(line)

    def run(self) -> Result:
        status = None
        try:
            if self.plan.stand_in is not None:
                self.plan.stand_in.start()
                self.note(f"stand-in Redis for {self.plan.stand_in.url} on 127.0.0.1:{self.plan.stand_in.local}")
            for wave in self.plan.waves:
                members = [c for c in self.plan.containers if c.pod.workload in wave]
                for c in members:
                    self._start(c)
                self._wait_ready(members)
            self._wait_jobs()
            status = self._status()
            for hook in self.plan.hooks:
                self._run_hook(hook)
        finally:
            codes = self._stop()
        bad = [f"{label}: exited {code} on SIGTERM (0 expected within terminationGracePeriodSeconds)"
               for label, code in codes.items() if code != 0]
        if bad:
            raise ChartRunError(bad)
        self.note(f"stopped: {len(codes)} processes exited 0 on SIGTERM")
        return Result(self.lines, status, self.running, self.plan.folder)

    def _start(self, c: Container) -> None:
        log = self.plan.folder / "logs" / f"{c.pod.name}.{c.name}.log"
        c.process = Process(c.name, c.argv, log, c.env, cwd=c.cwd, inherit_env=False)
        self.running.append(c)

    def _fail(self, c: Container, reason: str) -> ChartRunError:
        tail = c.process.output()[-3000:] if c.process is not None else ""
        return ChartRunError([f"{c.label}: {reason}" + (f"\n--- its output (last lines)\n{tail}" if tail else "")])

    def _watch(self, exempt: Iterable[Container] = ()) -> None:
        """Every long-running process still runs."""
        for c in self.running:
            if not c.job and c not in exempt and c.process is not None and not c.process.alive:
                raise self._fail(c, f"exited with {c.process.popen.returncode} while the chart was running")

    def _wait_ready(self, members: list[Container]) -> None:
        passed: dict[int, int] = {id(c): 0 for c in members}  # probes passed so far
        budget = {id(c): time.monotonic() + sum(p.budget_s for p in c.probes) for c in members}
        waiting = list(members)
        while waiting:
            self._watch(exempt=waiting)
            for c in list(waiting):
                assert c.process is not None
                if not c.process.alive and not (c.job and c.process.popen.returncode == 0 and c.ready_s):
                    raise self._fail(c, f"exited with {c.process.popen.returncode} before it was ready")
                while passed[id(c)] < len(c.probes) and c.probes[passed[id(c)]].check():
                    passed[id(c)] += 1
                if passed[id(c)] == len(c.probes):
                    c.ready_s = time.monotonic() - self.started
                    waiting.remove(c)
                    probes = ", ".join(p.describe for p in c.probes) or "no probes"
                    self.note(f"ready    {c.label} after {c.ready_s:.1f} s ({probes})")
                elif time.monotonic() > min(budget[id(c)], self.deadline):
                    probe = c.probes[passed[id(c)]]
                    raise self._fail(c, f"{probe.name} ({probe.describe}) did not pass within "
                                        f"{min(probe.budget_s, self.deadline - self.started):.0f} s")
            if waiting:
                time.sleep(POLL_S)

    def _wait_jobs(self) -> None:
        jobs = [c for c in self.running if c.job]
        while any(c.process is not None and c.process.alive for c in jobs):
            self._watch()
            if time.monotonic() > self.deadline:
                raise self._fail(next(c for c in jobs if c.process and c.process.alive),
                                 "did not finish its steps within the run's timeout")
            time.sleep(POLL_S)
        for c in jobs:
            assert c.process is not None
            code = c.process.popen.returncode
            if code != 0:
                raise self._fail(c, f"exited with {code} before finishing its steps")
            self.note(f"trained  {c.label}: its steps done, exit 0 after {time.monotonic() - self.started:.1f} s")

    def _status(self) -> dict[str, Any] | None:
        """`rollstream status --json` in the first admission pod (as `kubectl exec` would)."""
        admission = next((c for c in self.running if c.argv[1:2] == ["admission"] and c.process
                          and c.process.alive), None)
        if admission is None:
            return None
        config = admission.argv[admission.argv.index("--config") + 1]
        shards = len([c for c in self.running if c.pod.workload == admission.pod.workload])
        argv = [admission.argv[0], "status", "--config", config, "--shards", str(shards), "--json"]
        done = subprocess.run(argv, env=child_env(admission.env, inherit_env=False), cwd=admission.cwd,
                              capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            raise ChartRunError([f"{admission.label}: `rollstream status` exited {done.returncode}: "
                                 f"{done.stderr[-1500:]}"])
        status = json.loads(done.stdout)
        self.note(f"status   (rollstream status in {admission.pod.name}) published weights "
                  f"{status['published_version']}, rollout consumers alive {len(status['consumers_alive'])}, "
                  f"dead-lettered {status['dead_lettered']}")
        return status

    def _run_hook(self, hook: Container) -> None:
        self._start(hook)
        assert hook.process is not None
        while hook.process.alive:
            self._watch()
            if time.monotonic() > self.deadline:
                raise self._fail(hook, "the helm test hook did not finish within the run's timeout")
            time.sleep(POLL_S)
        code = hook.process.popen.returncode
        if code != 0:
            raise self._fail(hook, f"the helm test hook failed (exit {code})")
        last = (hook.process.output().strip().splitlines() or [""])[-1]
        self.note(f"passed   {hook.label} (helm test): exit 0, {last!r}")

    def _stop(self) -> dict[str, int]:
        """SIGTERM, the last wave first; each process gets its pod's grace period."""
        codes: dict[str, int] = {}
        groups = [[c for c in self.running if c.pod.hook]] + [
            [c for c in self.running if c.pod.workload in wave and not c.pod.hook]
            for wave in reversed(self.plan.waves)]
        for group in groups:
            alive = [c for c in group if c.process is not None and c.process.alive]
            for c in alive:
                assert c.process is not None
                c.process.signal(15)
            for c in alive:
                assert c.process is not None
                try:
                    codes[c.label] = c.process.wait(c.pod.grace_s)
                except subprocess.TimeoutExpired:
                    codes[c.label] = c.process.kill()
        for c in self.running:  # those that ended by themselves: reaped, their logs closed
            if c.process is not None and not c.process.alive:
                c.process.wait(1.0)
        if self.plan.stand_in is not None:
            self.plan.stand_in.stop()
        return codes


def run(values: Mapping[str, Any], *, folder: Path | None = None, timeout_s: float = 900.0,
        say: Callable[[str], None] = lambda line: None, **options: Any) -> Result:
    """Plan and run (module docstring). `folder` holds the pods' files and logs (a temporary
    one by default, removed when the run passes); `options` go to `plan`."""
    keep = folder is not None
    folder = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="chart-run-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        planned = plan(values, folder=folder, **options)
        say(f"chart-run: {len(planned.containers)} containers in {len(planned.waves)} waves, "
            f"{len(planned.hooks)} helm test hook(s); files and logs under {folder}")
        result = Runner(planned, timeout_s, say).run()
    except ChartRunError as exc:
        raise ChartRunError([*exc.problems, f"the pods' files and logs are under {folder}"]) from None
    result.lines.extend([f"not run  {line}" for line in planned.ignored] + [f"note     {n}" for n in planned.notes])
    if not keep:
        shutil.rmtree(folder, ignore_errors=True)
    return result


# ------------------------------------------------------------------------------ the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--values", "-f", action="append", default=[], metavar="FILE",
                   help="a values file (repeat for several, as helm -f)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a value, as helm --set")
    p.add_argument("--secrets", action="append", default=[], metavar="FILE",
                   help="YAML of the Secrets the values name that the chart does not create (existingSecret ...)")
    p.add_argument("--chart", default=str(CHART), help="the chart folder (default: this repository's)")
    p.add_argument("--release", default="rs", help="release name (default rs)")
    p.add_argument("--namespace", default="default", help="the release's Kubernetes namespace (default default)")
    p.add_argument("--steps", type=int, default=3, help="trainer.config.steps for this run (default 3)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="the whole run's limit (default 900)")
    p.add_argument("--out", help="keep the pods' files and logs in this folder (default: a temporary one, "
                                 "removed when the run passes)")
    p.add_argument("--redis-server", help="the redis-server that runs the chart's Redis image (default: the first "
                                          "of /usr/bin/redis-server and PATH's of the image's major version)")


def _values_from(args: argparse.Namespace) -> dict[str, Any]:
    """The values of `--values` and `--set`, rendered by helm-python-sdk, which must be there."""
    if importlib.util.find_spec("helm_python") is None:
        raise CommandError("needs helm-python-sdk (pip install -e '.[dev]'), which renders the chart")
    return load_values(args.values, args.set)


def add_alert_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--values", "-f", action="append", default=[], metavar="FILE",
                   help="a values file for the alerts' settings (monitoring.prometheusRule; repeat as helm -f)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a value, as helm --set")
    p.add_argument("--release", required=True,
                   help="the run's release label (with metrics_targets: the run's Redis namespace)")
    p.add_argument("--namespace", required=True, help="the run's namespace label")


def alert_rules_from_args(args: argparse.Namespace) -> int:
    """`rollstream alert-rules`: the chart's alerts for one run, a Prometheus rule file on stdout."""
    rules = alert_rules(_values_from(args), release=args.release, namespace=args.namespace)
    sys.stdout.write(yaml.safe_dump(rules, sort_keys=False))
    return 0


def run_from_args(args: argparse.Namespace) -> int:
    """`rollstream chart-run`: 0 when the run passed (what was not emulated is listed); a
    failure raises (`ChartRunError`, `ConfigError`), which the command reports in one line."""
    values = _values_from(args)
    result = run(values, folder=Path(args.out) if args.out else None, timeout_s=args.timeout_s, say=print,
                 chart=Path(args.chart), release=args.release, namespace=args.namespace,
                 secrets=secrets_from(args.secrets), steps=args.steps, redis_server=args.redis_server)
    for line in result.lines:
        if line.startswith(("not run", "note")):
            print(line)
    print("rollstream chart-run: passed")
    return 0
