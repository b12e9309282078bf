"""The admission consumer: the imperative shell around the scheduling state machine.

One admission consumer runs per trainer rank (shard). It reads, through its consumer group
`admission_group(shard)`, the trainer's `tasks:{shard}` (Open, Registration, Handover), the
rollout consumers' `results:{shard}` and the shared `weights` stream; turns each entry into
a scheduler event; and carries out the actions:

| action      | effect |
|-------------|--------|
| Submit      | XADD `work` a `wire.Work` (deadline on the wall clock: `now` is `time.time()`) |
| Cancel      | XADD `control` a `wire.Cancel`, and ZADD the attempt to `cancelled:{shard}` |
| Discard     | release the attempt's held result (a superseded result was never held) |
| Emit        | pack the held results, XADD `ready:{shard}` a `wire.Ready`, `records:{shard}` a `wire.Record` |
| Fail        | XADD `ready:{shard}` a `wire.Ready` with the `error` (a traceback) |
| Abandon     | counted and logged |
| PushWeights | logged: the distributed trainer publishes itself and reports `published` |

Delivery: every read batch is one `MULTI/EXEC` holding, for each transition in order, its
appended entries, its journal entry (the event and its `now`, see `consumers.journal`) and
the `XACK` of its input. A kill -9 anywhere leaves either all of it
or none of it; what was not committed is still pending in the group and is processed again
on restart, after the machine is rebuilt from the snapshot and the journal. An admitted
result is held until its step is emitted, by reference: its entry of `results:{shard}`
stays in the stream, its Finish's journal entry (and every snapshot while it is held) names
the entry's id, and trimming keeps the stream from the lowest id held (`trim`). Nothing is
written to hold it. Only a result cut to the row width, which no entry holds as cut, is held
as its encoded payload, in `held:{shard}` (one HSET a transaction).

Leases: rollout consumers hold their work as pending entries of the `work` stream's
`WORK_GROUP` and renew them by re-claiming. Every `lease_s / 2` this consumer lists entries
idle longer than `lease_s`, claims those of its own shard (XCLAIM with that min-idle, so a
renewal that raced it wins) and, in one transaction per batch, feeds the scheduler an
`INFRA_ERROR` finish for each, then XACKs and XDELs the entry. Other shards' entries are
left for their own admission consumer. If this process dies between claim and commit, the
claimed entries are pending under its own name and are finished on restart.

Refusals: an entry that does not decode, or violates the schema, or belongs to another
shard, goes to the `dead` stream with the reason, acknowledged in the same transaction.
A result that fails validation but still names its attempt is also finished as an
`INFRA_ERROR` attempt, so its sample is resubmitted instead of waiting forever. An event the
protocol refuses (`ProtocolError`: a handover before its batch, an epoch going backwards)
is dead-lettered the same way (a refused handover also gets an error `Ready`, so the trainer
raises instead of waiting), and the machine is rebuilt from Redis.

Connection loss: `run` hands connection and timeout errors to a `redis_io.Outage` (bounded,
jittered backoff; `RedisUnavailable` after `RedisConfig.reconnect_s`), then reconnects with a
fresh client and recovers exactly as on start. A transaction whose reply was lost applies
once either way: if it committed, its journal entry is replayed and its inputs are
acknowledged; if not, neither, and the inputs are read again. See docs/pipeline.md.

One admission consumer per shard, enforced (`consumers.fence`): it takes the shard's lease
and a fencing token before it recovers, every transaction commits only under that token,
and a consumer that another has replaced finds its next transaction refused (`Fenced`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import signal
import threading
import time
import traceback
from bisect import bisect_right
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from operator import itemgetter
from typing import Any

import numpy as np
import redis

from consumers import journal
from consumers.fence import Fence
from pipeline import streams, wire
from pipeline.collector import collect_less
from pipeline.config import AdmissionConfig, scheduler_differences
from pipeline.keys import TRAINER_GROUP, WORK_GROUP, Keys, admission_group
from pipeline.metrics import Metrics, serving
from pipeline.packing import Group, PackedBatch, Rollout, pack
from pipeline.ready import ReadyRecord, compact
from pipeline.redis_io import (
    FATAL,
    RETRYABLE,
    Outage,
    check,
    connect,
    parse_id,
    text,
)
from pipeline.scheduler import (
    Abandon,
    Action,
    Cancel,
    Close,
    Discard,
    Emit,
    Event,
    Fail,
    Finish,
    Handover,
    Open,
    ProtocolError,
    Publish,
    PushWeights,
    Register,
    SampleKey,
    Submit,
    Tick,
    member,
    parse_member,
)
from pipeline.session_metrics import session_metrics
from pipeline.sessions import Status

log = logging.getLogger(__name__)


class ConfigMismatch(ProtocolError):
    """The trainer opened an epoch under another scheduler config than this consumer's."""

READ_COUNT = 256
"""Entries read per input stream per iteration (one transaction)."""
RECLAIM_PAGE = 256
RECLAIM_PAGES = 20
COMMIT_BYTES = 8 * 1024 * 1024
"""A read batch is committed in several transactions once this many payload bytes are staged."""
COMMIT_TRANSITIONS = 256
RECORDS_MAXLEN = 10_000
DEAD_MAXLEN = 10_000


_NONE_HELD: dict[int, set[str]] = {}  # an epoch without held results (never changed)

REF = b"@"
"""A value of `held:{shard}` that starts with this is `REF` + the id of the result's entry of
`results:{shard}` (a payload is a msgpack map, which never starts with it): how a result was
held by reference before the journal named it; still read on recovery."""


class _Commands:
    """The commands of a transaction, in order, each as the arguments redis-py's pipeline
    would stack for the same call (so the same bytes go on the wire), without its command
    machinery; `Fence.execute_commands` sends them."""

    def __init__(self) -> None:
        self.stack: list[tuple] = []

    def __len__(self) -> int:
        return len(self.stack)

    def xadd(self, name: str, fields: Mapping[bytes, bytes]) -> None:
        if not fields:  # as redis-py refuses it
            raise redis.exceptions.DataError("XADD fields must be a non-empty dict")
        self.stack.append(streams.xadd_args(name, fields))

    def xack(self, name: str, group: str, *ids: bytes) -> None:
        self.stack.append(("XACK", name, group, *ids))

    def xdel(self, name: str, *ids: bytes) -> None:
        self.stack.append(("XDEL", name, *ids))

    def hset(self, name: str, key: str | None = None, value: bytes | None = None, *,
             mapping: Mapping[str, bytes] | None = None) -> None:
        pairs = [] if key is None else [key, value]
        for pair in (mapping or {}).items():
            pairs.extend(pair)
        self.stack.append(("HSET", name, *pairs))

    def hdel(self, name: str, *keys: str) -> None:
        self.stack.append(("HDEL", name, *keys))

    def zadd(self, name: str, mapping: Mapping[str, float]) -> None:
        self.stack.append(("ZADD", name, *(part for member_, score in mapping.items() for part in (score, member_))))

    def delete(self, *names: str) -> None:
        self.stack.append(("DEL", *names))

    def set(self, name: str, value: str, *, px: int) -> None:
        self.stack.append(("SET", name, value, "PX", px))


