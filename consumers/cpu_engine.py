"""`rollstream engine`: a small OpenAI-compatible inference server on CPU, with token ids,
log-probs and the weight version in every response. It stands in for vLLM/SGLang on machines
without GPUs and in tests.

    rollstream engine --model tiny --port 8001                       # TinyTransformer, VOCAB
    rollstream engine --model trainer-model.yaml --port 8001         # the trainer's `model:` section
    rollstream engine --model ./my-hf-model --port 8001              # config.json (+ weights, tokenizer)
    rollstream engine --model tiny --port 8001 --weights-redis redis://redis:6379/0 --namespace exp1
    rollstream engine --model tiny --port 8001 --weights-dir /ckpt/w

Models: `tiny` is a `TinyTransformer` of `domain.model_config.TinyModelConfig`'s defaults (the
envs' 64-id `VOCAB`); a YAML/JSON file is a trainer `ModelConfig` (`kind: tiny | hf`), so the
engine builds exactly the model the trainer starts from (version 0); a directory holds a
Hugging Face `config.json` (its weights are loaded when present, otherwise it is built from
the config under a fixed seed, as `consumers.sources.policy.build_model` does) and, when
present, its tokenizer. Nothing is downloaded. Without a tokenizer the engine speaks
`VOCAB`: characters and `<word>` tokens, ids it has no token for written `<tNN>`; the chat
template is `<bos>` then each message's content, an assistant message followed by `<eos>`,
so a conversation that appends the reply and the next message extends the previous call's
prompt + completion token by token (the calls merge into one chain).

Endpoints (OpenAI shapes, plus the extension fields below):

| endpoint | what |
|---|---|
| `POST /v1/chat/completions` | `messages`, `max_tokens` / `max_completion_tokens`, `temperature` (> 0), `top_p` (1 only), `n`, `seed`, `stop`, `logprobs` (bool), `stream` |
| `POST /v1/completions` | `prompt` (a string, or a list of token ids as vLLM takes it), the same sampling fields, `logprobs` (an int, 0 only), `stream` |
| `GET /v1/models`, `GET /get_weight_version` | the model, `{"weight_version": "3"}` |
| `GET /health` | 200 `{"status": "ok", ...}`, or 503 `"status": "stale"` while it cannot follow the run's weights (`weights`: why, for how long) |
| `GET /metrics` | Prometheus: `rollstream_engine_weights_following`, `_version`, `_failures_total` |
| `POST /update_weights_from_disk` | SGLang's shape: `{"model_path": FILE_OR_DIR, "weight_version": "3"}` -> `{"success": true, "message"}` |
| `POST /collective_rpc` | vLLM's dev-mode shape: `{"method": "reload_weights", "kwargs": {"weights_path": ..., "weight_version": ...}}` |
| `POST /pause`, `POST /resume`, `POST /reset_prefix_cache`, `POST /update_weight_version`, `GET /weight_info` | vLLM's dev-mode weight-update routes: `/pause` holds new requests and waits for the one sampling (any `mode`), `/resume` lets them run; `/update_weight_version {"new_version": "3"}` sets the version; there is no prefix cache to reset |

Extension fields, always present (vLLM's `return_token_ids` names, SGLang's version name):
`prompt_token_ids` (top level, and on each choice of `/v1/completions`), `token_ids` on each
choice (and on each streamed chunk's choice: the ids of that chunk), `weight_version` (top
level of every response and chunk: the version that sampled it). Log-probs, when asked for,
are `log_softmax(logits / temperature)` at each sampled token over the full vocabulary
(no top-k/top-p: what `GRPOObjective(temperature=...)` rescores): chat
`choices[i].logprobs.content[j].logprob`, completions `choices[i].logprobs.token_logprobs`.
`<eos>`, when sampled, ends the completion with `finish_reason="stop"` and is the last of
`token_ids` (it is trained) but not in the text; `"length"` means `max_tokens` or the
context (`max_positions`) ran out. A prompt that fills the context is refused (400,
`context_length_exceeded`).

Weights: one model, one lock: a request samples under the version it started with, and a
new version is loaded between requests (partial rollouts). New versions come from the
run's `weights` stream (`--weights-redis` + `--namespace`, or `--redis-config FILE` with a
process config's user and password source: every announced version is
loaded with `consumers.weights.load_weights`, digest checked), from a directory a
`DirectoryPublisher` writes (`--weights-dir`, polled), or through the two admin endpoints
(what `producers.engine_publishers` pushes to SGLang and vLLM). A Redis outage never stops the
follower: it retries (backoff up to 5 s), the engine answers with its last version
meanwhile and says so (`/health`, the metrics), and what was announced in between is loaded
once Redis answers. At start, a Redis it cannot reach or that refuses its credentials, and a
`--model` that is not there or does not load, end the command in one line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from prometheus_client.exposition import choose_encoder
from torch import nn

from consumers.http import BadRequest, bad_requests, field, json_body, sse_response
from domain.tokenizers import CharTokenizer, HFTokenizer, has_tokenizer
from consumers.sources.policy import _last_logits, build_model
from pipeline.errors import CommandError, ConfigError
from pipeline.metrics import Metrics
from domain.model import context_size, vocab_size

log = logging.getLogger(__name__)

MAX_N = 16


# ----------------------------------------------------------------------------- models


MODEL_SPECS = "tiny, a trainer ModelConfig YAML/JSON file, or a Hugging Face model directory (config.json)"


def _model_from_path(path: Path) -> tuple[nn.Module, Any]:
    """A model (and its tokenizer) from a trainer ModelConfig file or a Hugging Face directory."""
    from pipeline.config import load
    from domain.model_config import ModelConfig

    if path.is_file():
        return build_model(load(ModelConfig, path).build()), None
    if not path.exists():
        raise ConfigError(f"--model {path}: no such file or directory; give {MODEL_SPECS}")
    if not (path / "config.json").exists():
        raise ConfigError(f"--model {path}: a directory without config.json; give {MODEL_SPECS}")
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        if any(path.glob("*.safetensors")) or any(path.glob("*.bin")):
            model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).eval()
        else:
            model = build_model(config)
        tokenizer = HFTokenizer(path) if has_tokenizer(path) else None
    except (OSError, ValueError, KeyError) as exc:  # transformers' refusals of a directory
        raise CommandError(f"--model {path}: cannot load the model: {type(exc).__name__}: {exc}") from exc
    return model, tokenizer


def build(spec: str) -> Engine:
    """The engine `--model` names: `tiny`, a ModelConfig file, or a Hugging Face directory;
    a model that is not there is a ConfigError, one that does not load a CommandError."""
    if spec == "tiny":
        from domain.model_config import TinyModelConfig

        model, tokenizer = build_model(TinyModelConfig().build()), None
    else:
        model, tokenizer = _model_from_path(Path(spec))
    return Engine(model, tokenizer, name="tiny" if spec == "tiny" else Path(spec).name)


# ----------------------------------------------------------------------------- sampling


@dataclass
class Params:
    """The sampling fields of one request, validated."""

    max_tokens: int
    temperature: float
    n: int
    seed: int | None
    stop: list[str]
    logprobs: bool
    stream: bool


@dataclass
class Completion:
    """One sampled choice."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version: int
    text: str = ""


