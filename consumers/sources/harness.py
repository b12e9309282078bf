"""`HarnessSource`: an agent harness behind the recording gateway (`consumers.gateway`).

    source = HarnessSource(gateway="http://127.0.0.1:8000", harness=my_agent, verifier=my_check,
                           max_turns=8, max_tokens=4096, timeout_s=600)
    source = HarnessSource(gateway=..., harness=["python", "agent.py"], verifier="my.module:check")

Per session: the source opens a gateway session with the turn and context limits (`PUT
/sessions/{id}`), runs the harness with `OPENAI_BASE_URL` set to the session's URL
(`http://GATEWAY/sessions/{id}/v1`) and a dummy `OPENAI_API_KEY`, then reads the calls the
gateway recorded (`GET /sessions/{id}`), frees the session and returns them as the
session's `Call`s (prompt ids, completion ids, behaviour log-probs, the version that served
each); packing merges the calls whose prompt extends the previous call's prompt +
completion into one chain.

The harness is either
- a Python callable `harness(ctx: HarnessContext) -> output`, run in a thread of its own
  (`ctx.base_url`, `ctx.api_key`, `ctx.env`, `ctx.task`, `ctx.cancelled`, `ctx.deadline`); or
- a command (a list of arguments, or a string split like a shell), run as a subprocess
  with `OPENAI_BASE_URL`, `OPENAI_API_KEY`, `ROLLSTREAM_TASK_ID` and `ROLLSTREAM_TASK`
  (the task's payload as JSON) in its environment; its output is its stdout, stripped.

The verifier (a callable or `module:function`) scores `verifier(task, output)` in [0, 1],
returning a float or `(reward, components)`.

How a session ends, first match wins:

| what happened | status |
|---|---|
| `request.cancelled` | CANCELLED |
| an engine failed one of its calls (unreachable, 5xx, a broken stream; the gateway flags it) | INFRA_ERROR: resubmitted, never trained |
| the gateway could not be reached, or lost the session (restarted) | INFRA_ERROR |
| `timeout_s` (or the request's deadline) passed | TRUNCATED `wall_clock` (unscored) |
| a call past `max_turns`, or prompt + completion reaching `max_tokens` | TRUNCATED with that reason, scored when the harness still returned an output |
| the harness raised, or the command exited non-zero | AGENT_ERROR, scored by `verifier(task, None)` (None counts as 0): the specification admits and trains it |
| otherwise | COMPLETED, scored (a verifier returning None there is an error) |

A harness thread cannot be killed: at a wall-clock limit or a cancel the source closes the
gateway session (the harness's next call is refused) and returns at once; a command is
killed (its process group). A gateway answer that shows a wrong set-up (an engine that
returns no token ids or log-probs) raises: a broken source fails the step with its
traceback rather than resubmitting forever.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx

from pipeline.sessions import Call, Session, SessionRequest, Status, Task

log = logging.getLogger(__name__)

API_KEY = "rollstream"  # the gateway does not check it; OpenAI clients want one


@dataclass
class HarnessContext:
    """What a Python harness gets: its task, its session's base URL, and when to stop."""

    task: Task
    base_url: str
    api_key: str
    cancelled: Any
    deadline: float | None
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass
class _Outcome:
    output: Any = None
    error: str | None = None  # the harness crashed
    finished: bool = False  # the harness returned (or exited)
    cut: str | None = None  # wall_clock or cancelled: the source stopped waiting


def _resolve(spec: Any, what: str) -> Any:
    if isinstance(spec, str) and ":" in spec and what == "verifier":
        from consumers.sources import import_object

        return import_object(spec, "source_args.verifier")
    return spec


