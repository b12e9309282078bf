"""`SleepSource`: a stand-in for real environments with heavy-tailed session durations.

Each session sleeps a log-normal duration (median `median_s`, shape `sigma`, capped at
`cap` times the median), split evenly over `calls` fake policy calls, and returns a status
drawn from `status_mix` with a reward in [0, 1]. Call k's prompt extends call k-1's prompt
and completion, so the calls merge into one chain. Every call carries the version the
engines serve when it is made. Cancellation is honoured within a few milliseconds: the
source waits on the request's cancel event rather than sleeping. `median_s` 0 gives
sessions of zero length (`rollstream bench consumer`), which never wait: the source is then
`inline` (`pipeline.sessions.runs_inline`), run by the consumer on its reading thread.

Tokens and log-probs are windows of two pools drawn once, from `seed`, when the source is
built (`POOL` entries plus the longest draw): a session copies a window at an offset drawn
from its attempt's `_Draws` (SplitMix64 seeded from a hash of the seed and the attempt: a
microsecond to seed, where a Mersenne Twister's 624 words take several), as are its status
and reward, so a 1k-token session costs a few microseconds, and the same seed and request
give the same session. Its duration is the first draw of its attempt's `random.Random`
(`duration_for`), made only for sessions of non-zero length.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import random
import threading
import time
from collections.abc import Mapping

import numpy as np

from pipeline.sessions import Call, Session, SessionRequest, Status

_POLL_S = 0.01
POOL = 1 << 16
"""Entries of the token and log-prob pools beyond the longest draw."""


def wait_cancelled(request: SessionRequest, seconds: float) -> bool:
    """Wait up to `seconds`; True as soon as the request is cancelled. A wait of 0 only
    looks (a timed wait of any length costs tens of microseconds of timer slack)."""
    if seconds <= 0:
        return request.cancelled.is_set()
    if isinstance(request.cancelled, threading.Event):
        return request.cancelled.wait(max(0.0, seconds))
    end = time.monotonic() + seconds
    while not request.cancelled.is_set():
        left = end - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(_POLL_S, left))
    return True


_M64 = (1 << 64) - 1


def _call(prompt: np.ndarray, completion: np.ndarray, logprobs: np.ndarray, version: int) -> Call:
    """A call of windows of the checked pools: made unchecked, but for the version, which the
    request's `served_version` returns (checked unless a plain int >= 0)."""
    if type(version) is int and version >= 0:
        return Call.trusted(prompt, completion, logprobs, version)
    return Call(prompt, completion, logprobs, version)


class _Draws:
    """An attempt's draws in [0, 1): SplitMix64 (Steele, Lea and Flood, 2014), a 64-bit
    state seeded at once."""

    def __init__(self, state: int) -> None:
        self._state = state & _M64

    def uniform(self) -> float:
        self._state = z = (self._state + 0x9E3779B97F4A7C15) & _M64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        return ((z ^ (z >> 31)) >> 11) * 2.0 ** -53

    def below(self, n: int) -> int:
        """An int in [0, n)."""
        return min(int(self.uniform() * n), n - 1)