class Stopped(Exception):
    """The client went away mid-generation."""


class Engine:
    """One model on CPU behind the OpenAI endpoints (module docstring)."""

    def __init__(self, model: nn.Module, tokenizer: Any = None, *, version: int = 0, name: str = "tiny",
                 max_tokens: int = 16) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer or CharTokenizer(size=vocab_size(model))
        self.version, self.name, self.default_max_tokens = version, name, max_tokens
        self.context = context_size(model)
        self._lock = threading.Lock()  # one request samples at a time; weights load between
        self._running = threading.Event()  # cleared by /pause: new requests wait for /resume
        self._running.set()
        self._rng = torch.Generator().manual_seed(int.from_bytes(uuid.uuid4().bytes[:8], "little"))
        self.stats = {"requests": 0, "tokens": 0, "loads": 0, "load_errors": 0}
        self.followers: list[Any] = []  # what loads new versions (`_Follower`s), for /health
        self.metrics = Metrics(process=True, component="engine")
        self.metrics.set_build(component="engine", run="")  # a run's namespace once it follows one
        self.metrics.engine_weights_version.set(version)
        self.metrics.engine_weights_following.set(1)  # 0 only while a follower fails

    # ------------------------------------------------------------------ weights

    def load_state(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Serve `state` as `version` from the next request on."""
        with self._lock, torch.no_grad():
            if callable(getattr(self.model, "tie_weights", None)):  # a Hugging Face checkpoint
                # omits tied weights (lm_head = embeddings); they are tied again after loading
                missing, unexpected = self.model.load_state_dict(dict(state), strict=False)
                tied = set(getattr(self.model, "_tied_weights_keys", None) or [])
                if unexpected or set(missing) - tied:
                    raise ValueError(f"the weights do not fit the model: missing {sorted(set(missing) - tied)}, "
                                     f"unexpected {sorted(unexpected)}")
                self.model.tie_weights()
            else:
                self.model.load_state_dict(dict(state))
            self.version = int(version)
            self.stats["loads"] += 1
            self.metrics.engine_weights_version.set(self.version)
        log.info("engine %s: serving weights version %d", self.name, version)

    def load_path(self, path: str | Path, version: int | None = None) -> int:
        """Load a safetensors file, or a directory's `model.safetensors` / newest `v<N>.safetensors`
        (a `.sha256` sidecar, when present, is checked). The version is `version`, else the
        file's `v<N>`, else the current one + 1."""
        from consumers.weights import load_weights

        files = _weights_files(Path(path))
        if version is None:
            m = re.fullmatch(r"v(\d+)(\.safetensors)?", Path(path).name)
            version = int(m.group(1)) if m else self.version + 1
        if len(files) == 1 and Path(f"{files[0]}.sha256").exists():
            state = load_weights(str(files[0]))
        else:
            from safetensors.torch import load_file

            state = {k: v for f in files for k, v in load_file(str(f)).items()}
        self.load_state(state, version)
        return version

    # ------------------------------------------------------------------ sampling

    def _generator(self, seed: int | None) -> torch.Generator:
        if seed is None:
            return torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,), generator=self._rng)))
        return torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def sample(self, prompt: list[int], params: Params, generator: torch.Generator,
               emit: Callable[[int, float, int], None] | None = None,
               stopped: Callable[[], bool] | None = None) -> Completion:
        """Sample one completion after `prompt` under the version loaded now."""
        self._running.wait()
        with self._lock:
            version = self.version
            budget = params.max_tokens
            if self.context is not None:
                budget = min(budget, self.context - len(prompt))
            ids: list[int] = []
            logprobs: list[float] = []
            seq = torch.tensor(prompt, dtype=torch.long)
            finish = "length"
            for _ in range(budget):
                if stopped is not None and stopped():
                    raise Stopped()
                logp = torch.log_softmax(_last_logits(self.model, seq).float() / params.temperature, dim=-1)
                token = int(torch.multinomial(logp.exp(), 1, generator=generator))
                lp = min(float(logp[token]), 0.0)
                ids.append(token)
                logprobs.append(lp)
                if emit is not None:
                    emit(token, lp, version)
                if token == self.tokenizer.eos:
                    finish = "stop"
                    break
                if params.stop and any(self.tokenizer.decode(ids).endswith(s) for s in params.stop):
                    finish = "stop"
                    break
                seq = torch.cat([seq, seq.new_tensor([token])])
            self.stats["requests"] += 1
            self.stats["tokens"] += len(ids)
        return Completion(ids, logprobs, finish, version, self.text(ids, finish, params.stop))

    def text(self, ids: Sequence[int], finish: str, stop: Sequence[str]) -> str:
        """The completion's text: without a final `<eos>`, without a stop string it ended on."""
        if ids and ids[-1] == self.tokenizer.eos:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids)
        for s in stop:
            if finish == "stop" and text.endswith(s):
                return text[: -len(s)]
        return text

    # ------------------------------------------------------------------ requests

    def params(self, body: Mapping[str, Any], *, chat: bool) -> Params:
        max_tokens = field(body, "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens",
                           int, self.default_max_tokens, minimum=1)
        temperature = float(field(body, "temperature", (int, float), 1.0))
        if temperature <= 0:
            raise BadRequest("temperature must be > 0 (greedy decoding has no behaviour log-probs to train on)",
                             param="temperature")
        top_p = field(body, "top_p", (int, float), 1.0)
        if top_p != 1:
            raise BadRequest("top_p: only 1.0 is supported (log-probs are over the full vocabulary)", param="top_p")
        stop = field(body, "stop", (str, list), [])
        stop = [stop] if isinstance(stop, str) else stop
        if not all(isinstance(s, str) and s for s in stop):
            raise BadRequest("stop must be a string or a list of non-empty strings", param="stop")
        if chat:
            logprobs = field(body, "logprobs", bool, False)
            if field(body, "top_logprobs", int, 0, minimum=0) > 0:
                raise BadRequest("top_logprobs > 0 is not supported", param="top_logprobs")
        else:
            lp = field(body, "logprobs", int, None, minimum=0, nullable=True)
            if lp:
                raise BadRequest("logprobs: only 0 (the sampled token's log-prob) is supported", param="logprobs")
            logprobs = lp is not None
        return Params(max_tokens=max_tokens, temperature=temperature, n=field(body, "n", int, 1, minimum=1, maximum=MAX_N),
                      seed=field(body, "seed", int, None, nullable=True), stop=stop, logprobs=logprobs,
                      stream=field(body, "stream", bool, False))

    def chat_prompt(self, body: Mapping[str, Any]) -> list[int]:
        messages = field(body, "messages", list)
        if not messages:
            raise BadRequest("messages must not be empty", param="messages")
        plain = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}] must be an object with a role", param=f"messages[{i}].role")
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise BadRequest(f"messages[{i}].content: only text parts are supported",
                                     param=f"messages[{i}].content")
                content = "".join(p["text"] for p in content)
            if content is None:
                content = ""
            if not isinstance(content, str):
                raise BadRequest(f"messages[{i}].content must be a string or text parts",
                                 param=f"messages[{i}].content")
            plain.append({"role": m["role"], "content": content})
        try:
            return self.tokenizer.chat(plain)
        except ValueError as exc:
            raise BadRequest(f"messages: {exc}", param="messages") from exc

    def completion_prompt(self, body: Mapping[str, Any]) -> list[int]:
        prompt = field(body, "prompt", (str, list))
        if isinstance(prompt, list):
            if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # one prompt in a batch of one
            elif not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise BadRequest("prompt must be a string or a list of token ids (one prompt per request)",
                                 param="prompt")
        if isinstance(prompt, str):
            try:
                return self.tokenizer.encode(prompt)
            except ValueError as exc:
                raise BadRequest(f"prompt: {exc}", param="prompt") from exc
        size = vocab_size(self.model)
        if any(t < 0 or t >= size for t in prompt):
            raise BadRequest(f"prompt holds token ids outside [0, {size})", param="prompt")
        return list(prompt)

    def check_context(self, prompt: list[int], param: str) -> None:
        if not prompt:
            raise BadRequest(f"{param} is empty", param=param)
        if self.context is not None and len(prompt) >= self.context:
            raise BadRequest(f"{param}: {len(prompt)} tokens leave no room in the context of {self.context}",
                             param=param, code="context_length_exceeded")

    # ------------------------------------------------------------------ the application

    def app(self) -> web.Application:
        app = web.Application(middlewares=[bad_requests])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/get_weight_version", self._weight_version)
        app.router.add_post("/update_weights_from_disk", self._update_from_disk)
        app.router.add_post("/collective_rpc", self._collective_rpc)
        app.router.add_post("/pause", self._pause)
        app.router.add_post("/resume", self._resume)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        app.router.add_post("/update_weight_version", self._update_weight_version)
        app.router.add_get("/weight_info", self._weight_version)
        return app

    async def _pause(self, request: web.Request) -> web.Response:
        self._running.clear()

        def drained() -> None:  # the request sampling now finishes first
            with self._lock:
                pass

        await asyncio.get_running_loop().run_in_executor(None, drained)
        return web.json_response({"status": "paused"})

    async def _resume(self, request: web.Request) -> web.Response:
        self._running.set()
        return web.json_response({"status": "resumed"})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True})

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        version = field(body, "new_version", str)
        if not version.isdigit():
            raise BadRequest(f"new_version must be a non-negative integer, got {version!r}", param="new_version")
        with self._lock:
            self.version = int(version)
        return web.json_response({"success": True, "new_version": version})

    async def _health(self, request: web.Request) -> web.Response:
        """200 while every follower follows the run's weights; 503 (`"status": "stale"`)
        while one cannot: the engine still answers, with its last version."""
        weights = [f.status() for f in self.followers]
        ok = all(w["following"] for w in weights)
        return web.json_response({"status": "ok" if ok else "stale", "weight_version": self.version,
                                  **self.stats, "weights": weights}, status=200 if ok else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encoder(self.metrics.registry), headers={"Content-Type": content_type})

    async def _weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.version)})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.name, "object": "model", "created": 0, "owned_by": "rollstream",
             "max_model_len": self.context, "weight_version": self.version}]})

    async def _update_from_disk(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        path = field(body, "model_path", str)
        version = field(body, "weight_version", (str, int), None, nullable=True)
        loaded = await self._load(path, version, "weight_version")
        return web.json_response({"success": True, "message": f"loaded {path} as version {loaded}",
                                  "weight_version": str(loaded)})

    async def _collective_rpc(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        method = field(body, "method", str)
        if method != "reload_weights":
            raise BadRequest(f"method {method!r} is not supported (reload_weights only)", param="method")
        kwargs = field(body, "kwargs", dict, {})
        path = field(kwargs, "weights_path", str)
        version = field(kwargs, "weight_version", (str, int), None, nullable=True)
        await self._load(path, version, "kwargs.weight_version")
        return web.json_response({"results": [None]})

    async def _load(self, path: str, version: str | int | None, param: str) -> int:
        if isinstance(version, str):
            if not version.isdigit():
                raise BadRequest(f"{param} must be a non-negative integer, got {version!r}", param=param)
            version = int(version)
        try:
            return await asyncio.get_running_loop().run_in_executor(None, self.load_path, path, version)
        except (OSError, ValueError, RuntimeError) as exc:  # missing, corrupt, or not this model's
            raise BadRequest(f"cannot load weights from {path}: {exc}", param="model_path") from exc

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await json_body(request)
        params = self.params(body, chat=True)
        prompt = self.chat_prompt(body)
        self.check_context(prompt, "messages")
        return await self._respond(request, prompt, params, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await json_body(request)
        params = self.params(body, chat=False)
        prompt = self.completion_prompt(body)
        self.check_context(prompt, "prompt")
        return await self._respond(request, prompt, params, chat=False)

    async def _respond(self, request: web.Request, prompt: list[int], params: Params, *,
                       chat: bool) -> web.StreamResponse:
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        generator = self._generator(params.seed)
        if params.stream:
            return await sse_response(request, self._stream(rid, created, prompt, params, generator, chat))
        loop = asyncio.get_running_loop()
        done = [await loop.run_in_executor(None, self.sample, prompt, params, generator)
                for _ in range(params.n)]
        tokens = sum(len(c.ids) for c in done)
        return web.json_response({
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": self.name, "choices": [_choice(i, c, params, chat, prompt, self.tokenizer)
                                            for i, c in enumerate(done)],
            "prompt_token_ids": prompt, "weight_version": min(c.version for c in done),
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": tokens,
                      "total_tokens": len(prompt) + tokens}})

    async def _stream(self, rid: str, created: int, prompt: list[int], params: Params,
                      generator: torch.Generator, chat: bool) -> Any:
        """One chunk per token (the first also carries the role), then one with the finish
        reason and usage; choices one after the other when n > 1."""
        loop = asyncio.get_running_loop()
        kind = "chat.completion.chunk" if chat else "text_completion"
        for index in range(params.n):
            queue: asyncio.Queue[tuple[int, float, int] | None] = asyncio.Queue()
            gone = threading.Event()

            def emit(token: int, lp: float, version: int) -> None:
                loop.call_soon_threadsafe(queue.put_nowait, (token, lp, version))  # noqa: B023 (awaited within this iteration)

            task = loop.run_in_executor(None, lambda: self.sample(prompt, params, generator, emit, gone.is_set))  # noqa: B023 (awaited within this iteration)
            # the sentinel follows every token (both are scheduled on this loop in order);
            # reading the exception keeps a Stopped task from being reported as unretrieved
            task.add_done_callback(lambda f: (f.cancelled() or f.exception(), queue.put_nowait(None)))  # noqa: B023 (awaited within this iteration)
            said: list[int] = []
            try:
                while (item := await queue.get()) is not None:
                    token, lp, version = item
                    before = self.text(said, "length", [])
                    said.append(token)
                    piece = self.text(said, "length", [])[len(before):]
                    choice = _delta(index, token, lp, piece, params, chat, self.tokenizer)
                    if len(said) == 1 and chat:
                        choice["delta"]["role"] = "assistant"
                    yield {"id": rid, "object": kind, "created": created, "model": self.name,
                           "choices": [choice], "prompt_token_ids": prompt, "weight_version": version}
                c = await task
            finally:
                gone.set()  # a client that went away stops the sampling at the next token
            last: dict[str, Any] = {"index": index, "token_ids": [], "finish_reason": c.finish_reason,
                                    "logprobs": None}
            last |= {"delta": {}} if chat else {"text": ""}
            yield {"id": rid, "object": kind, "created": created, "model": self.name, "choices": [last],
                   "weight_version": c.version,
                   "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(c.ids),
                             "total_tokens": len(prompt) + len(c.ids)}}


