"""A new user's start-up mistakes, each as the real command against a real Redis: one line
naming what to fix, exit code 2 (what was given cannot run) or 1 (it cannot run now), the
traceback only under `--log-level DEBUG`. And the reliability of the same first hour: the
trainer stops within seconds of SIGTERM while it waits for Redis, `rollstream engine`
follows its weights through a Redis outage and reports while it cannot, a Redis URL's
user is the one connected as, and `rollstream simulate --json | head` ends quietly.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline import wire
from pipeline.config import RedisConfig
from pipeline.keys import Keys
from pipeline.processes import Process, free_port
from pipeline.redis_io import connect
from producers.publishers import RedisPublisher
from producers.trainer_link import TaskWriter
from tests.conftest import ROOT
from tests.integration.servers import RedisServer, server_missing
from domain.model_config import TinyModelConfig
from domain.model import TinyTransformer

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180),
              pytest.mark.skipif(server_missing() is not None, reason=str(server_missing()))]

PASSWORD = "first-hour-password"
ROLLSTREAM = shutil.which("rollstream") or pytest.fail("the rollstream command is not installed (pip install -e .)")
ONE_LINE = re.compile(r"^rollstream [a-z]+: ")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A private redis-server that wants a password (the shared one has none)."""
    with RedisServer(tmp_path_factory.mktemp("redis"), "--requirepass", PASSWORD, password=PASSWORD) as s:
        yield s


