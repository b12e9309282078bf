"""The recipes of README.md and docs/*.md, followed as a new user would.

Every fenced command block (bash, sh, console; or a plain block that starts with a command)
and every config block (yaml, json) of the README and docs/ carries a mark, an HTML comment
on the line before its fence, and is checked by it:

- `<!-- recipe: NAME -->`: a command block that the test `test_NAME_recipe` runs line by
  line in a copy of `examples/` (`test_vllm_recipe` is in test_vllm.py, with the other
  tests of a real vLLM): `cd` moves, a line ending in `&` starts in the background
  (stopped with SIGTERM once the others are done: it must exit 0), any other line must exit
  0. The test substitutes a few strings, in the block and the copied files, and nothing
  else: the Redis URL and namespace (the test's), free ports for the documented ones, and
  fewer steps. Each substituted string must be there, so a recipe that changes is noticed.
- `<!-- file: PATH -->`: the block is the repository's file PATH, verbatim (the docs quote
  the examples instead of fragments).
- `<!-- config: MODEL -->`: the block validates as MODEL (a fragment of a config).
- `<!-- not run: WHY -->`: an illustration that cannot run here (Kubernetes, Docker, GPUs,
  several nodes), said why; kept rare.

Every config file under `examples/` validates, and the files of one example agree (the
namespace, the scheduler section, the vocabulary, the model). The recipes run against the
Redis server (one namespace each, deleted at the end), a few steps each.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from consumers.weights import RedisWeights, decode
from pipeline import wire
from pipeline.config import AdmissionConfig, ConsumerConfig, build, load
from pipeline.errors import CommandError
from pipeline.processes import Process, free_port
from pipeline.ready import expand
from tests.conftest import ROOT
from trainer.run_config import RunConfig, TrainerConfig
from trainer.main import batches
from domain.model import TinyTransformer
from rollstream.prometheus import Prometheus, api, panels, promql
from tests.integration.helpers import wait_until
from tests.integration.run_metrics import MEDIAN_S, SLOTS, scraped_run

pytestmark = [pytest.mark.redis, pytest.mark.timeout(240)]
SERVER = pytest.mark.parametrize("redis_url", ["server"], indirect=True)

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = ROOT / "examples"
CHECKED = {"bash", "sh", "shell", "console", "yaml", "yml", "json"}
COMMANDS = ("rollstream ", "python", "torchrun ", "deepspeed ", "helm ", "docker ", "kubectl ", "redis-", "pip ", "cd ")
MARK = re.compile(r"^<!--\s*(recipe|file|config|not run):\s*(.+?)\s*-->$")
RECIPES = {"demo", "local", "local_prometheus", "two_ranks", "harness", "hf_prompts", "chart_run", "vllm",
           "tune", "tune_prometheus", "tune_current"}
MODELS = {"RunConfig": RunConfig, "TrainerConfig": TrainerConfig, "AdmissionConfig": AdmissionConfig,
          "ConsumerConfig": ConsumerConfig}
DEFAULT_URL = "redis://127.0.0.1:6379/0"


@dataclass
class Block:
    doc: Path
    line: int  # of the opening fence, from 1
    lang: str
    text: str
    kind: str | None  # recipe, file, config, not run; None: unmarked
    arg: str = ""

    def __str__(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line} ({self.lang or 'plain'})"


def blocks() -> list[Block]:
    found = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        i = 0
        while i < len(lines):
            m = re.match(r"^```(\w*)\s*$", lines[i])
            if m is None:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            mark = MARK.match(lines[i - 1].strip()) if i > 0 else None
            found.append(Block(doc, i + 1, m.group(1), "\n".join(lines[i + 1:end]),
                               mark.group(1) if mark else None, mark.group(2) if mark else ""))
            i = end + 1
    return found


def needs_mark(block: Block) -> bool:
    first = block.text.lstrip().splitlines()[0] if block.text.strip() else ""
    return block.lang in CHECKED or (block.lang == "" and first.startswith(COMMANDS))


def recipe_block(name: str) -> Block:
    (block,) = [b for b in blocks() if b.kind == "recipe" and b.arg == name]
    return block


# ---------------------------------------------------------------------------- the marks


def test_every_command_and_config_block_is_run_quoted_validated_or_said_illustrative():
    unmarked = [str(b) for b in blocks() if needs_mark(b) and b.kind is None]
    assert unmarked == [], "mark each block (tests/integration/test_recipes.py docstring)"
    recipes = sorted(b.arg for b in blocks() if b.kind == "recipe")
    assert recipes == sorted(RECIPES), "each recipe block needs its test_<name>_recipe, once"
    assert all(b.arg for b in blocks() if b.kind == "not run"), "say why a block is not run"


def test_quoted_files_are_the_files():
    quoted = [b for b in blocks() if b.kind == "file"]
    assert quoted
    for block in quoted:
        assert (ROOT / block.arg).read_text().rstrip("\n") == block.text, f"{block} differs from {block.arg}"


def test_config_fragments_validate():
    for block in (b for b in blocks() if b.kind == "config"):
        data = json.loads(block.text) if block.lang == "json" else yaml.safe_load(block.text)
        build(MODELS[block.arg], data)


def _example_configs() -> dict[Path, object]:
    models = {"trainer": RunConfig, "admission": AdmissionConfig, "consumer": ConsumerConfig}
    return {path: load(models[path.stem], path) for path in sorted(EXAMPLES.glob("*/*.yaml"))}


def test_every_example_config_validates_and_the_files_of_an_example_agree():
    configs = _example_configs()
    assert {p.parent.name for p in configs} == {"local", "two-ranks", "harness", "hf-prompts", "gpu", "vllm"}
    for folder in {p.parent for p in configs}:
        trainer = configs[folder / "trainer.yaml"]
        others = [configs[p] for p in (folder / "admission.yaml", folder / "consumer.yaml") if p in configs]
        assert all(c.redis == trainer.redis for c in others), folder
        admission = configs.get(folder / "admission.yaml")
        if admission is not None:
            assert admission.scheduler == trainer.scheduler, folder
        model = trainer.trainer.model
        consumer = configs.get(folder / "consumer.yaml")
        if consumer is not None and model.kind == "tiny":
            assert consumer.vocab == admission.vocab == model.tiny.vocab, folder
            if "model_config" in consumer.source_args:  # the consumers sample the trainer's model
                assert consumer.source_args["model_config"] == model.tiny.model_dump(
                    include=set(consumer.source_args["model_config"])), folder


# ---------------------------------------------------------------------------- running a recipe


@dataclass
class Run:
    """A recipe being run: its copy of examples/, the output of its foreground commands."""

    tmp: Path
    cwd: Path
    outputs: list[str] = field(default_factory=list)
    background: list[Process] = field(default_factory=list)

    def logs(self) -> str:
        return "\n".join(f"--- {p.args[-1]}\n{p.output()[-3000:]}" for p in self.background)


def _commands(text: str) -> list[str]:
    """A block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if line:
            out.append(line)
    return out


