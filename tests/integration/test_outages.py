"""Connection loss: the pipeline survives restarts of its Redis server (a private
redis-server with an fsync-always AOF, restarted on the same port and dir mid-run), and
gives up with a clear error once Redis stays away for `reconnect_s`."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import redis as redis_lib

from consumers.admission import Admission
from consumers.sources.scripted import ScriptedSource
from pipeline.config import AdmissionConfig, RedisConfig, build
from pipeline.keys import WORK_GROUP, Keys
from pipeline.redis_io import RedisUnavailable, connect
from tests.conftest import Threads
from tests.integration.helpers import Trainer, admitted_tasks
from tests.integration.servers import RedisServer, server_missing

pytestmark = [pytest.mark.redis,
              pytest.mark.skipif(server_missing() is not None, reason=str(server_missing()))]

SCHEDULER = {"groups": 2, "rows": 8, "width": 64}
STEPS = 6
TASKS = 3


@pytest.fixture
def server(tmp_path):
    with RedisServer(tmp_path / "redis", "--appendonly", "yes", "--appendfsync", "always") as s:
        yield s


@pytest.mark.timeout(180)
def test_the_pipeline_survives_redis_restarts_and_admits_every_group_once(server):
    keys = Keys("outage")
    config = RedisConfig(url=server.url, namespace=keys.namespace, password_env=None,
                         socket_timeout_s=5, reconnect_s=30)
    threads = Threads(config)
    try:
        admission = threads.admission(block_ms=50, lease_s=10, trim_every_s=0.2, snapshot_every=7,
                                      scheduler=SCHEDULER)
        source = ScriptedSource(default={"duration_s": 0.15})
        consumers = [threads.consumer(source, slots=3, block_ms=50, lease_s=10, grace_s=2)
                     for _ in range(2)]
        trainer = Trainer(connect(config), keys, tasks=TASKS)
        trainer.open()
        for step in range(STEPS):
            trainer.handover()
            if step in (2, 4):  # sessions are running: their results are published after it
                time.sleep(0.1)
                server.stop()
                time.sleep(0.2 if step == 2 else 1.0)
                server.start()
                trainer.writer.r = connect(config)  # the trainer's appends are not retried
            trainer.wait(timeout_s=60)
    finally:
        threads.stop_all()
    assert not threads.errors, threads.errors

    readies = trainer.readies
    assert [ready.step for ready in readies] == list(range(STEPS))
    assert all(ready.error is None for ready in readies)
    admitted = admitted_tasks(readies)
    assert Counter(admitted) == Counter(f"t{b}.{i}" for b in range(STEPS) for i in range(TASKS)), \
        "every group admitted exactly once"
    assert admission.stats["reconnects"] >= 2
    # results finished during an outage were published after it (a consumer whose slots
    # were all busy may not need a new client: its pool reconnects by itself)
    assert sum(c.stats["publish_retries"] + c.stats["reconnects"] for c in consumers) >= 1
    r = connect(config)
    assert r.xlen(keys.dead) == 0
    assert r.xpending(keys.work, WORK_GROUP)["pending"] == 0, "every work entry acknowledged"
    # the snapshot and journal in Redis reproduce the machine the admission consumer ran
    again = Admission(build(AdmissionConfig, {"redis": config.model_dump(), "scheduler": SCHEDULER}), r)
    assert again.sched.snapshot() == admission.sched.snapshot()


@pytest.mark.timeout(30)
def test_a_consumer_gives_up_with_a_clear_error_once_redis_stays_away(server):
    config = RedisConfig(url=server.url, namespace="gone", password_env=None, socket_timeout_s=2,
                         reconnect_s=1.0)
    admission = Admission(build(AdmissionConfig, {"redis": config.model_dump(), "block_ms": 50,
                                                  "scheduler": SCHEDULER}), connect(config))
    server.stop()
    stop = threading.Event()
    started = time.monotonic()
    with pytest.raises(RedisUnavailable, match=r"admission shard 0: Redis unreachable for .*reconnect_s=1"):
        admission.run(stop)
    assert time.monotonic() - started < 5


@pytest.mark.timeout(30)
def test_a_result_whose_exec_reply_was_lost_is_not_appended_twice(server, monkeypatch):
    """The EXEC applies but its reply is lost: the retry finds the work entry acknowledged
    and does not publish again."""
    from consumers import rollout
    from consumers.rollout import RolloutConsumer, _Owned, _Publication
    from pipeline import wire
    from pipeline.config import ConsumerConfig
    from pipeline.sessions import Task

    keys = Keys("lost-reply")
    config = RedisConfig(url=server.url, namespace=keys.namespace, password_env=None, socket_timeout_s=5)
    r = connect(config)
    consumer = RolloutConsumer(build(ConsumerConfig, {"redis": config.model_dump()}),
                               ScriptedSource(), r, name="c")
    r.xgroup_create(keys.work, WORK_GROUP, id="0", mkstream=True)
    work = wire.Work(0, 0, 1, 0, 0, Task("t"), 0)
    r.xadd(keys.work, wire.to_fields(work))
    [(_, [(entry_id, _)])] = r.xreadgroup(WORK_GROUP, "c", {keys.work: ">"})
    owned = _Owned(entry_id, work)
    calls = []
    real_transaction = rollout.transaction

    def transaction(client, commands):  # the result's MULTI/EXEC: it applies, and its first reply is lost
        out = real_transaction(client, commands)
        calls.append(1)
        if len(calls) == 1:
            raise redis_lib.exceptions.ConnectionError("reply lost")
        return out

    monkeypatch.setattr(rollout, "transaction", transaction)
    consumer._commit([_Publication(owned, {b"m": b"result"}, None)])
    assert r.xlen(keys.results(0)) == 1 and calls == [1]
    assert consumer.stats["republish_skipped"] == 1


@pytest.mark.timeout(60)
def test_work_read_just_before_an_outage_is_started_after_it(redis_config, r):
    """Entries read, then not started because Redis went away, must not stay owned (their
    leases would be renewed forever and nobody would run them): the consumer forgets them
    and adopts them from its pending entries once Redis is back."""
    from consumers.rollout import RolloutConsumer
    from pipeline import wire
    from pipeline.config import ConsumerConfig
    from pipeline.streams import ensure_group
    from pipeline.sessions import Task

    keys = Keys(redis_config.namespace)
    ensure_group(r, keys.work, WORK_GROUP)
    r.xadd(keys.work, wire.to_fields(wire.Work(0, 0, 1, 0, 0, Task("t"), 0)))
    config = build(ConsumerConfig, {"redis": redis_config.model_dump(mode="json"), "slots": 2})
    consumer = RolloutConsumer(config, ScriptedSource(default={"duration_s": 0.0}), connect(redis_config))
    real = consumer._skip_cancelled

    def outage(owned):
        raise redis_lib.exceptions.ConnectionError("Redis went away")

    consumer._skip_cancelled = outage
    reply = consumer.r.xreadgroup(WORK_GROUP, consumer.name, {keys.work: ">"}, count=2)
    with pytest.raises(redis_lib.exceptions.ConnectionError):
        consumer._start([(i, f) for _, entries in reply for i, f in entries])
    assert consumer.running == 0, "an entry that never started is still owned"
    consumer._skip_cancelled = real
    consumer._adopt_own_pending()  # what the main loop does after reconnecting
    deadline = time.monotonic() + 10
    while r.xlen(keys.results(0)) == 0:
        assert time.monotonic() < deadline, "the adopted entry never ran"
        time.sleep(0.02)
    assert r.xpending(keys.work, WORK_GROUP)["pending"] == 0


@pytest.mark.timeout(60)
def test_a_process_started_while_redis_restarts_waits_for_it(tmp_path):
    """A consumer restarted during a Redis restart (as an orchestrator does) waits up to
    `redis.start_wait_s` instead of exiting: here `rollstream status`, whose first step is
    the same start-up check; once the server listens it runs and exits 0."""
    import subprocess
    import sys

    server = RedisServer(tmp_path / "redis")
    log = tmp_path / "status.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rollstream.cli", "--log-level", "INFO", "status",
                                 "--url", server.url, "--namespace", "late"],
                                stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            while b"is unreachable; waiting" not in log.read_bytes():
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.02)
            with server:
                assert proc.wait(timeout=30) == 0, log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