class _Txn:
    """One MULTI/EXEC being assembled: effects and journal entries in order, acks, the
    entry ids of the results it holds by reference (journaled with their Finish), and the
    held payloads it writes (so a step emitted in the same transaction can read them; they
    are written in one HSET at the end, less those the same transaction released)."""

    def __init__(self) -> None:
        self.pipe = _Commands()
        self.observe: list[Callable[[Metrics], None]] = []  # metrics, applied once committed
        # and the per-entry ones, counted together then (`Admission._observe`): the events'
        # kinds, their actions, the results' statuses and sessions' durations
        self.kinds: list[type] = []
        self.actions: list[Action] = []
        self.statuses: list[Status] = []
        self.durations: list[float | None] = []
        self.held: dict[str, bytes | None] = {}
        self.refs: dict[int, bytes] = {}  # by the index of its Finish in `journal`
        self.acks: dict[tuple[str, str], list[bytes]] = defaultdict(list)
        self.journal: list[tuple[Event, float]] = []  # the transitions' events and times, in order
        self.bytes = 0  # payload bytes staged

    def xadd(self, stream: str, fields: dict[bytes, bytes]) -> None:
        self.bytes += sum(map(len, fields.values()))
        self.pipe.xadd(stream, fields)

    def append(self, stream: str, data: bytes) -> None:
        """`xadd(stream, {wire.FIELD: data})`: an encoded message, as `wire.to_fields` carries it."""
        self.bytes += len(data)
        self.pipe.stack.append(streams.xadd_field_args(stream, wire.FIELD, data))

    @property
    def transitions(self) -> int:
        return len(self.journal)

    @property
    def full(self) -> bool:
        return self.bytes >= COMMIT_BYTES or self.transitions >= COMMIT_TRANSITIONS

    def ack(self, stream: str, group: str, entry_id: bytes) -> None:
        self.acks[(stream, group)].append(entry_id)

    def __len__(self) -> int:
        return len(self.pipe) + len(self.journal) + sum(map(len, self.acks.values()))