def _delta(index: int, token: int, lp: float, piece: str, params: Params, chat: bool, tokenizer: Any) -> dict[str, Any]:
    if chat:
        logprobs = {"content": [{"token": tokenizer.decode([token]), "logprob": lp, "bytes": None,
                                 "top_logprobs": []}]} if params.logprobs else None
        return {"index": index, "delta": {"content": piece}, "logprobs": logprobs, "token_ids": [token],
                "finish_reason": None}
    logprobs = {"tokens": [tokenizer.decode([token])], "token_logprobs": [lp], "top_logprobs": None,
                "text_offset": [0]} if params.logprobs else None
    return {"index": index, "text": piece, "logprobs": logprobs, "token_ids": [token], "finish_reason": None}


def _choice(index: int, c: Completion, params: Params, chat: bool, prompt: list[int], tokenizer: Any) -> dict[str, Any]:
    tokens = [tokenizer.decode([t]) for t in c.ids]
    if chat:
        logprobs = {"content": [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                                for t, lp in zip(tokens, c.logprobs)]} if params.logprobs else None
        return {"index": index, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs,
                "finish_reason": c.finish_reason, "token_ids": c.ids}
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    logprobs = {"tokens": tokens, "token_logprobs": c.logprobs, "top_logprobs": None,
                "text_offset": offsets} if params.logprobs else None
    return {"index": index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason,
            "token_ids": c.ids, "prompt_token_ids": prompt}


