"""The scheduling state machine: events in, actions out.

`Scheduler.handle(event, now)` is the only entry point. It never touches Redis or a clock:
time arrives as `now` (seconds, any monotonic origin the caller keeps), and everything the
outside world must do comes back as an ordered list of actions which the caller carries out
in order (a `PushWeights` before the `Submit`s that follow it, so those run under the new
version).

Events: `Open` (a task stream was (re)opened: a new epoch), `Register` (the trainer's
prefetch read a task batch), `Handover` (the trainer calls for step i), `Finish` (a
rollout's result arrived), `Publish` (a weight version is served), `Tick` (time advanced),
`Close`.

Actions: `Submit`, `Cancel`, `Discard` (a result the scheduler will not train on),
`PushWeights`, `Abandon`, `Emit` (a step's admitted groups and its `SchedulerRecord`),
`Fail` (the step fails with a source's traceback).

Two admission modes. `batch`: step i trains task batch i's groups, submitted `ahead` calls
early; `oversample` and `admit` cut the tail. `stream`: step i trains the first `admit`
complete groups within the staleness bound from any registered batch, and submission is
credit-driven backfill: every sample that ends, whatever its outcome, is one credit; a
resubmission takes one credit and `groups + oversample` credits submit one new group, so
`in flight + credits == inflight_samples` holds after every event. New groups come from the
tasks registered so far, which the trainer keeps `config.registered_ahead` batches ahead (a
window sized from the in-flight target, not from `ahead`); at each handover the admitted
members of groups still waiting on a straggler that aged past the bound are resubmitted at
once. `oversample` works in stream mode as in batch mode (the first `groups` finishers of a
group are admitted, the rest cancelled as surplus), with the same bias toward short sessions;
with `oversample_start="straggler"` the extra samples are held back and submitted, at a
handover, only as backups of a group's stragglers once its admitted members are aging; with
`oversample_start="replace"` they are held back too, and each stands in for one admitted
member that the next handover will make stale, queued while the trainer waits for a step
that lacks at most `replace_ahead` of its groups (the replaced member is then not run again
while its group can still complete, and its slot can carry the next replacement).
`stale_running="finish"` leaves a running sample submitted past the bound to its result.
With `group_start="handover"` new groups start only while a Handover is handled (the
trainer's weights just pushed) or while the groups not yet trained cannot fill a step; a
credit freed between handovers that no resubmission, backup or replacement takes waits for
the next one (the conservation above still holds). With `end_backups` K, once the trainer
waits for one of the run's last K steps (each `Handover` says how many steps follow it), every
running sample of a group not yet complete gets one backup from its group's extra samples:
with no later step to start work for, a slot is better spent racing a straggler of the steps
that remain.

Stream mode with `backfill="group"` (additive; the legacy group-gated baseline that sample
backfill replaces): the credit of an ended sample is held by its group until every sample of
that group has ended (admitted, failed for good, cancelled), and the group's credits are
then released together; a resubmission still takes one credit (its own group's held credit
first, else a free one). `in flight + credits + held == inflight_samples` holds after every
event, so in flight never exceeds the target either way.
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Union

import msgspec

from pipeline.config import SchedulerConfig
from pipeline.sessions import Status, Task

CAUSES = ("infra_error", "cancelled", "stale", "timeout", "unscored")
"""Resubmission causes, as counted in `SchedulerRecord.resubmitted`."""

FAILURE_CAUSE = {Status.INFRA_ERROR: "infra_error", Status.CANCELLED: "cancelled"}


class ProtocolError(RuntimeError):
    """An event that the protocol does not allow in the scheduler's current state."""


class SampleKey(NamedTuple):
    """One attempt of one sample: the identity of a work entry and of its result (a named
    tuple: made, hashed and compared in C, several times per result)."""

    epoch: int
    group: int
    sample: int
    attempt: int


def member(key: SampleKey) -> str:
    """The name of one attempt (`held:{shard}`, the held references of the journal and the
    snapshot, `cancelled:{shard}`): its four ints joined by colons."""
    return "%s:%s:%s:%s" % key  # (formatted from the tuple at once: about 0.6 of an f-string's time)


def parse_member(name: bytes | str) -> SampleKey:
    """The attempt `member` names (ValueError or TypeError when `name` names none)."""
    text = name.decode() if isinstance(name, bytes) else name
    return SampleKey(*(int(x) for x in text.split(":")))


class SchedulerRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one trainer call consumed and what it cost.

    version and lag are the oldest admitted call's; groups counts admitted groups;
    resubmitted counts resubmissions by cause; cancelled counts in-flight rollouts cancelled
    as surplus, stale or abandoned; abandoned counts groups given up after max_attempts; cut
    counts complete groups left out because their chains did not fit the batch's rows;
    waited is the seconds the trainer waited; metrics is session_metrics over the admitted
    rollouts and their packed batch; backups counts extra rollouts queued as backups of a
    group's stragglers or replacements of its members about to go stale (stream mode,
    oversample_start="straggler" or "replace").

    A typed struct (msgspec): the one definition of these fields, which the `Ready` a trainer
    receives carries (`pipeline.ready.ReadyRecord` adds what packing and admission know) and
    which is decoded strictly (`msgspec.convert`, unknown fields refused)."""

    updates: int
    version: int
    lag: int
    groups: int
    resubmitted: dict[str, int]
    cancelled: int
    abandoned: int
    cut: int
    waited: float
    metrics: dict[str, float] = {}
    backups: int = 0

    def fields(self) -> dict[str, Any]:
        """The record as a dict of its fields (JSON-able)."""
        return {name: getattr(self, name) for name in SchedulerRecord.__struct_fields__}


# ---------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Open:
    """The trainer opened its task stream (again): a new epoch; the old one's work ends."""

    epoch: int


@dataclass(frozen=True)
class Register:
    """The trainer's prefetch read task batch `batch`."""

    batch: int
    tasks: tuple[Task, ...]


@dataclass(frozen=True)
class Handover:
    """The trainer calls for step `step` after `updates` optimizer updates. `published`, when
    given, is a weight version the trainer already published before this call; `steps_left`,
    when given, how many more steps the trainer will call for after this one (its run's end)."""

    step: int
    updates: int
    published: int | None = None
    steps_left: int | None = None


