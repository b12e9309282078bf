"""The rollout consumer: stateless, `slots` concurrent sessions per process.

The main loop reads `work` through `WORK_GROUP` with COUNT = free slots (a freed slot is
refilled at once) and starts one session thread per entry; a sync source runs in that
thread, an async source (`arun`) on the consumer's event loop while the thread waits for
it. A sync source whose sessions never wait (`inline = True`, `runs_inline`: a stand-in of
zero-length sessions) runs on the main loop instead, the sessions of one read one after
another, their results committed together: no thread hand-off per session; and that commit
carries the next read of work (and of `control`) behind its EXEC, in the same write, so a
read and its commit cost one round trip (the entries read are this consumer's as any others:
run next, adopted if the read's reply is lost, run and committed before it stops). A listener
thread follows `control` (cancels; every consumer sees every entry) and `weights` (the
served version `SessionRequest.served_version()` returns) with XREAD.

Owning work: a work entry is this consumer's while it is pending under its name in
`WORK_GROUP`. Every `lease_s / 3` the consumer re-claims all of its entries (XCLAIM, min-idle
0, JUSTID), which resets their idle time: that is the lease. An entry the admission consumer
reclaimed meanwhile (the lease lapsed) no longer comes back, and its session is cancelled.
Liveness for `rollstream status`: after each work read (at most every `lease_s / 3`) the
consumer refreshes `Keys.consumer_heartbeat(name)`, a key that expires after three leases.

Results: each session's result is appended to `results:{shard}` and its work entry
acknowledged in ONE transaction, so a result is never lost and a work entry never
acknowledged without one. Sessions that end while a transaction is in flight share the
next one (`_GroupCommit`); its thread merges, checks and encodes their results. A source that raises produces an INFRA_ERROR result whose `error`
is the traceback (the scheduler then fails the step with it: a broken source), except for
a Redis connection or timeout error (a source loading weights from Redis during an outage):
that fails the attempt as an INFRA_ERROR without `error`, and it is resubmitted. A source
that returns invalid data (a Session that does not encode, e.g. a positive log-prob)
produces an INFRA_ERROR result without `error` plus a dead letter describing the data: bad
data fails the attempt, which is resubmitted, but does not break the run.

Connection loss (a Redis restart, a dropped connection): the main loop backs off, swaps in
a fresh client and re-adopts its pending entries; running sessions keep running. The
listener retries its read, and a session's publication retries its transaction, each
through the same outage bound (`RedisConfig.reconnect_s`, then `RedisUnavailable` stops
the consumer). A publication whose EXEC reply was lost is not simply repeated: it is retried
only while its work entry is still pending under this consumer's name (the transaction also
XACKs it), so a result is appended at most once per work entry by this consumer. If the
lease lapsed during the outage and the admission consumer reclaimed the entry, nothing is
published: the attempt was already finished as `infra_error` and resubmitted.

Cancellation: work whose attempt is in `cancelled:{shard}` when it is read is acknowledged
without running (the scheduler already ended that attempt). The consumer knows that set
without asking for it at each read (`_Cancels`): it reads a shard's set once, when the
shard's first work comes, and each read of work also reads `control` from where the last one
stopped, in the same round trip, so the cancels it knows are those committed before that
read returned, as the set would have told it. At each lease renewal it forgets the cancels
older than `control`'s oldest entry (the admission prunes the set and the stream by the same
age). A Cancel on `control` sets the running session's cancel event; its result is still
appended (the scheduler drops it).

SIGTERM (`main`): stop taking work; let running sessions finish within `grace_s` (leases
kept renewed meanwhile); then cancel the rest and wait briefly for them to return; a
session still stuck after that gets a CANCELLED result appended by the main thread. Every
owned entry thus leaves with a result and an acknowledgement in one transaction: nothing
is lost, and the scheduler resubmits cancelled attempts at once instead of waiting for a
lease to lapse.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import queue
import secrets
import signal
import socket
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from consumers.sources import load_source
from pipeline import streams, wire
from pipeline.collector import collect_less
from pipeline.config import ConsumerConfig
from pipeline.keys import WORK_GROUP, Keys
from pipeline.metrics import Metrics, serving
from pipeline.redis_io import (
    FATAL,
    RETRYABLE,
    Outage,
    check,
    connect,
    parse_id,
    text,
    transaction,
)
from pipeline.scheduler import SampleKey, member, parse_member
from pipeline.sessions import Session, SessionRequest, Status, is_async_source, runs_inline

log = logging.getLogger(__name__)

CANCEL_WAIT_S = 5.0
"""After the grace period, how long cancelled sessions get to return."""


def _member(work: wire.Work) -> str:
    return member(SampleKey(work.epoch, work.group, work.sample, work.attempt))


def _ident(msg: wire.Work | wire.Cancel) -> tuple[int, int, int, int, int]:
    return msg.shard, msg.epoch, msg.group, msg.sample, msg.attempt


class _Cancels:
    """The cancelled attempts this consumer knows, by `_ident`, each with the time of its
    cancel (seconds): each shard's `cancelled` set as read once (`load`; scored by the
    admission's clock), and the Cancels read on `control` since (`note`; Redis's clock)."""

    def __init__(self) -> None:
        self._known: dict[tuple[int, int, int, int, int], float] = {}
        self.shards: set[int] = set()

    def __contains__(self, work: wire.Work) -> bool:
        return _ident(work) in self._known

    def __len__(self) -> int:
        return len(self._known)

    def note(self, cancel: wire.Cancel, at: float) -> None:
        self._known[_ident(cancel)] = at

    def load(self, shard: int, members: Sequence[tuple[bytes, float]]) -> None:
        """A shard's set as read now (members with their scores)."""
        self.shards.add(shard)
        for name, score in members:
            try:
                key = parse_member(name)
            except (ValueError, TypeError):
                log.warning("ignored %r in the cancelled set of shard %d: not epoch:group:sample:attempt",
                            text(name), shard)
                continue
            self._known.setdefault((shard, key.epoch, key.group, key.sample, key.attempt), score)

    def forget_before(self, when: float) -> None:
        """Forget the cancels made before `when` (seconds)."""
        self._known = {ident: at for ident, at in self._known.items() if at >= when}


