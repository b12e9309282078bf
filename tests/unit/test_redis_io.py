"""`pipeline.redis_io` without a server: connection settings, retry, stream ids."""

import pytest
import redis

from pipeline.config import RedisConfig
from pipeline.redis_io import connect, next_id, parse_id, retry


def test_connect_takes_username_password_and_tls_ca_from_the_config(tmp_path, monkeypatch):
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    client = connect(RedisConfig(url="rediss://cache.example:6380/2", username="trainer",
                                 password_file=str(secret), tls_ca_file=str(tmp_path / "ca.pem")))
    pool = client.connection_pool
    assert pool.connection_class is redis.connection.SSLConnection
    kw = pool.connection_kwargs
    assert (kw["username"], kw["password"], kw["ssl_ca_certs"]) == ("trainer", "s3cret", str(tmp_path / "ca.pem"))
    assert (kw["host"], kw["port"], kw["db"]) == ("cache.example", 6380, 2)
    monkeypatch.setenv("ROLLSTREAM_REDIS_PASSWORD", "from-env")
    unix = connect(RedisConfig(url="unix:///tmp/redis.sock"))
    assert unix.connection_pool.connection_class is redis.connection.UnixDomainSocketConnection
    assert unix.connection_pool.connection_kwargs["password"] == "from-env"


def test_the_client_never_retries_by_itself():
    """A retried MULTI/EXEC whose reply was lost would apply twice."""
    client = connect(RedisConfig(url="redis://127.0.0.1:1/0"))
    assert client.get_retry().get_retries() == 0


def test_retry_retries_connection_errors_with_backoff_then_gives_up():
    calls, sleeps = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise redis.exceptions.ConnectionError("down")
        return "ok"

    assert retry(flaky, what="x", sleep=sleeps.append) == "ok"
    assert len(calls) == 3 and sleeps == [0.05, 0.1]

    def down():
        raise redis.exceptions.TimeoutError("slow")

    with pytest.raises(redis.exceptions.TimeoutError):
        retry(down, what="x", attempts=4, sleep=sleeps.append)
    assert len(sleeps) == 2 + 3


def test_retry_does_not_retry_other_errors():
    calls = []

    def wrong():
        calls.append(1)
        raise redis.exceptions.ResponseError("WRONGTYPE")

    with pytest.raises(redis.exceptions.ResponseError):
        retry(wrong, what="x", sleep=lambda s: None)
    assert calls == [1]


def test_stream_ids():
    assert parse_id(b"1700000000000-3") == (1700000000000, 3)
    assert parse_id("5") == (5, 0)
    assert next_id(b"12-9") == "12-10"


def test_an_outage_backs_off_with_jitter_up_to_the_cap_then_gives_up():
    from pipeline.redis_io import Outage, RedisUnavailable

    now = [0.0]
    outage = Outage("test", 20.0, base_s=0.1, cap_s=5.0, clock=lambda: now[0], jitter=lambda: 1.0)
    delays = []
    for _ in range(8):
        delays.append(outage.failed(redis.exceptions.ConnectionError("down")))
        now[0] += delays[-1]
    assert delays[:3] == pytest.approx([0.1, 0.2, 0.4])  # full delay at jitter 1.0
    assert max(delays) == 5.0  # capped
    half = Outage("test", 20.0, base_s=0.1, clock=lambda: 0.0, jitter=lambda: 0.0)
    assert half.failed(redis.exceptions.ConnectionError("down")) == pytest.approx(0.05)
    while now[0] < 20.0:
        try:
            now[0] += outage.failed(redis.exceptions.ConnectionError("down"))
        except RedisUnavailable as exc:
            assert "reconnect_s=20" in str(exc) and "ConnectionError: down" in str(exc)
            break
    else:
        with pytest.raises(RedisUnavailable, match="giving up"):
            outage.failed(redis.exceptions.ConnectionError("down"))
    outage.ended()
    assert outage.failures == 0 and outage.failed(redis.exceptions.TimeoutError("slow")) > 0


def test_refused_credentials_are_never_retried():
    calls = []

    def refused():
        calls.append(1)
        raise redis.exceptions.AuthenticationError("WRONGPASS")

    with pytest.raises(redis.exceptions.AuthenticationError):
        retry(refused, what="x", sleep=lambda _: None)
    assert calls == [1]


def test_acl_rules_confine_a_user_to_the_run_s_keys():
    from pipeline.keys import Keys
    from pipeline.redis_io import acl_rules, where

    rules = acl_rules(Keys("exp1")).split()
    assert rules[:4] == ["resetkeys", "~rs:{exp1}:*", "resetchannels", "-@all"]
    assert {"+xreadgroup", "+multi", "+exec", "+xgroup|create"} <= set(rules)
    # a config refuses a password in its URL; where() still hides one
    assert where(RedisConfig.model_construct(url="redis://u:pw@h:1/0")) == "redis://u:***@h:1/0"