def _versions(path: Path) -> list[tuple[int, Path]]:
    """The `v<N>.safetensors` files in `path`, oldest first."""
    return sorted((int(m.group(1)), p) for p in path.glob("v*.safetensors")
                  if (m := re.fullmatch(r"v(\d+)\.safetensors", p.name)))


def _weights_files(path: Path) -> list[Path]:
    """The safetensors files of `path`: the file itself; a checkpoint directory's
    `model.safetensors` or the shards its index names; or the newest `v<N>.safetensors`."""
    if path.is_file():
        return [path]
    if path.is_dir():
        if (path / "model.safetensors").exists():
            return [path / "model.safetensors"]
        if (path / "model.safetensors.index.json").exists():
            index = json.loads((path / "model.safetensors.index.json").read_text())
            return [path / name for name in sorted(set(index["weight_map"].values()))]
        versions = _versions(path)
        if versions:
            return [versions[-1][1]]
        raise FileNotFoundError(f"{path} holds neither model.safetensors, a sharded index nor v<N>.safetensors")
    raise FileNotFoundError(f"{path} does not exist")


# ----------------------------------------------------------------------------- following new versions


class _Follower:
    """A thread that loads new versions into `engine` until `stop()`. While it cannot follow
    (its source unreachable, or the thread stopped by a failure, kept in `failure`) it says
    so in `status()`, which `/health` and the engine's metrics report."""

    source = "weights"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.stop_event = threading.Event()
        self.failure: BaseException | None = None
        self.error: str | None = None  # why it cannot follow now; None while it follows
        self.since: float | None = None  # when it last stopped following (time.monotonic)
        engine.followers.append(self)
        self.thread = threading.Thread(target=self._guarded, name="rollstream-engine-weights", daemon=True)
        self.thread.start()

    def _guarded(self) -> None:
        try:
            self._follow()
        except BaseException as exc:
            self.failure = exc
            self._lost(exc, retrying=False)
            log.exception("engine: the weights follower stopped")
            raise

    def _follow(self) -> None:
        raise NotImplementedError

    def status(self) -> dict[str, Any]:
        """`{"source", "following", "error", "for_s"}`: whether the engine follows the run's
        weights now, and if not why and for how long (it serves its last version meanwhile)."""
        following = self.error is None and self.failure is None and self.thread.is_alive()
        lost_s = None if self.since is None else round(time.monotonic() - self.since, 1)
        return {"source": self.source, "following": following, "error": self.error,
                "for_s": None if following else lost_s}

    def _lost(self, exc: BaseException, *, retrying: bool = True) -> None:
        """An attempt failed: report it (once per outage in the log), count it."""
        first = self.error is None
        self.error = f"{type(exc).__name__}: {exc}"
        self.since = self.since if not first else time.monotonic()
        self.engine.metrics.engine_weights_failures.inc()
        self.engine.metrics.engine_weights_following.set(0)
        if first and retrying:
            log.warning("engine: cannot follow the run's weights (%s); serving version %d meanwhile, "
                        "retrying (/health reports it)", self.error, self.engine.version)

    def _followed(self) -> None:
        """An attempt succeeded: following again."""
        if self.error is not None:
            log.warning("engine: following the run's weights again after %.1fs (version %d)",
                        time.monotonic() - (self.since or time.monotonic()), self.engine.version)
        self.error, self.since = None, None
        self.engine.metrics.engine_weights_following.set(1)

    def _missing(self, version: int, exc: Exception) -> None:
        """A version gone before it was read (superseded and pruned): counted; a newer one follows."""
        self.engine.stats["load_errors"] += 1
        log.warning("engine: weights version %d is gone before it was read: %s", version, exc)

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(10)