class GatewayClient:
    """The recording gateway's session API as a source uses it: open a session with its
    limits, read what it recorded, free it (`consumers.gateway`)."""

    def __init__(self, gateway: str, timeout_s: float) -> None:
        if not isinstance(gateway, str) or not gateway.startswith(("http://", "https://")):
            raise ValueError(f"gateway must be an http(s) URL, got {gateway!r}")
        self.gateway = gateway.rstrip("/")
        self.http = httpx.Client(timeout=timeout_s)

    @staticmethod
    def session_id(request: SessionRequest) -> str:
        return (f"{quote(request.task.id, safe='')}.{request.group}.{request.sample}.{request.attempt}."
                f"{uuid.uuid4().hex[:8]}")

    def url(self, sid: str) -> str:
        return f"{self.gateway}/sessions/{sid}"

    def open(self, sid: str, *, max_turns: int | None, max_tokens: int | None) -> None:
        """Create the session (raises httpx.TransportError when the gateway is unreachable)."""
        self.http.put(self.url(sid), json={"max_turns": max_turns, "max_tokens": max_tokens}).raise_for_status()

    def record(self, sid: str) -> dict[str, Any] | None:
        """What the gateway recorded, or None when it no longer knows the session (restarted)."""
        answer = self.http.get(self.url(sid))
        if answer.status_code == 404:
            log.error("gateway session %s: the gateway %s no longer knows it", sid, self.gateway)
            return None
        answer.raise_for_status()
        recorded = answer.json()
        if recorded.get("protocol_error"):
            raise RuntimeError(f"gateway session {sid}: {recorded['protocol_error']}")
        return recorded

    def free(self, sid: str) -> None:
        try:
            self.http.delete(self.url(sid))
        except httpx.TransportError as exc:  # the gateway drops idle sessions itself
            log.warning("gateway session %s: could not free it: %s", sid, exc)

    def close(self) -> None:
        self.http.close()


def recorded_calls(recorded: Mapping[str, Any]) -> list[Call]:
    """The `Call`s of a gateway record (`GET /sessions/{id}`)."""
    return [_call(c, i) for i, c in enumerate(recorded["calls"])]