class Admission:
    """The admission consumer of one shard; see the module docstring.

    `poll_once(block_ms)` runs one iteration (read a batch, its transitions, a tick, and
    lease reclaim and trimming when due) and returns the number of transitions; `run(stop)`
    loops until `stop` is set, recovering from Redis after connection errors.
    """

    def __init__(self, config: AdmissionConfig, redis: redis.Redis, *,
                 clock: Callable[[], float] = time.time, snapshot_every: int | None = None,
                 control_retention_s: float | None = None,
                 read_count: int = READ_COUNT, metrics: Metrics | None = None,
                 fence: Fence | None = None) -> None:
        self.config = config
        self.metrics = metrics
        if metrics is not None:
            metrics.start_shard(config.shard)
        self.r = redis
        self.keys = Keys(config.redis.namespace)
        self.shard = config.shard
        self.group = admission_group(config.shard)
        self.name = f"admission-{config.shard}"
        self.clock = clock
        # the config's, unless overridden (tests)
        self.snapshot_every = snapshot_every if snapshot_every is not None else config.snapshot_every
        self.control_retention_s = (control_retention_s if control_retention_s is not None
                                    else config.control_retention_s)
        self.read_count = read_count
        self.stats: Counter[str] = Counter()
        k = self.keys
        self._expect: dict[str, Any] = {
            k.tasks(self.shard): (wire.Open, wire.Registration, wire.Handover),
            k.results(self.shard): wire.Result,
            k.weights: wire.Weights,
        }
        self._new = {stream: ">" for stream in self._expect}  # a read of new entries
        self._work = k.work
        self._next_reclaim = 0.0
        self._next_taken_back = 0.0
        self._unapplied = 0  # entries of the batch being applied not applied yet (`_transitions`)
        self._next_trim = time.monotonic() + config.trim_every_s
        self.outage = Outage(f"admission shard {self.shard}", config.redis.reconnect_s)
        # the read of new entries written ahead (`_read_new`), and its reply once read early
        self._ahead: streams.ReadAhead | None = None
        self._received: tuple[list[_Read], tuple[int, int] | None] | None = None
        check(self.r, config.redis)
        # one consumer per shard: every transaction commits under this one's fencing token
        self.fence = fence or Fence(self.r, self.keys, self.shard, config.shard_lease_s)
        if self.fence.token is None:
            self.fence.acquire()
        self._recover()

    # ------------------------------------------------------------------ loop

    def run(self, stop: threading.Event) -> None:
        """Poll until `stop` is set. On a connection or timeout error: back off, reconnect
        with a fresh client and recover exactly as on start (the machine rebuilt from the
        snapshot and journal, the pending inputs read again): a transaction whose reply was
        lost may or may not have committed, and only Redis knows which. Gives up with
        `RedisUnavailable` after `reconnect_s` without Redis; refused credentials raise."""
        stale = False
        log.info("admission shard %d running (epoch %d)", self.shard, self.sched.epoch)
        while not stop.is_set():
            try:
                if stale:
                    self._reconnect()
                    stale = False
                self.poll_once(self.config.block_ms)
                self.outage.ended()
            except FATAL:
                raise
            except RETRYABLE as exc:
                stale = True
                stop.wait(self.outage.failed(exc))
        log.info("admission shard %d stopped: %s", self.shard, dict(self.stats))

    def poll_once(self, block_ms: int | None = None) -> int:
        """One iteration: read, transitions, tick, reclaim and trim when due, and the
        shard's lease renewed when nothing else renewed it."""
        if self.fence.due():
            self._commit(_Txn(), renew=True)
        entries = self._read(block_ms)
        done = self._transitions(entries)
        done += self._tick()
        now = time.monotonic()
        if now >= self._next_reclaim:
            self._next_reclaim = now + self.config.lease_s / 2
            done += self._reclaim()
        if now >= self._next_taken_back:
            self._next_taken_back = now + self.config.shard_lease_s / 2
            self._taken_back()
        if now >= self._next_trim:
            self._next_trim = now + self.config.trim_every_s
            self.trim()
        return done

    # ------------------------------------------------------------------ recovery

    def _recover(self) -> None:
        """Create the groups, rebuild the machine, index the held payloads, and finish the
        work this consumer claimed but did not commit."""
        k = self.keys
        for stream in self._expect:
            streams.ensure_group(self.r, stream, self.group)
        streams.ensure_group(self.r, k.work, WORK_GROUP)
        streams.ensure_group(self.r, k.ready(self.shard), TRAINER_GROUP)
        journal.check_config(self.r, k, self.shard, self.config.scheduler)
        self._rebuild()
        self._backlog = True  # read this consumer's own pending inputs first
        self._deferred: list[_Read] = []  # read, pending, not yet applied
        self._drop_ahead()  # its entries are in the backlog
        self._finish_reclaimed(self._own_work())

    def _reconnect(self) -> None:
        """A fresh client, then recovery from Redis (nothing in memory is trusted)."""
        old, self.r = self.r, connect(self.config.redis)
        old.close()
        self.fence.use(self.r)
        self.stats["reconnects"] += 1
        self._recover()
        log.info("shard %d: reconnected and recovered (epoch %d, %d in flight)", self.shard,
                 self.sched.epoch, self.sched.in_flight)

    def _rebuild(self) -> None:
        self.sched, self._since_snapshot, refs = journal.load(
            self.r, self.keys, self.shard, self.config.scheduler)
        self._snapshot_after = self._snapshot_interval()
        # the members held, by epoch then group (`_hold`)
        self._held: dict[int, dict[int, set[str]]] = {}
        # the held results this process decoded, by member: never trusted across a rebuild
        self._decoded: dict[str, Rollout] = {}
        # the entry id of each result held by reference; the members whose payload
        # `held:{shard}` has, and those it has as a reference (written by an earlier version)
        self._refs: dict[str, bytes] = {}
        self._stored: set[str] = set()
        self._stored_refs: set[str] = set()
        # the slot seconds of the results this process held (`rollstream_held_session_seconds`;
        # those held across a rebuild are not in it: their sessions were counted before it)
        self._held_seconds: dict[str, float] = {}
        self._held_s = 0.0
        for name, value in self.r.hgetall(self.keys.held(self.shard)).items():
            if value.startswith(REF):
                self._refs[text(name)] = value[len(REF):]
                self._stored_refs.add(text(name))
            else:
                self._stored.add(text(name))
        admitted = set(map(member, self.sched.admitted_keys()))
        self._refs.update((name, ref) for name, ref in refs.items()
                          if name in admitted and name not in self._stored)
        for name in [*self._stored, *self._refs]:
            key = parse_member(name)
            self._held.setdefault(key.epoch, {}).setdefault(key.group, set()).add(name)

    def held(self) -> set[str]:
        """The members whose results this consumer holds until their step."""
        return {name for groups in self._held.values() for names in groups.values() for name in names}

    def held_count(self) -> int:
        """How many results it holds (as `len(held())`; safe to read from another thread)."""
        return len(self._refs) + len(self._stored)

    # ------------------------------------------------------------------ reading

    def _read(self, block_ms: int | None) -> list[tuple[str, bytes, dict | None]]:
        """The next entries of the three input streams, in id order across the streams.

        A stream whose read returned `read_count` entries may hold more before the entries
        the other streams returned (a backlog of results behind a handover): only the
        entries up to the last id of such a stream are applied now. The rest stay pending:
        a backlog read (`0`) returns them again, new entries (`>`) wait in `_deferred`."""
        if self._backlog:
            read, cutoff = self._xread({s: "0" for s in self._expect}, None)
            if read:
                return [entry for _, entry in _up_to(read, cutoff)[0]]
            self._backlog = False
        block = None if self._deferred else (block_ms or None)
        read, cutoff = self._read_new(block)
        if self._deferred:
            read = sorted(self._deferred + read, key=_ID)
        now, self._deferred = _up_to(read, cutoff)
        return [entry for _, entry in now]

    def _read_new(self, block_ms: int | None) -> tuple[list[_Read], tuple[int, int] | None]:
        """`_xread` of new entries: those of the read written ahead when there is one (when it
        found none, a read that may block follows), and, when this read was cut at
        `read_count` (a backlog: more entries wait already), the next one written ahead
        (`streams.ReadAhead`), which Redis runs while this batch is applied. Behind a backlog,
        an entry appended during a batch is read with the batch after the next one."""
        self._receive_ahead()
        got, self._received = self._received, None
        if got is None or not got[0]:
            got = self._xread(self._new, block_ms)
        if got[1] is not None:
            self._ahead = streams.ReadAhead(self.r, self.group, self.name, self._new, count=self.read_count)
        return got

    def _receive_ahead(self) -> None:
        """The reply of the read written ahead, if one is pending, read into `_received`."""
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            self._received = self._ordered(ahead.receive())

    def _drop_ahead(self) -> None:
        """Forget the read written ahead, received or not: what it delivered is pending in
        the group, and a backlog read (`0`) returns it."""
        ahead, self._ahead, self._received = self._ahead, None, None
        if ahead is not None:
            ahead.drop()

    def _taken_back(self, unapplied: int = 0) -> bool:
        """Read again, from the backlog, entries of this consumer's name that it neither
        applied nor holds back (`_deferred`, and the `unapplied` entries of the batch being
        applied): those a predecessor read after it lost the shard. Its consumer name is this
        one and its commits are fenced, but not its reads: an entry it read stays pending here,
        unapplied, and `>` never returns it. Checked every `shard_lease_s / 2` and before an
        event is refused (a handover whose batch's registration such a read took). True when there
        were some: the backlog, in id order, is read next."""
        taken = self._taken(unapplied)
        if taken <= 0:
            return False
        log.warning("shard %d: %d input entries pending here were read by a consumer that lost "
                    "the shard; reading them again", self.shard, taken)
        self.stats["taken_back"] += taken
        self._deferred, self._backlog = [], True  # the backlog read returns the deferred too
        self._drop_ahead()  # received by `_taken`: the backlog returns it too
        return True

    def _taken(self, unapplied: int) -> int:
        """Input entries pending under this consumer's name that it neither applied nor holds
        back: read by a predecessor that lost the shard (`_taken_back`). The read written
        ahead is received first: its entries are this consumer's own."""
        self._receive_ahead()
        received = len(self._received[0]) if self._received is not None else 0
        return streams.pending_of(self.r, list(self._expect), self.group, self.name) \
            - len(self._deferred) - unapplied - received

    def _xread(self, names: dict[str, str],
               block_ms: int | None) -> tuple[list[_Read], tuple[int, int] | None]:
        """The entries read with their ids parsed (`_Read`), sorted by id, and the lowest
        last id of a stream whose read was cut at `read_count` (None if none was)."""
        return self._ordered(streams.read_group(self.r, self.group, self.name, names, count=self.read_count,
                                               block_ms=block_ms))

    def _ordered(self, entries: list[streams.Entry]) -> tuple[list[_Read], tuple[int, int] | None]:
        """`_xread`'s value of the entries of one read."""
        read = [(parse_id(e.id), e) for e in entries]
        per_stream = Counter(e.stream for e in entries)
        cut = [max(key for key, e in read if e.stream == name)
               for name, n in per_stream.items() if n >= self.read_count]
        read.sort(key=_ID)
        return read, min(cut, default=None)

    # ------------------------------------------------------------------ transitions

    def _transitions(self, entries: Sequence[tuple[str, bytes, dict | None]]) -> int:
        txn = _Txn()
        done = 0
        results = self._results(entries)
        for i, (stream, entry_id, fields) in enumerate(entries):
            self._unapplied = len(entries) - i
            try:
                self._input(txn, stream, entry_id, fields, results[i])
            except ProtocolError as exc:
                done += self._commit(txn)
                self._rebuild()  # the refused event may have touched the machine
                if self._taken_back(unapplied=len(entries) - i):
                    return done  # this entry again, after the ones it was refused for lack of
                self._refuse(stream, entry_id, fields, exc)
                txn = _Txn()
            if txn.full:  # whole transitions only: a batch may span several transactions
                done += self._commit(txn)
                txn = _Txn()
        return done + self._commit(txn)

    def _results(self, entries: Sequence[tuple[str, bytes, dict | None]]) -> list[wire.Result | None]:
        """The results of the entries of `results:{shard}` among `entries`, decoded and checked
        (this run's vocabulary) together (`wire.decode_results`); None for every other entry
        and for any result that path leaves to `_input` (which decodes it alone: the message,
        or the refusal with its field and reason)."""
        results = self.keys.results(self.shard)
        datas = [fields.get(wire.FIELD) if stream == results and type(fields) is dict else None
                 for stream, _, fields in entries]
        return wire.decode_results(datas, vocab=self.config.vocab, max_bytes=self.config.max_message_bytes)

    def _input(self, txn: _Txn, stream: str, entry_id: bytes, fields: dict | None,
               result: wire.Result | None = None) -> None:
        """One input entry: decode, apply, acknowledge (all staged in `txn`); `result`: its
        result, already decoded and checked (`_results`). A ProtocolError leaves nothing of
        this entry staged."""
        if not fields:  # deleted while pending: nothing left to apply
            txn.ack(stream, self.group, entry_id)
            return
        try:
            msg: wire.Message | None = result
            if msg is None:
                msg = wire.from_fields(fields, self._expect[stream], max_bytes=self.config.max_message_bytes)
                if isinstance(msg, wire.Result):  # this run's limits: vocabulary
                    wire.check_result(msg, vocab=self.config.vocab)
            payload = fields[wire.FIELD]
            event = self._event(msg)
            if isinstance(event, Finish):  # a chain longer than a packed row is cut to it
                msg, payload, event = self._fit_width(txn, msg, payload, event)
        except wire.SchemaError as exc:
            self._dead_letter(txn, stream, entry_id, fields, str(exc))
            if stream == self.keys.results(self.shard):
                self._salvage(txn, fields)
            txn.ack(stream, self.group, entry_id)
            return
        if isinstance(event, str):
            self.stats["dropped"] += 1
            log.info("shard %d: dropped %s %s: %s", self.shard, msg.KIND, text(entry_id), event)
        else:
            held = None
            if isinstance(msg, wire.Result):  # the entry itself, unless cut to the row width
                held = ((entry_id, None) if payload is fields[wire.FIELD] else (None, payload), msg.rollout())
            self._apply(txn, event, held)
        if isinstance(msg, wire.Result):
            txn.statuses.append(msg.status)
            txn.durations.append(_duration(msg.timings))
        txn.ack(stream, self.group, entry_id)

    def _event(self, msg: wire.Message) -> Event | str:
        """The scheduler event of a decoded message, or why it is dropped (an earlier
        epoch's, or a repeated handover of the step already pending)."""
        if isinstance(msg, wire.Weights):
            return Publish(msg.version)
        if msg.shard != self.shard:
            raise wire.SchemaError("shard", f"shard {msg.shard} on shard {self.shard}'s stream")
        if isinstance(msg, wire.Result):
            key = SampleKey(msg.epoch, msg.group, msg.sample, msg.attempt)
            return Finish(key, msg.status, msg.reward, msg.oldest_version, msg.error)
        if isinstance(msg, wire.Open):
            self._check_run_config(msg)
            return Open(msg.epoch)
        if msg.epoch < self.sched.epoch:
            return f"epoch {msg.epoch} ended"
        if msg.epoch > self.sched.epoch:
            raise ProtocolError(f"{msg.KIND} of epoch {msg.epoch} while epoch {self.sched.epoch} is open")
        if isinstance(msg, wire.Registration):
            after = self.sched.last_batch
            if 0 <= after < msg.batch - 1 and self._taken(self._unapplied) > 0:
                # a predecessor that lost the shard read the batches between: they come
                # first (refused here, they are read again from the backlog, in id order)
                raise ProtocolError(f"batch {msg.batch} registered before batch {after + 1} in "
                                    f"epoch {msg.epoch}, which a consumer that lost the shard read")
            return Register(msg.batch, msg.tasks)
        if msg.step == self.sched.pending_step:
            return f"step {msg.step} is already pending"
        return Handover(msg.step, msg.updates, msg.published, msg.steps_left)

    def _check_run_config(self, msg: wire.Open) -> None:
        """The trainer's scheduler config is the run's: an epoch opened under another one
        than this consumer's is refused (ConfigMismatch), naming the differing fields."""
        if msg.scheduler is None:  # a writer that predates the field
            return
        differ = scheduler_differences(msg.scheduler, self.config.scheduler)
        if differ:
            raise ConfigMismatch(
                f"epoch {msg.epoch} refused: the trainer's scheduler config differs from admission "
                f"shard {self.shard}'s (trainer's != admission's): {'; '.join(differ)}; give both "
                "the same scheduler section")

    def _fit_width(self, txn: _Txn, result: wire.Result, payload: bytes,
                   event: Finish) -> tuple[wire.Result, bytes, Finish]:
        """A result with a chain longer than a packed row, cut to the row (`wire.fit_width`):
        it trains as a truncation under the run's policy, and its staleness stays the whole
        rollout's. The cut result is what is held."""
        cut = wire.fit_width(result, self.config.scheduler.width)
        if cut is None:
            return result, payload, event
        self.stats["overlong"] += 1
        log.info("shard %d: %s's chains (%s tokens) cut to the row width %d", self.shard, event.key,
                 "/".join(str(len(c)) for c in result.chains), self.config.scheduler.width)
        txn.observe.append(lambda m: m.rollouts_overlong.labels(str(self.shard)).inc())
        encoded = wire.encode(cut, max_bytes=self.config.max_message_bytes)
        return cut, encoded, replace(event, status=cut.status)

    def _apply(self, txn: _Txn, event: Event,
               payload: tuple[tuple[bytes | None, bytes | None], Rollout] | None = None) -> list[Action]:
        """Apply `event` now, journal it and stage its effects. `payload` is what holds the
        result of a Finish (the id of its entry, or its encoded payload when it was cut)
        and its decoded rollout, held if the scheduler admits it."""
        now = self.clock()
        actions = self.sched.handle(event, now)
        txn.journal.append((event, now))
        self.stats["transitions"] += 1
        if isinstance(event, (Open, Close)):
            self._drop_epochs(txn, keep=self.sched.epoch if isinstance(event, Open) else None)
        if isinstance(event, Finish) and payload is not None and not (actions and any(
                isinstance(a, Discard) and a.key == event.key for a in actions)):
            (ref, data), rollout = payload
            self._hold(txn, event.key, ref, data, rollout)
        for action in actions:
            self._carry_out(txn, action, now)
        txn.kinds.append(type(event))
        txn.actions += actions
        if isinstance(event, Publish):
            txn.observe.append(lambda m: m.served_version.set(self.sched.served))
        return actions

    def _tick(self) -> int:
        """Advance time; journaled only when it did something (a tick without actions
        changes nothing a later event could observe)."""
        txn = _Txn()
        now = self.clock()
        actions = self.sched.handle(Tick(), now)
        if not actions:
            return 0
        txn.journal.append((Tick(), now))
        for action in actions:
            self._carry_out(txn, action, now)
        txn.actions += actions
        return self._commit(txn)

    def _commit(self, txn: _Txn, renew: bool = False) -> int:
        """EXEC the transaction, with a snapshot replacing the journal when one is due, the
        shard's lease renewed, and only under this consumer's fencing token (`Fenced`
        otherwise: another consumer took the shard over). `renew`: commit even an empty
        transaction (the lease's renewal alone)."""
        if not len(txn) and not renew:
            return 0
        held = {name: payload for name, payload in txn.held.items() if payload is not None}
        if held:  # one HSET for the transaction (the names are new: one per attempt)
            txn.pipe.hset(self.keys.held(self.shard), mapping=held)
        for (stream, group), ids in txn.acks.items():
            streams.ack(txn.pipe, stream, group, *ids)
        snapshot = self._since_snapshot + txn.transitions >= self._snapshot_after
        if snapshot:  # it covers this transaction's events too, and the results they hold
            txn.pipe.hset(self.keys.state(self.shard), mapping={
                journal.SNAPSHOT: journal.encode_snapshot(self.sched), journal.HELD: journal.encode_held(self._refs)})
            txn.pipe.delete(self.keys.journal(self.shard))
        elif txn.journal:  # the transaction's events, in order, in one entry
            txn.pipe.xadd(self.keys.journal(self.shard),
                          {journal.FIELD: journal.encode_events(txn.journal, txn.refs)})
        self.fence.renew_in(txn.pipe)
        self._execute(txn)
        self._since_snapshot = 0 if snapshot else self._since_snapshot + txn.transitions
        if snapshot:
            self._snapshot_after = self._snapshot_interval()
        if self.metrics is not None:
            self._observe(self.metrics, txn)
        return txn.transitions

    def _observe(self, m: Metrics, txn: _Txn) -> None:
        """The metrics of a committed transaction: its entries' counted together, then the
        rest in order."""
        m.observe_events(self.shard, txn.kinds)
        m.observe_actions(self.shard, txn.actions)
        m.observe_finished_many(self.shard, txn.statuses, txn.durations)
        for observe in txn.observe:
            observe(m)
        m.set_in_flight(self.shard, self.sched.in_flight)
        m.set_held_seconds(self.shard, self._held_s)

    def _snapshot_interval(self) -> int:
        """Transitions until the next snapshot, fixed at each snapshot and at a rebuild:
        `snapshot_every`, or the samples the machine tracks then when there are more. A
        snapshot's size grows with them (every sample of every group running, admitting or
        awaiting its step is in it), so this bounds its cost per transition to about one
        sample's; the journal a recovery replays stays bounded by the same number of
        transitions."""
        return max(self.snapshot_every, self.sched.tracked_samples)

    def _execute(self, txn: _Txn) -> None:
        """EXEC under the fencing token (`Fence.execute`). A refused EXEC is `Fenced` when
        the token changed; otherwise a connection error, which the loop rides out like any
        other (nothing of the transaction was applied), as it does a connection lost while
        the transaction was sent or its reply read (applied or not: recovery finds out)."""
        try:
            self.fence.execute_commands(txn.pipe.stack)
        except redis.exceptions.WatchError as exc:
            self.fence.check()
            raise redis.exceptions.ConnectionError(f"shard {self.shard}: transaction not applied: {exc}") from exc
        finally:
            txn.pipe.stack.clear()
        self.fence.renewed_now()

    # ------------------------------------------------------------------ actions

    def _carry_out(self, txn: _Txn, action: Action, now: float) -> None:
        k, shard = self.keys, self.shard
        if isinstance(action, Submit):  # its task was checked on input: encoded as trusted
            key = action.key
            txn.append(self._work, wire.work_bytes(shard, key.epoch, key.group, key.sample, key.attempt,
                                                   action.task, action.submitted_version, action.deadline,
                                                   action.cause))
        elif isinstance(action, Cancel):
            key = action.key
            cancel = wire.Cancel(shard, key.epoch, key.group, key.sample, key.attempt, action.reason)
            txn.xadd(k.control, wire.to_fields(cancel, trusted=True))
            txn.pipe.zadd(k.cancelled(shard), {member(key): now})
        elif isinstance(action, Discard):
            if action.reason != "superseded":  # a superseded result was never held
                self._unhold(txn, [action.key])
        elif isinstance(action, Emit):
            self._emit(txn, action)
        elif isinstance(action, Fail):
            self.stats["failed"] += 1
            log.error("shard %d: step %s fails: %s", shard, action.step, action.error)
            if action.step is not None:
                self._ready_error(txn, action.step, action.error)
        elif isinstance(action, Abandon):
            self.stats["abandoned"] += 1
            log.warning("shard %d: abandoned group %d (task %s of batch %d) after %s",
                        shard, action.group, action.task.id, action.batch, action.cause)
            self._unhold_group(txn, self.sched.epoch, action.group)
        elif isinstance(action, PushWeights):
            log.info("shard %d: weights %d are due; the trainer publishes them and reports "
                     "`published` in its handover", shard, action.version)
        else:
            raise TypeError(f"unknown action {action!r}")

    def _emit(self, txn: _Txn, emit: Emit) -> None:
        """Pack the step's admitted groups and append its Ready and Record."""
        cfg = self.config.scheduler
        keys = [key for g in emit.groups for key in g.samples]
        names = [member(key) for key in keys]
        rollouts = iter(self._rollouts(txn, keys, names))
        groups = [Group.from_rollouts(g.group, [next(rollouts) for _ in g.samples]) for g in emit.groups]
        rec = emit.record
        try:
            packed = pack(groups, rows=cfg.rows, width=cfg.width, estimator=cfg.estimator,
                          truncation=cfg.truncation, support_capacity=cfg.support_capacity)
            metrics = _finite(session_metrics(groups, packed, updates=rec.updates))
            ready_record = _ready_record(emit, packed, metrics, _extra(emit, packed, groups))
            ready = wire.to_fields(wire.Ready(self.shard, self.sched.epoch, emit.step, rec.updates,
                                              compact(packed), ready_record),
                                   max_bytes=self.config.max_message_bytes)
            record = wire.to_fields(wire.Record.of(self.shard, self.sched.epoch, emit.step, ready_record))
        except ValueError as exc:  # a rollout that cannot train as given; SchemaError included
            self._ready_error(txn, emit.step, f"step {emit.step} cannot be emitted: {exc}\n"
                              + traceback.format_exc())
        else:
            txn.xadd(self.keys.ready(self.shard), ready)
            txn.xadd(self.keys.records(self.shard), record)
            self.stats["emitted"] += 1
            txn.observe.append(lambda m: m.observe_record(ready_record.scheduler_record(), shard=self.shard,
                                                          **ready_record.extra))
            txn.observe.append(lambda m: m.observe_trained(self.shard, _trained_seconds(groups, packed)))
        self._unhold(txn, keys, names)
        # and the held results of every group the machine no longer tracks
        self._drop_epochs(txn, keep=self.sched.epoch)
        held = self._held.get(self.sched.epoch)
        if held and not held.keys() <= (live := self.sched.live_groups()):
            for gid in [gid for gid in held if gid not in live]:
                self._unhold_group(txn, self.sched.epoch, gid)

    def _ready_error(self, txn: _Txn, step: int, error: str, epoch: int | None = None) -> None:
        """Fail `step` of `epoch` (default: the open one): the trainer waiting on it raises."""
        epoch = self.sched.epoch if epoch is None else epoch
        ready = wire.Ready(self.shard, epoch, step, self.sched.updates, {}, None, error=error)
        txn.xadd(self.keys.ready(self.shard), wire.to_fields(ready))

    # ------------------------------------------------------------------ held payloads

    def _hold(self, txn: _Txn, key: SampleKey, ref: bytes | None, payload: bytes | None,
              rollout: Rollout) -> None:
        """Hold an admitted result: by `ref`, the id of its entry (journaled with its Finish,
        the last event of `txn`), or as its encoded `payload`."""
        name = member(key)
        if ref is not None:
            self._refs[name] = ref
            txn.refs[len(txn.journal) - 1] = ref
        else:
            txn.bytes += len(payload)
            txn.held[name] = payload
            self._stored.add(name)
        groups = self._held.get(key.epoch)
        if groups is None:
            groups = self._held[key.epoch] = {}
        names = groups.get(key.group)
        if names is None:
            names = groups[key.group] = set()
        names.add(name)
        self._decoded[name] = rollout
        seconds = _duration(rollout.timings)
        if seconds is not None:
            self._held_seconds[name] = seconds
            self._held_s += seconds

    def _unhold(self, txn: _Txn, keys: Sequence[SampleKey], names: Sequence[str] | None = None) -> None:
        """Release the held results of `keys` (`names`: their members, when known)."""
        stored = []
        for key, name in zip(keys, names if names is not None else map(member, keys), strict=True):
            groups = self._held.get(key.epoch, _NONE_HELD)
            held = groups.get(key.group)
            if held is not None and name in held:
                held.discard(name)
                if not held:
                    del groups[key.group]
                    if not groups:
                        del self._held[key.epoch]
                self._decoded.pop(name, None)
                self._refs.pop(name, None)
                seconds = self._held_seconds.pop(name, None)
                if seconds is not None:  # the sum starts again from 0 whenever nothing is held
                    self._held_s = self._held_s - seconds if self._held_seconds else 0.0
                if name in self._stored or name in self._stored_refs:  # in the hash, or staged for it
                    self._stored.discard(name)
                    self._stored_refs.discard(name)
                    stored.append(name)
                    txn.held[name] = None
        if stored:
            txn.pipe.hdel(self.keys.held(self.shard), *stored)

    def _unhold_group(self, txn: _Txn, epoch: int, group: int) -> None:
        names = list(self._held.get(epoch, {}).get(group, ()))
        self._unhold(txn, [parse_member(n) for n in names], names)

    def _drop_epochs(self, txn: _Txn, keep: int | None) -> None:
        for epoch in [epoch for epoch in self._held if epoch != keep]:
            for gid in list(self._held.get(epoch, ())):
                self._unhold_group(txn, epoch, gid)

    def _rollouts(self, txn: _Txn, keys: Sequence[SampleKey], names: Sequence[str]) -> list[Rollout]:
        """The held rollouts of `keys` (`names`: their members), in order: decoded when they
        were admitted by this process (each result is decoded once), else (after a recovery)
        read from their entries or decoded from their held payloads, those this transaction
        wrote, then Redis."""
        out: list = list(map(self._decoded.get, names))
        missing = [i for i, rollout in enumerate(out) if rollout is None]
        if not missing:
            return out
        known = {i: self._known(txn, names[i]) for i in missing}
        rest = [i for i in missing if known[i] is None]
        values = self.r.hmget(self.keys.held(self.shard), [names[i] for i in rest]) if rest else []
        pairs = [*((i, v) for i, v in known.items() if v is not None), *zip(rest, values)]
        for (i, _), payload in zip(pairs, self._held_payloads([v for _, v in pairs])):
            if payload is None:
                raise RuntimeError(f"shard {self.shard}: the held result of admitted {keys[i]} is missing")
            out[i] = _rollout(payload)
        return out

    def _known(self, txn: _Txn, name: str) -> bytes | None:
        """What holds `name`'s result as known here: `REF` and the id of its entry, or the
        payload this transaction stages; None: in `held:{shard}`."""
        ref = self._refs.get(name)
        return REF + ref if ref is not None else txn.held.get(name)

    def _held_payloads(self, values: Sequence[bytes | None]) -> list[bytes | None]:
        """The encoded results held values stand for: a reference is read from its entry
        (all of them in one round trip), a payload is itself."""
        refs = [text(v[len(REF):]) for v in values if v is not None and v.startswith(REF)]
        pipe = self.r.pipeline(transaction=False)
        for entry_id in refs:
            streams.entries(pipe, self.keys.results(self.shard), entry_id, entry_id)
        found = iter(pipe.execute() if refs else [])
        out = []
        for value in values:
            if value is None or not value.startswith(REF):
                out.append(value)
            else:
                entry = next(found)
                out.append(entry[0][1].get(wire.FIELD) if entry else None)
        return out

    def _held_from(self) -> str | None:
        """The lowest entry id of `results:{shard}` a held result refers to (None: none)."""
        lowest = min(self._refs.values(), key=parse_id, default=None)
        return None if lowest is None else text(lowest)

    # ------------------------------------------------------------------ refusals

    def _dead_letter(self, txn: _Txn, stream: str, entry_id: bytes, fields: Mapping, reason: str) -> None:
        self.stats["dead_letters"] += 1
        log.warning("shard %d: dead-lettered %s %s: %s", self.shard, stream, text(entry_id), reason)
        txn.xadd(self.keys.dead, wire.dead_letter_fields(stream, entry_id, reason, fields))
        short = stream.removeprefix(self.keys.prefix)
        txn.observe.append(lambda m: m.dead_letter(short, reason.split(":", 1)[0]))

    def _salvage(self, txn: _Txn, fields: Mapping) -> None:
        """Finish, as an INFRA_ERROR attempt, an invalid result that still names its attempt."""
        key = _named_attempt(fields, self.shard)
        if key is not None:
            self.stats["salvaged"] += 1
            self._apply(txn, Finish(key, Status.INFRA_ERROR))

    def _refuse(self, stream: str, entry_id: bytes, fields: Mapping, exc: ProtocolError) -> None:
        """Dead-letter an event the protocol refuses; a refused handover fails its step."""
        txn = _Txn()
        txn.ack(stream, self.group, entry_id)
        self._dead_letter(txn, stream, entry_id, fields, f"protocol: {exc}")
        msg = wire.from_fields(fields)
        if isinstance(msg, wire.Handover):  # in its own epoch, which the trainer waits in
            self._ready_error(txn, msg.step, f"handover of step {msg.step} refused: {exc}", msg.epoch)
        elif isinstance(exc, ConfigMismatch):  # the trainer's first step of the epoch fails
            log.error("shard %d: %s", self.shard, exc)
            self._ready_error(txn, 0, str(exc), msg.epoch)
        self._commit(txn)

    # ------------------------------------------------------------------ leases

    def _reclaim(self) -> int:
        """Finish, as INFRA_ERROR attempts, this shard's work whose lease lapsed."""
        lease_ms = int(self.config.lease_s * 1000)
        ids = self._idle_work(lease_ms)
        if not ids:
            return 0
        entries = self._work_entries(ids)
        gone = [i for i in ids if i not in entries]
        streams.ack(self.r, self.keys.work, WORK_GROUP, *gone)  # deleted while pending
        ours = [i for i, (msg, _) in entries.items() if msg is None or msg.shard == self.shard]
        if not ours:
            return 0
        claimed = streams.claim(self.r, self.keys.work, WORK_GROUP, self.name, lease_ms, ours)
        return self._finish_reclaimed({i: entries[i] for i in claimed if i in entries})

    def _idle_work(self, lease_ms: int) -> list[bytes]:
        ids: list[bytes] = []
        start = "-"
        for _ in range(RECLAIM_PAGES):
            page = streams.pending(self.r, self.keys.work, WORK_GROUP, start=start,
                                   count=RECLAIM_PAGE, idle_ms=lease_ms)
            ids += [p["message_id"] for p in page]
            if len(page) < RECLAIM_PAGE:
                break
            start = "(" + text(page[-1]["message_id"])
        return ids

    def _own_work(self) -> dict[bytes, tuple[wire.Work | None, dict]]:
        """Work entries this consumer claimed and had not finished when it stopped."""
        page = streams.pending(self.r, self.keys.work, WORK_GROUP,
                               count=RECLAIM_PAGE * RECLAIM_PAGES, consumer=self.name)
        ids = [p["message_id"] for p in page]
        entries = self._work_entries(ids)
        gone = [i for i in ids if i not in entries]
        streams.ack(self.r, self.keys.work, WORK_GROUP, *gone)
        return entries

    def _work_entries(self, ids: Sequence[bytes]) -> dict[bytes, tuple[wire.Work | None, dict]]:
        """The work entries still in the stream, decoded (None where they do not decode)."""
        pipe = self.r.pipeline(transaction=False)
        for entry_id in ids:
            streams.entries(pipe, self.keys.work, entry_id, entry_id)
        out = {}
        for found in pipe.execute():
            for entry_id, fields in found:
                try:
                    out[entry_id] = (wire.from_fields(fields, wire.Work), fields)
                except wire.SchemaError:
                    out[entry_id] = (None, fields)
        return out

    def _finish_reclaimed(self, entries: Mapping[bytes, tuple[wire.Work | None, dict]]) -> int:
        if not entries:
            return 0
        txn = _Txn()
        for entry_id, (work, fields) in entries.items():
            txn.ack(self.keys.work, WORK_GROUP, entry_id)
            txn.pipe.xdel(self.keys.work, entry_id)
            if work is None:
                reason = _reason(fields, wire.Work)
                self._dead_letter(txn, self.keys.work, entry_id, fields, reason)
                continue
            key = SampleKey(work.epoch, work.group, work.sample, work.attempt)
            log.info("shard %d: lease of %s lapsed; finishing it as infra_error", self.shard, key)
            self.stats["reclaimed"] += 1
            self._apply(txn, Finish(key, Status.INFRA_ERROR))
        return self._commit(txn)

    # ------------------------------------------------------------------ trimming

    def trim(self) -> None:
        """Trim every stream this shard reads or writes (see `pipeline.streams`)."""
        k, shard = self.keys, self.shard
        for stream in (k.tasks(shard), k.work, k.ready(shard)):
            streams.trim_acknowledged(self.r, stream)
        # acknowledged results still held (by reference) until their step is emitted are kept
        streams.trim_acknowledged(self.r, k.results(shard), keep_from=self._held_from())
        streams.trim_acknowledged(self.r, k.weights, keep_last=True)
        streams.trim_by_age(self.r, k.control, self.control_retention_s)
        self.r.zremrangebyscore(k.cancelled(shard), "-inf", self.clock() - self.control_retention_s)
        streams.trim_length(self.r, k.records(shard), RECORDS_MAXLEN)
        streams.trim_length(self.r, k.dead, DEAD_MAXLEN)
        if self.metrics is not None:
            self._observe_streams()

    def _observe_streams(self) -> None:
        """Length, and lag and pending of each consumer group, of every stream of the shard."""
        k = self.keys
        for stream in (k.tasks(self.shard), k.results(self.shard), k.ready(self.shard),
                       k.records(self.shard), k.work, k.control, k.weights, k.dead):
            if not self.r.exists(stream):
                continue
            groups = {text(g["name"]): (g.get("lag"), g["pending"])
                      for g in self.r.xinfo_groups(stream)}
            self.metrics.observe_stream(stream.removeprefix(k.prefix), self.r.xlen(stream), groups)


