"""A multi-turn agent harness written with the official `openai` client, its verifier, and
the local engine + gateway it talks to (real servers on ephemeral ports of 127.0.0.1), for
the harness tests.

The game is `GuessEnv`'s: guess a secret digit in three turns, told `<higher>` / `<lower>`.
The harness keeps the conversation (its replies and the game's answers) and sends it whole
each turn, as agent frameworks do; the engine's chat template makes each call's prompt
extend the previous prompt + completion.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from openai import OpenAI

from consumers.cpu_engine import Engine
from consumers.gateway import Gateway
from consumers.http import ServerThread
from domain.envs import VOCAB
from consumers.sources.harness import HarnessContext

TURNS = 3


class GuessHarness:
    """`harness(ctx)`: up to three chat calls; returns `{"solved", "turn"}`. Every answer it
    got (the engine's token ids, log-probs and version, passed through the gateway) is kept
    per session URL in `seen`. `after_call(ctx, turn)` runs after each call (a test's hook)."""

    def __init__(self, after_call: Callable[[HarnessContext, int], None] | None = None,
                 max_tokens: int = 2) -> None:
        self.seen: dict[str, list[dict[str, Any]]] = {}
        self.after_call, self.max_tokens = after_call, max_tokens
        self._lock = threading.Lock()

    def __call__(self, ctx: HarnessContext) -> dict[str, Any]:
        client = OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0, timeout=30)
        secret = int(ctx.task.payload["secret"])
        messages = [{"role": "user", "content": "<guess>"}]
        with self._lock:
            seen = self.seen.setdefault(ctx.base_url, [])
        for turn in range(TURNS):
            answer = client.chat.completions.create(model="tiny", messages=messages,
                                                    max_tokens=self.max_tokens)
            raw = answer.to_dict()
            choice = raw["choices"][0]
            seen.append({"prompt_ids": raw["prompt_token_ids"], "completion_ids": choice["token_ids"],
                         "logprobs": [c["logprob"] for c in choice["logprobs"]["content"]],
                         "version": raw["weight_version"]})
            if self.after_call is not None:
                self.after_call(ctx, turn)
            said = choice["message"]["content"]
            if said == str(secret):
                return {"solved": True, "turn": turn}
            reply = "<invalid>" if not said.isdigit() else "<higher>" if secret > int(said) else "<lower>"
            messages += [{"role": "assistant", "content": said}, {"role": "user", "content": reply}]
        return {"solved": False, "turn": TURNS - 1}


def verify(task: Any, output: Any) -> tuple[float, dict[str, float]]:
    """`1 - turn / 3` for a solved game, else 0 (also for a harness that crashed: None)."""
    if not output or not output.get("solved"):
        return 0.0, {"solved": 0.0}
    return 1.0 - output["turn"] / TURNS, {"solved": 1.0}


def eos_biased(model: torch.nn.Module, bias: float = 1.3) -> None:
    """Make `<eos>` likely (about 0.4 a token for a fresh tiny model), in place: short
    replies that end the way a chat model's do."""
    with torch.no_grad():
        model.ln_f.weight[0], model.ln_f.bias[0] = 0.0, 3.0
        model.embed.weight[VOCAB.eos] = 0.0
        model.embed.weight[VOCAB.eos, 0] = bias


class Stack:
    """The local engine and the gateway in front of it; the engine can be stopped and
    started again on its port."""

    def __init__(self, model: torch.nn.Module, **gateway_options: Any) -> None:
        self.engine = Engine(model, name="tiny")
        self.engine_server = ServerThread(self.engine.app(), name="engine")
        self.port = self.engine_server.port
        self.gateway = Gateway([self.engine_server.url], health_interval_s=0.1, temperature=1.0, **gateway_options)
        self.gateway_server = ServerThread(self.gateway.app(), name="gateway")

    @property
    def url(self) -> str:
        return self.gateway_server.url

    def stop_engine(self) -> None:
        self.engine_server.stop()

    def start_engine(self) -> None:
        self.engine_server = ServerThread(self.engine.app(), port=self.port, name="engine")

    def close(self) -> None:
        self.gateway_server.stop()
        self.engine_server.stop()


class Capture:
    """A source that records every (request, session) of the source it wraps."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sessions: list[tuple[Any, Any]] = []
        self._lock = threading.Lock()

    def run(self, request: Any) -> Any:
        session = self.inner.run(request)
        with self._lock:
            self.sessions.append((request, session))
        return session
