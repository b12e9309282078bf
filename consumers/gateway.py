"""`rollstream gateway`: the recording gateway in front of the inference engines, so that any
agent harness that speaks the OpenAI API can be trained.

    rollstream gateway --engine http://10.0.0.5:8001 --engine http://10.0.0.6:8001 --port 8000

Each session gets its own base URL, `http://GATEWAY/sessions/{session_id}/v1` (what a
harness is given as `OPENAI_BASE_URL`). The gateway forwards `POST .../chat/completions` and
`POST .../completions` (streaming too) to an engine, asking it for token ids and log-probs
(`logprobs`, `return_token_ids`, and SGLang's `return_prompt_token_ids` for chat), and
records per call, per choice:

    {"prompt_ids": [...], "completion_ids": [...], "logprobs": [...], "finish_reason": "stop", "version": 3}

read from the engine's `prompt_token_ids` (top level or on the choice), the choice's
`token_ids` (SGLang's chat answers: `response_token_ids`), its log-probs (chat
`logprobs.content[].logprob`, completions `logprobs.token_logprobs`) and the version the
engine stamps (`weight_version`, or SGLang's `metadata.weight_version`). An engine that
stamps none (vLLM's OpenAI answers) is credited with the version set for it with `POST
/weight_version`, else 0: the older of the version set when the call started and when it
ended, so a call is never credited with weights newer than those that served it. A
`producers.engine_publishers` publisher brackets each engine's push: `POST /engines/hold` first (new
calls to that engine wait in the gateway, up to `hold_timeout_s`, while the calls in flight
finish under the old weights), then `POST /weight_version` once the engine serves the new
version (the held calls go on, credited with it), or `POST /engines/release` after a failed
push. Streamed answers are recorded whole at `[DONE]`; chunks that carry no tokens (vLLM's
first chat chunk, the role alone; a usage chunk) are passed through. The harness gets the
engine's response unchanged.

| endpoint | what |
|---|---|
| `PUT /sessions/{id}` | create a session with limits `{"max_turns": int, "max_tokens": int}` (optional: a first call creates one without) |
| `GET /sessions/{id}` | `{"calls": [...], "infra_error", "truncated", "closed", "protocol_error"}` |
| `POST /sessions/{id}/close` | `{"reason": "wall_clock"}`: later calls are refused (400, code `session_closed`) |
| `DELETE /sessions/{id}` | free it |
| `GET /health`, `GET /engines` | the engines: up or down, calls in flight, failures |
| `POST /weight_version` | `{"version": 3, "engine": URL or null (all)}`: set the version, end a hold |
| `POST /engines/hold`, `POST /engines/release` | `{"engine": URL or null (all)}`: hold new calls to the engine during its push; let them go |

Limits: a call past `max_turns` is refused (400, code `max_turns`) and the session is
`truncated: "max_turns"`; a call whose prompt + completion reaches `max_tokens`, or that
an engine refuses as longer than its context (`context_length_exceeded`, or vLLM's
"maximum context length" message), makes it `truncated: "max_tokens"` (the later calls are
refused). `HarnessSource` turns these into TRUNCATED with the reason.

Engines and failures: a session sticks to the engine of its first call while that engine
is up (its prefix cache); a new one goes to the up engine with the fewest calls in flight.
A request that fails on a pooled keep-alive connection the engine has just closed
(`ServerDisconnectedError`, a reset before any answer: the engine never read it) is sent
again once on a fresh connection. An engine that cannot be reached, times out, breaks a
stream or answers 5xx fails the call (502 to the harness) and flags the session
`infra_error`, so its rollout ends INFRA_ERROR (resubmitted, never trained as the agent's
failure). One failed call does not take an engine out of rotation: the gateway then asks
its `GET /health`, and only an engine that does not answer that either is marked down and
probed every `health_interval_s` until it answers. With no engine up (after probing the
down ones once more), calls get 503 and their sessions are flagged too. 4xx answers are
the harness's: passed through unchanged. An engine answer that lacks token ids, log-probs
or prompt ids sets `protocol_error` (the set-up is wrong; `HarnessSource` raises). Sessions
idle for `session_ttl_s` are dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from consumers.http import BadRequest, bad_requests, error, json_body
from consumers.http import field as body_field

log = logging.getLogger(__name__)

RECORD_KEYS = ("prompt_ids", "completion_ids", "logprobs", "finish_reason", "version")
UNREACHABLE = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)
HEALTH_TIMEOUT_S = 2.0


def _stale(exc: BaseException) -> bool:
    """A failure of a pooled connection the engine closed before reading the request."""
    return isinstance(exc, aiohttp.ServerDisconnectedError) or (
        isinstance(exc, aiohttp.ClientOSError) and not isinstance(exc, aiohttp.ClientConnectorError))


@dataclass
class Upstream:
    """One engine as the gateway sees it."""

    url: str
    up: bool = True
    outstanding: int = 0
    calls: int = 0
    failures: int = 0
    version: int = 0  # credited to responses without a weight_version
    last_error: str | None = None
    released: asyncio.Event = field(default_factory=asyncio.Event)  # cleared while a push holds calls
    waiting: int = 0  # calls held

    def __post_init__(self) -> None:
        self.released.set()

    def view(self) -> dict[str, Any]:
        return {"url": self.url, "up": self.up, "outstanding": self.outstanding, "calls": self.calls,
                "failures": self.failures, "version": self.version, "last_error": self.last_error,
                "held": not self.released.is_set(), "waiting": self.waiting}


@dataclass
class Recording:
    """One session's recorded calls and what ended it."""

    max_turns: int | None = None
    max_tokens: int | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)
    engine: Upstream | None = None
    infra_error: str | None = None
    truncated: str | None = None
    closed: str | None = None
    protocol_error: str | None = None
    touched: float = field(default_factory=time.monotonic)

    def view(self) -> dict[str, Any]:
        return {"calls": self.calls, "infra_error": self.infra_error, "truncated": self.truncated,
                "closed": self.closed, "protocol_error": self.protocol_error}