class RedisFollower(_Follower):
    """Loads every version announced on a run's `weights` stream (the newest one at start,
    then each later one), digest checked. A Redis outage (or refused credentials) never
    stops it: it retries with a capped backoff, reports that it cannot follow meanwhile
    (`status()`: `/health`, `rollstream_engine_weights_following`), and loads what was
    announced in between once Redis answers again."""

    source = "redis"

    def __init__(self, engine: Engine, redis_config: Any, *, block_ms: int = 1000, cap_s: float = 5.0) -> None:
        from pipeline.keys import Keys
        from pipeline.redis_io import connect

        self.config, self.block_ms, self.cap_s = redis_config, block_ms, cap_s
        self.keys = Keys(redis_config.namespace)
        self.r = connect(redis_config)
        engine.metrics.set_build(component="engine", run=redis_config.namespace)
        super().__init__(engine)

    def _follow(self) -> None:
        from pipeline import streams
        from pipeline.redis_io import FATAL, RETRYABLE, backoff_s, text

        pending: list[tuple[bytes, dict]] | None = None  # read, not yet loaded; None: read the newest
        last, failures = "0", 0
        while not self.stop_event.is_set():
            try:
                if pending is None:
                    newest = streams.newest(self.r, self.keys.weights)
                    pending = [newest] if newest else []
                while pending:
                    entry_id, fields = pending[0]
                    self._load(fields)
                    last = text(entry_id)
                    pending.pop(0)
                read = streams.read(self.r, {self.keys.weights: last}, block_ms=self.block_ms)
                pending = [(e.id, e.fields or {}) for e in read]
                self._followed()
                failures = 0
            except (*RETRYABLE, *FATAL) as exc:  # never given up: reported, retried
                self._lost(exc)
                self.stop_event.wait(backoff_s(failures, 0.1, self.cap_s))
                failures += 1

    def _load(self, fields: dict) -> None:
        from consumers.weights import WeightsMissing, load_weights
        from pipeline import wire

        w = wire.from_fields(fields, wire.Weights)
        if w.version > self.engine.version:
            try:
                self.engine.load_state(load_weights(w.location, redis=self.r), w.version)
            except WeightsMissing as exc:
                self._missing(w.version, exc)

    def stop(self) -> None:
        super().stop()
        self.r.close()


