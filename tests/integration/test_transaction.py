"""`redis_io.transaction`: MULTI, the commands and EXEC written at once; the EXEC's replies
as Redis sent them; a command's error raised as redis-py's transaction pipeline raises it
(one refused while queued: nothing applied); the connection back in the pool after each."""

from __future__ import annotations

import pytest
import redis as redis_lib

from pipeline import streams
from pipeline.redis_io import transaction


def test_the_replies_are_the_exec_s_and_every_command_applied(r, keys):
    stream = keys.results(0)
    replies = transaction(r, [streams.xadd_args(stream, {b"m": b"one"}), streams.xadd_args(stream, {b"m": b"two"}),
                              ("XLEN", stream)])
    assert replies[2] == 2 and [f[b"m"] for _, f in r.xrange(stream)] == [b"one", b"two"]
    assert [i for i, _ in r.xrange(stream)] == replies[:2]
    assert r.connection_pool._in_use_connections == set()


def test_a_command_refused_while_queued_applies_nothing(r, keys):
    stream = keys.results(0)
    with pytest.raises(redis_lib.exceptions.ResponseError, match="wrong number of arguments"):
        transaction(r, [streams.xadd_args(stream, {b"m": b"one"}), ("XACK", stream)])
    assert r.xlen(stream) == 0
    assert transaction(r, [("XLEN", stream)]) == [0]  # the connection is still good


def test_a_command_that_fails_when_run_raises_after_the_others_applied(r, keys):
    stream, plain = keys.results(0), keys.results(1)
    r.set(plain, "not a stream")
    with pytest.raises(redis_lib.exceptions.ResponseError, match="WRONGTYPE"):
        transaction(r, [streams.xadd_args(stream, {b"m": b"one"}), streams.xadd_args(plain, {b"m": b"x"})])
    assert r.xlen(stream) == 1  # as MULTI/EXEC does: no rollback


def test_a_transaction_larger_than_a_gather_and_the_socket_buffer_is_written_whole(r, keys):
    stream = keys.results(0)
    payloads = [bytes([i % 251]) * 9000 for i in range(1100)]  # 1100 commands, ~10 MB: partial writes
    replies = transaction(r, [streams.xadd_args(stream, {b"m": p}) for p in payloads])
    assert len(replies) == 1100
    assert [f[b"m"] for _, f in r.xrange(stream)] == payloads


def test_the_queued_replies_are_read_from_hiredis_and_the_other_path_reads_the_same(r, keys, monkeypatch):
    """`redis_io` reads a MULTI's QUEUED replies straight from the connection's hiredis reader
    (the installed redis-py has one: a release that moved it is caught here), and the path
    through `read_response`, for a client without it, gives the same replies and errors."""
    from pipeline import redis_io

    conn = redis_io.pool_connection(r.connection_pool)
    try:
        assert redis_io._hiredis_reader(conn) is not None
    finally:
        r.connection_pool.release(conn)
    stream = keys.results(0)
    fast = transaction(r, [streams.xadd_args(stream, {b"m": b"one"}), ("XLEN", stream)])
    monkeypatch.setattr(redis_io, "_hiredis_reader", lambda conn: None)
    slow = transaction(r, [streams.xadd_args(stream, {b"m": b"two"}), ("XLEN", stream)])
    assert (fast[1], slow[1]) == (1, 2) and [i for i, _ in r.xrange(stream)] == [fast[0], slow[0]]
    with pytest.raises(redis_lib.exceptions.ResponseError, match="wrong number of arguments"):
        transaction(r, [streams.xadd_args(stream, {b"m": b"three"}), ("XACK", stream)])
    assert r.xlen(stream) == 2


def test_a_connection_lost_while_the_queued_replies_are_read_is_a_connection_error(r, keys, monkeypatch):
    """As redis-py's own reading fails: the socket's error (a reset, as a killed Redis gives)
    raised as redis-py's ConnectionError, which the loops ride out, and the connection closed."""
    from pipeline import redis_io

    def reset(*args, **kwargs):
        raise ConnectionResetError(104, "Connection reset by peer")

    conn = redis_io.pool_connection(r.connection_pool)
    try:
        redis_io.send_commands(conn, [("MULTI",), streams.xadd_args(keys.results(0), {b"m": b"one"}), ("EXEC",)])
        monkeypatch.setattr(conn._parser, "read_from_socket", reset)
        with pytest.raises(redis_lib.exceptions.ConnectionError, match="Connection reset by peer"):
            redis_io.exec_replies(conn, 1)
        assert conn._sock is None
        monkeypatch.undo()  # the parser is the connection's own, kept when it reconnects
    finally:
        r.connection_pool.release(conn)
    assert transaction(r, [("XLEN", keys.results(0))]) in ([0], [1])  # the pool still serves
