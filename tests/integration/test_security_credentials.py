"""Credentials and exposure, on private redis-servers: the Redis password reaches the
processes only from the environment or a file and never shows anywhere else (the logs of a
full run, in-process and of a consumer process; `rollstream status`, text and JSON, also
when the password is wrong; the messages and tracebacks of failed connections; the metrics
a process serves); the least-privilege ACL user runs everything the pipeline does, status
included, and nothing else; TLS and the ACL user together; and the metrics endpoint binds
to loopback unless configured otherwise, as docs/security.md says."""

from __future__ import annotations

import errno
import json
import logging
import socket
import sys
import time
import traceback
import urllib.request
from pathlib import Path

import pytest
import redis

from consumers.admission import Admission
from consumers.sources.scripted import ScriptedSource
from rollstream import cli
from pipeline.config import AdmissionConfig, ConfigError, ConsumerConfig, RedisConfig, build, metrics_address
from pipeline.keys import Keys
from pipeline.metrics import Metrics, serve
from pipeline.redis_io import Outage, RedisAuthError, acl_rules, connect
from tests.conftest import ROOT, Proc, Threads
from tests.integration.helpers import Trainer, admitted_tasks
from tests.integration.servers import RedisServer, free_port, server_missing
from tests.integration.test_security import ADMIN_PASSWORD, run_short_pipeline, tls_server
from trainer.run_config import RunConfig

pytestmark = pytest.mark.skipif(server_missing() is not None, reason=str(server_missing()))

SECRET = "Pa55-word-never-shown-7f3a"  # the rollout user's password
NAMESPACE = "sec"
SCHEDULER = {"groups": 2, "rows": 8, "width": 64}


def _acl_setup(admin: redis.Redis) -> None:
    admin.execute_command("ACL", "SETUSER", "admin", "on", f">{ADMIN_PASSWORD}", "~*", "&*", "+@all")
    admin.execute_command("ACL", "SETUSER", "rollout", "on", f">{SECRET}", *acl_rules(Keys(NAMESPACE)).split())
    admin.execute_command("ACL", "SETUSER", "default", "off")


@pytest.fixture
def server(tmp_path):
    """`default` off; `rollout` holds only the pipeline's rules for NAMESPACE."""
    with RedisServer(tmp_path / "redis", password=ADMIN_PASSWORD) as s:
        _acl_setup(s.admin(password=None, username="default"))
        s.username = "admin"
        yield s


def _shown(text: str) -> bool:
    return SECRET in text