@dataclass(frozen=True, init=False)
class Finish:
    """A rollout's result: its status, reward, oldest call's version (None: no calls) and,
    when the source raised instead of returning a status, the traceback in `error`."""

    key: SampleKey
    status: Status
    reward: float | None = None
    oldest_version: int | None = None
    error: str | None = None

    def __init__(self, key: SampleKey, status: Status, reward: float | None = None,
                 oldest_version: int | None = None, error: str | None = None) -> None:
        # the fields written as a frozen dataclass's own __init__ sets them, without its
        # `object.__setattr__` per field (one event per result)
        fields = self.__dict__
        fields["key"], fields["status"], fields["reward"] = key, status, reward
        fields["oldest_version"], fields["error"] = oldest_version, error


@dataclass(frozen=True)
class Publish:
    """The engines serve weight version `version` (published elsewhere)."""

    version: int


@dataclass(frozen=True)
class Tick:
    """Time advanced (deadlines are checked on every event; this one carries nothing else)."""


@dataclass(frozen=True)
class Close:
    """Cancel every rollout in flight."""


Event = Union[Open, Register, Handover, Finish, Publish, Tick, Close]

# ---------------------------------------------------------------------------- actions


@dataclass(frozen=True, init=False)
class Submit:
    key: SampleKey
    task: Task
    submitted_version: int
    deadline: float | None
    cause: str | None  # None for a first attempt, else one of CAUSES

    def __init__(self, key: SampleKey, task: Task, submitted_version: int, deadline: float | None,
                 cause: str | None) -> None:
        # as `Finish.__init__` (one action per attempt)
        fields = self.__dict__
        fields["key"], fields["task"], fields["submitted_version"] = key, task, submitted_version
        fields["deadline"], fields["cause"] = deadline, cause


@dataclass(frozen=True)
class Cancel:
    key: SampleKey
    reason: str  # surplus, stale, abandoned, timeout, epoch, closed, broken


@dataclass(frozen=True)
class Discard:
    """A result that will not be trained on; the caller may drop its payload."""

    key: SampleKey
    reason: str  # superseded, stale, or a failure cause


@dataclass(frozen=True)
class PushWeights:
    version: int


@dataclass(frozen=True)
class Abandon:
    group: int
    batch: int
    task: Task
    cause: str


@dataclass(frozen=True)
class AdmittedGroup:
    group: int
    batch: int
    task: Task
    samples: tuple[SampleKey, ...]  # the `groups` admitted attempts, in finishing order


@dataclass(frozen=True)
class DroppedGroup:
    """A group that ended without being trained: abandoned after `max_attempts` (`cause` is
    the last failure's: infra_error, cancelled, timeout, unscored) or cut as `surplus` when
    its batch reached `admit`."""

    group: int
    batch: int
    task: Task
    cause: str


@dataclass(frozen=True)
class Emit:
    """A step's admitted groups and record. `dropped` lists the groups that ended untrained
    since the previous emission (stream) or of this step's batch (batch), so every
    registered task of an epoch ends in exactly one Emit: trained or dropped."""

    step: int
    groups: tuple[AdmittedGroup, ...]
    record: SchedulerRecord
    dropped: tuple[DroppedGroup, ...] = ()


@dataclass(frozen=True)
class Fail:
    step: int | None
    error: str


Action = Union[Submit, Cancel, Discard, PushWeights, Abandon, Emit, Fail]

# ---------------------------------------------------------------------------- state

_RUNNING, _IDLE, _ADMITTED, _DEAD, _SURPLUS = range(5)
_COMPACT_MIN = 4096  # entries of admitted members' heaps before the first rebuild


class _Sample:
    __slots__ = ("index", "attempt", "failures", "state", "submitted_version", "oldest", "key")

    def __init__(self, index: int) -> None:
        self.index = index
        self.key: SampleKey | None = None  # its attempt's key, once made (`Scheduler._key`)
        self.attempt = -1
        self.failures = 0
        self.state = _IDLE
        self.submitted_version = 0
        self.oldest = 0  # version of the admitted result's oldest call


class _Group:
    __slots__ = ("id", "batch", "task", "samples", "admitted", "complete", "backed_up", "replaced")

    def __init__(self, gid: int, batch: int, task: Task, size: int) -> None:
        self.id = gid
        self.batch = batch
        self.task = task
        self.samples = [_Sample(i) for i in range(size)]
        self.admitted: list[int] = []  # sample indices in finishing order
        self.complete = False
        self.backed_up = False  # oversample_start="straggler": its extra samples were queued
        self.replaced: set[int] = set()  # oversample_start="replace": admitted, replacement queued


class _Batch:
    __slots__ = ("tasks", "groups", "submitted", "complete", "dropped")

    def __init__(self, tasks: tuple[Task, ...]) -> None:
        self.tasks = tasks
        self.groups: list[int] = []
        self.submitted = False
        self.complete: list[int] = []  # group ids in completion order
        self.dropped: list[DroppedGroup] = []  # groups ended untrained, reported at its step