class _Flag:
    """The cancel mark of a session that never waits (`runs_inline`): its source only looks
    (`is_set`), so it needs no `threading.Event` (a lock and a condition, 2 us to make)."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


class _Owned:
    """One work entry this consumer owns, and the session running it (`waits`: on a thread
    of its own, whose source may wait on its cancel event; else inline, with a `_Flag`)."""

    def __init__(self, entry_id: bytes, work: wire.Work, waits: bool = True) -> None:
        self.entry_id = entry_id
        self.work = work
        self.cancelled: threading.Event | _Flag = threading.Event() if waits else _Flag()
        self.aevent: asyncio.Event | None = None
        self.lock = threading.Lock()
        self.published = False
        self.started = time.time()

    def cancel(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.cancelled.set()
        aevent = self.aevent
        if aevent is not None and loop is not None:
            loop.call_soon_threadsafe(aevent.set)

    def claim_publication(self) -> bool:
        """True for the one caller that may publish this entry's result."""
        with self.lock:
            if self.published:
                return False
            self.published = True
            return True


def _held_lock() -> threading.Lock:
    lock = threading.Lock()
    lock.acquire()
    return lock


@dataclass(eq=False)
class _Publication:
    """A finished session's result entry (and dead letter), waiting for its commit; or,
    with `ended` (the session, its traceback if any, its finish time), what makes them,
    which the committing thread encodes with the rest of its batch (`fields` None till then).
    `wake`, held, is given to the first publication of a `publish` call that finds a commit
    in flight, and released when it is committed (`done`) or its thread is to lead the next
    commit."""

    owned: _Owned
    fields: dict | None
    dead: dict | None
    done: bool = False
    error: BaseException | None = None
    ended: tuple[Session, str | None, float] | None = None
    wake: threading.Lock | None = None


class _GroupCommit:
    """Publications committed in batches: a session thread that finds no commit in flight
    commits every publication queued so far (its own included) in one transaction; the
    others wait, and when a commit ends its thread wakes the publications it committed and
    hands the next commit, of everything queued meanwhile, to the first of the rest. An
    idle consumer thus commits each result at once, a busy one one transaction per round
    trip instead of one per session; only the threads whose turn it is wake. `publish`
    returns once its publications (queued together, so committed together) are committed;
    it raises what the commit raised."""

    def __init__(self, commit: Callable[[Sequence[_Publication]], None]) -> None:
        self._commit = commit
        self._lock = threading.Lock()
        self._queue: list[_Publication] = []
        self._busy = False

    def publish(self, p: _Publication, *more: _Publication) -> None:
        with self._lock:
            self._queue.extend((p, *more))
            lead, self._busy = not self._busy, True
            if not lead:  # before the lock is let go: the commit in flight may release it
                p.wake = _held_lock()
        if p.wake is not None:
            p.wake.acquire()  # committed, or handed the next commit
        if not p.done:
            self._lead()
        if p.error is not None:
            raise p.error

    def _lead(self) -> None:
        with self._lock:
            batch, self._queue = self._queue, []
        error = None
        try:
            self._commit(batch)
        except BaseException as exc:  # noqa: BLE001 (every waiter of the batch raises it)
            error = exc
        finally:
            with self._lock:
                for q in batch:
                    q.done, q.error = True, error
                following = self._queue[0] if self._queue else None
                self._busy = following is not None
            for q in batch:
                if q.wake is not None and q.wake.locked():
                    q.wake.release()
            if following is not None:
                assert following.wake is not None  # the first of a call that found this commit in flight
                following.wake.release()  # it leads the next commit


