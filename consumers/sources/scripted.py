"""`ScriptedSource`: a deterministic source for tests, whose outcome per (task id, sample,
attempt) is given by rules or a function.

Rules are plain data, so a rollout consumer in another process builds the same script from
`ConsumerConfig.source_args`: `ScriptedSource(rules=[{"task": "t3.*", "attempt": 0,
"status": "infra_error"}, ...], default={...})`. A rule matches when its `task` (an
`fnmatch` pattern), `sample` and `attempt` (an int, a list of ints, or "*"; absent means
"*") match; the first matching rule's other keys are the `Outcome`'s fields, over
`default`'s. In-process tests may pass `outcome=function(request) -> Outcome` instead.

An outcome waits `duration_s` (returning CANCELLED as soon as the request is cancelled,
unless `cancellable` is false: a stuck environment), then raises `ScriptedError(raise)` if
`raise` is set, else returns a session with `calls` calls of `tokens` prompt and completion
tokens each, log-probs `logprob`, call versions `call_version` (None: the served version),
`timings` (a negative value passes `Session` but not the wire: invalid data, as a clock
skew makes it) and `status`/`reward`.
"""

from __future__ import annotations

import asyncio
import fnmatch
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from consumers.sources.sleep import wait_cancelled
from pipeline.sessions import Call, Session, SessionRequest, Status


class ScriptedError(RuntimeError):
    """What a scripted source raises when its outcome says `raise`."""


@dataclass(frozen=True)
class Outcome:
    status: str = "completed"
    reward: float | None = 1.0
    duration_s: float = 0.0
    raise_: str | None = None
    calls: int = 1
    tokens: int = 4
    call_version: int | None = None
    logprob: float = -0.5
    timings: Mapping[str, float] | None = None
    cancellable: bool = True

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], base: Outcome | None = None) -> Outcome:
        names = {f.name for f in fields(cls)}
        values = {("raise_" if k == "raise" else k): v for k, v in data.items()}
        unknown = set(values) - names
        if unknown:
            raise ValueError(f"unknown outcome fields {sorted(unknown)}")
        return replace(base or cls(), **values)


def _matches(want: Any, value: int) -> bool:
    if want is None or want == "*":
        return True
    if isinstance(want, (list, tuple)):
        return value in want
    return want == value


class _Rule:
    def __init__(self, rule: Mapping[str, Any], default: Outcome) -> None:
        rule = dict(rule)
        self.task = rule.pop("task", "*")
        self.sample = rule.pop("sample", "*")
        self.attempt = rule.pop("attempt", "*")
        self.outcome = Outcome.from_dict(rule, default)

    def matches(self, request: SessionRequest) -> bool:
        return (fnmatch.fnmatchcase(request.task.id, self.task)
                and _matches(self.sample, request.sample) and _matches(self.attempt, request.attempt))


class ScriptedSource:
    """See the module docstring."""

    def __init__(self, *, rules: Sequence[Mapping[str, Any]] = (),
                 default: Mapping[str, Any] | None = None,
                 outcome: Callable[[SessionRequest], Outcome] | None = None) -> None:
        self.default = Outcome.from_dict(default or {})
        self.rules = [_Rule(r, self.default) for r in rules]
        self.outcome = outcome

    def outcome_for(self, request: SessionRequest) -> Outcome:
        if self.outcome is not None:
            return self.outcome(request)
        for rule in self.rules:
            if rule.matches(request):
                return rule.outcome
        return self.default

    def run(self, request: SessionRequest) -> Session:
        o = self.outcome_for(request)
        if o.cancellable:
            if wait_cancelled(request, o.duration_s):
                return Session(Status.CANCELLED)
        else:
            time.sleep(o.duration_s)
        return self._finish(request, o)

    @staticmethod
    def _finish(request: SessionRequest, o: Outcome) -> Session:
        if o.raise_ is not None:
            raise ScriptedError(o.raise_)
        calls = []
        for i in range(o.calls):
            version = request.served_version() if o.call_version is None else o.call_version
            prompt = np.arange(o.tokens, dtype=np.int32) + i
            completion = np.arange(o.tokens, dtype=np.int32) + 100 + i
            calls.append(Call(prompt, completion, np.full(o.tokens, o.logprob, np.float32), version))
        return Session(Status(o.status), o.reward, calls=calls, timings=dict(o.timings or {}))


class AsyncScriptedSource(ScriptedSource):
    """The same script, awaited (`arun`) on the consumer's event loop."""

    run = None  # type: ignore[assignment]  (an async source only)

    async def arun(self, request: SessionRequest) -> Session:
        o = self.outcome_for(request)
        if not o.cancellable:
            await asyncio.sleep(o.duration_s)
            return self._finish(request, o)
        try:
            await asyncio.wait_for(request.cancelled.wait(), o.duration_s)
        except asyncio.TimeoutError:
            return self._finish(request, o)
        return Session(Status.CANCELLED)
