"""The public names every session source uses.

A `SessionSource` turns one `SessionRequest` (a task, relabelled with the scheduler's own
group, sample index and attempt) into one `Session`: a status, a verifier reward, and the
policy calls the session made, each with the token ids, the behaviour log-probability of
every completion token and the weight version that served it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, Union, runtime_checkable

import numpy as np

TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")


class Status(str, enum.Enum):
    """How a session ended. Admission is decided per status (see `pipeline.scheduler`)."""

    COMPLETED = "completed"
    AGENT_ERROR = "agent_error"
    TRUNCATED = "truncated"
    INFRA_ERROR = "infra_error"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class Task:
    """One task of a registered batch; it becomes one group of rollouts. Tasks hash by id."""

    id: str
    payload: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"Task.id must be a non-empty str, got {self.id!r}")
        if not isinstance(self.payload, Mapping):
            raise TypeError(f"Task.payload must be a mapping, got {type(self.payload).__name__}")

    def __hash__(self) -> int:
        return hash(self.id)


_MAX_TOKEN = int(np.iinfo(TOKEN_DTYPE).max)
_new = object.__new__
_MIN, _MAX = np.minimum.reduce, np.maximum.reduce  # ufunc reductions: no `ndarray.min` Python layer


def _tokens(name: str, values: Any) -> np.ndarray:
    raw = values if type(values) is np.ndarray else np.asarray(values)
    kind = raw.dtype.kind
    if raw.size and kind not in "iu":
        raise TypeError(f"Call.{name} must hold integer token ids, got dtype {raw.dtype}")
    if raw.ndim != 1:
        raise ValueError(f"Call.{name} must be one-dimensional, got shape {raw.shape}")
    # a signed array's least id, and the greatest of one whose type goes past int32
    if raw.size and ((kind == "i" and _MIN(raw, axis=None) < 0) or (
            raw.dtype is not TOKEN_DTYPE and not np.can_cast(raw.dtype, TOKEN_DTYPE)
            and _MAX(raw, axis=None) > _MAX_TOKEN)):
        raise ValueError(f"Call.{name} holds token ids outside [0, 2**31)")
    return np.ascontiguousarray(raw, dtype=TOKEN_DTYPE)


def _logprobs(values: Any) -> np.ndarray:
    arr = np.ascontiguousarray(values, dtype=LOGPROB_DTYPE)
    if arr.ndim != 1:
        raise ValueError(f"Call.logprobs must be one-dimensional, got shape {arr.shape}")
    if arr.size and not finite_logprobs(arr):
        raise ValueError("Call.logprobs must be finite log-probabilities (<= 0)")
    return arr


LOGPROB_EPSILON = 1e-4  # log-probs may exceed 0 by this much (engine rounding), no more


def finite_logprobs(arr: np.ndarray) -> bool:
    """Whether a non-empty array holds finite log-probabilities, none above `LOGPROB_EPSILON`
    (its max is NaN when any is NaN, and its min catches -inf; ufunc reductions, without
    `ndarray.max`'s Python layer)."""
    return bool(_MAX(arr, axis=None) <= LOGPROB_EPSILON and _MIN(arr, axis=None) > -np.inf)


@dataclass(eq=False)
class Call:
    """One policy call: prompt and completion token ids, a behaviour log-prob per completion
    token, the weight version that served it and, for filtered sampling (top-k/top-p), the
    sampling support of each completion token as a `[len(completion_ids), k]` array of token
    ids padded with -1."""

    prompt_ids: Sequence[int] | np.ndarray
    completion_ids: Sequence[int] | np.ndarray
    logprobs: Sequence[float] | np.ndarray
    version: int
    support: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.prompt_ids = _tokens("prompt_ids", self.prompt_ids)
        self.completion_ids = _tokens("completion_ids", self.completion_ids)
        self.logprobs = _logprobs(self.logprobs)
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"Call.logprobs has {len(self.logprobs)} entries for "
                f"{len(self.completion_ids)} completion tokens"
            )
        version = self.version
        if type(version) is not int:
            if isinstance(version, bool) or not isinstance(version, (int, np.integer)):
                raise TypeError(f"Call.version must be an int, got {type(version).__name__}")
            version = int(version)
        if version < 0:
            raise ValueError(f"Call.version must be >= 0, got {version}")
        self.version = version
        if self.support is not None:
            sup = np.ascontiguousarray(np.asarray(self.support, dtype=TOKEN_DTYPE))
            if sup.ndim != 2 or sup.shape[0] != len(self.completion_ids):
                raise ValueError(
                    f"Call.support must have shape [{len(self.completion_ids)}, k], got {sup.shape}"
                )
            self.support = sup

    @classmethod
    def trusted(cls, prompt_ids: np.ndarray, completion_ids: np.ndarray, logprobs: np.ndarray,
                version: int) -> Call:
        """The call of these fields without `__post_init__`'s checks and conversions: only for
        values already as it makes them, which the caller has checked itself (one-dimensional
        contiguous `TOKEN_DTYPE` ids in [0, 2**31), as many finite `LOGPROB_DTYPE` log-probs
        <= 0 as completion ids, an int version >= 0; e.g. copies of windows of pools the
        caller built as a checked `Call` once). No sampling support. The consumer checks
        every call's values again when it encodes the session's result."""
        call = _new(cls)
        call.__dict__.update(prompt_ids=prompt_ids, completion_ids=completion_ids, logprobs=logprobs,
                             version=version, support=None)
        return call

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Call):
            return NotImplemented
        same_support = (self.support is None and other.support is None) or (
            self.support is not None and other.support is not None
            and np.array_equal(self.support, other.support))
        return (self.version == other.version and same_support
                and np.array_equal(self.prompt_ids, other.prompt_ids)
                and np.array_equal(self.completion_ids, other.completion_ids)
                and np.array_equal(self.logprobs, other.logprobs))


