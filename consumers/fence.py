"""One admission consumer per shard, enforced: a lease to wait on, a fencing token to commit by.

Two admission consumers applying one shard's events would both submit its work and emit its
steps. So a consumer first takes the shard's lease (`Keys.lease(shard)`: `SET NX PX`, the
value naming its host and process), then increments the shard's fence (`Keys.fence(shard)`)
and keeps the new value as its token. Every transaction it commits runs on a connection
that `WATCH`es the fence and read it after the WATCH: if the token read is no longer its own,
another consumer has taken the shard over and the transaction is not sent (`Fenced`); if the
fence changes between that read and `EXEC`, Redis refuses the `EXEC` (`WatchError`, then
`Fenced` once the fence is read again). The WATCH and the read of the next transaction are
written after each `EXEC`, in the same round trip, on the same connection, which the fence
keeps for its transactions (`Fence.execute`): a transaction costs one round trip.
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import redis
from redis.client import EMPTY_RESPONSE
from redis.exceptions import ResponseError, WatchError

from pipeline.errors import CommandError
from pipeline.keys import Keys
from pipeline.redis_io import exec_replies, pool_connection, send_commands, text

log = logging.getLogger(__name__)


class Staged(Protocol):
    """What `renew_in` queues its command in: a pipeline, or any stack of commands with its
    `set`."""

    def set(self, name: str, value: str, *, px: int) -> Any: ...


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
        # the connection transactions run on, WATCHing the fence, and the fence read after it
        self._conn: redis.connection.Connection | None = None
        self._value: bytes | str | None = None

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
        self._drop()  # a WATCH taken before the new token would refuse the next EXEC
        self.token = int(self.r.incr(self.fence_key))
        self.renewed = time.monotonic()
        log.info("shard %d: taken with fencing token %d", self.shard, self.token)
        return self.token

    def renew_in(self, pipe: Staged) -> None:
        """Queue the lease's renewal in a transaction (before `execute`)."""
        pipe.set(self.lease_key, self.me, px=self.lease_ms)

    def execute(self, pipe: redis.client.Pipeline) -> None:
        """Commit the commands queued in `pipe` (a transaction pipeline, not yet executed)
        as one MULTI/EXEC under this consumer's token, in one round trip: `Fenced` (nothing
        sent) when the fence read after the WATCH held on this fence's connection is not
        the token; `WatchError` when the fence changed since (Redis refused the EXEC:
        nothing applied); the first error of a command, as redis-py raises it. The WATCH of
        the next transaction and its read follow the EXEC in the same write. Any other
        failure drops the connection (and its WATCH) and raises."""
        if pipe.scripts:
            raise TypeError("a fenced transaction runs no scripts")
        self.execute_commands([args for args, options in pipe.command_stack if EMPTY_RESPONSE not in options])

    def execute_commands(self, commands: Sequence[tuple]) -> None:
        """`execute` of `commands` (each a command's arguments, as redis-py's pipeline stacks
        them) instead of a pipeline's."""
        conn, value = self._watched()
        try:
            self.check(value)
            send_commands(conn, [("MULTI",), *commands, ("EXEC",), *self._watch_commands()])
            result = exec_replies(conn, len(commands))
            conn.read_response()  # WATCH's OK
            self._value = conn.read_response()
        except BaseException:
            self._drop()
            raise
        if result is None:
            raise WatchError(f"shard {self.shard}: the fence changed while watched")
        for reply in result:
            if isinstance(reply, ResponseError):
                raise reply

    def _watch_commands(self) -> list[tuple[str, str]]:
        return [("WATCH", self.fence_key), ("GET", self.fence_key)]

    def _watched(self) -> tuple[redis.connection.Connection, bytes | str | None]:
        """The connection that WATCHes the fence, and the fence as read after that WATCH;
        a fresh one (one round trip) when there is none."""
        if self._conn is not None:
            return self._conn, self._value
        conn = pool_connection(self.r.connection_pool)
        self._conn = conn
        try:
            send_commands(conn, self._watch_commands())
            conn.read_response()
            self._value = conn.read_response()
        except BaseException:
            self._drop()
            raise
        return conn, self._value

    def _drop(self) -> None:
        """Close the watching connection (its WATCH ends with it) and hand it back."""
        conn, self._conn, self._value = self._conn, None, None
        if conn is not None:
            conn.disconnect()
            self.r.connection_pool.release(conn)

    def use(self, r: redis.Redis) -> None:
        """Commit through the client `r` from now on (after a reconnect)."""
        self._drop()
        self.r = r

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
