"""`pipeline.redis_io` against both Redis servers."""

import threading

import pytest

from pipeline.redis_io import connect
from pipeline.streams import ensure_group
from tests.integration.helpers import wait_until


@pytest.mark.timeout(30)
def test_ensure_group_creates_the_stream_once_and_reads_from_the_start(r, keys):
    r.xadd(keys.tasks(0), {b"m": b"early"})
    assert ensure_group(r, keys.tasks(0), "g") is True
    assert ensure_group(r, keys.tasks(0), "g") is False  # BUSYGROUP: already there
    assert ensure_group(r, keys.results(0), "g") is True  # MKSTREAM
    assert r.exists(keys.results(0)) == 1
    reply = r.xreadgroup("g", "c", {keys.tasks(0): ">"})
    assert [f for _, entries in reply for _, f in entries] == [{b"m": b"early"}]


@pytest.mark.timeout(60)
def test_one_client_serves_more_concurrent_commands_than_redis_py_s_default_pool(redis_config, keys):
    """A consumer's sessions share its client, a connection each while they commit: 128 slots
    must not run out of connections (redis-py 8's default pool holds 100)."""
    shared, other = connect(redis_config), connect(redis_config)
    key, n = keys.prefix + "blocked", 128
    got, errors = [], []

    def block() -> None:
        try:
            got.append(shared.blpop([key], timeout=30))
        except Exception as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=block, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    wait_until(lambda: errors or len(shared.connection_pool._in_use_connections) >= n, 20,
               "every command to hold a connection")
    other.rpush(key, *range(n))
    for t in threads:
        t.join(30)
    shared.close()
    other.close()
    assert not errors, errors[:1]
    assert sorted(int(v) for _, v in got) == list(range(n))