class _SessionThreads:
    """Daemon threads that run sessions (`run(owned)`), started when none is idle and then
    kept: a session starts on an idle thread, not on a thread started for it. There are as
    many as sessions ever ran at once (the slots; a session stuck past its cancel keeps its
    thread). `close` ends the idle ones."""

    def __init__(self, name: str, run: Callable[[_Owned], None]) -> None:
        self._name, self._run = name, run
        self._queue: queue.SimpleQueue[_Owned | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = self._started = 0

    def start(self, o: _Owned) -> None:
        with self._lock:
            spawn = self._idle == 0
            if spawn:
                self._started += 1
            else:  # an idle thread takes it
                self._idle -= 1
        self._queue.put(o)
        if spawn:
            threading.Thread(target=self._work, name=f"{self._name}-session-{self._started}",
                             daemon=True).start()

    def _work(self) -> None:
        while (o := self._queue.get()) is not None:
            self._run(o)
            with self._lock:
                self._idle += 1

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, 0
        for _ in range(idle):
            self._queue.put(None)


class RolloutConsumer:
    """See the module docstring. `run(stop)` works until `stop` is set, then drains."""

    def __init__(self, config: ConsumerConfig, source: Any, redis: redis.Redis,
                 name: str | None = None, metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.source = source
        self.r = redis
        self.keys = Keys(config.redis.namespace)
        self.name = name or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.is_async = is_async_source(source)
        self.inline = runs_inline(source)
        # a blocking read must not outlast a lease renewal period
        self.block_ms = max(1, min(config.block_ms, int(config.lease_s * 1000 / 6)))
        self.stats: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._owned: dict[bytes, _Owned] = {}
        self._by_ident: dict[tuple, _Owned] = {}
        self._freed = threading.Event()
        self._cancels = _Cancels()
        self._control_from = "0-0"  # where the next read of work reads `control` from
        self._stop = threading.Event()  # `run`'s
        self._read_behind = False  # the commit in hand reads the next work behind its EXEC
        self._read_ahead: tuple[list[streams.Entry], list[streams.Entry]] | None = None  # what it read
        self._adopt_again = False  # a read behind a commit failed: its entries may be pending here
        self._served = 0
        self._failure: BaseException | None = None
        self._next_renew = 0.0
        self._next_heartbeat = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []
        self._quit = threading.Event()  # stops the background threads
        self._publisher = _GroupCommit(self._commit)
        self._sessions = _SessionThreads(self.name, lambda o: self._guarded(self._session, o))

    # ------------------------------------------------------------------ public

    def served_version(self) -> int:
        """The latest weight version seen on the weights stream."""
        return self._served

    @property
    def running(self) -> int:
        return len(self._owned)

    def run(self, stop: threading.Event) -> None:
        """Take and run work until `stop` is set, then drain (see the module docstring)."""
        self._stop = stop
        self._prepare()
        log.info("consumer %s running %d slots (source %s)", self.name, self.config.slots,
                 type(self.source).__name__)
        try:
            outage = Outage(f"consumer {self.name}", self.config.redis.reconnect_s)
            adopt = True
            while not stop.is_set():
                try:
                    if adopt or self._adopt_again:
                        self._read_ahead = None  # the adoption starts them
                        self._adopt_again = False
                        self._adopt_own_pending()
                        adopt = False
                    self._raise_background_failure()
                    self._renew_if_due()
                    self._take_work()
                    self._heartbeat_if_due()
                    outage.ended()
                except FATAL:
                    raise
                except RETRYABLE as exc:
                    # sessions keep running; their results are published once Redis is back
                    stop.wait(outage.failed(exc))
                    self._reconnect()
                    adopt = True  # a lost read reply leaves entries pending under our name
            if self._read_ahead is not None:  # read behind the last commit: started, then drained
                self._take_work()
            self._drain()
        finally:
            self._shutdown()
        log.info("consumer %s stopped: %s", self.name, dict(self.stats))

    # ------------------------------------------------------------------ start-up

    def _prepare(self) -> None:
        check(self.r, self.config.redis)
        streams.ensure_group(self.r, self.keys.work, WORK_GROUP)
        last = {self.keys.control: "0-0", self.keys.weights: "0-0"}
        for stream in last:
            newest = streams.newest(self.r, stream)
            if newest:
                last[stream] = text(newest[0])
                if stream == self.keys.weights:
                    self._on_broadcast(stream, *newest)
        self._control_from = last[self.keys.control]  # older cancels are in the cancelled sets
        self._spawn(self._listen, dict(last), name="listener", background=True)
        if self.is_async:
            self._loop = asyncio.new_event_loop()
            self._spawn(self._loop.run_forever, name="loop", background=True)

    def _spawn(self, target: Callable, *args: Any, name: str, background: bool = False) -> None:
        """Start a daemon thread (a stuck session must not keep the process alive);
        background threads are joined at shutdown."""
        thread = threading.Thread(target=self._guarded, args=(target, *args),
                                  name=f"{self.name}-{name}", daemon=True)
        thread.start()
        if background:
            self._threads.append(thread)

    def _guarded(self, target: Callable, *args: Any) -> None:
        """Run a background thread's work; its failure stops the main loop, which raises it."""
        try:
            target(*args)
        except BaseException as exc:  # handed to the main loop, which re-raises it
            log.exception("consumer %s: background thread failed", self.name)
            if self._failure is None:
                self._failure = exc
            self._freed.set()

    def _raise_background_failure(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"consumer {self.name}: a background thread failed") from self._failure

    def _reconnect(self) -> None:
        """Swap in a fresh client (session and listener threads pick it up at their next
        command); the old one's idle connections are closed, in-use ones fail and retry."""
        old, self.r = self.r, connect(self.config.redis)
        old.connection_pool.disconnect(inuse_connections=False)
        self.stats["reconnects"] += 1
        self._next_renew = 0.0  # renew the leases first thing

    def _adopt_own_pending(self) -> None:
        """Run the entries pending under this consumer's name that it is not running (a
        restart under the same name, or a read whose reply was lost)."""
        known = set(self._owned)  # before the read: one published meanwhile is still known
        items = [(e.id, e.fields) for e in streams.read_group(self.r, WORK_GROUP, self.name, {self.keys.work: "0"})
                 if e.id not in known]
        streams.ack(self.r, self.keys.work, WORK_GROUP, *(i for i, f in items if not f))  # deleted while pending
        self._start([(i, f) for i, f in items if f])

    # ------------------------------------------------------------------ main loop steps

    def _take_work(self) -> None:
        """Read as many entries as there are free slots (or wait for a slot) and start them."""
        self._freed.clear()
        if self._read_ahead is not None:  # read behind the last commit (`_commit_and_read`)
            (read, control), self._read_ahead = self._read_ahead, None
        else:
            free = self.config.slots - len(self._owned)
            if free <= 0:
                self._freed.wait(self.block_ms / 1000)
                return
            read, control = streams.read_group_and_follow(
                self.r, WORK_GROUP, self.name, {self.keys.work: ">"}, {self.keys.control: self._control_from},
                count=free, block_ms=self.block_ms)
        self._note_cancels(control)
        self._start([(e.id, e.fields) for e in read])

    def _note_cancels(self, control: Sequence[streams.Entry]) -> None:
        """Learn the Cancels read on `control` with the work (the listener counts and logs
        what does not decode: every consumer sees every broadcast)."""
        for entry in control:
            self._control_from = text(entry.id)
            try:
                msg = wire.from_fields(entry.fields or {}, wire.Cancel)
            except wire.SchemaError:
                continue  # the listener's `bad_broadcasts`
            self._cancels.note(msg, parse_id(entry.id)[0] / 1000)

    def _start(self, items: Sequence[tuple[bytes, dict]]) -> None:
        """Dead-letter undecodable entries, skip cancelled attempts, start the rest."""
        decoded, poison = [], None
        for entry_id, fields in items:
            try:
                decoded.append((entry_id, wire.from_fields(fields, wire.Work,
                                                           max_bytes=self.config.max_message_bytes)))
            except wire.SchemaError as exc:
                poison = poison if poison is not None else self.r.pipeline(transaction=True)
                self._dead_letter_work(poison, entry_id, fields, exc)
        owned = self._own(decoded)  # before the check: a later Cancel finds them
        try:
            if poison is not None:
                poison.execute()
            skipped = self._skip_cancelled(owned)
        except RETRYABLE:
            # not started: forget them, so that adopting this consumer's pending entries
            # after the reconnect starts them (kept, their leases would be renewed forever)
            self._release(*owned)
            raise
        if self.inline:
            self._run_inline([o for o in owned if o not in skipped])
            return
        for o in owned:
            if o not in skipped:
                self._sessions.start(o)

    def _dead_letter_work(self, pipe: redis.client.Pipeline, entry_id: bytes, fields: dict,
                          exc: wire.SchemaError) -> None:
        """Stage the dead letter and acknowledgement of a work entry that does not decode,
        and, if it still names its attempt, an INFRA_ERROR result for it: the scheduler
        resubmits the sample (and abandons its group after `max_attempts`) instead of
        waiting for a result that would never come."""
        self.stats["dead_letters"] += 1
        log.warning("consumer %s: dead-lettered work %s: %s", self.name, text(entry_id), exc)
        streams.dead_letter(pipe, self.keys.dead, self.keys.work, entry_id, str(exc), fields)
        named = wire.named_attempt(fields)
        if named is not None:
            self.stats["salvaged"] += 1
            failed = wire.Result(*named, self.name, Status.INFRA_ERROR)
            streams.append(pipe, self.keys.results(named[0]), wire.to_fields(failed))
        streams.ack(pipe, self.keys.work, WORK_GROUP, entry_id)
        if self.metrics is not None:
            self.metrics.dead_letter("work", exc.field)

    def _own(self, decoded: Sequence[tuple[bytes, wire.Work]]) -> list[_Owned]:
        """Own the work entries of one read (the slot gauge set once)."""
        owned = [_Owned(entry_id, work, waits=not self.inline) for entry_id, work in decoded]
        with self._lock:
            for o in owned:
                self._owned[o.entry_id] = o
                self._by_ident[_ident(o.work)] = o
            self._observe_slots()
        return owned

    def _release(self, *owned: _Owned) -> None:
        """Forget entries that left (the slot gauge set once), and wake the main loop."""
        if not owned:
            return
        with self._lock:
            for o in owned:
                self._owned.pop(o.entry_id, None)
                ident = _ident(o.work)
                if self._by_ident.get(ident) is o:
                    del self._by_ident[ident]
            self._observe_slots()
        self._freed.set()

    def _observe_slots(self) -> None:
        if self.metrics is not None:
            self.metrics.set_slots(self.name, busy=len(self._owned), total=self.config.slots)

    def _skip_cancelled(self, owned: Sequence[_Owned]) -> set[_Owned]:
        """Acknowledge, without running, attempts cancelled before they started."""
        if not owned:
            return set()
        new_shards = {o.work.shard for o in owned} - self._cancels.shards
        if new_shards:
            self._load_cancels(new_shards)
        cancels = self._cancels
        skipped = {o for o in owned if o.work in cancels or o.cancelled.is_set()}
        skipped = {o for o in skipped if o.claim_publication()}
        if skipped:
            streams.ack(self.r, self.keys.work, WORK_GROUP, *(o.entry_id for o in skipped))
            self.stats["skipped"] += len(skipped)
            self._release(*skipped)
        return skipped

    def _load_cancels(self, shards: set[int]) -> None:
        """Read the cancelled sets of `shards` (one round trip)."""
        ordered = sorted(shards)
        pipe = self.r.pipeline(transaction=False)
        for shard in ordered:
            pipe.zrange(self.keys.cancelled(shard), 0, -1, withscores=True)
        for shard, members in zip(ordered, pipe.execute()):
            self._cancels.load(shard, members)

    def _forget_old_cancels(self) -> None:
        """Forget the cancels older than `control`'s oldest entry: the admission has pruned
        them from the cancelled sets too (by the same age)."""
        oldest = streams.entries(self.r, self.keys.control, count=1)
        if oldest:
            self._cancels.forget_before(parse_id(oldest[0][0])[0] / 1000)

    def _renew_if_due(self) -> None:
        """Re-claim every owned entry (the lease); cancel sessions whose entry was reclaimed;
        forget the cancels the admission pruned."""
        now = time.monotonic()
        if now < self._next_renew:
            return
        self._next_renew = now + self.config.lease_s / 3
        if len(self._cancels):
            self._forget_old_cancels()
        ids = list(self._owned)
        if ids:
            kept = set(streams.claim(self.r, self.keys.work, WORK_GROUP, self.name, 0, ids))
            for entry_id in ids:
                o = self._owned.get(entry_id)
                if entry_id not in kept and o is not None and not o.published:
                    log.warning("consumer %s: lost the lease of %s; cancelling it", self.name, text(entry_id))
                    self.stats["leases_lost"] += 1
                    o.cancel(self._loop)

    def _heartbeat_if_due(self) -> None:
        """Refresh the liveness key (a TTL of three leases), written after a work read, so
        a consumer shown alive has polled for work."""
        now = time.monotonic()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.config.lease_s / 3
        self.r.set(self.keys.consumer_heartbeat(self.name), f"{time.time():.3f}",
                   ex=max(1, math.ceil(3 * self.config.lease_s)))

    # ------------------------------------------------------------------ sessions

    def _session(self, o: _Owned) -> None:
        """Run one session and publish its result (in its own thread)."""
        session, error = self._outcome(o)
        self._publish((o, session, error, time.time()))

    def _run_inline(self, owned: Sequence[_Owned]) -> None:
        """Run the sessions of a source that never waits (`runs_inline`) one after another
        on this thread, and publish their results in one commit."""
        ended = []
        for o in owned:
            session, error = self._outcome(o)
            ended.append((o, session, error, time.time()))
        self._read_behind = not self._stop.is_set()  # this thread leads the commit: no other publishes
        try:
            self._publish(*ended)
        finally:
            self._read_behind = False

    def _outcome(self, o: _Owned) -> tuple[Session, str | None]:
        """Run one session: its Session, and the traceback of a source that raised."""
        o.started = time.time()
        try:
            session = self._call_source(o)
            if not isinstance(session, Session):
                raise TypeError(f"the source returned {type(session).__name__}, not a Session")
            return session, None
        except RETRYABLE as exc:  # its own Redis (the weights) unreachable: an outage, not a bug
            log.warning("consumer %s: the source lost Redis on %s (%s: %s); the attempt fails as "
                        "infra_error", self.name, _member(o.work), type(exc).__name__, exc)
            self.stats["source_outages"] += 1
            return Session(Status.INFRA_ERROR), None
        except Exception:  # a broken source: the step fails with its traceback
            error = traceback.format_exc()
            log.error("consumer %s: the source raised on %s:\n%s", self.name, _member(o.work), error)
            return Session(Status.INFRA_ERROR), error

    def _request(self, o: _Owned, cancelled: Any) -> SessionRequest:
        w = o.work
        return SessionRequest(w.task, w.group, w.sample, w.attempt, w.submitted_version,
                              w.deadline, cancelled, self.served_version)

    def _call_source(self, o: _Owned) -> Session:
        if self._loop is None:
            return self.source.run(self._request(o, o.cancelled))
        return asyncio.run_coroutine_threadsafe(self._arun(o), self._loop).result()

    async def _arun(self, o: _Owned) -> Session:
        o.aevent = asyncio.Event()
        if o.cancelled.is_set():
            o.aevent.set()
        return await self.source.arun(self._request(o, o.aevent))

    def _publish(self, *ended: tuple[_Owned, Session, str | None, float]) -> None:
        """Append the results of sessions that ended (each with its traceback, if any, and
        its finish time) and acknowledge their work entries in one transaction (each once)."""
        ended = tuple(e for e in ended if e[0].claim_publication())
        if not ended:
            return
        # encoded by the thread that commits the batch: one thread at a time encodes, as
        # many numpy calls release the GIL and sessions encoding at once would contend for it
        self._publisher.publish(*(_Publication(o, None, None, ended=(session, error, finished))
                                  for o, session, error, finished in ended))
        for status, n in Counter(session.status for _, session, _, _ in ended).items():  # once per status
            self.stats[f"results_{status.value}"] += n
        self._release(*(o for o, _, _, _ in ended))

    def _commit(self, batch: Sequence[_Publication]) -> None:
        """Append the results of `batch` and acknowledge their work entries in ONE
        MULTI/EXEC, until it is known to have applied, through outages of up to
        `reconnect_s`. After a failure the EXEC may have applied with its reply lost, so
        before trying again an entry must still be pending under this consumer's name: if
        not, it was acknowledged by that EXEC (or reclaimed by the admission consumer, which
        already finished the attempt), and publishing it again would only append a
        duplicate. (Sessions that end while a commit is in flight share the next one.)"""
        self._encode([p for p in batch if p.ended is not None])
        outage = Outage(f"consumer {self.name} publishing {len(batch)} results", self.config.redis.reconnect_s)
        while True:
            try:
                if outage.failures:
                    batch = self._still_pending(batch)
                    if not batch:
                        return
                free = self.config.slots - (len(self._owned) - len(batch))
                if self._read_behind and self._read_ahead is None and not outage.failures and free > 0:
                    self._commit_and_read(batch, free)
                else:
                    transaction(self.r, self._commands(batch))
                outage.ended()
                return
            except FATAL:
                raise
            except RETRYABLE as exc:
                self.stats["publish_retries"] += 1
                time.sleep(outage.failed(exc))

    def _commit_and_read(self, batch: Sequence[_Publication], free: int) -> None:
        """The transaction of `batch` and, behind its EXEC in the same write, the next read of
        work (`free` entries at most, without a block: an empty read leaves the wait to the
        main loop's own read) and of `control`, kept for the next `_take_work`. If the reads'
        replies are lost (the commit raised) or refused, the entries they took may be pending
        under this consumer's name: the main loop adopts its pending entries first."""
        self._read_behind = False  # one read per batch, whatever happens
        try:
            _, self._read_ahead = streams.commit_then_read_group_and_follow(
                self.r, self._commands(batch), WORK_GROUP, self.name, {self.keys.work: ">"},
                {self.keys.control: self._control_from}, count=free)
        except BaseException:  # re-raised: the commit is retried (or fails) as any other
            self._adopt_again = True
            raise
        if self._read_ahead is None:
            self._adopt_again = True

    def _commands(self, batch: Sequence[_Publication]) -> list[tuple]:
        """The XADDs of `batch`'s results (and dead letters), and the XACK of its work."""
        results = {shard: self.keys.results(shard) for shard in {p.owned.work.shard for p in batch}}
        commands: list[tuple] = []
        for p in batch:
            assert p.fields is not None  # encoded before the commit
            commands.append(streams.xadd_args(results[p.owned.work.shard], p.fields))
            if p.dead is not None:
                commands.append(streams.xadd_args(self.keys.dead, p.dead))
        commands.append(("XACK", self.keys.work, WORK_GROUP, *(p.owned.entry_id for p in batch)))
        return commands

    def _still_pending(self, batch: Sequence[_Publication]) -> list[_Publication]:
        pipe = self.r.pipeline(transaction=False)
        for p in batch:
            streams.pending(pipe, self.keys.work, WORK_GROUP, start=p.owned.entry_id, end=p.owned.entry_id,
                            count=1, consumer=self.name)
        kept = [p for p, page in zip(batch, pipe.execute()) if page]
        for p in batch:
            if not any(p is k for k in kept):
                log.info("consumer %s: %s is no longer pending here; not publishing it again",
                         self.name, _member(p.owned.work))
                self.stats["republish_skipped"] += 1
        return kept

    def _encode(self, batch: Sequence[_Publication]) -> None:
        """Make the result entries (and dead letters) of `batch`'s ended sessions: their
        sessions' calls merged into chains here (so a repeated prompt never crosses the
        network), their per-token checks run once over the batch (`wire.results_fields`); a
        session that takes another path, or any of a batch whose joint check fails, is
        encoded alone (`_result_fields`), which refuses a bad one with its reason."""
        if not batch:
            return
        items, own = [], []  # `own`: the consumer's timings of each, for a failed result
        for p in batch:
            assert p.ended is not None
            session, error, finished = p.ended
            o, w = p.owned, p.owned.work
            timings = {"submitted": parse_id(o.entry_id)[0] / 1000, "started": o.started, "finished": finished}
            session.timings = {**timings, **dict(session.timings)}
            own.append(timings)
            items.append((w.shard, w.epoch, w.group, w.sample, w.attempt, session, self.name, error))
        made = wire.results_fields(items, vocab=self.config.vocab, max_bytes=self.config.max_message_bytes)
        for p, item, timings, fields in zip(batch, items, own, made):
            p.fields, p.dead = (fields, None) if fields is not None else self._result_fields(p.owned, item, timings)
            p.ended = None

    def _result_fields(self, o: _Owned, item: tuple[int, int, int, int, int, Session, str, str | None],
                       timings: dict[str, float]) -> tuple[dict, dict | None]:
        """The result entry of one session (`item`: as `wire.result_fields` takes it, its
        timings set), and a dead letter when the session's data does not encode (its
        INFRA_ERROR result with the consumer's `timings`)."""
        w = o.work
        try:
            return wire.result_fields(*item, vocab=self.config.vocab,
                                      max_bytes=self.config.max_message_bytes), None
        except ValueError as exc:  # SchemaError, or calls a source changed after making them
            reason = f"invalid session from {type(self.source).__name__} for {_member(w)}: {exc}"
            log.warning("consumer %s: %s", self.name, reason)
            self.stats["invalid_sessions"] += 1
            if self.metrics is not None:
                self.metrics.dead_letter(f"results:{w.shard}", "invalid session")
            failed = wire.Result(w.shard, w.epoch, w.group, w.sample, w.attempt, self.name,
                                 Status.INFRA_ERROR, timings=timings)
            dead = wire.dead_letter_fields(self.keys.results(w.shard), o.entry_id, reason, {})
            return wire.to_fields(failed), dead

    # ------------------------------------------------------------------ broadcasts

    def _listen(self, last: dict[str, str]) -> None:
        """Follow control (cancels) and weights (served version) until shutdown."""
        outage = Outage(f"consumer {self.name} listener", self.config.redis.reconnect_s)
        while not self._quit.is_set():
            try:
                read = streams.read(self.r, last, block_ms=self.block_ms)
                outage.ended()
            except FATAL:
                raise
            except RETRYABLE as exc:
                self._quit.wait(outage.failed(exc))
                continue
            for stream, entry_id, fields in read:
                last[stream] = text(entry_id)
                self._on_broadcast(stream, entry_id, fields)

    def _on_broadcast(self, stream: str, entry_id: bytes, fields: dict) -> None:
        try:
            msg = wire.from_fields(fields, (wire.Cancel, wire.Weights))
        except wire.SchemaError as exc:
            # every consumer sees every broadcast; the admission consumer dead-letters bad
            # weights entries (it reads them through a group); here they are only counted
            self.stats["bad_broadcasts"] += 1
            log.warning("consumer %s: ignored %s %s: %s", self.name, stream, text(entry_id), exc)
            return
        if isinstance(msg, wire.Weights):
            self._served = max(self._served, msg.version)
            return
        o = self._by_ident.get(_ident(msg))
        if o is not None:
            self.stats["cancelled"] += 1
            o.cancel(self._loop)

    # ------------------------------------------------------------------ shutdown

    def _drain(self) -> None:
        """Let running sessions finish within grace_s, then cancel, then publish CANCELLED
        for sessions that are stuck."""
        log.info("consumer %s draining %d sessions (grace %.1fs)", self.name, len(self._owned),
                 self.config.grace_s)
        self._wait_owned(self.config.grace_s)
        if self._owned:
            log.warning("consumer %s: cancelling %d sessions still running", self.name, len(self._owned))
            for o in list(self._owned.values()):
                o.cancel(self._loop)
            self._wait_owned(min(CANCEL_WAIT_S, self.config.lease_s))
        for o in list(self._owned.values()):
            log.warning("consumer %s: session %s is stuck; handing it back cancelled", self.name,
                        _member(o.work))
            self._publish((o, Session(Status.CANCELLED), None, time.time()))

    def _wait_owned(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while self._owned and time.monotonic() < end:
            self._raise_background_failure()
            try:
                self._renew_if_due()
                self._heartbeat_if_due()
            except FATAL:
                raise
            except RETRYABLE as exc:  # renewed again on the next pass; results retry themselves
                log.warning("consumer %s: lease renewal failed while draining: %s", self.name, exc)
            self._freed.clear()
            if self._owned:
                self._freed.wait(min(self.block_ms / 1000, max(0.0, end - time.monotonic())))

    def _shutdown(self) -> None:
        self._quit.set()
        self._sessions.close()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        for thread in self._threads:
            thread.join(timeout=self.block_ms / 1000 + 5)
        try:
            self.r.delete(self.keys.consumer_heartbeat(self.name))
        except RETRYABLE as exc:
            log.warning("consumer %s: could not remove its heartbeat: %s", self.name, exc)


# ---------------------------------------------------------------------------- entry point


def main(config: ConsumerConfig, source: Any = None, name: str | None = None) -> int:
    """`rollstream consumer --config FILE`: run until SIGTERM or SIGINT, then drain.
    `source` defaults to the one `config.source` names, built from `config.source_args`."""
    collect_less()  # as the admission process: the collector scanned every session's objects
    source = source if source is not None else load_source(config.source, config.source_args)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with serving("consumer", config.redis.namespace, config.metrics_addr, targets=config.metrics_targets,
                 health=lambda: not stop.is_set()) as metrics:
        consumer = RolloutConsumer(config, source, connect(config.redis), name=name, metrics=metrics)
        consumer._observe_slots()
        consumer.run(stop)
    return 0
