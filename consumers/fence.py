"""One admission consumer per shard, enforced: a lease to wait on, a fencing token to commit by.

Two admission consumers applying one shard's events would both submit its work and emit its
steps. So a consumer first takes the shard's lease (`Keys.lease(shard)`: `SET NX PX`, the
value naming its host and process), then increments the shard's fence (`Keys.fence(shard)`)
and keeps the new value as its token. Every transaction it commits first `WATCH`es the
fence and reads it: if the token is no longer its own, another consumer has taken the shard
over and the transaction is not sent (`Fenced`); if the fence changes between that read and
`EXEC`, Redis refuses the `EXEC` (`WatchError`, then `Fenced` once the fence is read again).
Each transaction also renews the lease; an idle consumer renews it every `lease_s / 3`.

A second consumer waits while the lease is held (by a consumer that renews it: alive and
reaching Redis), and takes the shard over when it lapses: after the first was killed on
another host, or paused, or cut off from Redis past `lease_s`. A lease held by a process of
this host that no longer runs (a killed process, a restarted container: same host name and
process id, or a process id that is gone) is taken over at once. The first consumer, if it
comes back, finds its next transaction fenced and stops (`Fenced`, exit 1); restarted, it
waits for the lease in turn, so two consumers never alternate.

Safety rests on the token alone (a transaction commits only under the current token); the
lease decides who waits, so that a consumer that merely restarts does not wait at all.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path

import redis

from pipeline.errors import CommandError
from pipeline.keys import Keys
from pipeline.redis_io import text

log = logging.getLogger(__name__)


class Fenced(CommandError):
    """Another admission consumer took this one's shard over: it must stop."""


def identity() -> str:
    """This process, as a lease names it: `host:pid`."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _gone(holder: str) -> bool:
    """Whether the process a lease names is known not to run any more: it is of this host
    and it is this very process (a consumer before this one in it, or a container restarted
    under the same process id), or its process id is gone or a zombie."""
    host, _, pid = holder.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    if int(pid) == os.getpid():
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] == "Z"


class Fence:
    """The lease and fencing token of one admission consumer on one shard."""

    def __init__(self, r: redis.Redis, keys: Keys, shard: int, lease_s: float) -> None:
        self.r, self.shard = r, shard
        self.lease_key, self.fence_key = keys.lease(shard), keys.fence(shard)
        self.lease_ms = max(1, int(lease_s * 1000))
        self.me = identity()
        self.token: int | None = None
        self.renewed = 0.0  # monotonic time of the last renewal

    def acquire(self, stop: threading.Event | None = None) -> int:
        """Take the shard: wait while another live consumer holds its lease (until `stop`
        is set: then `Fenced`), then take the next fencing token."""
        told = False
        while True:
            if self.r.set(self.lease_key, self.me, nx=True, px=self.lease_ms):
                break
            holder = text(self.r.get(self.lease_key) or b"")
            if holder and _gone(holder):
                log.info("shard %d: the lease of %s, which no longer runs, is taken over", self.shard, holder)
                self.r.set(self.lease_key, self.me, px=self.lease_ms)
                break
            if not told:
                log.warning("shard %d is held by admission consumer %s; waiting for its lease "
                            "(%d ms) to lapse", self.shard, holder or "(unknown)", self.lease_ms)
                told = True
            if stop is not None and stop.wait(min(1.0, self.lease_ms / 4000)):
                raise Fenced(f"admission shard {self.shard}: stopped while waiting for the shard")
            if stop is None:
                time.sleep(min(1.0, self.lease_ms / 4000))
        self.token = int(self.r.incr(self.fence_key))
        self.renewed = time.monotonic()
        log.info("shard %d: taken with fencing token %d", self.shard, self.token)
        return self.token

    def renew_in(self, pipe: redis.client.Pipeline) -> None:
        """Queue the lease's renewal in a transaction (before `guard`)."""
        pipe.set(self.lease_key, self.me, px=self.lease_ms)

    def guard(self, pipe: redis.client.Pipeline) -> None:
        """Make `pipe`'s transaction commit only under this consumer's token: WATCH the
        fence and check it (`Fenced` if another consumer took over). Call it after queueing
        the transaction's commands, just before `execute`."""
        pipe.watch(self.fence_key)
        self.check(pipe.get(self.fence_key))

    def check(self, value: bytes | str | None = None) -> None:
        """`Fenced` unless the fence (read now when `value` is not given) is this token."""
        if value is None:
            value = self.r.get(self.fence_key)
        if value is None or int(value) != self.token:
            raise Fenced(
                f"admission shard {self.shard}: another admission consumer took the shard over "
                f"(fencing token {text(value) if value is not None else 'gone'}, this one's "
                f"{self.token}); this one stops without applying anything more")

    def due(self) -> bool:
        """Whether an idle consumer should renew its lease now."""
        return time.monotonic() - self.renewed >= self.lease_ms / 3000

    def renewed_now(self) -> None:
        self.renewed = time.monotonic()