class Scheduler:
    """The pure scheduling core shared by every admission mode. See the module docstring."""

    def __init__(self, config: SchedulerConfig, *, shard: int = 0) -> None:
        self.config = config
        self.shard = shard
        self._replacing = config.oversample_start == "replace"  # checked on every event
        self._starts_anytime = config.group_start == "any"  # checked on every backfill
        self._handing_over = False  # the event in hand is a Handover (group_start="handover")
        self.epoch = -1
        self.served = 0  # version the engines serve now
        self.updates = 0  # trainer updates at the latest handover
        self.credits = 0  # stream mode: samples that may still be submitted
        self.target = 0  # stream mode: samples kept in flight
        self._gids = itertools.count()
        self._seq = itertools.count()
        self._reset()

    # -------------------------------------------------------------- public queries

    @property
    def in_flight(self) -> int:
        """Samples submitted and not yet ended."""
        return len(self._running)

    @property
    def tracked_samples(self) -> int:
        """Samples of the groups the machine tracks (running, admitting or awaiting their
        step): what the size of its snapshot grows with."""
        return sum(len(group.samples) for group in self._groups.values())

    @property
    def last_batch(self) -> int:
        """The last batch registered in the open epoch (-1: none yet)."""
        return self._last_batch

    @property
    def pending_step(self) -> int | None:
        """The step the trainer waits for, if any."""
        return self._pending

    def running(self) -> list[SampleKey]:
        return list(self._running)

    # -------------------------------------------------------------- entry point

    def handle(self, event: Event, now: float) -> list[Action]:
        """Apply one event at time `now`; return the actions to carry out, in order."""
        out: list[Action] = []
        self._now = now
        self._handing_over = isinstance(event, Handover)  # group_start="handover"
        if isinstance(event, Finish):
            self._on_finish(event, out)
        elif isinstance(event, Register):
            self._on_register(event, out)
        elif isinstance(event, Handover):
            self._on_handover(event, out)
        elif isinstance(event, Publish):
            self.served = max(self.served, event.version)
        elif isinstance(event, Open):
            self._on_open(event, out)
        elif isinstance(event, Close):
            self._cancel_all("closed", out)
            self._reset()
        elif not isinstance(event, Tick):
            raise TypeError(f"not a scheduler event: {event!r}")
        self._expire(out)
        self._backfill(out)
        self._maybe_emit(out)
        if self._replacing:
            self._replace_ahead()
        if self._ending:
            self._back_up_ending()
        self._backfill(out)  # emission may have queued stale resubmissions, or replacements
        return out

    # -------------------------------------------------------------- events

    def _reset(self) -> None:
        self._groups: dict[int, _Group] = {}
        self._batches: dict[int, _Batch] = {}
        self._running: dict[SampleKey, tuple[_Group, _Sample]] = {}
        self._deadlines: list[tuple[float, int, SampleKey]] = []
        self._by_version: list[tuple[int, int, SampleKey]] = []
        self._tasks: deque[tuple[int, Task]] = deque()  # stream mode: tasks not yet drawn
        self._resubmit: deque[tuple[_Group, _Sample, str | None]] = deque()  # stream: awaiting credit
        self._complete: deque[int] = deque()  # stream mode: complete groups, in order
        # stream mode: complete groups found fresh at update count `_lag_checked_at` (a
        # cache of `_recheck_complete`, not state: a restored machine checks them again)
        self._lag_checked_at: int | None = None
        self._lag_checked: set[int] = set()
        self._dropped: list[DroppedGroup] = []  # stream mode: dropped since the last emission
        self._pending: int | None = None
        self._handover_at = 0.0
        self._last_step = -1
        self._last_batch = -1
        self._broken: str | None = None
        self._counts: Counter[str] = Counter()
        self._resubmitted: Counter[str] = Counter()
        self._held_credits: dict[int, list] = {}  # backfill="group": gid -> [group, credits]
        # stream mode, caches (not state: `restore` rebuilds them) by which a handover and
        # `_replace_ahead` find the groups whose admitted members age without looking through
        # every group: the handover's, the groups by the versions their members were admitted
        # at (an entry stays while it may still be so, and goes once found otherwise), and
        # oversample_start="replace"'s, a heap of (oldest, gid) of each admitted member, taken
        # as it ages (its group then waits in `_to_replace` until it has its replacements)
        self._waiting_at: dict[int, set[int]] = {}
        self._waiting_entries = 0  # of `_waiting_at`
        self._admitted_by_version: list[tuple[int, int]] = []
        self._compact_at = _COMPACT_MIN  # entries that have both rebuilt without the gone
        self._to_replace: set[int] = set()
        self._backed_up: dict[int, _Group] = {}  # backup_limit: the groups backed up
        self._final_step: int | None = None  # the run's last step, as the latest handover said
        # end_backups: whether the pending step is one of the run's last `end_backups`, and the
        # groups to look at for backups (every live one as it begins, then those submitted to)
        self._ending = False
        self._end_candidates: set[int] = set()
        self.credits = self.target = 0
        self._admit_default = 0

    def _on_open(self, ev: Open, out: list[Action]) -> None:
        if ev.epoch <= self.epoch:
            raise ProtocolError(f"epoch {ev.epoch} does not follow epoch {self.epoch}")
        self._cancel_all("epoch", out)
        self._reset()
        self.epoch = ev.epoch

    def _on_register(self, ev: Register, out: list[Action]) -> None:
        self._require_open()
        if ev.batch <= self._last_batch:
            raise ProtocolError(
                f"batch {ev.batch} registered after batch {self._last_batch} in epoch {self.epoch}"
            )
        if not ev.tasks:
            raise ProtocolError(f"batch {ev.batch} has no tasks")
        self._last_batch = ev.batch
        admit = self.config.admit
        if admit is not None and admit > len(ev.tasks):
            raise ProtocolError(f"admit={admit} exceeds batch {ev.batch}'s {len(ev.tasks)} tasks")
        if self.config.admission == "stream":
            # without batch_size, the largest batch registered so far sizes the target and
            # the step: a resumed epoch may start with a short batch of carried-over tasks
            target = self._stream_target(len(ev.tasks))
            if target > self.target:
                self.credits += target - self.target
                self.target = target
            self._admit_default = max(self._admit_default,
                                      self.config.admit or self.config.batch_size or len(ev.tasks))
            self._tasks.extend((ev.batch, t) for t in ev.tasks)
            return
        self._batches[ev.batch] = _Batch(ev.tasks)
        if self._last_step >= 0 and ev.batch <= self._last_step + self.config.ahead:
            self._submit_batch(ev.batch, out)

    def _on_handover(self, ev: Handover, out: list[Action]) -> None:
        self._require_open()
        if self._pending is not None:
            raise ProtocolError(f"handover of step {ev.step} while step {self._pending} is pending")
        if ev.step <= self._last_step:
            raise ProtocolError(f"step {ev.step} handed over after step {self._last_step}")
        if self._broken is not None:
            out.append(Fail(ev.step, self._broken))
            return
        if self.config.admission == "batch" and ev.step not in self._batches:
            raise ProtocolError(f"step {ev.step} handed over before batch {ev.step} was registered")
        if ev.published is not None:
            self.served = max(self.served, ev.published)
        if ev.updates < self.updates and self._replacing:  # members it took may age again
            self._rebuild_admitted()
        self.updates = ev.updates
        if self.updates - self.served >= self.config.sync_every:
            out.append(PushWeights(self.updates))
            self.served = self.updates
        self._pending, self._handover_at, self._last_step = ev.step, self._now, ev.step
        self._final_step = None if ev.steps_left is None else ev.step + ev.steps_left
        self._begin_ending()
        self._cancel_stale_running(out)
        if self.config.admission == "stream":
            # admitted members of groups still waiting on a straggler that fell past the
            # bound now: resubmitted at once, so that they run beside the straggler rather
            # than after it, when the group completes and is re-checked at consumption. Only
            # groups with a member admitted at `limit` or older can hold one (or, for
            # backups, one past the bound at the next handover: `_back_up_stragglers`' horizon)
            backing_up = self.config.oversample_start == "straggler"
            limit = self.updates - self.config.max_lag + (1 if backing_up else -1)
            waiting = [g for g in self._admitted_by(limit) if g.admitted and not g.complete]
            self._recheck_lag(waiting, self._complete, out)
            if backing_up:
                self._back_up_stragglers(waiting)
        if self.config.admission == "batch":
            for b in sorted(self._batches):
                if b <= ev.step + self.config.ahead and not self._batches[b].submitted:
                    self._submit_batch(b, out)
            batch = self._batches[ev.step]
            live = [self._groups[g] for g in batch.groups if g in self._groups]
            self._recheck_lag(live, batch.complete, out)

    def _on_finish(self, ev: Finish, out: list[Action]) -> None:
        entry = self._running.pop(ev.key, None)
        if entry is None:
            out.append(Discard(ev.key, "superseded"))
            return
        group, sample = entry
        self._credit(group)
        if ev.error is not None:
            out.append(Discard(ev.key, "broken"))
            self._broken = ev.error
            self._cancel_all("broken", out)
            if self._pending is not None:
                out.append(Fail(self._pending, ev.error))
                self._pending = None
            return
        cause = self._failure_cause(ev)
        if cause is not None:
            out.append(Discard(ev.key, cause))
            self._fail_sample(group, sample, cause, out)
            return
        oldest = sample.submitted_version if ev.oldest_version is None else ev.oldest_version
        if self.updates - oldest > self.config.max_lag:
            out.append(Discard(ev.key, "stale"))
            self._resubmit_sample(group, sample, "stale", out)
            return
        sample.state, sample.oldest = _ADMITTED, oldest
        group.admitted.append(sample.index)
        if self.config.admission == "stream":
            self._note_admitted(oldest, group.id)
        if len(group.admitted) == self.config.groups:
            self._complete_group(group, out)

    # -------------------------------------------------------------- admission rules

    def _failure_cause(self, ev: Finish) -> str | None:
        """None when the rollout is admitted by its status, else the resubmission cause."""
        if ev.status is Status.COMPLETED:
            return "unscored" if ev.reward is None else None  # its verifier never scored it
        if ev.status is Status.AGENT_ERROR:
            return None
        if ev.status is Status.TRUNCATED:
            if self.config.truncation == "score" and ev.reward is None:
                return "unscored"
            return None
        return FAILURE_CAUSE[ev.status]

    def _fail_sample(self, group: _Group, sample: _Sample, cause: str, out: list[Action]) -> None:
        """A failed attempt: resubmit it, or give the group up once it cannot complete."""
        sample.failures += 1
        if sample.failures < self.config.max_attempts:
            self._resubmit_sample(group, sample, cause, out)
            return
        sample.state = _DEAD
        # samples that can still be admitted: a re-opened group's surplus was cancelled
        viable = sum(s.state in (_ADMITTED, _RUNNING, _IDLE) for s in group.samples)
        if viable < self.config.groups:
            self._abandon(group, cause, out)
        elif self.config.oversample_start == "straggler":
            self._back_up(group)  # it can only complete with its extra samples now (those left)
        elif self.config.oversample_start == "replace":
            self._queue_spares(group)

    def _abandon(self, group: _Group, cause: str, out: list[Action]) -> None:
        self._cancel_group(group, "abandoned", out)
        out.append(Abandon(group.id, group.batch, group.task, cause))
        self._drop(group, cause)

    def _drop(self, group: _Group, cause: str) -> None:
        """`group` ends untrained: forgotten, and reported in the Emit of its step (batch
        mode) or the next one (stream mode)."""
        del self._groups[group.id]
        dropped = DroppedGroup(group.id, group.batch, group.task, cause)
        batch = self._batches.get(group.batch)
        (batch.dropped if batch is not None else self._dropped).append(dropped)

    def _complete_group(self, group: _Group, out: list[Action]) -> None:
        group.complete = True
        self._cancel_group(group, "surplus", out)
        if self.config.admission == "stream":
            self._complete.append(group.id)
            return
        batch = self._batches[group.batch]
        batch.complete.append(group.id)
        if len(batch.complete) == self._admit_target(batch):
            for gid in batch.groups:
                other = self._groups.get(gid)
                if other is not None and not other.complete:
                    self._cancel_group(other, "surplus", out)
                    self._drop(other, "surplus")

    def _recheck_lag(self, groups: list[_Group], complete, out: list[Action]) -> None:
        """At consumption, discard admitted rollouts that fell past the bound and resubmit
        them; a complete group among them leaves `complete` and waits for the new attempts."""
        bound = self.updates - self.config.max_lag  # a member older than this is stale
        for group in groups:
            samples = group.samples
            stale = [i for i in group.admitted if samples[i].oldest < bound]
            for i in stale:
                sample = samples[i]
                out.append(Discard(self._key(group, sample), "stale"))
                group.admitted.remove(i)
                if i in group.replaced:
                    group.replaced.discard(i)
                    if not group.complete and self._can_complete(group, self._queued()):
                        sample.state = _IDLE  # replaced: not run again, its slot a spare
                        sample.failures = 0  # for the new sample the slot may carry
                        self._to_replace.add(group.id)  # a spare for another ageing member
                        continue
                self._resubmit_sample(group, sample, "stale", out)
            if stale and group.complete:
                group.complete = False
                complete.remove(group.id)
                if self._replacing:  # its members that age may need replacements again
                    self._to_replace.add(group.id)

    def _recheck_complete(self, out: list[Action]) -> None:
        """`_recheck_lag` of the complete groups (stream mode) not yet found fresh at the
        trainer's current update count. A group found fresh stays fresh until a handover
        changes the count (a sample admitted into it later was checked at the same count as
        it was admitted), so each group is checked once per count, not once per event: the
        actions are those of checking them all."""
        if self._lag_checked_at != self.updates:
            self._lag_checked_at, self._lag_checked = self.updates, set()
        groups = [self._groups[g] for g in self._complete if g not in self._lag_checked]
        self._recheck_lag(groups, self._complete, out)
        self._lag_checked.update(g.id for g in groups if g.complete)

    def _admitted_by(self, limit: int) -> list[_Group]:
        """The live groups with a member admitted at version `limit` or older, in the order
        they were made in; entries found wrong on the way (the member went, or its group)
        are dropped."""
        found: dict[int, _Group] = {}
        for version in [v for v in self._waiting_at if v <= limit]:
            gids = self._waiting_at[version]
            for gid in list(gids):
                group = self._groups.get(gid)
                if group is not None and any(group.samples[i].oldest == version for i in group.admitted):
                    found[gid] = group
                else:
                    gids.discard(gid)
                    self._waiting_entries -= 1
            if not gids:
                del self._waiting_at[version]
        return [found[gid] for gid in sorted(found)]

    def _note_admitted(self, oldest: int, gid: int) -> None:
        """Stream mode: a member of group `gid` admitted with its oldest call at `oldest`.
        An entry goes only once a handover finds it wrong, so those of groups trained or
        dropped before their members aged are cleared out by a rebuild once there are twice
        as many as after the last."""
        gids = self._waiting_at.get(oldest)
        if gids is None:
            gids = self._waiting_at[oldest] = set()
        if gid not in gids:
            gids.add(gid)
            self._waiting_entries += 1
            if self._waiting_entries > self._compact_at:
                self._rebuild_admitted()
        if self._replacing:
            heapq.heappush(self._admitted_by_version, (oldest, gid))
            if len(self._admitted_by_version) > self._compact_at:
                self._rebuild_admitted()

    def _rebuild_admitted(self) -> None:
        """Both caches made anew from the live groups (`replace`'s heap with the members that
        aged already: their groups are looked at once more, to no effect)."""
        entries = [(g.samples[i].oldest, g.id) for g in self._groups.values() for i in g.admitted]
        self._waiting_at = {}
        for oldest, gid in entries:
            self._waiting_at.setdefault(oldest, set()).add(gid)
        self._waiting_entries = sum(map(len, self._waiting_at.values()))
        if self._replacing:
            heapq.heapify(entries)
            self._admitted_by_version = entries
        self._compact_at = 2 * max(self._waiting_entries, len(self._admitted_by_version)) + _COMPACT_MIN

    def _cancel_stale_running(self, out: list[Action]) -> None:
        """Cancel running rollouts whose submission is already past the bound (their first
        call was made under that version) and resubmit them under the served weights."""
        if self.config.stale_running == "finish":
            return  # judged by the result's oldest call when it finishes
        heap, bound = self._by_version, self.updates - self.config.max_lag
        while heap and heap[0][0] < bound:
            version, _, key = heapq.heappop(heap)
            entry = self._running.get(key)
            if entry is None:
                continue
            if version >= self.served:  # a resubmission would be no fresher
                heapq.heappush(heap, (version, next(self._seq), key))
                break
            group, sample = entry
            self._end_running(key, Cancel(key, "stale"), out)
            self._counts["cancelled"] += 1
            self._resubmit_sample(group, sample, "stale", out)

    def _expire(self, out: list[Action]) -> None:
        """Cancel rollouts past their deadline and resubmit them as failed attempts."""
        heap = self._deadlines
        while heap and heap[0][0] <= self._now:
            _, _, key = heapq.heappop(heap)
            entry = self._running.get(key)
            if entry is None:
                continue
            group, sample = entry
            self._end_running(key, Cancel(key, "timeout"), out)
            self._fail_sample(group, sample, "timeout", out)

    # -------------------------------------------------------------- submission

    def _stream_target(self, batch_size: int) -> int:
        cfg = self.config
        if cfg.inflight_samples is not None:
            return cfg.inflight_samples
        return (cfg.ahead + 1) * (cfg.batch_size or batch_size) * cfg.group_size

    def _admit_target(self, batch: _Batch) -> int:
        return min(self.config.admit or len(batch.tasks), len(batch.tasks))

    def _new_group(self, batch: int, task: Task) -> _Group:
        group = _Group(next(self._gids), batch, task, self.config.group_size)
        self._groups[group.id] = group
        return group

    def _submit_batch(self, b: int, out: list[Action]) -> None:
        batch = self._batches[b]
        batch.submitted = True
        for task in batch.tasks:
            group = self._new_group(b, task)
            batch.groups.append(group.id)
            for sample in group.samples:
                self._submit(group, sample, None, out)

    def _backfill(self, out: list[Action]) -> None:
        """Stream mode: spend credits, resubmissions first, then whole new groups."""
        if not (self._resubmit or self._tasks or self._held_credits):
            return  # nothing to spend credits on, nor any held to release
        if self._held_credits:
            self._release_held()
        while self._resubmit and (self.credits > 0 or self._held_credits):
            group, sample, cause = self._resubmit[0]
            if self._groups.get(group.id) is group and sample.state == _IDLE and not group.complete:
                held = self._held_credits.get(group.id)
                if held is not None and held[0] is group and held[1] > 0:
                    held[1] -= 1  # group backfill: the group's own held credit first
                    if held[1] == 0:
                        del self._held_credits[group.id]
                elif self.credits > 0:
                    self.credits -= 1
                else:
                    break
                self._submit(group, sample, cause, out)
            self._resubmit.popleft()
        if self._held_credits:
            self._release_held()
        # oversample_start="straggler": a new group takes only its `groups` samples' credits;
        # each extra sample takes one when it is queued as a backup
        size = self._first_submitted()
        while self._tasks and self.credits >= size and self._broken is None and (
                self._starts_anytime or self._may_start_group()):
            batch, task = self._tasks.popleft()
            group = self._new_group(batch, task)
            self.credits -= size
            for sample in group.samples[:size]:
                self._submit(group, sample, None, out)

    def _may_start_group(self) -> bool:
        """group_start="handover": a new group starts only while the trainer hands over a
        step (its weights just pushed), or while the groups not yet trained cannot fill a
        step (so a step never waits on groups that only the next handover would start)."""
        return self._handing_over or len(self._groups) < max(1, self._admit_default)

    def _first_submitted(self) -> int:
        """Samples of a new group submitted with it."""
        if self.config.oversample_start != "group":
            return self.config.groups
        return self.config.group_size

    def _replace_ahead(self) -> None:
        """oversample_start="replace", while the trainer waits for a step that lacks at most
        `replace_ahead` of its groups: every admitted member of a waiting group that the next
        handover will make stale gets a replacement, queued for a credit like a resubmission
        (the first `groups` of the group to finish are admitted, as with any oversample). Not in
        the run's last step, when a handover said which it is: no handover follows it to make a
        member stale."""
        if self._pending is None or self._in_last_steps(1):
            return
        target = self._admit_default
        if target - len(self._complete) > self.config.replace_ahead * target:
            return
        aging = self.updates - self.config.max_lag  # this old: stale at the next handover
        heap, candidates = self._admitted_by_version, self._to_replace
        while heap and heap[0][0] <= aging:
            candidates.add(heapq.heappop(heap)[1])
        queued: set[int] | None = None
        for gid in sorted(candidates):  # the order the groups were made in
            group = self._groups.get(gid)
            candidates.discard(gid)  # until a member ages, a spare frees or it re-opens
            if group is None or group.complete:
                continue
            for i in group.admitted:
                if group.samples[i].oldest > aging or i in group.replaced:
                    continue
                if queued is None:
                    queued = self._queued()
                spare = self._spare(group, queued)
                if spare is None:
                    break
                group.replaced.add(i)
                self._queue(group, spare, queued)

    def _queued(self) -> set[int]:
        """The samples waiting for a credit (ids of the objects)."""
        return {id(sample) for _, sample, _ in self._resubmit}

    @staticmethod
    def _spare(group: _Group, queued: set[int]) -> _Sample | None:
        """A sample of `group` free to carry a replacement: an extra one never submitted, or
        a replaced member's that went stale (idle and not waiting for a credit)."""
        return next((s for s in group.samples if s.state == _IDLE and id(s) not in queued), None)

    def _queue(self, group: _Group, sample: _Sample, queued: set[int]) -> None:
        """Queue `sample`, an extra rollout of `group`, for a credit (a first attempt or a
        spare's next one), counted with the step's backups."""
        queued.add(id(sample))
        self._resubmit.append((group, sample, None))
        self._counts["backups"] += 1

    def _can_complete(self, group: _Group, queued: set[int]) -> bool:
        """Whether `group`'s admitted, running and queued (`queued`, from `_queued`) samples
        make a whole group."""
        live = sum(s.state == _RUNNING or (s.state == _IDLE and id(s) in queued) for s in group.samples)
        return len(group.admitted) + live >= self.config.groups

    def _queue_spares(self, group: _Group) -> None:
        """oversample_start="replace": queue spare samples of `group` until it can complete
        (a sample that failed for good left it short)."""
        queued = self._queued()
        while not self._can_complete(group, queued):
            spare = self._spare(group, queued)
            if spare is None:
                return
            self._queue(group, spare, queued)

    def _back_up_stragglers(self, groups: list[_Group]) -> None:
        """oversample_start="straggler", at a handover: a waiting group with no more than
        `oversample` samples still running, whose oldest admitted member will be past the
        bound two handovers from now, gets its extra samples as backups of its stragglers, the groups with the oldest members first while `backup_limit` allows; the
        first `groups` to finish are admitted as with any oversample."""
        horizon = self.updates - self.config.max_lag + 1
        due = []
        for group in groups:
            if group.backed_up or group.complete or self._groups.get(group.id) is not group:
                continue
            running = sum(s.state == _RUNNING for s in group.samples)
            if running > self.config.oversample or not group.admitted:
                continue  # more stragglers than backups, or nothing aging (re-checked)
            oldest = min(group.samples[i].oldest for i in group.admitted)
            if oldest <= horizon:  # its admitted members age out within the horizon
                due.append((oldest, group.id, group))
        limit = self.config.backup_limit
        room = math.inf if limit is None else limit - self._backups_in_flight()
        for _, _, group in sorted(due, key=lambda d: d[:2]):
            extra = sum(s.state == _IDLE and s.attempt < 0 for s in group.samples[self.config.groups:])
            if extra > room:
                break
            room -= extra
            self._back_up(group)

    def _backups_in_flight(self) -> int:
        """Extra samples of backed-up groups still waiting for their result: running, or
        queued for a credit (an end backup may leave some of a group's never queued)."""
        for gid, group in list(self._backed_up.items()):
            if self._groups.get(gid) is not group:
                del self._backed_up[gid]  # trained or dropped
        queued = self._queued()
        return sum(s.state == _RUNNING or id(s) in queued
                   for g in self._backed_up.values() if not g.complete
                   for s in g.samples[self.config.groups:])

    def _back_up(self, group: _Group, most: int | None = None, queued: set[int] | None = None) -> None:
        """Queue `group`'s extra samples never run nor queued yet (the first `most` of them,
        when given), first attempts that wait for credits like resubmissions; `queued`, when
        given, is `_queued()`'s set, kept up to date here. Only a backup or a replacement
        queues an extra sample, so a group never backed up has none queued outside `replace`."""
        if queued is None:
            queued = self._queued() if group.backed_up or self._replacing else set()
        group.backed_up = True
        if self.config.backup_limit is not None:  # `_backups_in_flight` counts them
            self._backed_up[group.id] = group
        extras = [s for s in group.samples[self.config.groups:]
                  if s.state == _IDLE and s.attempt < 0 and id(s) not in queued]
        for sample in extras[:most]:
            queued.add(id(sample))
            self._resubmit.append((group, sample, None))
            self._counts["backups"] += 1

    def _begin_ending(self) -> None:
        """end_backups, at a handover: whether the step called for is one of the run's last
        `end_backups` steps; if so, every live group is looked at for backups."""
        k = self.config.end_backups
        self._ending = bool(k) and self._in_last_steps(k)
        self._end_candidates = set(self._groups) if self._ending else set()

    def _in_last_steps(self, n: int) -> bool:
        """Whether the trainer waits for one of its run's last `n` steps, as its latest
        handover said (False when it did not say)."""
        final, pending = self._final_step, self._pending
        return final is not None and pending is not None and pending > final - n

    def _back_up_ending(self) -> None:
        """end_backups, while the trainer waits for one of the run's last steps: each group
        looked at that is not complete, not backed up and has samples running gets one backup
        per running sample, from its extra samples never run (counted with `backup_limit`'s,
        never held back by it)."""
        candidates, self._end_candidates = self._end_candidates, set()
        # the groups looked at are not backed up: only replacements may have queued extras
        queued = self._queued() if self._replacing else set()
        for gid in sorted(candidates):  # the order the groups were made in
            group = self._groups.get(gid)
            if group is None or group.complete or group.backed_up:
                continue
            running = sum(s.state == _RUNNING for s in group.samples)
            if running:
                self._back_up(group, running, queued)

    def _resubmit_sample(self, group: _Group, sample: _Sample, cause: str, out: list[Action]) -> None:
        self._resubmitted[cause] += 1
        if self.config.admission == "stream":
            sample.state = _IDLE
            self._resubmit.append((group, sample, cause))
        else:
            self._submit(group, sample, cause, out)

    def _submit(self, group: _Group, sample: _Sample, cause: str | None, out: list[Action]) -> None:
        sample.attempt += 1
        sample.state = _RUNNING
        sample.submitted_version = self.served
        sample.key = None  # the new attempt's, made by `_key`
        key = self._key(group, sample)
        deadline = None
        if self.config.timeout_s is not None:
            deadline = self._now + self.config.timeout_s
            heapq.heappush(self._deadlines, (deadline, next(self._seq), key))
        if self.config.stale_running == "cancel":  # what `_cancel_stale_running` looks through
            heapq.heappush(self._by_version, (self.served, next(self._seq), key))
        self._running[key] = (group, sample)
        if self._ending:
            self._end_candidates.add(group.id)
        out.append(Submit(key, group.task, self.served, deadline, cause))

    # -------------------------------------------------------------- cancellation

    def _key(self, group: _Group, sample: _Sample) -> SampleKey:
        """The key of `sample`'s attempt, made once per attempt (its attempt changes only in
        `_submit`, which clears the old one; the epoch and group never change under it)."""
        key = sample.key
        if key is None:
            key = sample.key = SampleKey(self.epoch, group.id, sample.index, sample.attempt)
        return key

    def _end_running(self, key: SampleKey, action: Cancel, out: list[Action]) -> None:
        group, _ = self._running.pop(key)
        self._credit(group)
        out.append(action)

    def _credit(self, group: _Group) -> None:
        """One sample of `group` ended: a free credit, or (backfill="group") one held by its
        group until the whole group has ended."""
        if self.config.backfill != "group" or self.config.admission != "stream":
            self.credits += 1
            return
        held = self._held_credits.get(group.id)
        if held is None or held[0] is not group:
            held = self._held_credits[group.id] = [group, 0]
        held[1] += 1

    def _release_held(self) -> None:
        """backfill="group": free the held credits of every group that has ended (no sample
        running or awaiting resubmission; a group no longer tracked has ended too)."""
        for gid, (group, n) in list(self._held_credits.items()):
            tracked = self._groups.get(gid) is group
            if not tracked or all(s.state not in (_RUNNING, _IDLE) for s in group.samples):
                self.credits += n
                del self._held_credits[gid]

    @property
    def held_credits(self) -> int:
        """backfill="group": credits held by groups that have not ended yet."""
        return sum(n for _, n in self._held_credits.values())

    def _cancel_group(self, group: _Group, reason: str, out: list[Action]) -> None:
        """Cancel every running sample of `group`; samples not admitted end as surplus."""
        for sample in group.samples:
            if sample.state == _RUNNING:
                key = self._key(group, sample)
                self._end_running(key, Cancel(key, reason), out)
                self._counts["cancelled"] += 1
            if sample.state in (_RUNNING, _IDLE):
                sample.state = _SURPLUS

    def _cancel_all(self, reason: str, out: list[Action]) -> None:
        for key in sorted(self._running):
            self._end_running(key, Cancel(key, reason), out)
            self._counts["cancelled"] += 1
        self._tasks.clear()
        self._resubmit.clear()
        if self._replacing:  # the samples that waited for credits are spares again
            self._to_replace.update(self._groups)

    def _require_open(self) -> None:
        if self.epoch < 0:
            raise ProtocolError("no epoch is open: the task stream must be opened first")

    # -------------------------------------------------------------- emission

    def _maybe_emit(self, out: list[Action]) -> None:
        step = self._pending
        if step is None or self._broken is not None:
            return
        if self.config.admission == "batch":
            batch = self._batches[step]
            target = self._admit_target(batch)
            # settled: every group of the batch is complete or has ended untrained
            settled = all(gid not in self._groups or self._groups[gid].complete
                          for gid in batch.groups)
            if len(batch.complete) < target and not settled:
                return
            chosen = batch.complete[:target]
            del self._batches[step]
            dropped = batch.dropped
        else:
            self._recheck_complete(out)
            target = self._admit_default
            drained = not self._running and not self._tasks and not self._resubmit
            if len(self._complete) < target and not drained:
                return
            chosen = [self._complete.popleft() for _ in range(min(target, len(self._complete)))]
            dropped, self._dropped = self._dropped, []
        out.append(self._emit(step, chosen, dropped))

    def _emit(self, step: int, chosen: list[int], dropped: list[DroppedGroup]) -> Emit:
        groups = []
        oldest = math.inf
        for gid in chosen:
            group = self._groups.pop(gid)
            keep = group.admitted[: self.config.groups]
            samples = tuple(self._key(group, group.samples[i]) for i in keep)
            oldest = min([oldest, *(group.samples[i].oldest for i in keep)])
            groups.append(AdmittedGroup(group.id, group.batch, group.task, samples))
        version = self.served if oldest == math.inf else int(oldest)
        record = SchedulerRecord(
            updates=self.updates,
            version=version,
            lag=self.updates - version,
            groups=len(groups),
            resubmitted={c: self._resubmitted[c] for c in CAUSES},
            cancelled=self._counts["cancelled"],
            abandoned=sum(d.cause != "surplus" for d in dropped),
            cut=0,
            waited=max(0.0, self._now - self._handover_at),
            backups=self._counts["backups"],
        )
        self._counts.clear()
        self._resubmitted.clear()
        self._pending = None
        self._ending = False
        self._end_candidates.clear()
        return Emit(step, tuple(groups), record, tuple(dropped))

    # -------------------------------------------------------------- persistence
    # Additive: the admission consumer persists the machine as a snapshot plus a journal of
    # the events since (see `consumers.journal`). A snapshot is msgpack-native (ints, floats,
    # strs, lists, str-keyed maps; never pickle) and restores a machine that answers every
    # later event exactly as the original would.

    SNAPSHOT_VERSION = 2
    READS_SNAPSHOTS = (1, 2)  # version 1: before dropped groups were kept

    def admitted_keys(self) -> list[SampleKey]:
        """The attempts admitted into the groups the machine still tracks: the results a
        consumer holds until their step is emitted (any other will never be)."""
        return [self._key(g, g.samples[i]) for g in self._groups.values() for i in g.admitted]

    def live_groups(self) -> frozenset[int]:
        """Ids of the groups the machine still tracks (running, admitting or awaiting their
        step); a held result of any other group will never be emitted."""
        return frozenset(self._groups)

    def snapshot(self) -> dict:
        """The whole state as msgpack-native data (the config is the caller's to keep)."""
        # the tracked groups first, then any other a sample or a credit still refers to;
        # keys and samples' fields go as tuples (msgpack arrays: the bytes lists would give)
        groups: list[list] = [_dump_group(group, True) for group in self._groups.values()]
        table = {id(group): i for i, group in enumerate(self._groups.values())}  # id(group) -> index

        def ref(group: _Group) -> int:
            at = table.get(id(group))
            if at is None:
                at = table[id(group)] = len(groups)
                groups.append(_dump_group(group, self._groups.get(group.id) is group))
            return at

        running = [[k, ref(g), s.index] for k, (g, s) in self._running.items()]
        resubmit = [[ref(g), s.index, cause] for g, s, cause in self._resubmit]
        held = [[ref(g), n] for g, n in self._held_credits.values()]
        snap = {
            "v": self.SNAPSHOT_VERSION,
            "shard": self.shard, "epoch": self.epoch, "served": self.served,
            "updates": self.updates, "credits": self.credits, "target": self.target,
            "gids": _peek(self, "_gids"), "seq": _peek(self, "_seq"),
            "groups": groups,
            "batches": [[b, _dump_batch(batch)] for b, batch in self._batches.items()],
            "running": running,
            "deadlines": [[d, q, k] for d, q, k in self._deadlines],
            "by_version": [[v, q, k] for v, q, k in self._by_version],
            "tasks": [[b, _dump_task(t)] for b, t in self._tasks],
            "resubmit": resubmit,
            "complete": list(self._complete),
            "dropped": [_dump_dropped(d) for d in self._dropped],
            "pending": self._pending, "handover_at": self._handover_at,
            "last_step": self._last_step, "last_batch": self._last_batch,
            "broken": self._broken,
            "counts": dict(self._counts), "resubmitted": dict(self._resubmitted),
            "admit_default": self._admit_default,
        }
        if held:  # additive: only a group-backfill machine holds credits
            snap["held_credits"] = held
        if self._final_step is not None:  # additive: only a handover naming the run's end sets it
            snap["final_step"] = self._final_step
        return snap

    @classmethod
    def restore(cls, config: SchedulerConfig, snapshot: Mapping) -> Scheduler:
        """A machine in the state `snapshot` describes, under `config`."""
        if snapshot.get("v") not in cls.READS_SNAPSHOTS:
            raise ValueError(f"scheduler snapshot version {snapshot.get('v')!r} is not one of "
                             f"{cls.READS_SNAPSHOTS}")
        s = snapshot
        sched = cls(config, shard=s["shard"])
        sched.epoch, sched.served, sched.updates = s["epoch"], s["served"], s["updates"]
        sched.credits, sched.target = s["credits"], s["target"]
        sched._gids, sched._seq = itertools.count(s["gids"]), itertools.count(s["seq"])
        groups = [_load_group(g) for g in s["groups"]]
        sched._groups = {g.id: g for g, live in groups if live}
        objs = [g for g, _ in groups]
        sched._batches = {b: _load_batch(d) for b, d in s["batches"]}
        sched._running = {SampleKey(*k): (objs[g], objs[g].samples[i]) for k, g, i in s["running"]}
        sched._deadlines = [(d, q, SampleKey(*k)) for d, q, k in s["deadlines"]]
        if sched.config.stale_running == "cancel":  # a snapshot may hold them in finish mode too
            sched._by_version = [(v, q, SampleKey(*k)) for v, q, k in s["by_version"]]
        sched._tasks = deque((b, _load_task(t)) for b, t in s["tasks"])
        sched._resubmit = deque((objs[g], objs[g].samples[i], c) for g, i, c in s["resubmit"])
        sched._complete = deque(s["complete"])
        sched._dropped = [_load_dropped(d) for d in s.get("dropped", [])]
        sched._pending, sched._handover_at = s["pending"], s["handover_at"]
        sched._last_step, sched._last_batch = s["last_step"], s["last_batch"]
        sched._broken = s["broken"]
        sched._counts = Counter(s["counts"])
        sched._resubmitted = Counter(s["resubmitted"])
        sched._admit_default = s["admit_default"]
        sched._held_credits = {objs[g].id: [objs[g], n] for g, n in s.get("held_credits", [])}
        sched._final_step = s.get("final_step")
        sched._begin_ending()  # every live group looked at again: those already seen are skipped
        if config.admission == "stream":
            sched._rebuild_admitted()
            if config.backup_limit is not None:
                sched._backed_up = {g.id: g for g in sched._groups.values() if g.backed_up}
        return sched