def _substitute(text: str, subs: dict[str, str]) -> str:
    for old, new in subs.items():
        text = text.replace(old, new)
    return text


def _copy_examples(tmp: Path, subs: dict[str, str]) -> str:
    """examples/ copied under `tmp` (without what earlier runs left), with `subs` applied;
    returns all the text the substitutions could apply to."""
    shutil.copytree(EXAMPLES, tmp / "examples", ignore=shutil.ignore_patterns(
        "checkpoints", "model", "weights", "rollstream-demo", "steps*.jsonl", "__pycache__", "targets",
        "prometheus-data"))
    seen = []
    for path in (tmp / "examples").rglob("*"):
        if path.is_file() and path.suffix in (".yaml", ".py", ".jsonl"):
            text = path.read_text()
            seen.append(text)
            path.write_text(_substitute(text, subs))
    return "\n".join(seen)


@contextlib.contextmanager
def recipe(name: str, tmp: Path, subs: dict[str, str], timeout_s: float = 180.0) -> Iterator[Run]:
    """Run the recipe block `name` (the module docstring); yield once its foreground commands
    are done, with the background ones still running; stop those at exit."""
    block = recipe_block(name)
    copied = _copy_examples(tmp, subs)
    missing = [old for old in subs if old not in block.text and old not in copied]
    assert missing == [], f"{block}: the recipe no longer holds {missing}"
    run = Run(tmp, tmp)
    deadline = time.monotonic() + timeout_s
    try:
        for i, command in enumerate(_commands(_substitute(block.text, subs))):
            if command.startswith("cd "):
                run.cwd = (run.cwd / command[3:].strip()).resolve()
            elif command.endswith("&"):
                run.background.append(Process(f"bg{i}", ["bash", "-c", "exec " + command[:-1]],
                                              tmp / f"{i}.log", cwd=run.cwd))
            else:
                run.outputs.append(_foreground(run, command, deadline))
        yield run
    finally:
        codes = {p.args[-1]: p.stop(30.0) for p in run.background}
    assert all(code == 0 for code in codes.values()), (codes, run.logs())