# ---------------------------------------------------------------------------- helpers


_Read = tuple[tuple[int, int], streams.Entry]  # an entry read, and its id parsed
_ID = itemgetter(0)


def _up_to(read: list[_Read], cutoff: tuple[int, int] | None) -> tuple[list[_Read], list[_Read]]:
    """`read` (sorted by id) split into the entries up to `cutoff` and those after it."""
    if cutoff is None:
        return read, []
    n = bisect_right(read, cutoff, key=_ID)
    return read[:n], read[n:]


def _trained_seconds(groups: Sequence[Group], packed: PackedBatch) -> list[float | None]:
    """The slot seconds of each rollout of `groups` that `packed` trains (packed, and not
    masked out of the loss)."""
    rollouts = {(g.group, r.sample): r for g in groups for r in g.rollouts}
    return [_duration(rollouts[(group, sample)].timings) for group, sample, trained in zip(
        packed.rollout_group.tolist(), packed.rollout_sample.tolist(), packed.rollout_trained.tolist()) if trained]


def _duration(timings: Mapping[str, float]) -> float | None:
    """A session's duration from the timings the consumer stamps (`started`, `finished`)."""
    if "started" in timings and "finished" in timings:
        return timings["finished"] - timings["started"]
    return None


def _rollout(payload: bytes) -> Rollout:
    """A held result as packing reads it: its chains, merged by the consumer."""
    return wire.decode(payload, wire.Result).rollout()


