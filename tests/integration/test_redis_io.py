"""`pipeline.redis_io` against both Redis servers."""

import threading

import hiredis
import pytest

from pipeline.redis_io import _packed, connect, pool_connection, send_commands
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


@pytest.mark.timeout(30)
def test_large_arguments_are_sent_from_their_own_buffers_and_arrive_whole(r, keys):
    """`send_commands` sends a last argument of 64 KiB or more after its length, from its own
    buffer: the bytes are those hiredis would pack, and Redis stores every argument whole,
    before, between and after small ones."""
    big, bigger = bytes(range(256)) * 300, b"\x00\r\n$" * 70_000
    commands = [("SET", keys.prefix + "a", big), ("XADD", keys.prefix + "s", "*", "n", 7, b"m", bigger),
                ("SET", keys.prefix + "b", "small"), ("MSET", keys.prefix + "c", big, keys.prefix + "d", bigger)]
    assert b"".join(_packed(commands)) == b"".join(map(hiredis.pack_command, commands))
    assert any(buffer is bigger for buffer in _packed(commands))  # sent apart, not copied
    conn = pool_connection(r.connection_pool)
    try:
        conn.connect()
        send_commands(conn, commands)
        assert [conn.read_response() for _ in commands][2:] == [b"OK", b"OK"]
    finally:
        r.connection_pool.release(conn)
    assert r.get(keys.prefix + "a") == big and r.get(keys.prefix + "b") == b"small"
    assert r.mget(keys.prefix + "c", keys.prefix + "d") == [big, bigger]
    assert r.xrange(keys.prefix + "s")[0][1] == {b"n": b"7", b"m": bigger}