def _foreground(run: Run, command: str, deadline: float) -> str:
    """Run `command`; it must exit 0, while every background process keeps running."""
    log = run.tmp / f"fg-{len(run.outputs)}.log"
    proc = Process("fg", ["bash", "-c", command], log, cwd=run.cwd)
    while proc.alive:
        died = [p.args[-1] for p in run.background if not p.alive]
        if died or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{command!r}: {'stopped: ' + str(died) if died else 'timed out'}\n"
                        f"{proc.output()[-3000:]}\n{run.logs()}")
        time.sleep(0.1)
    code = proc.wait(5.0)
    assert code == 0, f"{command!r} exited {code}:\n{proc.output()[-3000:]}\n{run.logs()}"
    return proc.output()


def free_ports(n: int) -> int:
    """The first of `n` consecutive free ports (`host:port+shard` binds port + shard)."""
    for _ in range(50):
        base = free_port()
        if all(_bindable(base + i) for i in range(1, n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def run_subs(redis_url: str, example: str, namespace: str, shards: int = 1, steps: int = 2) -> dict[str, str]:
    """What a recipe changes: the test's Redis and namespace, free metrics ports, `steps`."""
    return {DEFAULT_URL: redis_url, f"namespace: example-{example}": f"namespace: {namespace}",
            "127.0.0.1:9400+shard": f"127.0.0.1:{free_ports(shards)}+shard",
            "127.0.0.1:9500+rank": f"127.0.0.1:{free_ports(shards)}+rank",
            "trainer --config trainer.yaml": f"trainer --config trainer.yaml --steps {steps}"}


@contextlib.contextmanager
def watching(r, stream: str) -> Iterator[list[dict]]:
    """Every entry appended to `stream` while the block runs (before any trim removes it)."""
    seen: list[dict] = []
    stop = threading.Event()

    def read() -> None:
        last = "0"
        while not stop.is_set():
            for _, entries in r.xread({stream: last}, block=200) or []:
                for entry_id, fields in entries:
                    last = entry_id
                    seen.append(fields)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(5)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------- the recipes


def test_demo_recipe(tmp_path):
    """README: install and run the demo (the install is this environment's)."""
    subs = {"pip install torch==2.13.0 && pip install -e '.[dev]' && ": "",
            "rollstream demo": "rollstream demo --steps 2 --quiet"}
    with recipe("demo", tmp_path, subs) as run:
        pass
    assert len(records(run.cwd / "rollstream-demo" / "metrics.jsonl")) == 2


@SERVER
def test_local_recipe(tmp_path, redis_url, namespace, r):
    """README: the admission consumer, two rollout consumers and a trainer as processes on
    one machine, then `rollstream status`."""
    with recipe("local", tmp_path, run_subs(redis_url, "local", namespace)) as run:
        pass
    steps = records(run.cwd / "steps.jsonl")
    assert [s["step"] for s in steps] == [0, 1] and all(0 <= s["reward_mean"] <= 1 for s in steps)
    assert "rollout consumers alive: 2" in run.outputs[-1], run.outputs[-1]
    assert list((run.cwd / "targets").iterdir()) == []  # every process listed itself, then left


@SERVER
@pytest.mark.skipif(not Prometheus.available(), reason="no prometheus binary (Debian's prometheus package)")
def test_local_prometheus_recipe(tmp_path, redis_url, namespace, r):
    """docs/operations.md: the local example under a real Prometheus outside Kubernetes,
    which finds each process by the file it lists in targets/ (consumers on free ports too):
    its series carry the component, the run as release and the namespace the dashboard and
    the alerts select by; the trainer drops out as it exits, a consumer killed outright reads
    down and sets off the chart's RollstreamComponentDown, and nothing else stays listed."""
    url = f"http://127.0.0.1:{free_port()}"
    subs = {**run_subs(redis_url, "local", namespace), "127.0.0.1:9090": url.removeprefix("http://"),
            "--release example-local": f"--release {namespace}"}
    with recipe("local_prometheus", tmp_path, subs) as run:
        up = _wait_up(url, namespace, ["admission", "consumer", "consumer"])
        listed = _listed(run.cwd / "targets")  # the trainer's entry left with it
        assert {s["metric"]["instance"]: s["metric"]["component"] for s in up} == {
            target: labels["component"] for target, labels in listed.items()}
        assert all(labels["release"] == namespace for labels in listed.values())
        builds = _panel("Builds")
        assert {s["metric"]["component"] for s in api(url, "query", {"query": promql(
            builds, namespace="local", release=namespace)})} == {"admission", "consumer"}
        assert api(url, "query", {"query": promql(builds, namespace="local", release="another")}) == []

        extra = Process("extra", ["rollstream", "consumer", "--config", "consumer.yaml"], tmp_path / "extra.log",
                        cwd=run.cwd)
        try:
            _wait_up(url, namespace, ["admission", "consumer", "consumer", "consumer"])
            (killed,) = set(_listed(run.cwd / "targets")) - set(listed)
        finally:
            extra.kill()  # no chance to take its entry away: its target reads down
        down = {"alertname": "RollstreamComponentDown", "alertstate": "pending", "instance": killed,
                "component": "consumer", "namespace": "local", "release": namespace}
        _wait_query(url, f'ALERTS{{release="{namespace}"}}', lambda found: any(
            down.items() <= s["metric"].items() for s in found))
        with urllib.request.urlopen(f"{url}/api/v1/alerts", timeout=10) as reply:
            alerts = json.load(reply)["data"]["alerts"]
        assert f"rollstream consumer {killed} cannot be scraped" in {
            a["annotations"]["summary"] for a in alerts if a["labels"].get("instance") == killed}
        assert set(_listed(run.cwd / "targets")) - set(listed) == {killed}
        (run.cwd / "targets").joinpath(f"consumer-{killed.replace(':', '-')}.json").unlink()  # handled
    assert list((run.cwd / "targets").iterdir()) == []


def _listed(folder: Path) -> dict[str, dict]:
    """Each listed target's labels, by its address."""
    entries = [json.loads(p.read_text()) for p in folder.glob("*.json")]
    return {entry["targets"][0]: entry["labels"] for [entry] in entries}


def _panel(title: str) -> str:
    (panel,) = [p for p in panels() if p.title == title]
    return panel.targets[0][0]


def _wait_up(url: str, release: str, components: list[str]) -> list[dict]:
    """The `up` series of `release` once exactly `components` (one per target) are scraped up."""
    return _wait_query(url, f'up{{job="rollstream", namespace="local", release="{release}"}} == 1',
                       lambda up: sorted(s["metric"]["component"] for s in up) == components)


def _wait_query(url: str, query: str, done: Callable[[list[dict]], bool], timeout_s: float = 60.0) -> list[dict]:
    """The result of `query` once `done` says so, polled until `timeout_s`."""
    found: list[dict] = []

    def holds() -> bool:
        nonlocal found
        try:
            found = api(url, "query", {"query": query})
        except CommandError:  # not answering yet: it starts in the background beside the run
            return False
        return done(found)

    wait_until(holds, timeout_s, query)
    return found


@SERVER
def test_two_ranks_recipe(tmp_path, redis_url, namespace, r, keys):
    """docs/scale.md on one machine: two admission shards and two trainer ranks under ZeRO-3,
    each from one file (their metrics ports derived from the shard and the rank); each rank
    trains its own shard's tasks and rank 0 publishes the whole model."""
    with recipe("two_ranks", tmp_path, run_subs(redis_url, "two-ranks", namespace, shards=2)) as run:
        pass
    config = load(RunConfig, run.cwd / "trainer.yaml")
    assert config.trainer.zero_stage == 3
    for rank in (0, 1):
        steps = records(run.cwd / f"steps-{rank}.jsonl")
        assert [s["step"] for s in steps] == [0, 1] and all(s["shard"] == rank for s in steps)
        for s in steps:  # every task of the rank's own batch share, once
            batch = next(batches(config.data, rank, 2, start=s["step"]))["task_id"]
            assert sorted(s["tasks"], key=int) == [str(t) for t in batch]
        # the push is agreed: both ranks push version 1 at step 1; rank 0 publishes
        assert [s["pushed"] for s in steps] == [None, 1] and all(s["publisher"] == (rank == 0) for s in steps)
    # what rank 0 published is the whole model, gathered from both ranks' halves
    published = RedisWeights(r, keys)
    tensors = decode(*published.fetch(1), 1, published.location(1))
    TinyTransformer(config.trainer.model.tiny.build()).load_state_dict(tensors, strict=True)


@SERVER
def test_harness_recipe(tmp_path, redis_url, namespace, r):
    """docs/harness.md: engine, gateway, admission, a consumer running a command harness
    (examples/harness/agent.py, imported verifier from the current folder), the trainer."""
    engine, gateway = free_port(), free_port()
    subs = {**run_subs(redis_url, "harness", namespace),
            "--port 8001": f"--port {engine}", "127.0.0.1:8001": f"127.0.0.1:{engine}",
            "--port 8000": f"--port {gateway}", "127.0.0.1:8000": f"127.0.0.1:{gateway}"}
    with recipe("harness", tmp_path, subs) as run:
        with urllib.request.urlopen(f"http://127.0.0.1:{engine}/health", timeout=10) as reply:
            health = json.load(reply)
    steps = records(run.cwd / "steps.jsonl")
    assert [s["step"] for s in steps] == [0, 1]
    assert health["weights"][0]["following"] and health["weight_version"] >= 1  # it loaded a push


@SERVER
def test_hf_prompts_recipe(tmp_path, redis_url, namespace, r, keys):
    """docs/trainer.md: a Hugging Face model directory trained on a prompt file with its own
    tokenizer; the consumer samples the same directory."""
    transformers = pytest.importorskip("transformers")
    with watching(r, keys.ready(0)) as readies, \
            recipe("hf_prompts", tmp_path, run_subs(redis_url, "hf", namespace)) as run:
        pass
    steps = records(run.cwd / "steps.jsonl")
    assert [s["step"] for s in steps] == [0, 1]
    model_dir = run.cwd / "model"
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    # every trained chain's prompt is <s> and a line of the file in the model's own ids
    prompts = records(run.cwd / "prompts.jsonl")
    expected = {tuple([tokenizer.bos_token_id, *tokenizer.encode(p["prompt"], add_special_tokens=False)])
                for p in prompts}
    seen = 0
    for fields in readies:
        a = expand(wire.from_fields(fields, wire.Ready).arrays)
        for row in range(a["tokens"].shape[0]):
            for segment in set(a["segments"][row].tolist()) - {0}:  # 0: padding
                at = (a["segments"][row] == segment) & ~a["loss_mask"][row]
                assert tuple(a["tokens"][row][at].tolist()) in expected
                seen += 1
    assert seen >= len(steps) * 4 * 8  # batch_size x groups
    # the pushed version is the whole model: it loads strictly into the directory's model
    published = RedisWeights(r, keys)
    tensors = decode(*published.fetch(1), 1, published.location(1))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    model.load_state_dict(tensors, strict=True)


def _tuned(output: str, max_lag: int) -> dict:
    """The scheduler fields `rollstream tune` printed last; they validate as a scheduler."""
    last = output.strip().splitlines()[-1]
    assert last.startswith("  scheduler: "), output[-2000:]
    fields = json.loads(last.removeprefix("  scheduler: "))
    assert fields["admission"] == "stream" and fields["max_lag"] == max_lag
    build(AdmissionConfig, {"redis": {"url": DEFAULT_URL}, "scheduler": fields})
    return fields


def test_tune_recipe(tmp_path):
    """docs/operations.md: the stream setting for a workload given by hand (fewer steps)."""
    subs = {"--train-ms 30000": "--train-ms 30000 --steps 3 --seeds 1"}
    with recipe("tune", tmp_path, subs) as run:
        pass
    assert "sessions log-normal (median 40000 ms, shape 1.08)" in run.outputs[-1], run.outputs[-1]
    assert _tuned(run.outputs[-1], 2)["batch_size"] == 64


def test_tune_current_recipe(tmp_path):
    """docs/operations.md: the pick against the local example's own setting (fewer steps);
    the workload's group and step sizes and max_lag are the example trainer's."""
    subs = {"--slots 16": "--slots 16 --steps 3 --seeds 1"}
    with recipe("tune_current", tmp_path, subs) as run:
        pass
    out = run.outputs[-1]
    assert "workload: 16 slots, groups of 16, 8 groups a step" in out and "max_lag 1" in out, out
    assert "the run's own setting (row current): the scheduler section of examples/local/trainer.yaml" in out
    assert re.search(r"^[ *]current +\d", out, re.M)
    if out.strip().endswith("keep its scheduler section"):  # the example's own setting did best
        assert re.search(r"^\*current ", out, re.M)
    else:
        assert "against the run's own setting (--current): share " in out
        _tuned(out, 1)


@pytest.mark.skipif(not Prometheus.available(), reason="no prometheus binary (Debian's prometheus package)")
def test_tune_prometheus_recipe(tmp_path):
    """docs/operations.md: the same, the workload read from a run's Prometheus (a real one,
    scraping real /metrics endpoints fed known sessions, labelled as the chart's monitors
    label release rs in namespace rl, beside another release's; fewer steps)."""
    with scraped_run(tmp_path / "prometheus", runs={"rs": MEDIAN_S, "rs-other": 4 * MEDIAN_S}) as fed:
        subs = {"http://prometheus:9090": f"{fed.url} --window 5m --steps 3 --seeds 1"}
        with recipe("tune_prometheus", tmp_path, subs) as run:
            pass
    assert f"read from {fed.url} over 5m: " in run.outputs[-1], run.outputs[-1]
    assert f"workload: {sum(SLOTS)} slots" in run.outputs[-1]
    median = re.search(r"over 5m: \d+ sessions \(\d+ cut short\), median ([\d.]+) ms", run.outputs[-1])
    assert float(median[1]) == pytest.approx(MEDIAN_S * 1000, rel=0.1)  # release rs's sessions alone
    _tuned(run.outputs[-1], 2)


def test_chart_run_recipe(tmp_path):
    """docs/operations.md: the chart's workloads with its default values as local processes
    (their own Redis, not the test's; tests/integration/test_chart_run.py checks what ran)."""
    from rollstream.chart_run import ChartRunError, redis_programs

    try:
        redis_programs(7)
    except ChartRunError as exc:
        pytest.skip(str(exc))
    with recipe("chart_run", tmp_path, {}) as run:
        pass
    assert run.outputs[-1].splitlines()[-1] == "rollstream chart-run: passed", run.outputs[-1]
