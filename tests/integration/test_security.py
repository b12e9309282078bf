"""AUTH/ACL users and TLS, each on a private redis-server: a short pipeline runs as a
least-privilege ACL user (`redis_io.acl_rules`, the `default` user disabled) with its
password from a file or the environment, a wrong password fails at start with a clear error,
and the pipeline runs over `rediss://` with the test's own CA."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from consumers.admission import Admission
from consumers.sources.scripted import ScriptedSource
from pipeline.config import AdmissionConfig, RedisConfig, build
from pipeline.keys import Keys
from pipeline.redis_io import RedisAuthError, acl_rules, connect
from tests.conftest import Threads
from tests.integration.helpers import Trainer, admitted_tasks
from tests.integration.servers import RedisServer, server_missing

pytestmark = [pytest.mark.redis,
              pytest.mark.skipif(server_missing() is not None, reason=str(server_missing()))]

SCHEDULER = {"groups": 2, "rows": 8, "width": 64}
ADMIN_PASSWORD = "admin-secret"
PASSWORD = "rollout-secret"


def run_short_pipeline(config: RedisConfig, steps: int = 2) -> list:
    threads = Threads(config)
    try:
        threads.admission(block_ms=50, lease_s=5, trim_every_s=0.1, scheduler=SCHEDULER)
        threads.consumer(ScriptedSource(default={"duration_s": 0.005}), slots=4, block_ms=50,
                         lease_s=5, grace_s=1)
        readies = Trainer(connect(config), Keys(config.namespace), tasks=2).run(steps, timeout_s=20)
    finally:
        threads.stop_all()
    assert not threads.errors, threads.errors
    return readies


@pytest.fixture
def acl_server(tmp_path):
    """`default` off; `admin` for the test's set-up; `rollout` with only the pipeline's rules."""
    with RedisServer(tmp_path / "redis", password=ADMIN_PASSWORD) as s:
        setup = s.admin(password=None, username="default")
        setup.execute_command("ACL", "SETUSER", "admin", "on", f">{ADMIN_PASSWORD}", "~*", "&*", "+@all")
        setup.execute_command("ACL", "SETUSER", "rollout", "on", f">{PASSWORD}",
                              *acl_rules(Keys("acl")).split())
        setup.execute_command("ACL", "SETUSER", "default", "off")
        s.username = "admin"
        yield s


@pytest.mark.timeout(60)
def test_the_pipeline_runs_as_a_least_privilege_acl_user(acl_server, tmp_path, monkeypatch):
    secret = tmp_path / "password"
    secret.write_text(PASSWORD + "\n")
    config = RedisConfig(url=acl_server.url, namespace="acl", username="rollout",
                         password_file=str(secret), socket_timeout_s=5)
    readies = run_short_pipeline(config)
    assert sorted(admitted_tasks(readies)) == [f"t{b}.{i}" for b in range(2) for i in range(2)]
    # the user is really confined: another namespace's keys and other commands are refused
    r = connect(config)
    with pytest.raises(redis.exceptions.NoPermissionError):
        r.xadd(Keys("other").work, {b"m": b"x"})
    with pytest.raises(redis.exceptions.NoPermissionError):
        r.flushall()
    # the password from the environment works the same
    monkeypatch.setenv("RS_TEST_ACL_PASSWORD", PASSWORD)
    from_env = RedisConfig(url=acl_server.url, namespace="acl", username="rollout",
                           password_env="RS_TEST_ACL_PASSWORD")
    assert connect(from_env).ping()


@pytest.mark.timeout(30)
def test_a_wrong_password_fails_at_start_with_a_clear_error(acl_server, tmp_path, monkeypatch):
    monkeypatch.setenv("RS_TEST_ACL_PASSWORD", "not-the-password")
    config = RedisConfig(url=acl_server.url, namespace="acl", username="rollout",
                         password_env="RS_TEST_ACL_PASSWORD", socket_timeout_s=5)
    admission_config = build(AdmissionConfig, {"redis": config.model_dump(), "scheduler": SCHEDULER})
    with pytest.raises(RedisAuthError, match=r"refused user 'rollout' \(password from \$RS_TEST_ACL_PASSWORD\)"):
        Admission(admission_config, connect(config))
    monkeypatch.delenv("RS_TEST_ACL_PASSWORD")
    with pytest.raises(RedisAuthError, match="which is unset: no password sent"):
        Admission(admission_config, connect(config))


# ---------------------------------------------------------------------------- TLS


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(d: Path) -> dict[str, Path]:
    """A CA and a server certificate for 127.0.0.1/localhost signed by it (EC keys: fast)."""
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=rollstream test CA", cwd=d)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "san.ext", cwd=d)
    return {name: d / f"{name}" for name in ("ca.crt", "server.crt", "server.key")}


def tls_missing() -> str | None:
    try:
        subprocess.run(["openssl", "version"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return "the openssl CLI is not available to make the test certificates"
    from tests.integration.servers import REDIS_SERVER
    probe = subprocess.run([REDIS_SERVER, "--port", "0", "--tls-port", "0"], capture_output=True,
                           text=True, timeout=10)
    if "not supported" in (probe.stdout + probe.stderr).lower():
        return f"{REDIS_SERVER} was built without TLS"
    return None


@contextlib.contextmanager
def tls_server(tmp_path: Path) -> Iterator[tuple[RedisServer, dict[str, Path]]]:
    """A redis-server that speaks only TLS, with a certificate of the test's own CA; yields
    it and the certificate files (skips where TLS cannot run here)."""
    reason = tls_missing()
    if reason is not None:
        pytest.skip(reason)
    certs = make_certs(tmp_path / "certs")
    with RedisServer(tmp_path / "redis", "--tls-cert-file", str(certs["server.crt"]),
                     "--tls-key-file", str(certs["server.key"]), "--tls-ca-cert-file", str(certs["ca.crt"]),
                     "--tls-auth-clients", "no", tls=True) as server:
        yield server, certs


@pytest.mark.timeout(60)
def test_the_pipeline_runs_over_tls_with_the_configured_ca(tmp_path):
    with tls_server(tmp_path) as (server, certs):
        config = RedisConfig(url=server.url, namespace="tls", password_env=None,
                             tls_ca_file=str(certs["ca.crt"]), socket_timeout_s=5)
        assert config.url.startswith("rediss://")
        readies = run_short_pipeline(config)
        assert len(admitted_tasks(readies)) == 4
        # without the CA the server's certificate is refused
        untrusted = RedisConfig(url=server.url, namespace="tls", password_env=None, socket_timeout_s=5)
        with pytest.raises(Exception, match="(?i)certificate"):
            connect(untrusted).ping()
