"""`append_once` and `ride_out`: a trainer's appends survive a Redis outage without being
repeated when the reply of an applied XADD was lost."""

import fakeredis
import pytest
import redis

from pipeline.redis_io import RedisUnavailable, ride_out
from pipeline.streams import append_once


class Flaky:
    """A client whose next `fail` XADDs raise ConnectionError, before or after applying."""

    def __init__(self, r, *, fail: int, applied: bool) -> None:
        self.r, self.fail, self.applied = r, fail, applied

    def xadd(self, stream, fields):
        if self.fail:
            self.fail -= 1
            if self.applied:
                self.r.xadd(stream, fields)  # the server applied it; the reply was lost
            raise redis.exceptions.ConnectionError("Connection reset by peer")
        return self.r.xadd(stream, fields)

    def xrevrange(self, stream, count):
        return self.r.xrevrange(stream, count=count)


@pytest.mark.parametrize("applied", [True, False])
def test_an_append_whose_reply_was_lost_lands_exactly_once(applied):
    r = fakeredis.FakeRedis()
    r.xadd("s", {"m": b"first"})
    flaky = Flaky(r, fail=2, applied=applied)
    append_once(flaky, "s", {"m": b"second"}, what="test", total_s=5.0, sleep=lambda s: None)
    assert [f[b"m"] for _, f in r.xrange("s")] == [b"first", b"second"]


def test_an_outage_past_its_budget_raises_redis_unavailable():
    calls = []

    def down():
        calls.append(1)
        raise redis.exceptions.ConnectionError("refused")

    clock = iter(range(100))
    with pytest.raises(RedisUnavailable, match="unreachable"):
        ride_out(down, what="test", total_s=0.0, sleep=lambda s: next(clock))
    assert calls


def test_ride_out_returns_once_redis_is_back():
    attempts = iter([redis.exceptions.TimeoutError("slow"), redis.exceptions.ConnectionError("x"), "ok"])

    def fn():
        value = next(attempts)
        if isinstance(value, Exception):
            raise value
        return value

    assert ride_out(fn, what="test", total_s=60.0, sleep=lambda s: None) == "ok"