class SleepSource:
    """See the module docstring. Keyword arguments only, so that a consumer builds it from
    `ConsumerConfig.source_args`."""

    def __init__(self, *, median_s: float = 0.02, sigma: float = 1.0, cap: float = 20.0,
                 status_mix: Mapping[str, float] | None = None, calls: int = 1,
                 prompt_tokens: int = 16, completion_tokens: int = 16, vocab: int = 1000,
                 seed: int | None = None) -> None:
        if median_s < 0 or sigma < 0 or cap < 1:
            raise ValueError(f"need median_s >= 0, sigma >= 0, cap >= 1; got {median_s}, {sigma}, {cap}")
        if calls < 1 or prompt_tokens < 1 or completion_tokens < 1 or vocab < 2:
            raise ValueError("calls, prompt_tokens and completion_tokens must be >= 1, vocab >= 2")
        mix = dict(status_mix or {"completed": 1.0})
        self.statuses = [Status(s) for s in mix]
        self.weights = [float(w) for w in mix.values()]
        if any(w < 0 for w in self.weights) or not sum(self.weights) > 0:
            raise ValueError(f"status_mix needs non-negative weights with a positive sum, got {mix}")
        self._cumulative = list(itertools.accumulate(self.weights))
        self.median_s, self.sigma, self.cap = median_s, sigma, cap
        self.calls, self.prompt_tokens, self.completion_tokens = calls, prompt_tokens, completion_tokens
        self.vocab = vocab
        self.seed = seed
        self.inline = median_s == 0  # a session never waits: no thread of its own
        draws = np.random.default_rng(seed)
        size = POOL + max(prompt_tokens, completion_tokens)
        self._tokens = draws.integers(0, vocab, size, dtype=np.int32)
        self._logprobs = -(draws.random(size, dtype=np.float32) * 2.0)
        # the pools checked once as a call's values: a session's calls, copies of their
        # windows, are then made without checking them again (`Call.trusted`)
        checked = Call(self._tokens, self._tokens, self._logprobs, 0)
        self._tokens, self._logprobs = checked.prompt_ids, checked.logprobs

    def _key(self, task_id: str, group: int, sample: int, attempt: int) -> str:
        return f"{self.seed}:{task_id}:{group}:{sample}:{attempt}"

    def _rng(self, task_id: str, group: int, sample: int, attempt: int) -> random.Random:
        """An attempt's generator of its duration: with a `seed`, a function of the attempt alone."""
        if self.seed is None:
            return random.Random()
        return random.Random(self._key(task_id, group, sample, attempt))

    def _draws(self, request: SessionRequest) -> _Draws:
        """An attempt's draws of its tokens, status and reward: with a `seed`, a function of
        the attempt alone."""
        if self.seed is None:
            return _Draws(random.getrandbits(64))
        key = self._key(request.task.id, request.group, request.sample, request.attempt)
        return _Draws(int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little"))

    def duration_for(self, task_id: str, group: int, sample: int, attempt: int) -> float:
        """The duration `run` gives the attempt (its generator's first draw); with a `seed`,
        the same every time (`rollstream simulate --frontier` meets the bench's sessions)."""
        return self.duration_s(self._rng(task_id, group, sample, attempt))

    def duration_s(self, rng: random.Random) -> float:
        if self.median_s == 0:  # sessions of zero length (`rollstream bench consumer`)
            return 0.0
        return min(rng.lognormvariate(math.log(self.median_s), self.sigma), self.cap * self.median_s)

    def run(self, request: SessionRequest) -> Session:
        duration = 0.0 if self.median_s == 0 else self.duration_for(
            request.task.id, request.group, request.sample, request.attempt)
        draws = self._draws(request)
        started = time.time()
        calls: list[Call] = []
        prompt = self._window(draws, self._tokens, self.prompt_tokens)
        for k in range(self.calls):
            if wait_cancelled(request, duration / self.calls):
                return Session(Status.CANCELLED, calls=calls, timings=self._timings(started))
            completion = self._window(draws, self._tokens, self.completion_tokens)
            logprobs = self._window(draws, self._logprobs, self.completion_tokens)
            calls.append(_call(prompt, completion, logprobs, request.served_version()))
            if k + 1 < self.calls:  # the next call's prompt: this one's, its completion, 4 more
                prompt = np.concatenate([prompt, completion, self._window(draws, self._tokens, 4)])
        status = self._status(draws)
        reward = None if status in (Status.INFRA_ERROR, Status.CANCELLED) else draws.uniform()
        return Session.trusted(status, reward, calls, self._timings(started))

    def _status(self, draws: _Draws) -> Status:
        """A status drawn from `status_mix` (as `random.choices` draws)."""
        if len(self.statuses) == 1:
            return self.statuses[0]
        return self.statuses[bisect.bisect_right(self._cumulative, draws.uniform() * self._cumulative[-1])]

    @staticmethod
    def _window(draws: _Draws, pool: np.ndarray, n: int) -> np.ndarray:
        """A copy of `n` consecutive entries of `pool`, at an offset drawn from `draws`."""
        start = draws.below(len(pool) - n + 1)
        return pool[start:start + n].copy()

    @staticmethod
    def _timings(started: float) -> dict[str, float]:
        return {"run_s": time.time() - started}