def _peek(sched: Scheduler, name: str) -> int:
    """The next value of an `itertools.count` attribute, leaving the counter where it was."""
    value = next(getattr(sched, name))
    setattr(sched, name, itertools.count(value))
    return value


def _dump_task(task: Task) -> list:
    return [task.id, dict(task.payload)]


def _load_task(data: list) -> Task:
    return Task(data[0], data[1])


_SAMPLE_FIELDS = operator.attrgetter("index", "attempt", "failures", "state", "submitted_version", "oldest")
"""A sample's fields in a snapshot, in order (`_load_group`)."""


def _dump_group(group: _Group, live: bool) -> list:
    data = [group.id, group.batch, _dump_task(group.task), list(map(_SAMPLE_FIELDS, group.samples)),
            list(group.admitted), group.complete, live]
    # additive: [7] oversample_start="straggler"'s flag, [8] "replace"'s replaced members
    if group.backed_up or group.replaced:
        data.append(group.backed_up)
    if group.replaced:
        data.append(sorted(group.replaced))
    return data


def _load_group(data: list) -> tuple[_Group, bool]:
    gid, batch, task, samples, admitted, complete, live = data[:7]
    group = _Group(gid, batch, _load_task(task), len(samples))
    group.backed_up = len(data) > 7 and bool(data[7])
    group.replaced = set(data[8]) if len(data) > 8 else set()
    for sample, (index, attempt, failures, state, version, oldest) in zip(group.samples, samples):
        sample.index, sample.attempt, sample.failures = index, attempt, failures
        sample.state, sample.submitted_version, sample.oldest = state, version, oldest
    group.admitted, group.complete = list(admitted), complete
    return group, live


def _dump_batch(batch: _Batch) -> list:
    return [[_dump_task(t) for t in batch.tasks], list(batch.groups), batch.submitted,
            list(batch.complete), [_dump_dropped(d) for d in batch.dropped]]


def _load_batch(data: list) -> _Batch:
    tasks, groups, submitted, complete, dropped = data
    batch = _Batch(tuple(_load_task(t) for t in tasks))
    batch.groups, batch.submitted = list(groups), submitted
    batch.complete = list(complete)
    # a version-1 snapshot kept a count of abandoned groups, not the groups
    batch.dropped = [_load_dropped(d) for d in dropped] if isinstance(dropped, list) else []
    return batch


def _dump_dropped(d: DroppedGroup) -> list:
    return [d.group, d.batch, _dump_task(d.task), d.cause]


def _load_dropped(data: list) -> DroppedGroup:
    group, batch, task, cause = data
    return DroppedGroup(group, batch, _load_task(task), cause)
