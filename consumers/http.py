"""What the HTTP servers of the rollout side (`consumers.cpu_engine`, `consumers.gateway`) share:
OpenAI-style errors, request-body validation that names the field, Server-Sent Events, and
running an aiohttp application on a port (a process's main thread, or a background thread in
tests and in-process set-ups).

    server = ServerThread(app, port=0)      # 127.0.0.1, an ephemeral port
    server.url                              # "http://127.0.0.1:40213"
    server.stop()
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import threading
from collections.abc import AsyncIterator, Mapping
from typing import Any

from aiohttp import web

from pipeline.errors import CommandError

log = logging.getLogger(__name__)


class BadRequest(ValueError):
    """A request the client must fix: answered 400 with `param` named in the error."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400) -> None:
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


def error(status: int, message: str, *, param: str | None = None, code: str | None = None,
          kind: str | None = None) -> web.Response:
    """An OpenAI-shaped error: `{"error": {"message", "type", "param", "code"}}`."""
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code}},
                             status=status)


@web.middleware
async def bad_requests(request: web.Request, handler: Any) -> web.StreamResponse:
    """Turn a `BadRequest` raised by a handler into its 4xx error."""
    try:
        return await handler(request)
    except BadRequest as exc:
        return error(exc.status, str(exc), param=exc.param, code=exc.code)


async def json_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object, or a `BadRequest` saying why not."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


_MISSING = object()


def field(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], default: Any = _MISSING, *,
          minimum: float | None = None, maximum: float | None = None, nullable: bool = False) -> Any:
    """`body[name]` checked against `kind` (and bounds), or `default` when absent (or null)."""
    value = body.get(name, _MISSING)
    if value is _MISSING or (value is None and default is not _MISSING):
        if default is _MISSING:
            raise BadRequest(f"{name} is required", param=name)
        return default
    if value is None and nullable:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise BadRequest(f"{name} must be {names}, got {type(value).__name__}", param=name)
    if minimum is not None and value < minimum:
        raise BadRequest(f"{name} must be >= {minimum}, got {value}", param=name)
    if maximum is not None and value > maximum:
        raise BadRequest(f"{name} must be <= {maximum}, got {value}", param=name)
    return value


async def sse_response(request: web.Request, events: AsyncIterator[Mapping[str, Any]]) -> web.StreamResponse:
    """Stream `events` as Server-Sent Events (`data: <json>`), then `data: [DONE]`."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    async for event in events:
        await response.write(f"data: {json.dumps(event)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


class ServerThread:
    """An aiohttp application served on 127.0.0.1 (or `host`) from a thread of its own.

    `port=0` picks a free port; `url` says which. `stop()` shuts the server down and runs
    the application's cleanup hooks; a server that failed to start raises from `__init__`."""

    def __init__(self, app: web.Application, *, host: str = "127.0.0.1", port: int = 0,
                 name: str = "http") -> None:
        self.app, self.host = app, host
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._runner: web.AppRunner | None = None
        self.port = port
        self._thread = threading.Thread(target=self._serve, name=f"rollstream-{name}", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._failure is not None:
            raise RuntimeError(f"the {name} server did not start on {host}:{port}") from self._failure
        if not self._ready.is_set():
            raise RuntimeError(f"the {name} server did not start within 30 s")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._runner = web.AppRunner(self.app, handle_signals=False)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.host, self.port)
            self._loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        except BaseException as exc:  # reported by __init__
            self._failure = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread.is_alive() and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(app: web.Application, host: str, port: int) -> int:
    """Serve `app` in this process until SIGTERM/SIGINT (a process's entry point); an
    address that cannot be bound is a `CommandError` naming `--host` and `--port`."""
    try:
        web.run_app(app, host=host, port=port, print=lambda line: log.warning("%s", line))
    except OSError as exc:
        if exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            raise
        raise CommandError(f"--host {host} --port {port}: cannot listen there: {os.strerror(exc.errno)}; "
                           f"pick another --port (or stop what holds it)") from exc
    return 0