class ProtocolError(ValueError):
    """An engine's answer lacks what a trainable call needs."""


NO_TOKEN_IDS = "the engine returned no token_ids (it needs vLLM's or SGLang's return_token_ids)"


class Choice:
    """A choice's token ids, log-probs and finish reason, accumulated (streamed or whole)."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.prompt_ids: list[int] | None = None
        self.has_ids = False  # the engine sent token ids for it

    def add(self, choice: Mapping[str, Any], chat: bool, *, chunk: bool = False) -> None:
        """Add a whole choice, or a streamed chunk's (`chunk`: one without token ids is
        fine when it carries no tokens either, e.g. vLLM's first chat chunk, the role)."""
        ids = choice.get("token_ids")
        if ids is None:
            ids = choice.get("response_token_ids")  # SGLang's chat answers
        if ids is None:
            if not chunk or _carries_tokens(choice, chat):
                raise ProtocolError(NO_TOKEN_IDS)
            ids = []
        else:
            self.has_ids = True
        self.ids += ids
        if ids:
            self.logprobs += _logprobs(choice.get("logprobs"), chat, len(ids))
        if choice.get("prompt_token_ids") is not None:
            self.prompt_ids = list(choice["prompt_token_ids"])
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]


def _carries_tokens(choice: Mapping[str, Any], chat: bool) -> bool:
    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
    return bool(text) or bool(choice.get("logprobs"))


def _stamped(data: Mapping[str, Any]) -> Any:
    """The version an engine stamped on an answer: `weight_version` (rollstream engine),
    `metadata.weight_version` (SGLang), or None."""
    if data.get("weight_version") is not None:
        return data["weight_version"]
    metadata = data.get("metadata")
    return metadata.get("weight_version") if isinstance(metadata, Mapping) else None