class HarnessSource:
    """See the module docstring. Keyword arguments only (buildable from a consumer config)."""

    def __init__(self, *, gateway: str, harness: Callable[[HarnessContext], Any] | str | Sequence[str],
                 verifier: Callable[[Task, Any], Any] | str, max_turns: int | None = None,
                 max_tokens: int | None = None, timeout_s: float | None = None, poll_s: float = 0.05,
                 http_timeout_s: float = 30.0, env: Mapping[str, str] | None = None) -> None:
        for name, value in (("max_turns", max_turns), ("max_tokens", max_tokens)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.client = GatewayClient(gateway, http_timeout_s)
        self.gateway = self.client.gateway
        if callable(harness):
            self.harness, self.command = harness, None
        elif isinstance(harness, str):
            self.harness, self.command = None, shlex.split(harness)
        elif isinstance(harness, Sequence) and harness and all(isinstance(a, str) for a in harness):
            self.harness, self.command = None, list(harness)
        else:
            raise TypeError("harness must be a callable, a command string or a list of arguments")
        self.verifier = _resolve(verifier, "verifier")
        if not callable(self.verifier):
            raise TypeError(f"verifier must be callable or module:function, got {verifier!r}")
        self.max_turns, self.max_tokens, self.timeout_s = max_turns, max_tokens, timeout_s
        self.poll_s, self.env = poll_s, dict(env or {})
        self.http = self.client.http

    def close(self) -> None:
        self.client.close()

    # ------------------------------------------------------------------ a session

    def session_id(self, request: SessionRequest) -> str:
        return self.client.session_id(request)

    def run(self, request: SessionRequest) -> Session:
        started = time.time()
        sid = self.session_id(request)
        url = self.client.url(sid)
        deadline = request.deadline
        if self.timeout_s is not None:
            deadline = min(deadline or float("inf"), started + self.timeout_s)

        def end(status: Status, reward: float | None = None, components: Mapping[str, float] | None = None,
                calls: list[Call] | None = None, truncation: str | None = None) -> Session:
            return Session(status, reward, dict(components or {}), calls or [], truncation,
                           {"run_s": time.time() - started})

        try:
            self.client.open(sid, max_turns=self.max_turns, max_tokens=self.max_tokens)
        except httpx.TransportError as exc:
            log.error("harness session %s: the gateway %s is unreachable: %s", sid, self.gateway, exc)
            return end(Status.INFRA_ERROR)
        try:
            outcome = self._run_harness(request, f"{url}/v1", deadline)
            if outcome.cut is not None:
                self.http.post(f"{url}/close", json={"reason": outcome.cut})
            recorded = self.client.record(sid)
            if recorded is None:  # the gateway restarted and lost the session
                return end(Status.INFRA_ERROR)
        except httpx.TransportError as exc:
            log.error("harness session %s: the gateway %s is unreachable: %s", sid, self.gateway, exc)
            return end(Status.INFRA_ERROR)
        finally:
            self.client.free(sid)

        if outcome.cut == "cancelled" or request.cancelled.is_set():
            return end(Status.CANCELLED)
        calls = recorded_calls(recorded)
        if recorded.get("infra_error"):
            log.warning("harness session %s: infrastructure error: %s", sid, recorded["infra_error"])
            return end(Status.INFRA_ERROR, calls=calls)
        if outcome.cut == "wall_clock":
            return end(Status.TRUNCATED, calls=calls, truncation="wall_clock")
        if recorded.get("truncated"):
            reward, parts = self._score(request.task, outcome.output) if outcome.error is None else (None, {})
            return end(Status.TRUNCATED, reward, parts, calls, recorded["truncated"])
        if outcome.error is not None:
            log.info("harness session %s: the harness failed: %s", sid, outcome.error)
            reward, parts = self._score(request.task, None)
            return end(Status.AGENT_ERROR, 0.0 if reward is None else reward, parts, calls)
        reward, parts = self._score(request.task, outcome.output)
        if reward is None:
            raise ValueError(f"the verifier returned None for the completed session {sid}")
        return end(Status.COMPLETED, reward, parts, calls)

    def _score(self, task: Task, output: Any) -> tuple[float | None, dict[str, float]]:
        result = self.verifier(task, output)
        reward, parts = result if isinstance(result, tuple) else (result, {})
        if reward is not None and not 0.0 <= float(reward) <= 1.0:
            raise ValueError(f"the verifier returned {reward}, outside [0, 1]")
        return (None if reward is None else float(reward)), dict(parts)

    # ------------------------------------------------------------------ running the harness

    def _env(self, task: Task, base_url: str) -> dict[str, str]:
        return {**self.env, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": API_KEY,
                "ROLLSTREAM_TASK_ID": task.id, "ROLLSTREAM_TASK": json.dumps(dict(task.payload))}

    def _stop_reason(self, request: SessionRequest, deadline: float | None) -> str | None:
        if request.cancelled.is_set():
            return "cancelled"
        if deadline is not None and time.time() >= deadline:
            return "wall_clock"
        return None

    def _run_harness(self, request: SessionRequest, base_url: str, deadline: float | None) -> _Outcome:
        env = self._env(request.task, base_url)
        if self.command is not None:
            return self._run_command(request, env, deadline)
        outcome = _Outcome()
        ctx = HarnessContext(request.task, base_url, API_KEY, request.cancelled, deadline, env)

        def target() -> None:
            try:
                outcome.output = self.harness(ctx)  # type: ignore[misc]
            except Exception as exc:  # the agent's failure: AGENT_ERROR, scored
                outcome.error = f"{type(exc).__name__}: {exc}"
            finally:
                outcome.finished = True

        thread = threading.Thread(target=target, name="rollstream-harness", daemon=True)
        thread.start()
        while True:
            thread.join(self.poll_s)
            if not thread.is_alive():
                return outcome
            reason = self._stop_reason(request, deadline)
            if reason is not None:
                outcome.cut = reason
                return outcome

    def _run_command(self, request: SessionRequest, env: Mapping[str, str], deadline: float | None) -> _Outcome:
        outcome = _Outcome()
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=out, stderr=err,  # type: ignore[arg-type]
                                    env={**os.environ, **env}, start_new_session=True)
            try:
                while True:
                    try:
                        code = proc.wait(self.poll_s)
                        break
                    except subprocess.TimeoutExpired:
                        reason = self._stop_reason(request, deadline)
                        if reason is not None:
                            outcome.cut = reason
                            return outcome
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)  # the group this source started
                    proc.wait(10)
            out.seek(0)
            err.seek(0)
            outcome.finished = True
            outcome.output = out.read().decode(errors="replace").strip()
            if code != 0:
                tail = err.read().decode(errors="replace")[-2000:]
                outcome.error = f"{self.command[0]} exited with {code}: {tail}"  # type: ignore[index]
        return outcome


def _call(c: Mapping[str, Any], i: int) -> Call:
    try:
        return Call(c["prompt_ids"], c["completion_ids"], c["logprobs"], int(c["version"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"the gateway's call {i} is malformed: {exc}") from exc
