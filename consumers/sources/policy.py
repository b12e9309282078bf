"""`PolicySource`: the consumer runs the policy itself, on CPU, against an environment.

    source = PolicySource(env=GuessEnv(), model_config=TinyConfig(vocab=VOCAB.size),
                          temperature=1.0, max_new_tokens=4,
                          weights=WeightsLoader(RedisWeights(redis, keys)))

Each call samples a completion token by token with temperature sampling (no top-k/top-p: the
support is the full vocabulary) until `<eos>` or `max_new_tokens`, and reports the prompt
ids, the completion ids, the behaviour log-probability of every sampled token under the
temperature-scaled distribution it was drawn from (`log_softmax(logits / temperature)`, what
`GRPOObjective(temperature=...)` rescores) and the weight version of the model that sampled
it. The environment answers each completion; its answer extends the next call's prompt.

Weights: version 0 is the model `model_config` builds (`TinyTransformer` initialises
deterministically from its seed, so it matches a trainer built from the same config). Before
every call the source compares `request.served_version()` with its model's version and, when
a newer one is served, loads it through `weights` (a `consumers.weights.WeightsLoader`, or
what `weights_loader` accepts: a directory, `{"redis": {...}}`). A running session thus
continues across pushes and its later calls carry the new version. A newer version served
with no `weights` configured is an error (its calls would be stale forever).

Limits: a completion that reaches `max_new_tokens` without `<eos>` ends the session
TRUNCATED (`max_new_tokens`, rewarded by the episode's verifier where it has one, for the
`score` truncation policy); `max_turns` (calls) and `max_tokens` (the context: prompt plus
completion) end it TRUNCATED with that reason. `request.cancelled` is polled before every
token: a cancelled session returns CANCELLED within one forward pass.

Generation time: `delay_median_s` > 0 delays each session by a log-normal draw (median
`delay_median_s`, shape `delay_sigma`, capped at `delay_cap` times the median) before its
first call, as LLM decoding time varies with the output's length: heavy-tailed, so that
synchronous and asynchronous schedules differ in wall time on a CPU as they would on GPUs
(`rollstream bench learn`). The draw comes from the session's own generator (seeded runs
draw the same delays); a cancelled session stops waiting at once.

Thread-safety: the consumer runs each session in its own thread and several share this
object. Models live in a pool: a session checks one out for its whole length (a model per
running session, built on demand, reused afterwards), so sessions never share a model;
the `WeightsLoader` fetches each version once under its lock, and each pooled model copies
the cached tensors into its own parameters.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from consumers.sources.sleep import wait_cancelled
from domain import envs as envs_module
from consumers.weights import WeightsLoader, WeightsMissing, weights_loader
from pipeline.sessions import Call, Session, SessionRequest, Status
from domain.model import TinyConfig, TinyTransformer, vocab_size

log = logging.getLogger(__name__)


_BUILDING = threading.Lock()


def build_model(config: Any) -> nn.Module:
    """A `TinyTransformer` for a `TinyConfig` (or a mapping of its fields); a Hugging Face
    causal LM for a `transformers.PretrainedConfig` (initialised under a fixed torch seed)
    or for a local model directory (its weights; nothing is downloaded). One model is built
    at a time in a process: construction touches process-wide state (transformers patches
    the init functions and uses the meta device; the seeded init uses the global RNG), and
    two threads building at once got models with meta tensors or other weights."""
    with _BUILDING:
        return _build(config)


def _build(config: Any) -> nn.Module:
    if isinstance(config, Mapping):
        config = TinyConfig(**config)
    if isinstance(config, TinyConfig):
        return TinyTransformer(config).eval()
    from transformers import AutoModelForCausalLM, PretrainedConfig

    if isinstance(config, (str, os.PathLike)):
        if not os.path.isdir(config):
            raise ValueError(f"model path {config!r} is not a local model directory")
        return AutoModelForCausalLM.from_pretrained(config, local_files_only=True,
                                                    attn_implementation="sdpa").eval()

    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"model_config must be a TinyConfig or a PretrainedConfig, got {type(config).__name__}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config).eval()


def _last_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids[None]) if isinstance(model, TinyTransformer) else model(input_ids=ids[None], use_cache=False)
    return (out.logits if hasattr(out, "logits") else out)[0, -1]


@dataclass
class Sample:
    """One sampled completion."""

    ids: list[int]
    logprobs: list[float]
    ended: bool  # sampled `<eos>`
    cancelled: bool


class Policy:
    """One model and the weight version it holds."""

    def __init__(self, model: nn.Module, version: int = 0) -> None:
        self.model, self.version = model, version

    def update(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        with torch.no_grad():
            self.model.load_state_dict(state)
        self.version = version

    @torch.inference_mode()
    def sample(self, prompt: list[int], max_new_tokens: int, temperature: float, eos: int,
               generator: torch.Generator, cancelled: Any = None) -> Sample:
        """Sample up to `max_new_tokens` tokens after `prompt` (stopping after `eos`)."""
        ids = torch.tensor(prompt, dtype=torch.long)
        out, logprobs = [], []
        for _ in range(max_new_tokens):
            if cancelled is not None and cancelled.is_set():
                return Sample(out, logprobs, False, True)
            logp = torch.log_softmax(_last_logits(self.model, ids).float() / temperature, dim=-1)
            token = int(torch.multinomial(logp.exp(), 1, generator=generator))
            out.append(token)
            logprobs.append(min(float(logp[token]), 0.0))
            if token == eos:
                return Sample(out, logprobs, True, False)
            ids = torch.cat([ids, ids.new_tensor([token])])
        return Sample(out, logprobs, False, False)


class PolicySource:
    """See the module docstring. Keyword arguments only, so that a consumer builds it from
    `ConsumerConfig.source_args` (`env` may then be a name of `envs.ENVS` with `env_args`,
    `model_config` a mapping of `TinyConfig` fields, `weights` a mapping)."""

    def __init__(self, *, env: Any, env_args: Mapping[str, Any] | None = None, model_config: Any = None,
                 temperature: float = 1.0, max_new_tokens: int = 8, max_turns: int | None = None,
                 max_tokens: int | None = None, weights: Any = None, seed: int | None = None,
                 delay_median_s: float = 0.0, delay_sigma: float = 1.0, delay_cap: float = 20.0) -> None:
        env = envs_module.environment(env, env_args)
        if delay_median_s < 0 or delay_sigma < 0 or delay_cap < 1:
            raise ValueError(f"need delay_median_s >= 0, delay_sigma >= 0, delay_cap >= 1; got "
                             f"{delay_median_s}, {delay_sigma}, {delay_cap}")
        self.delay_median_s, self.delay_sigma, self.delay_cap = delay_median_s, delay_sigma, delay_cap
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if max_new_tokens < 1 or (max_turns is not None and max_turns < 1):
            raise ValueError("max_new_tokens and max_turns must be >= 1")
        self.env = env
        self.model_config = TinyConfig(vocab=env.vocab.size) if model_config is None else model_config
        self.temperature, self.max_new_tokens, self.max_turns = temperature, max_new_tokens, max_turns
        self.seed = seed
        self.weights: WeightsLoader | None = weights_loader(weights)
        self._lock = threading.Lock()
        self._free: list[Policy] = []
        first = Policy(build_model(self.model_config))  # fails fast on a bad config
        if vocab_size(first.model) < env.vocab.size:
            raise ValueError(f"the model's vocabulary ({vocab_size(first.model)}) is smaller than "
                             f"the environment's ({env.vocab.size})")
        cfg = getattr(first.model, "config", None)
        limit = getattr(cfg, "max_positions", None) or getattr(cfg, "max_position_embeddings", None)
        self.max_tokens = max_tokens if max_tokens is not None else limit
        if limit is not None and self.max_tokens is not None and self.max_tokens > limit:
            raise ValueError(f"max_tokens={self.max_tokens} is beyond the model's max_positions={limit}")
        self._free.append(first)
        self.models = 1

    # ------------------------------------------------------------------ models

    @contextmanager
    def policy(self) -> Iterator[Policy]:
        """A model of the pool, held for one session."""
        with self._lock:
            policy = self._free.pop() if self._free else None
            if policy is None:
                self.models += 1
        if policy is None:
            policy = Policy(build_model(self.model_config))
        try:
            yield policy
        finally:
            with self._lock:
                self._free.append(policy)

    def refresh(self, policy: Policy, request: SessionRequest) -> None:
        """Load the served version into `policy` when it is newer than the one it holds."""
        served = request.served_version()
        if served <= policy.version:
            return
        if self.weights is None:
            raise RuntimeError(f"weight version {served} is served but this PolicySource has no "
                               "`weights` to load it from")
        try:
            state = self.weights.load(served)
        except WeightsMissing:
            newer = request.served_version()
            if newer == served:
                raise
            log.info("weights version %d was superseded while loading; loading %d", served, newer)
            served, state = newer, self.weights.load(newer)
        policy.update(state, served)

    def _generator(self, request: SessionRequest) -> torch.Generator:
        gen = torch.Generator()
        if self.seed is None:
            gen.seed()
        else:
            key = f"{self.seed}:{request.task.id}:{request.group}:{request.sample}:{request.attempt}"
            gen.manual_seed(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little"))
        return gen

    def draw_delay_s(self, generator: torch.Generator) -> float:
        """The session's generation time: a log-normal draw (0 without `delay_median_s`)."""
        if not self.delay_median_s:
            return 0.0
        z = float(torch.randn((), generator=generator))
        return self.delay_median_s * min(math.exp(self.delay_sigma * z), self.delay_cap)

    # ------------------------------------------------------------------ a session

    def run(self, request: SessionRequest) -> Session:
        started = time.time()
        episode = self.env.start(request.task)
        generator = self._generator(request)
        # its own generator, so that the sampled tokens are the same with and without delays
        delay = self.draw_delay_s(torch.Generator().manual_seed(generator.initial_seed() ^ 0x5EED))
        prompt = list(episode.prompt)
        calls: list[Call] = []

        def end(status: Status, reward: float | None = None, components: Mapping[str, float] | None = None,
                truncation: str | None = None) -> Session:
            return Session(status, reward, dict(components or {}), calls, truncation,
                           {"run_s": time.time() - started})

        if delay and wait_cancelled(request, delay):
            return end(Status.CANCELLED)
        with self.policy() as policy:
            while True:
                if request.cancelled.is_set():
                    return end(Status.CANCELLED)
                if self.max_turns is not None and len(calls) >= self.max_turns:
                    return end(Status.TRUNCATED, truncation="max_turns")
                budget = self.max_new_tokens
                if self.max_tokens is not None:
                    budget = min(budget, self.max_tokens - len(prompt))
                if budget < 1:
                    return end(Status.TRUNCATED, truncation="max_tokens")
                self.refresh(policy, request)
                s = policy.sample(prompt, budget, self.temperature, self.env.vocab.eos, generator,
                                  request.cancelled)
                if s.cancelled:
                    return end(Status.CANCELLED)
                calls.append(Call(prompt, s.ids, s.logprobs, policy.version))
                if not s.ended:
                    reason = "max_new_tokens" if budget == self.max_new_tokens else "max_tokens"
                    return end(Status.TRUNCATED, episode.truncated(s.ids), truncation=reason)
                turn = episode.step(s.ids)
                if turn.done:
                    return end(Status.COMPLETED, turn.reward, turn.components)
                prompt = prompt + s.ids + list(turn.reply)