def _logprobs(block: Any, chat: bool, n: int) -> list[float]:
    try:
        values = [c["logprob"] for c in block["content"]] if chat else list(block["token_logprobs"])
    except (TypeError, KeyError) as exc:
        raise ProtocolError(f"the engine returned no log-probs for {n} tokens ({exc!r})") from exc
    if len(values) != n or not all(isinstance(v, (int, float)) for v in values):
        raise ProtocolError(f"the engine returned {len(values)} log-probs for {n} tokens")
    return [min(float(v), 0.0) for v in values]


class Gateway:
    """The recording gateway (module docstring) over `engines` (base URLs, without `/v1`)."""

    def __init__(self, engines: Sequence[str], *, timeout_s: float = 600.0, connect_timeout_s: float = 5.0,
                 health_interval_s: float = 2.0, session_ttl_s: float = 3600.0,
                 temperature: float | None = None, hold_timeout_s: float = 600.0) -> None:
        if not engines:
            raise ValueError("engines: give at least one engine URL")
        self.engines = [Upstream(url.rstrip("/")) for url in engines]
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self.health_interval_s, self.session_ttl_s = health_interval_s, session_ttl_s
        self.hold_timeout_s = hold_timeout_s
        self.temperature = temperature
        self.sessions: dict[str, Recording] = {}
        self._client: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None  # a new connection per request: the retries
        self._probe: asyncio.Task | None = None
        self.retried = 0  # requests sent again on a fresh connection

    # ------------------------------------------------------------------ the application

    def app(self) -> web.Application:
        app = web.Application(middlewares=[bad_requests])
        r = app.router
        r.add_post("/sessions/{sid}/v1/chat/completions", self._chat)
        r.add_post("/sessions/{sid}/v1/completions", self._completions)
        r.add_get("/sessions/{sid}/v1/models", self._models)
        r.add_put("/sessions/{sid}", self._create)
        r.add_get("/sessions/{sid}", self._get)
        r.add_post("/sessions/{sid}/close", self._close)
        r.add_delete("/sessions/{sid}", self._delete)
        r.add_get("/health", self._health)
        r.add_get("/engines", self._health)
        r.add_post("/weight_version", self._weight_version)
        r.add_post("/engines/hold", self._hold)
        r.add_post("/engines/release", self._release)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self._client = aiohttp.ClientSession(timeout=self.timeout)
        self._fresh = aiohttp.ClientSession(timeout=self.timeout, connector=aiohttp.TCPConnector(force_close=True))
        self._probe = asyncio.create_task(self._probe_loop())

    async def _stop(self, app: web.Application) -> None:
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
        for client in (self._client, self._fresh):
            if client is not None:
                await client.close()

    async def _probe_loop(self) -> None:
        """Bring engines that answer `/health` back up; drop sessions idle past their TTL."""
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self._probe_down()
            idle = time.monotonic() - self.session_ttl_s
            for sid in [sid for sid, s in self.sessions.items() if s.touched < idle]:
                del self.sessions[sid]

    async def _probe_down(self) -> None:
        """Probe every engine marked down once; those that answer are up again."""
        for engine in self.engines:
            if not engine.up and await self._healthy(engine):
                engine.up, engine.last_error = True, None
                log.warning("gateway: engine %s is up again", engine.url)

    async def _healthy(self, engine: Upstream) -> bool:
        """Whether `engine` answers `GET /health` with 200 (on a fresh connection)."""
        assert self._fresh is not None
        try:
            async with self._fresh.get(f"{engine.url}/health",
                                       timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as resp:
                return resp.status == 200
        except UNREACHABLE as exc:
            engine.last_error = f"{type(exc).__name__}: {exc}"  # down; probed again later
            return False

    # ------------------------------------------------------------------ sessions

    def session(self, sid: str) -> Recording:
        s = self.sessions.get(sid)
        if s is None:
            s = self.sessions[sid] = Recording()
        s.touched = time.monotonic()
        return s

    def _known(self, request: web.Request) -> Recording:
        s = self.sessions.get(request.match_info["sid"])
        if s is None:
            raise BadRequest(f"no session {request.match_info['sid']!r}", param="session_id", status=404)
        return s

    async def _create(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        s = self.session(request.match_info["sid"])
        s.max_turns = body_field(body, "max_turns", int, None, minimum=1, nullable=True)
        s.max_tokens = body_field(body, "max_tokens", int, None, minimum=1, nullable=True)
        return web.json_response({"session": request.match_info["sid"]})

    async def _get(self, request: web.Request) -> web.Response:
        return web.json_response(self._known(request).view())

    async def _close(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        s = self._known(request)
        s.closed = s.closed or body_field(body, "reason", str)
        return web.json_response(s.view())

    async def _delete(self, request: web.Request) -> web.Response:
        return web.json_response({"deleted": self.sessions.pop(request.match_info["sid"], None) is not None})

    async def _health(self, request: web.Request) -> web.Response:
        up = sum(e.up for e in self.engines)
        return web.json_response({"status": "ok" if up else "down", "engines": [e.view() for e in self.engines],
                                  "sessions": len(self.sessions)}, status=200 if up else 503)

    def _chosen(self, body: Mapping[str, Any]) -> list[Upstream]:
        url = body_field(body, "engine", str, None, nullable=True)
        chosen = [e for e in self.engines if url is None or e.url == url.rstrip("/")]
        if not chosen:
            raise BadRequest(f"engine {url!r} is not one of this gateway's", param="engine")
        return chosen

    async def _weight_version(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        version = body_field(body, "version", int, minimum=0)
        chosen = self._chosen(body)
        for e in chosen:
            e.version = version
            e.released.set()
        return web.json_response({"engines": [e.view() for e in chosen]})

    async def _hold(self, request: web.Request) -> web.Response:
        chosen = self._chosen(await json_body(request))
        for e in chosen:
            e.released.clear()
        return web.json_response({"engines": [e.view() for e in chosen]})

    async def _release(self, request: web.Request) -> web.Response:
        chosen = self._chosen(await json_body(request))
        for e in chosen:
            e.released.set()
        return web.json_response({"engines": [e.view() for e in chosen]})

    # ------------------------------------------------------------------ forwarding

    def pick(self, s: Recording) -> Upstream | None:
        if s.engine is not None and s.engine.up:
            return s.engine
        up = [e for e in self.engines if e.up]
        return min(up, key=lambda e: (e.outstanding, e.calls)) if up else None

    async def _models(self, request: web.Request) -> web.StreamResponse:
        engine = self.pick(self.session(request.match_info["sid"]))
        if engine is None:
            return error(503, "no inference engine is up")
        try:
            async with self._request("GET", f"{engine.url}/v1/models") as resp:
                return web.json_response(await resp.json(), status=resp.status)
        except UNREACHABLE as exc:
            await self._failed(engine, exc)
            return error(502, f"engine {engine.url} is unreachable: {exc}")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._forward(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._forward(request, chat=False)

    def _upstream_body(self, body: dict[str, Any], chat: bool) -> dict[str, Any]:
        out = dict(body)
        if chat:
            out["logprobs"] = True
            out["return_prompt_token_ids"] = True  # SGLang's chat answers
        elif out.get("logprobs") is None:
            out["logprobs"] = 0
        out["return_token_ids"] = True
        if self.temperature is not None:
            out["temperature"] = self.temperature
        return out

    def _refuse(self, s: Recording) -> web.Response | None:
        if s.infra_error is not None:
            return error(503, f"this session already failed: {s.infra_error}", code="infra_error")
        if s.closed is not None:
            return error(400, f"this session is closed ({s.closed})", code="session_closed")
        if s.truncated is not None:
            return error(400, f"this session reached its {s.truncated} limit", code=s.truncated)
        if s.max_turns is not None and len(s.calls) >= s.max_turns:
            s.truncated = "max_turns"
            return error(400, f"this session reached max_turns={s.max_turns}", code="max_turns")
        return None

    async def _failed(self, engine: Upstream, exc: BaseException) -> None:
        """A call to `engine` failed: counted; the engine leaves the rotation only when its
        `/health` does not answer either."""
        engine.failures += 1
        failure = engine.last_error = f"{type(exc).__name__}: {exc}"
        if engine.up and not await self._healthy(engine):
            engine.up = False
            log.warning("gateway: engine %s is down (%s; /health: %s)", engine.url, failure, engine.last_error)

    @contextlib.asynccontextmanager
    async def _request(self, method: str, url: str, **kw: Any) -> AsyncIterator[aiohttp.ClientResponse]:
        """A request on a pooled connection, sent once more on a fresh one when the pooled
        one turns out closed by the engine before it read the request (module docstring)."""
        assert self._client is not None and self._fresh is not None
        try:
            resp = await self._client.request(method, url, **kw)
        except UNREACHABLE as exc:
            if not _stale(exc):
                raise
            self.retried += 1
            log.info("gateway: %s %s failed on a pooled connection (%s: %s); sent again on a fresh one",
                     method, url, type(exc).__name__, exc)
            resp = await self._fresh.request(method, url, **kw)
        try:
            yield resp
        finally:
            resp.release()

    async def _forward(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        body = await json_body(request)
        stream = body_field(body, "stream", bool, False)
        s = self.session(request.match_info["sid"])
        refused = self._refuse(s)
        if refused is not None:
            return refused
        engine = self.pick(s)
        if engine is None:  # an engine back since the last probe serves this call
            await self._probe_down()
            engine = self.pick(s)
        if engine is None:
            s.infra_error = "no inference engine is up"
            return error(503, s.infra_error, code="infra_error")
        if not engine.released.is_set():  # a push is under way: wait for the new version
            engine.waiting += 1
            try:
                await asyncio.wait_for(engine.released.wait(), self.hold_timeout_s)
            except asyncio.TimeoutError:
                log.warning("gateway: engine %s held calls for %.0fs; sending them", engine.url, self.hold_timeout_s)
            finally:
                engine.waiting -= 1
        s.engine = engine
        engine.outstanding += 1
        engine.calls += 1
        started = engine.version
        url = f"{engine.url}/v1/{'chat/completions' if chat else 'completions'}"
        try:
            async with self._request("POST", url, json=self._upstream_body(body, chat)) as resp:
                if resp.status >= 500:
                    text = await resp.text()
                    s.infra_error = f"engine {engine.url} answered {resp.status}: {text[:500]}"
                    engine.failures += 1
                    return error(502, s.infra_error, code="infra_error")
                if resp.status >= 400:
                    return await self._passthrough_error(resp, s)
                if stream:
                    return await self._relay_stream(request, resp, s, chat, engine, started)
                data = await resp.json()
                self._record(s, data, _choices(data, chat), engine, started)
                return web.json_response(data)
        except UNREACHABLE as exc:
            await self._failed(engine, exc)
            s.infra_error = f"engine {engine.url} is unreachable: {type(exc).__name__}: {exc}"
            return error(502, s.infra_error, code="infra_error")
        finally:
            engine.outstanding -= 1

    async def _passthrough_error(self, resp: aiohttp.ClientResponse, s: Recording) -> web.Response:
        raw = await resp.read()
        if context_exceeded(raw):
            s.truncated = "max_tokens"
        return web.Response(body=raw, status=resp.status, content_type=resp.content_type)

    async def _relay_stream(self, request: web.Request, resp: aiohttp.ClientResponse, s: Recording,
                            chat: bool, engine: Upstream, started: int) -> web.StreamResponse:
        """Pass the engine's events through as they come, accumulating each choice."""
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await out.prepare(request)
        acc: dict[int, Choice] = {}
        top: dict[str, Any] = {}
        try:
            finished = await self._relay_events(resp, out, acc, top, s, chat)
            if not finished:
                raise aiohttp.ClientPayloadError(f"the stream from {engine.url} ended without [DONE]")
        except UNREACHABLE as exc:  # the harness sees an error event; the session is flagged
            await self._failed(engine, exc)
            s.infra_error = f"engine {engine.url} broke the stream: {type(exc).__name__}: {exc}"
            event = {"error": {"message": s.infra_error, "type": "server_error", "code": "infra_error"}}
            await out.write(f"data: {json.dumps(event)}\n\n".encode())
        else:
            if s.protocol_error is None:
                self._record(s, top, [acc[i] for i in sorted(acc)], engine, started)
        await out.write_eof()
        return out

    @staticmethod
    async def _relay_events(resp: aiohttp.ClientResponse, out: web.StreamResponse, acc: dict[int, Choice],
                            top: dict[str, Any], s: Recording, chat: bool) -> bool:
        """Write each line through; True once `[DONE]` passed."""
        async for raw in resp.content:
            await out.write(raw)
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                await out.write(b"\n")  # the blank line that ends the event; the engine's is not read
                return True
            event = json.loads(data)
            for key in ("prompt_token_ids", "weight_version", "metadata"):
                if event.get(key) is not None:
                    top[key] = event[key]
            try:
                for c in event.get("choices") or []:
                    acc.setdefault(int(c.get("index", 0)), Choice()).add(c, chat, chunk=True)
            except ProtocolError as exc:
                s.protocol_error = str(exc)
        return False

    def _record(self, s: Recording, data: Mapping[str, Any], choices: list[Choice] | ProtocolError,
                engine: Upstream, started: int) -> None:
        if isinstance(choices, ProtocolError):
            s.protocol_error = str(choices)
            return
        version = _stamped(data)
        try:
            version = min(started, engine.version) if version is None else int(version)
        except (TypeError, ValueError):
            s.protocol_error = f"the engine's weight_version {version!r} is not an integer"
            return
        for c in choices:
            if not c.has_ids:
                s.protocol_error = NO_TOKEN_IDS
                return
            prompt = c.prompt_ids if c.prompt_ids is not None else data.get("prompt_token_ids")
            if prompt is None:
                s.protocol_error = "the engine returned no prompt_token_ids (it needs vLLM's return_token_ids)"
                return
            s.calls.append({"prompt_ids": list(prompt), "completion_ids": c.ids, "logprobs": c.logprobs,
                            "finish_reason": c.finish_reason, "version": version})
            if s.max_tokens is not None and len(prompt) + len(c.ids) >= s.max_tokens:
                s.truncated = s.truncated or "max_tokens"


def context_exceeded(raw: bytes | str) -> bool:
    """Whether an engine's 4xx answer refuses a prompt longer than its context: the OpenAI
    code `context_length_exceeded` (rollstream engine, SGLang) or vLLM's message."""
    try:
        error = json.loads(raw).get("error") or {}
    except (ValueError, AttributeError):
        return False
    if not isinstance(error, Mapping):
        return False
    return error.get("code") == "context_length_exceeded" or "maximum context length" in str(error.get("message", ""))


def _choices(data: Mapping[str, Any], chat: bool) -> list[Choice] | ProtocolError:
    out = []
    try:
        for c in data.get("choices") or []:
            choice = Choice()
            choice.add(c, chat)
            out.append(choice)
    except ProtocolError as exc:
        return exc
    return out


# ----------------------------------------------------------------------------- the process


def main(args: argparse.Namespace) -> int:
    """`rollstream gateway` (its options: `rollstream.cli`)."""
    from consumers.http import serve

    gateway = Gateway(args.engine, timeout_s=args.timeout_s, health_interval_s=args.health_interval_s,
                      session_ttl_s=args.session_ttl_s, temperature=args.temperature)
    log.warning("rollstream gateway: %d engine(s) on %s:%d", len(gateway.engines), args.host, args.port)
    return serve(gateway.app(), args.host, args.port)
