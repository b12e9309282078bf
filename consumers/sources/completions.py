"""`CompletionsSource`: plain tasks (single- or multi-turn) sampled by an OpenAI-compatible
engine (vLLM, SGLang, `rollstream engine`) through the recording gateway, no agent harness.

    source = CompletionsSource(gateway="http://127.0.0.1:8000", env="prompts",
                               env_args={"prompts": "train.jsonl", "tokenizer": "/models/qwen"},
                               temperature=1.0, max_new_tokens=64)

Each session runs one episode of an environment of `domain.envs` (`env` names
one of `ENVS` with `env_args`, or is an environment object), as `PolicySource` does, but
every call is a `POST /v1/completions` on the session's gateway URL with the prompt as token
ids (`{"prompt": [ids], "max_tokens", "temperature", "logprobs": 0, "stop_token_ids":
[eos]}`), so no text goes through a tokenizer twice. The completion's token ids (eos
included when sampled) go to the environment, whose answer tokens extend the next call's
prompt (the calls merge into one chain). The session's calls are what the gateway recorded:
prompt and completion ids, behaviour log-probs and the weight version that served each; the
reward is the environment's verifier's.

The environment's tokenizer must be the engine's (a prompt set with `tokenizer=` the model
directory the engine serves), and `temperature` the trainer's `GRPOObjective(temperature=...)`
(vLLM started with `--logprobs-mode processed_logprobs`: docs/engines.md). `model` is the
served model name (default: the first the engine lists); `seed` makes each (task, group,
sample, attempt, call) draw a fixed `seed` per request.

How a session ends: as `PolicySource`'s (a completion cut at `max_new_tokens` is TRUNCATED
`max_new_tokens` and scored by the episode; `max_turns` calls and `max_tokens` of context
TRUNCATED with those reasons; `request.cancelled`, checked before each call: CANCELLED);
the gateway or an engine failing (unreachable, 5xx, no engine up): INFRA_ERROR, resubmitted.
An engine answer the gateway cannot record (no token ids or log-probs), or a 4xx other than
the context limit, raises: the set-up is wrong.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from consumers.gateway import context_exceeded
from domain import envs as envs_module
from consumers.sources.harness import GatewayClient, recorded_calls
from pipeline.sessions import Session, SessionRequest, Status

log = logging.getLogger(__name__)


class _Failed(Exception):
    """The gateway or an engine failed a call: the session is an infrastructure error."""


class CompletionsSource:
    """See the module docstring. Keyword arguments only (buildable from a consumer config)."""

    def __init__(self, *, gateway: str, env: Any, env_args: Mapping[str, Any] | None = None,
                 model: str | None = None, temperature: float = 1.0, max_new_tokens: int = 16,
                 max_turns: int | None = None, max_tokens: int | None = None, seed: int | None = None,
                 http_timeout_s: float = 600.0) -> None:
        env = envs_module.environment(env, env_args)
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        for name, value in (("max_new_tokens", max_new_tokens), ("max_turns", max_turns), ("max_tokens", max_tokens)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.env, self.model, self.temperature = env, model, temperature
        self.max_new_tokens, self.max_turns, self.max_tokens, self.seed = max_new_tokens, max_turns, max_tokens, seed
        self.client = GatewayClient(gateway, http_timeout_s)
        self._lock = threading.Lock()

    def close(self) -> None:
        self.client.close()

    # ------------------------------------------------------------------ a session

    def run(self, request: SessionRequest) -> Session:
        started = time.time()
        sid = self.client.session_id(request)
        try:
            self.client.open(sid, max_turns=self.max_turns, max_tokens=self.max_tokens)
        except httpx.TransportError as exc:
            log.error("completions session %s: the gateway %s is unreachable: %s", sid, self.client.gateway, exc)
            return _session(Status.INFRA_ERROR, started)
        try:
            try:
                status, reward, components, truncation = self._episode(request, sid)
            except _Failed as exc:
                log.warning("completions session %s: %s", sid, exc)
                status, reward, components, truncation = Status.INFRA_ERROR, None, {}, None
            recorded = self.client.record(sid)
        except httpx.TransportError as exc:
            log.error("completions session %s: the gateway %s is unreachable: %s", sid, self.client.gateway, exc)
            return _session(Status.INFRA_ERROR, started)
        finally:
            self.client.free(sid)
        if recorded is None:  # the gateway restarted and lost the session
            return _session(Status.INFRA_ERROR, started)
        if recorded.get("infra_error") and status is not Status.CANCELLED:
            status, reward, components, truncation = Status.INFRA_ERROR, None, {}, None
        if status is Status.CANCELLED:
            return _session(status, started)
        return _session(status, started, reward, components, recorded_calls(recorded), truncation)

    def _episode(self, request: SessionRequest, sid: str) -> tuple[Status, float | None, Mapping[str, float], str | None]:
        """Run the episode's calls: (status, reward, components, truncation)."""
        episode = self.env.start(request.task)
        prompt = list(episode.prompt)
        eos = self.env.vocab.eos
        for turn in range(self.max_turns or 2**31):
            if request.cancelled.is_set():
                return Status.CANCELLED, None, {}, None
            budget = self.max_new_tokens
            if self.max_tokens is not None:
                budget = min(budget, self.max_tokens - len(prompt))
            if budget < 1:
                return Status.TRUNCATED, None, {}, "max_tokens"
            ids = self._complete(sid, prompt, budget, eos, self._seed(request, turn))
            if ids is None:  # the engine's context ran out
                return Status.TRUNCATED, None, {}, "max_tokens"
            _, ended = self.env.vocab.until_eos(ids)
            if not ended:
                reason = "max_new_tokens" if budget == self.max_new_tokens else "max_tokens"
                return Status.TRUNCATED, episode.truncated(ids), {}, reason
            answer = episode.step(ids)
            if answer.done:
                return Status.COMPLETED, answer.reward, answer.components, None
            prompt = prompt + ids + list(answer.reply)
        return Status.TRUNCATED, None, {}, "max_turns"

    def _complete(self, sid: str, prompt: Sequence[int], budget: int, eos: int, seed: int | None) -> list[int] | None:
        """One completion's token ids; None when the engine refused the prompt as too long."""
        body: dict[str, Any] = {"model": self._model(sid), "prompt": list(prompt), "max_tokens": budget,
                                "temperature": self.temperature, "logprobs": 0, "stop_token_ids": [eos]}
        if seed is not None:
            body["seed"] = seed
        try:
            answer = self.client.http.post(f"{self.client.url(sid)}/v1/completions", json=body)
        except httpx.TransportError as exc:
            raise _Failed(f"the gateway {self.client.gateway} is unreachable: {exc}") from exc
        if answer.status_code >= 500:
            raise _Failed(f"the call failed ({answer.status_code}): {answer.text[:500]}")
        if answer.status_code >= 400:
            if context_exceeded(answer.content):
                return None
            raise RuntimeError(f"completions session {sid}: the engine refused the call ({answer.status_code}): "
                               f"{answer.text[:1000]}")
        choice = answer.json()["choices"][0]
        return list(choice["token_ids"])

    def _model(self, sid: str) -> str:
        """The served model's name: `model`, or the first the engine lists (asked once)."""
        with self._lock:
            if self.model is None:
                answer = self.client.http.get(f"{self.client.url(sid)}/v1/models")
                if answer.status_code >= 500:
                    raise _Failed(f"the engine's model list failed ({answer.status_code}): {answer.text[:500]}")
                answer.raise_for_status()
                self.model = str(answer.json()["data"][0]["id"])
            return self.model

    def _seed(self, request: SessionRequest, turn: int) -> int | None:
        if self.seed is None:
            return None
        key = f"{self.seed}:{request.task.id}:{request.group}:{request.sample}:{request.attempt}:{turn}"
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little")


def _session(status: Status, started: float, reward: float | None = None,
             components: Mapping[str, float] | None = None, calls: list[Any] | None = None,
             truncation: str | None = None) -> Session:
    return Session(status, reward, dict(components or {}), calls or [], truncation, {"run_s": time.time() - started})
