"""`Fence.execute`: a transaction commits only under the consumer's fencing token, in one
round trip, with the WATCH of the next one written after its EXEC on the connection the
fence keeps: a token taken by another consumer before or during a transaction refuses it,
and nothing of it is applied."""

from __future__ import annotations

import pytest
import redis as redis_lib

from consumers.fence import Fence, Fenced

pytestmark = pytest.mark.redis


def _fence(r, keys) -> Fence:
    fence = Fence(r, keys, 0, lease_s=60.0)
    fence.acquire()
    return fence


def _commit(r, fence: Fence, key: str, value: str) -> None:
    pipe = r.pipeline(transaction=True)
    pipe.rpush(key, value)
    fence.renew_in(pipe)
    try:
        fence.execute(pipe)
    finally:
        pipe.reset()


def test_transactions_commit_under_the_token_on_one_kept_connection(r, keys):
    fence = _fence(r, keys)
    log = f"{keys.prefix}log"
    _commit(r, fence, log, "a")
    conn = fence._conn
    _commit(r, fence, log, "b")
    assert fence._conn is conn and conn is not None  # kept, still watching for the next one
    assert r.lrange(log, 0, -1) == [b"a", b"b"]


def test_a_token_taken_between_transactions_refuses_the_next_one(r, keys):
    fence = _fence(r, keys)
    log = f"{keys.prefix}log"
    _commit(r, fence, log, "a")
    r.incr(keys.fence(0))  # another consumer takes the shard over, after the WATCH
    with pytest.raises(redis_lib.exceptions.WatchError):  # Redis refuses the EXEC
        _commit(r, fence, log, "b")
    assert r.lrange(log, 0, -1) == [b"a"]
    with pytest.raises(Fenced, match="another admission consumer took the shard over"):
        _commit(r, fence, log, "c")  # the fence read after the refused EXEC: not sent
    assert r.lrange(log, 0, -1) == [b"a"]


def test_a_token_taken_after_the_check_refuses_the_exec(r, keys, monkeypatch):
    """The fence read after the WATCH was this token, then another consumer took the shard
    over before the EXEC: Redis refuses the EXEC."""
    fence = _fence(r, keys)
    log = f"{keys.prefix}log"
    _commit(r, fence, log, "a")
    check = fence.check

    def check_then_taken(value=None):
        check(value)
        r.incr(keys.fence(0))

    monkeypatch.setattr(fence, "check", check_then_taken)
    with pytest.raises(redis_lib.exceptions.WatchError):
        _commit(r, fence, log, "b")
    monkeypatch.setattr(fence, "check", check)
    assert r.lrange(log, 0, -1) == [b"a"]
    with pytest.raises(Fenced):
        fence.check()


def test_the_first_transaction_is_checked_too(r, keys):
    fence = _fence(r, keys)
    r.incr(keys.fence(0))
    with pytest.raises(Fenced):
        _commit(r, fence, f"{keys.prefix}log", "a")
    assert not r.exists(f"{keys.prefix}log")


def test_a_command_error_raises_and_the_next_transaction_commits(r, keys):
    fence = _fence(r, keys)
    log = f"{keys.prefix}log"
    r.set(f"{keys.prefix}text", "x")
    pipe = r.pipeline(transaction=True)
    pipe.rpush(log, "a")
    pipe.rpush(f"{keys.prefix}text", "wrong type")
    with pytest.raises(redis_lib.exceptions.ResponseError, match="WRONGTYPE"):
        fence.execute(pipe)
    pipe.reset()
    assert r.lrange(log, 0, -1) == [b"a"]  # EXEC applies the commands that did not fail
    _commit(r, fence, log, "b")
    assert r.lrange(log, 0, -1) == [b"a", b"b"]


def test_a_command_refused_while_queued_aborts_the_transaction(r, keys):
    fence = _fence(r, keys)
    log = f"{keys.prefix}log"
    pipe = r.pipeline(transaction=True)
    pipe.rpush(log, "a")
    pipe.execute_command("NO-SUCH-COMMAND")
    with pytest.raises(redis_lib.exceptions.ResponseError, match="unknown command"):
        fence.execute(pipe)
    pipe.reset()
    assert not r.exists(log)
    assert fence._conn is None  # dropped with its unread replies
    _commit(r, fence, log, "b")
    assert r.lrange(log, 0, -1) == [b"b"]


def test_a_new_client_drops_the_kept_connection(r, keys, redis_config):
    from pipeline.redis_io import connect

    fence = _fence(r, keys)
    log = f"{keys.prefix}log"
    _commit(r, fence, log, "a")
    other = connect(redis_config)
    try:
        fence.use(other)
        assert fence._conn is None
        _commit(other, fence, log, "b")
        assert r.lrange(log, 0, -1) == [b"a", b"b"]
    finally:
        fence.use(r)
        other.close()