def _env(password: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ROLLSTREAM_REDIS_PASSWORD"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    if password is not None:
        env["ROLLSTREAM_REDIS_PASSWORD"] = password
    return env


@dataclass
class Mistake:
    name: str
    args: list[str]
    code: int
    says: str  # a part of the one line
    password: str | None = PASSWORD

    def run(self, cwd: Path) -> tuple[int, str]:
        done = subprocess.run([ROLLSTREAM, *self.args], cwd=cwd, env=_env(self.password),
                              capture_output=True, text=True, timeout=120)
        return done.returncode, done.stdout + done.stderr


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return path.name


def _held_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


def test_each_start_up_mistake_is_one_line_and_an_exit_code(server, tmp_path):
    url, down = server.url, f"redis://127.0.0.1:{free_port()}/0"
    redis = f"redis: {{url: '{url}', namespace: first-hour}}\n"
    gone = f"redis: {{url: '{down}', namespace: first-hour}}\n"
    tiny = "trainer: {model: {kind: tiny}, device: cpu}\nsteps: 1\nmetrics_addr: 127.0.0.1:0\n"
    admission = _write(tmp_path / "admission.yaml", redis + "metrics_addr: 127.0.0.1:0\n")
    consumer = _write(tmp_path / "consumer.yaml", redis)
    trainer = _write(tmp_path / "trainer.yaml", redis + tiny)
    _write(tmp_path / "gone-admission.yaml", gone + "metrics_addr: 127.0.0.1:0\n")
    _write(tmp_path / "gone-consumer.yaml", gone)
    _write(tmp_path / "gone-trainer.yaml", gone + tiny)
    held, port = _held_port()
    _write(tmp_path / "port-admission.yaml", redis + f"metrics_addr: 127.0.0.1:{port}\n")
    _write(tmp_path / "typo.yaml", redis + tiny + "sheduler: {groups: 4}\n")
    _write(tmp_path / "section.yaml", "model: {kind: tiny}\noptimizer: {lr: 0.001}\nzero_stage: 1\n")
    _write(tmp_path / "args.yaml", redis + "source_args: {env: arithmetic}\n")
    _write(tmp_path / "broken.yaml", redis + "slots: [8\n")
    engine = f"http://127.0.0.1:{free_port()}"
    _write(tmp_path / "vllm.yaml", redis + tiny + f"publisher: {{kind: vllm, path: w, engines: ['{engine}'], retries: 0}}\n")
    wrong = "refused user 'default' (password from $ROLLSTREAM_REDIS_PASSWORD)"
    unreachable = f"cannot reach Redis at {down} (redis.url): "
    mistakes = [
        # a wrong or missing password (the server wants one): every process, before DeepSpeed
        Mistake("admission, wrong password", ["admission", "--config", admission], 2, wrong, "nope"),
        Mistake("consumer, wrong password", ["consumer", "--config", consumer], 2, wrong, "nope"),
        Mistake("trainer, wrong password", ["trainer", "--config", trainer], 2, wrong, "nope"),
        Mistake("trainer, no password", ["trainer", "--config", trainer], 2,
                "$ROLLSTREAM_REDIS_PASSWORD, which is unset: no password sent", None),
        # Redis down
        Mistake("status, Redis down", ["status", "--config", "gone-consumer.yaml"], 1, unreachable),
        Mistake("admission, Redis down", ["admission", "--config", "gone-admission.yaml"], 1, unreachable),
        Mistake("consumer, Redis down", ["consumer", "--config", "gone-consumer.yaml"], 1, unreachable),
        Mistake("trainer, Redis down", ["trainer", "--config", "gone-trainer.yaml"], 1, unreachable),
        Mistake("engine, Redis down", ["engine", "--port", "0", "--weights-redis", down], 1, unreachable),
        Mistake("trainer, its vLLM not there", ["trainer", "--config", "vllm.yaml"], 1,
                f"{engine}/server_info?config_format=json failed 1 time(s); last: ConnectError"),
        # a source that is not there, or arguments it does not take
        Mistake("a missing --source module", ["consumer", "--config", consumer, "--source", "my_agent:Source"], 2,
                "source: cannot import my_agent (ModuleNotFoundError: No module named 'my_agent'); it must be "
                "importable from the current folder or PYTHONPATH"),
        Mistake("--source with another source's arguments",
                ["consumer", "--config", "args.yaml", "--source", "consumers.sources.sleep:SleepSource"], 2,
                "source_args: consumers.sources.sleep:SleepSource does not take them: got an unexpected "
                "keyword argument 'env'"),
        # ports in use
        Mistake("a metrics port in use", ["admission", "--config", "port-admission.yaml"], 1,
                f"metrics_addr 127.0.0.1:{port}: cannot serve /metrics there: Address already in use"),
        Mistake("an engine port in use", ["engine", "--port", str(port)], 1,
                f"--host 127.0.0.1 --port {port}: cannot listen there: Address already in use"),
        # a model that is not there
        Mistake("a missing --model", ["engine", "--model", "./my-model.yaml", "--port", "0"], 2,
                "--model my-model.yaml: no such file or directory"),
        # config files
        Mistake("a mistyped field", ["trainer", "--config", "typo.yaml"], 2,
                "config typo.yaml: invalid RunConfig: sheduler: Extra inputs are not permitted "
                "(did you mean scheduler?)"),
        Mistake("a trainer: section as the file", ["trainer", "--config", "section.yaml"], 2,
                "model, optimizer, zero_stage: Extra inputs are not permitted here; they are fields of "
                "the trainer section: put them under `trainer:`"),
        Mistake("broken YAML", ["consumer", "--config", "broken.yaml"], 2,
                "config broken.yaml is not valid YAML: line 3, column 1: "),
    ]
    try:
        with ThreadPoolExecutor(6) as pool:
            outcomes = list(pool.map(lambda m: m.run(tmp_path), mistakes))
    finally:
        held.close()
    wrong_ones = []
    for mistake, (code, output) in zip(mistakes, outcomes):
        lines = output.strip().splitlines()
        one_line = len(lines) == 1 and ONE_LINE.match(lines[0]) and mistake.says in lines[0]
        if code != mistake.code or not one_line or "DeepSpeed" in output:
            wrong_ones.append(f"{mistake.name}: exit {code} (want {mistake.code}):\n{output[-2000:]}")
    assert wrong_ones == [], "\n\n".join(wrong_ones)


def test_log_level_debug_adds_the_traceback(tmp_path):
    config = _write(tmp_path / "consumer.yaml", f"redis: {{url: 'redis://127.0.0.1:{free_port()}/0'}}\n")
    quiet = subprocess.run([ROLLSTREAM, "status", "--config", config], cwd=tmp_path, env=_env(None),
                           capture_output=True, text=True, timeout=60)
    loud = subprocess.run([ROLLSTREAM, "--log-level", "DEBUG", "status", "--config", config], cwd=tmp_path,
                          env=_env(None), capture_output=True, text=True, timeout=60)
    assert quiet.returncode == loud.returncode == 1
    assert len(quiet.stderr.strip().splitlines()) == 1 and "Traceback" not in quiet.stderr
    assert "Traceback (most recent call last)" in loud.stderr and "ConnectionRefusedError" in loud.stderr
    assert loud.stderr.strip().splitlines()[-1] == quiet.stderr.strip()


def test_log_level_before_a_command_that_parses_its_own_options(tmp_path):
    """`demo`, `chaos` and `bench learn` parse their own options: a `--log-level` before
    them still sets the level (DEBUG adds the traceback), and a bad one is refused."""
    url = f"redis://127.0.0.1:{free_port()}/0"

    def demo(*before: str) -> subprocess.CompletedProcess:
        return subprocess.run([ROLLSTREAM, *before, "demo", "--redis", url, "--steps", "1"], cwd=tmp_path,
                              env=_env(None), capture_output=True, text=True, timeout=120)

    with ThreadPoolExecutor(3) as pool:
        quiet, loud, equals = pool.map(lambda before: demo(*before),
                                       [(), ("--log-level", "DEBUG"), ("--log-level=debug",)])
    assert quiet.returncode == loud.returncode == equals.returncode == 1, loud.stderr
    assert len(quiet.stderr.strip().splitlines()) == 1 and "Traceback" not in quiet.stderr
    for run in (loud, equals):
        assert "Traceback (most recent call last)" in run.stderr and "RedisUnreachable" in run.stderr
        assert run.stderr.strip().splitlines()[-1] == quiet.stderr.strip()
    helped = subprocess.run([ROLLSTREAM, "--log-level", "INFO", "bench", "learn", "--help"], cwd=tmp_path,
                            env=_env(None), capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: rollstream bench learn")
    bad = subprocess.run([ROLLSTREAM, "--log-level", "LOUD", "chaos"], cwd=tmp_path, env=_env(None),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--log-level LOUD: not a logging level" in bad.stderr


def test_simulate_json_into_head_ends_quietly(tmp_path):
    done = subprocess.run(["bash", "-o", "pipefail", "-c", f"{ROLLSTREAM} simulate --json --steps 500 | head -2"],
                          cwd=tmp_path, env=_env(None), capture_output=True, text=True, timeout=60)
    assert done.stderr == "" and len(done.stdout.splitlines()) == 2
    assert done.returncode == 1  # the writer's status once its reader left (pipefail), no traceback


def test_a_urls_user_is_the_one_connected_as(server, tmp_path):
    server.admin().execute_command("ACL", "SETUSER", "alice", "on", ">alice-pw", "~*", "+@all")
    config = _write(tmp_path / "c.yaml", f"redis: {{url: '{server.url.replace('://', '://alice@')}', "
                                         f"namespace: url-user}}\n")
    done = subprocess.run([ROLLSTREAM, "status", "--config", config, "--json"], cwd=tmp_path,
                          env=_env("alice-pw"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["namespace"] == "url-user"
    done = subprocess.run([ROLLSTREAM, "status", "--config", config], cwd=tmp_path, env=_env("not-alice-pw"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "refused user 'alice'" in done.stderr
    clash = _write(tmp_path / "clash.yaml", f"redis: {{url: '{server.url.replace('://', '://alice@')}', "
                                            f"username: bob}}\n")
    done = subprocess.run([ROLLSTREAM, "status", "--config", clash], cwd=tmp_path, env=_env("alice-pw"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "url names user 'alice' and username is 'bob'" in done.stderr


def test_a_source_beyond_the_models_vocabulary_stops_the_trainer_with_one_line_naming_vocab(tmp_path):
    """The distributed recipe with SleepSource (ids up to 1000) and the tiny model (64 ids):
    the trainer says what to set instead of an IndexError from the embedding."""
    with RedisServer(tmp_path / "redis") as redis_server:
        redis = f"redis: {{url: '{redis_server.url}', namespace: vocab, password_env: null}}\n"
        scheduler = "scheduler: {groups: 2, width: 64, rows: 4}\n"
        (tmp_path / "admission.yaml").write_text(redis + scheduler + "metrics_addr: 127.0.0.1:0\n")
        (tmp_path / "consumer.yaml").write_text(redis + "source_args: {prompt_tokens: 4, completion_tokens: 4}\n")
        (tmp_path / "trainer.yaml").write_text(redis + scheduler + "metrics_addr: 127.0.0.1:0\n"
                                               "trainer: {model: {kind: tiny}, device: cpu}\ndata: {batch_size: 2}\n")
        background = [Process(role, [ROLLSTREAM, role, "--config", f"{role}.yaml", *extra], tmp_path / f"{role}.log",
                              env=_env(None), cwd=tmp_path)
                      for role, extra in (("admission", []),
                                          ("consumer", ["--source", "consumers.sources.sleep:SleepSource"]))]
        try:
            done = subprocess.run([ROLLSTREAM, "trainer", "--config", "trainer.yaml"], cwd=tmp_path, env=_env(None),
                                  capture_output=True, text=True, timeout=150)
        finally:
            codes = [p.stop(15.0) for p in background]
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and codes == [0, 0], (done.stderr, [p.output() for p in background])
    assert re.fullmatch(r"rollstream trainer: step 0: the rows hold token id \d+, beyond the model's vocabulary of "
                        r"64 ids: .*SleepSource: source_args.vocab: 64\), and set vocab: 64 in the consumer and "
                        r"admission configs .*\(config trainer.yaml\)", lines[-1]), lines[-1]
    assert "Traceback" not in done.stderr and "IndexError" not in done.stderr


# ---------------------------------------------------------------------------- stops and outages


def _wait(condition, timeout_s: float, why: str, log: Process | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{why}\n{log.output()[-3000:] if log else ''}")
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_the_trainer_stops_within_seconds_of_a_signal_while_it_waits_for_redis(tmp_path, sig):
    with RedisServer(tmp_path / "redis") as redis_server:
        config = tmp_path / "trainer.yaml"
        config.write_text(
            f"redis: {{url: '{redis_server.url}', namespace: waits, password_env: null}}\n"
            "metrics_addr: 127.0.0.1:0\ntrainer: {model: {kind: tiny}, device: cpu}\n"
            "scheduler: {groups: 2, width: 64, rows: 2}\ndata: {batch_size: 2}\nsteps: 5\n")
        r = connect(RedisConfig(url=redis_server.url, namespace="waits", password_env=None))
        tasks = Keys("waits").tasks(0)
        trainer = Process("trainer", [ROLLSTREAM, "--log-level", "WARNING", "trainer", "--config", str(config)],
                          tmp_path / "trainer.log", env=_env(None), cwd=tmp_path)
        try:
            # no admission consumer: the trainer hands step 0 over and waits for its rows
            _wait(lambda: _handed_over(r, tasks), 120, "the trainer never handed its first step over", trainer)
            r.close()
            redis_server.stop()
            _wait(lambda: "Redis unavailable" in trainer.output(), 30, "the trainer did not notice", trainer)
            stopped = time.monotonic()
            trainer.signal(sig)
            code = trainer.wait(15.0)
            took = time.monotonic() - stopped
        finally:
            trainer.kill()
    lines = trainer.output().strip().splitlines()
    assert code == 1 and took < 10, (code, took, trainer.output()[-2000:])
    assert lines[-1].startswith("rollstream trainer: trainer 0: ") and "stopped while Redis was unreachable" in lines[-1]


def _handed_over(r, stream: str) -> bool:
    for _, fields in r.xrange(stream):
        try:
            if isinstance(wire.from_fields(fields, (wire.Open, wire.Registration, wire.Handover)), wire.Handover):
                return True
        except wire.SchemaError:
            continue
    return False


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _publish(r, keys: Keys, version: int) -> None:
    model = TinyTransformer(TinyModelConfig(seed=version).build())
    at = RedisPublisher(r, keys).load(model, version)
    TaskWriter(r, keys, 0).announce_weights(version, location=at.location, digest=at.digest, size=at.size)


def test_the_engine_follows_its_weights_through_a_redis_outage_and_reports_while_it_cannot(tmp_path):
    keys = Keys("engine-outage")
    with RedisServer(tmp_path / "redis") as redis_server:
        r = connect(RedisConfig(url=redis_server.url, namespace=keys.namespace, password_env=None))
        _publish(r, keys, 1)
        port = free_port()
        engine = Process("engine", [ROLLSTREAM, "engine", "--model", "tiny", "--port", str(port),
                                    "--weights-redis", redis_server.url, "--namespace", keys.namespace],
                         tmp_path / "engine.log", env=_env(None), cwd=tmp_path)
        health, metrics = f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{port}/metrics"
        try:
            _wait(lambda: _reachable(health) and json.loads(_get(health)[1])["weight_version"] == 1,
                  60, "the engine did not load version 1", engine)
            redis_server.stop()
            _wait(lambda: _get(health)[0] == 503, 30, "/health did not report the outage", engine)
            status, body = _get(health)
            report = json.loads(body)
            assert report["status"] == "stale" and report["weight_version"] == 1
            (weights,) = report["weights"]
            assert weights["source"] == "redis" and not weights["following"] and "Connection" in weights["error"]
            scraped = _get(metrics)[1]
            assert "rollstream_engine_weights_following 0.0" in scraped
            assert "rollstream_engine_weights_version 1.0" in scraped
            assert _get(f"http://127.0.0.1:{port}/v1/models")[0] == 200  # it keeps answering meanwhile
            redis_server.start()  # empty: nothing on disk
            r = connect(RedisConfig(url=redis_server.url, namespace=keys.namespace, password_env=None))
            _publish(r, keys, 2)
            _wait(lambda: json.loads(_get(health)[1])["weight_version"] == 2 and _get(health)[0] == 200,
                  30, "the engine did not follow again after the outage", engine)
            scraped = _get(metrics)[1]
            assert "rollstream_engine_weights_following 1.0" in scraped
            assert "rollstream_engine_weights_version 2.0" in scraped
            failures = re.search(r"^rollstream_engine_weights_failures_total (\S+)$", scraped, re.M)
            assert failures and float(failures.group(1)) >= 1
        finally:
            code = engine.stop(15.0)
    assert code == 0, engine.output()[-3000:]
    assert "cannot follow the run's weights" in engine.output() and "following the run's weights again" in engine.output()


def _reachable(url: str) -> bool:
    try:
        _get(url)
    except OSError:
        return False
    return True