def _finite_numbers(values: object) -> bool:
    """Whether `values` maps names (str) to finite numbers (int or float, not bool)."""
    if type(values) is not dict and not isinstance(values, Mapping):
        return False
    for k, v in values.items():
        if not (isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                and math.isfinite(v)):
            return False
    return True


@dataclass
class Session:
    """What one rollout produced."""

    status: Status
    reward: float | None = None
    components: Mapping[str, float] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    truncation: str | None = None
    timings: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if type(self.status) is not Status:
            self.status = Status(self.status)
        if self.reward is not None:
            if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float, np.number)):
                raise TypeError(f"Session.reward must be a number, got {type(self.reward).__name__}")
            self.reward = float(self.reward)
            if not math.isfinite(self.reward):
                raise ValueError(f"Session.reward must be finite, got {self.reward}")
        if not _finite_numbers(self.components):
            raise ValueError("Session.components must map names to finite numbers")
        if not _finite_numbers(self.timings):
            raise ValueError("Session.timings must map names to finite numbers")
        self.calls = list(self.calls)
        if not all(isinstance(c, Call) for c in self.calls):
            raise TypeError("Session.calls must hold Call objects")

    @classmethod
    def trusted(cls, status: Status, reward: float | None, calls: list[Call],
                timings: dict[str, float]) -> Session:
        """The session of these fields without `__post_init__`'s checks and conversions: only
        for values already as it makes them, which the caller has checked itself (a `Status`,
        a finite float reward or None, a list of `Call`, timings a dict of finite floats). No
        components, no truncation."""
        session = _new(cls)
        session.__dict__.update(status=status, reward=reward, components={}, calls=calls, truncation=None,
                                timings=timings)
        return session

    @property
    def oldest_version(self) -> int | None:
        """The version of the oldest call: a rollout's staleness is its oldest call's."""
        return min((c.version for c in self.calls), default=None)


@runtime_checkable
class _Cancellation(Protocol):
    def is_set(self) -> bool: ...


@dataclass
class SessionRequest:
    """What a source is asked to run. `cancelled` is an event the source polls (a
    `threading.Event` or `asyncio.Event`); `served_version()` returns the weight version the
    engines serve now; `deadline` is a wall-clock time (seconds since the epoch) or None."""

    task: Task
    group: int
    sample: int
    attempt: int
    submitted_version: int
    deadline: float | None
    cancelled: _Cancellation
    served_version: Callable[[], int]


@runtime_checkable
class SyncSessionSource(Protocol):
    def run(self, request: SessionRequest) -> Session: ...


@runtime_checkable
class AsyncSessionSource(Protocol):
    async def arun(self, request: SessionRequest) -> Session: ...


SessionSource = Union[SyncSessionSource, AsyncSessionSource]
"""A source implements `run(request) -> Session` or `async arun(request) -> Session`. A
source that samples from a filtered support (top-k/top-p) and reports `Call.support` sets
the class attribute `filtered = True`; the scheduler then requires `support_capacity`. A
sync source whose `run` never waits (no I/O, no sleep: microseconds of CPU, such as a
stand-in of zero-length sessions) may set `inline = True` (`runs_inline`): the rollout
consumer then runs its sessions on the thread that reads the work instead of a thread each,
so a session holds up the reading of work and the lease renewals while it runs."""


def runs_inline(source: object) -> bool:
    """True for a sync source that declares its sessions never wait (`inline = True`)."""
    return getattr(source, "inline", False) is True and not is_async_source(source)


def is_async_source(source: object) -> bool:
    """True for a source to be awaited (`arun`), False for one to run in a thread (`run`)."""
    if callable(getattr(source, "arun", None)):
        return True
    if callable(getattr(source, "run", None)):
        return False
    raise TypeError(f"{type(source).__name__} is not a SessionSource: it has neither run nor arun")