class DirectoryFollower(_Follower):
    """Loads the newest `v<N>.safetensors` a `DirectoryPublisher` wrote, polled every `poll_s`."""

    source = "directory"

    def __init__(self, engine: Engine, path: str | Path, *, poll_s: float = 0.5) -> None:
        from consumers.weights import DirectoryWeights, WeightsLoader

        self.path, self.poll_s = Path(path), poll_s
        self.loader = WeightsLoader(DirectoryWeights(path))
        super().__init__(engine)

    def _follow(self) -> None:
        from consumers.weights import WeightsMissing

        while not self.stop_event.is_set():
            versions = _versions(self.path)
            if versions and versions[-1][0] > self.engine.version:
                newest = versions[-1][0]
                try:
                    self.engine.load_state(self.loader.load(newest), newest)
                except WeightsMissing as exc:
                    self._missing(newest, exc)
            self.stop_event.wait(self.poll_s)


# ----------------------------------------------------------------------------- the process


def _weights_redis(args: argparse.Namespace) -> Any:
    """The RedisConfig whose run's weights the engine follows: `--redis-config FILE` (a
    process config's redis section, with its user and password source) or `--weights-redis
    URL --namespace NS`; None without either."""
    from pipeline.config import RedisConfig, build, load_redis_section

    if getattr(args, "redis_config", None):
        if args.weights_redis:
            raise ConfigError("--redis-config and --weights-redis: give one")
        return load_redis_section(args.redis_config)
    if args.weights_redis:
        return build(RedisConfig, {"url": args.weights_redis, "namespace": args.namespace})
    return None


def main(args: argparse.Namespace) -> int:
    """`rollstream engine` (its options: `rollstream.cli`)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    redis_config = _weights_redis(args)
    if redis_config is not None:
        from pipeline.redis_io import check, connect

        with connect(redis_config) as r:  # a wrong URL or password fails at start, in one line
            check(r, redis_config)
    engine = build(args.model)
    engine.default_max_tokens = args.max_tokens
    followers: list[Any] = []
    if redis_config is not None:
        followers.append(RedisFollower(engine, redis_config))
    if args.weights_dir:
        followers.append(DirectoryFollower(engine, args.weights_dir))
    app = engine.app()

    async def stop_followers(app: web.Application) -> None:
        for f in followers:
            f.stop()

    app.on_cleanup.append(stop_followers)
    from consumers.http import serve

    log.info("rollstream engine: %s on %s:%d (context %s)", engine.name, args.host, args.port, engine.context)
    return serve(app, args.host, args.port)
