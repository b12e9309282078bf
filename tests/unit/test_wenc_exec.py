"""`redis_io.exec_replies` reads a transaction's MULTI, QUEUED and EXEC replies as reading
each with `Connection.read_response` does: the EXEC's replies; None when a WATCH refused
the EXEC; the first error of a command refused while queued (nothing applied); and on a
timeout, a socket error or any other exception while reading, the same exception (type and
message) with the connection closed."""

from __future__ import annotations

from typing import Any

import pytest
import redis as redis_lib

from pipeline import streams
from pipeline.redis_io import exec_replies, pool_connection, send_commands


def _one_by_one(conn: Any, n: int) -> list | None:
    """What `exec_replies` does, each reply read by `read_response` (redis-py's own reading)."""
    errors = []
    for _ in range(n + 1):
        try:
            conn.read_response()
        except redis_lib.exceptions.ResponseError as exc:
            errors.append(exc)
    try:
        return conn.read_response()
    except redis_lib.exceptions.ExecAbortError:
        if errors:
            raise errors[0] from None
        raise


def _outcome(read: Any, conn: Any, commands: list[tuple], n: int | None = None) -> tuple:
    send_commands(conn, [("MULTI",), *commands, ("EXEC",)])
    try:
        replies = read(conn, len(commands) if n is None else n)
    except BaseException as exc:  # noqa: BLE001 (compared: type, message, and the connection closed)
        return ("raised", type(exc), str(exc), conn._sock is None)
    if replies is None:
        return ("refused", None)
    return ("replies", [(type(x).__name__, str(x)) if isinstance(x, Exception) else type(x).__name__ for x in replies])


def _both(r: redis_lib.Redis, commands: list[tuple], n: int | None = None) -> tuple:
    """The outcome of `exec_replies` and of reading one by one, each on a connection of its own."""
    outcomes = []
    for read in (exec_replies, _one_by_one):
        conn = pool_connection(r.connection_pool)
        try:
            outcomes.append(_outcome(read, conn, commands, n))
        finally:
            r.connection_pool.release(conn)
    assert outcomes[0] == outcomes[1]
    return outcomes[0]


def test_the_replies_of_a_transaction_that_applied(r, keys):
    stream = keys.results(0)
    kind, replies = _both(r, [streams.xadd_args(stream, {b"m": b"x"}), ("XLEN", stream)])
    assert kind == "replies" and replies[1] == "int"
    assert r.xlen(stream) == 2  # each read applied its transaction
    assert _both(r, []) == ("replies", [])


def test_a_command_refused_while_queued_raises_the_first_error_and_applies_nothing(r, keys):
    stream = keys.results(0)
    outcome = _both(r, [streams.xadd_args(stream, {b"m": b"x"}), ("XACK", stream), ("NOSUCHCOMMAND",),
                        streams.xadd_args(stream, {b"m": b"y"})])
    assert outcome[:2] == ("raised", redis_lib.exceptions.ResponseError) and "wrong number of arguments" in outcome[2]
    assert outcome[3] is False  # the connection stays good
    assert r.xlen(stream) == 0


def test_a_command_failing_when_run_is_a_reply_and_the_others_applied(r, keys):
    stream, plain = keys.results(0), keys.results(1)
    r.set(plain, "not a stream")
    kind, replies = _both(r, [streams.xadd_args(stream, {b"m": b"x"}), streams.xadd_args(plain, {b"m": b"x"})])
    assert kind == "replies" and replies[1][0] == "ResponseError" and "WRONGTYPE" in replies[1][1]
    assert r.xlen(stream) == 2


def test_a_transaction_refused_by_a_watch_is_none(r, keys):
    watched, stream = keys.results(0), keys.results(1)
    for read in (exec_replies, _one_by_one):
        conn = pool_connection(r.connection_pool)
        try:
            conn.send_command("WATCH", watched)
            assert conn.read_response() in (b"OK", "OK")
            r.set(watched, "changed")
            assert _outcome(read, conn, [streams.xadd_args(stream, {b"m": b"x"})]) == ("refused", None)
        finally:
            r.connection_pool.release(conn)
    assert r.xlen(stream) == 0


def test_a_timeout_while_reading_raises_as_redis_py_and_closes_the_connection(r, keys):
    r.connection_pool.connection_kwargs["socket_timeout"] = 0.2
    r.connection_pool.reset()
    # one reply more than Redis sends: the read past EXEC's reply times out
    outcome = _both(r, [("XLEN", keys.results(0))], n=2)
    assert outcome[:2] == ("raised", redis_lib.exceptions.TimeoutError) and outcome[2].startswith("Timeout reading from")
    assert outcome[3] is True


class _Failing:
    """A parser whose reads after the first `after` raise `exc`."""

    def __init__(self, parser: Any, exc: BaseException, after: int) -> None:
        self.parser, self.exc, self.left = parser, exc, after

    def __getattr__(self, name: str) -> Any:
        return getattr(self.parser, name)

    def read_response(self, *args: Any, **kw: Any) -> Any:
        if self.left == 0:
            raise self.exc
        self.left -= 1
        return self.parser.read_response(*args, **kw)


@pytest.mark.parametrize("exc", [ConnectionResetError(104, "reset by peer"), KeyboardInterrupt(),
                                 redis_lib.exceptions.ConnectionError("gone"), RuntimeError("bug")],
                         ids=["socket", "interrupt", "redis", "other"])
def test_any_exception_while_reading_raises_as_redis_py_and_closes_the_connection(r, keys, exc):
    outcomes = []
    for read in (exec_replies, _one_by_one):
        conn = pool_connection(r.connection_pool)
        conn.connect()
        parser = conn._parser
        try:
            conn._parser = _Failing(parser, exc, after=1)  # MULTI's OK, then the failure
            outcomes.append(_outcome(read, conn, [("XLEN", keys.results(0)), ("XLEN", keys.results(1))]))
        finally:
            conn._parser = parser
            r.connection_pool.release(conn)
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][:2] == ("raised", redis_lib.exceptions.ConnectionError if isinstance(exc, OSError) else type(exc))
    assert outcomes[0][3] is True