def _reason(fields: Mapping, expect) -> str:
    try:
        wire.from_fields(fields, expect)
    except wire.SchemaError as exc:
        return str(exc)
    return "undecodable"


def _named_attempt(fields: Mapping, shard: int) -> SampleKey | None:
    """The attempt an invalid result names, if its map still names one of this shard."""
    named = wire.named_attempt(fields)
    if named is None or named[0] != shard:
        return None
    return SampleKey(*named[1:])


def _finite(metrics: Mapping[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if np.isfinite(v)}


def _extra(emit: Emit, packed: PackedBatch, groups: Sequence[Group]) -> dict[str, int]:
    """What a step's record adds to the SchedulerRecord: groups refused at packing (they
    can never fit the rows), groups cut as surplus by `admit`, admitted rollouts whose
    chains were cut to the row width."""
    return {"refused": len(packed.refused),
            "surplus": sum(d.cause == "surplus" for d in emit.dropped),
            "overlong": sum(r.truncation == wire.OVERLONG for g in groups for r in g.rollouts)}


def _ready_record(emit: Emit, packed: PackedBatch, metrics: dict[str, float],
                  extra: Mapping[str, int]) -> ReadyRecord:
    """The Ready's record: the SchedulerRecord with packing's `cut` and `metrics`, `extra`,
    and which tasks ended how (`ReadyRecord`)."""
    return ReadyRecord(
        **{**emit.record.fields(), "cut": packed.cut, "metrics": metrics}, **extra,
        admitted=tuple((g.group, g.batch, g.task.id) for g in emit.groups),
        packed=tuple(packed.groups),
        refused_groups=tuple((r.group, r.reason) for r in packed.refused),
        dropped=tuple((d.group, d.batch, d.task.id, d.cause) for d in emit.dropped))


# ---------------------------------------------------------------------------- entry point


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
KEEP_FREED_BYTES = 128 * 1024 * 1024


def keep_freed_memory() -> bool:
    """Have glibc's malloc serve the packing's large temporary arrays (a step's `[rows,
    width]` arrays, its encoded Ready) from memory the process already has, instead of
    mapping fresh pages for each one and unmapping them when freed: the page faults cost
    more than the packing itself (`BENCHMARKS.md`). Freed memory is kept up to
    `KEEP_FREED_BYTES`. False (and nothing changed) where the C library is not glibc."""
    path = ctypes.util.find_library("c")
    libc = ctypes.CDLL(path) if path else None
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or not hasattr(libc, "gnu_get_libc_version"):
        return False
    # 32 MiB is glibc's largest mmap threshold on 64-bit: larger blocks are still mapped
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 * 1024 * 1024)
                and mallopt(_M_TRIM_THRESHOLD, KEEP_FREED_BYTES))


def main(config: AdmissionConfig, *, snapshot_every: int | None = None) -> int:
    """`rollstream admission --config FILE`: run until SIGTERM or SIGINT."""
    keep_freed_memory()
    collect_less()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    recovered = threading.Event()  # ready once the state is rebuilt from Redis
    with serving("admission", config.redis.namespace, config.metrics_addr, offsets={"shard": config.shard},
                 health=lambda: not stop.is_set(), ready=recovered.is_set,
                 targets=config.metrics_targets) as metrics:
        r = connect(config.redis)
        check(r, config.redis, stop)
        fence = Fence(r, Keys(config.redis.namespace), config.shard, config.shard_lease_s)
        fence.acquire(stop)  # waits while another live consumer holds the shard
        admission = Admission(config, r, snapshot_every=snapshot_every, metrics=metrics, fence=fence)
        recovered.set()
        admission.run(stop)
    return 0