def _status(capsys, config_file: Path, *extra: str) -> tuple[int, str, str]:
    """`rollstream status`: its exit code, stdout and stderr."""
    capsys.readouterr()
    code = cli.main(["status", "--config", str(config_file), *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.timeout(120)
@pytest.mark.redis
def test_the_password_never_shows_in_logs_status_errors_or_metrics(server, tmp_path, monkeypatch, caplog, capsys):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("RS_TEST_SECRET", SECRET)
    config = RedisConfig(url=server.url, namespace=NAMESPACE, username="rollout", password_env="RS_TEST_SECRET",
                         socket_timeout_s=5)
    # a full run in this process: admission (with its metrics served), a rollout consumer, a trainer
    metrics = Metrics(process=True)
    metrics.set_build(component="admission", run=NAMESPACE)
    endpoint = serve(metrics, "127.0.0.1:0", health=lambda: True)
    threads = Threads(config)
    try:
        threads.admission(block_ms=50, lease_s=5, trim_every_s=0.1, scheduler=SCHEDULER, metrics=metrics)
        threads.consumer(ScriptedSource(default={"duration_s": 0.005}), slots=4, block_ms=50, lease_s=5,
                         grace_s=1, metrics=metrics)
        readies = Trainer(connect(config), Keys(NAMESPACE), tasks=2).run(3, timeout_s=20)
        assert len(admitted_tasks(readies)) == 6
        with urllib.request.urlopen(f"{endpoint.url}/metrics", timeout=5) as reply:
            scraped = reply.read().decode()
        assert "rollstream_groups_admitted_total" in scraped and not _shown(scraped)
    finally:
        threads.stop_all()
        endpoint.stop()
    assert not threads.errors, threads.errors

    # the admission consumer as its own process (the entry point's logging), stopped by SIGTERM
    config_file = tmp_path / "admission.json"
    config_file.write_text(json.dumps(build(AdmissionConfig, {
        "redis": config.model_dump(mode="json"), "scheduler": SCHEDULER, "metrics_addr": "127.0.0.1:0"}
    ).model_dump(mode="json")))
    assert not _shown(config_file.read_text())
    proc = Proc([sys.executable, "-m", "rollstream.cli", "--log-level", "INFO", "admission", "--config", str(config_file)], tmp_path / "admission.log")
    try:
        deadline = time.monotonic() + 30
        while "running" not in proc.output() and time.monotonic() < deadline:
            assert proc.alive, proc.output()
            time.sleep(0.1)
    finally:
        assert proc.terminate() == 0, proc.output()
    assert "admission shard 0 running" in proc.output() and not _shown(proc.output())

    # rollstream status, text and JSON, as the ACL user (which may run it) and with a wrong password
    for extra in ((), ("--json",)):
        code, out, err = _status(capsys, config_file, *extra)
        assert code == 0 and NAMESPACE in out and "dead" in out, err
        assert not _shown(out + err)
    monkeypatch.setenv("RS_TEST_SECRET", SECRET + "-wrong")
    code, out, err = _status(capsys, config_file)
    assert code == 2 and "refused user 'rollout'" in err and not _shown(out + err)

    # failed connections: a wrong password, an unreachable server, and the outage they start
    failures = []

    with pytest.raises(RedisAuthError) as refused:
        Admission(build(AdmissionConfig, {"redis": config.model_dump(), "scheduler": SCHEDULER}), connect(config))
    failures.append(refused.value)
    monkeypatch.setenv("RS_TEST_SECRET", SECRET)
    gone = config.model_copy(update={"url": f"redis://127.0.0.1:{free_port()}/0"})
    with pytest.raises(redis.exceptions.ConnectionError) as unreachable:
        connect(gone).ping()
    failures.append(unreachable.value)
    Outage("test", 60).failed(unreachable.value)  # logs the error, as a consumer's loop does
    for exc in failures:
        text = "".join(traceback.format_exception(exc)) + repr(exc) + repr(connect(config))
        assert not _shown(text), text

    # and nothing logged anywhere along the way holds it
    assert caplog.records and not _shown(caplog.text)
    assert not any(_shown(repr(record.args)) or _shown(record.exc_text or "") for record in caplog.records)


@pytest.mark.timeout(60)
@pytest.mark.redis
def test_the_acl_user_may_run_the_pipeline_and_nothing_else(server, tmp_path):
    secret = tmp_path / "password"
    secret.write_text(SECRET + "\n")
    config = RedisConfig(url=server.url, namespace=NAMESPACE, username="rollout", password_file=str(secret),
                         socket_timeout_s=5)
    r = connect(config)
    assert r.ping()
    for command in (("KEYS", "*"), ("CONFIG", "GET", "requirepass"), ("EVAL", "return 1", "0"), ("ACL", "LIST"),
                    ("FLUSHDB",), ("SHUTDOWN",), ("CLIENT", "LIST"), ("PUBLISH", "c", "x"),
                    ("GET", f"rs:{{{NAMESPACE}-other}}:state:0"), ("SET", "anything", "1")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.execute_command(*command)
    # a password file that cannot be read is a clear config error, not a traceback from open()
    missing = config.model_copy(update={"password_file": str(tmp_path / "nope")})
    with pytest.raises(ConfigError, match=r"redis.password_file: cannot read .*nope"):
        connect(missing)


@pytest.mark.timeout(60)
@pytest.mark.redis
def test_tls_and_the_acl_user_together(tmp_path):
    with tls_server(tmp_path) as (s, certs):
        _acl_setup(s.admin(password=None, ssl=True, ssl_ca_certs=str(certs["ca.crt"])))
        secret = tmp_path / "password"
        secret.write_text(SECRET)
        config = RedisConfig(url=s.url, namespace=NAMESPACE, username="rollout", password_file=str(secret),
                             tls_ca_file=str(certs["ca.crt"]), socket_timeout_s=5)
        assert len(admitted_tasks(run_short_pipeline(config))) == 4
        # plaintext to the TLS port gets nowhere
        plain = config.model_copy(update={"url": s.url.replace("rediss://", "redis://")})
        with pytest.raises(redis.exceptions.ConnectionError):
            connect(plain).ping()


def _other_address() -> str | None:
    """A non-loopback address of this machine, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks a route
        except OSError:
            return None
        host = s.getsockname()[0]
    return None if host.startswith("127.") or host == "0.0.0.0" else host


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


@pytest.mark.timeout(30)
def test_metrics_bind_to_loopback_by_default_as_documented():
    doc = (ROOT / "docs" / "security.md").read_text()
    for model, port in ((AdmissionConfig, 9400), (ConsumerConfig, 0), (RunConfig, 9500)):
        addr = build(model, {}).metrics_addr
        assert metrics_address(addr, ("shard", "rank")) == ("127.0.0.1", port) and f"`{addr}`" in doc
    addr = "127.0.0.1:9400"  # the admission consumer's of shard 0
    try:
        default = serve(Metrics(), addr, health=lambda: True)
    except OSError as exc:  # the port is taken (another process on this machine): the host is what matters
        if exc.errno != errno.EADDRINUSE:
            raise
        default = serve(Metrics(), addr.replace(":9400", ":0"), health=lambda: True)
    try:
        assert default.host == "127.0.0.1"
        assert _reachable("127.0.0.1", default.port)
        other = _other_address()
        if other is not None:
            assert not _reachable(other, default.port), f"the default metrics address answers on {other}"
    finally:
        default.stop()
    everywhere = serve(Metrics(), "0.0.0.0:0", health=lambda: True)  # configured: all interfaces
    try:
        assert everywhere.host == "0.0.0.0"
        assert _reachable(_other_address() or "127.0.0.1", everywhere.port)
    finally:
        everywhere.stop()

