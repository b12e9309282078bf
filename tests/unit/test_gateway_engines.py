"""The recording gateway against the answers real engines give (scripted here; the real
vLLM server: tests/integration/test_vllm.py): vLLM's streamed chat (a first chunk with the
role alone, no token ids), SGLang's chat names and version metadata, a keep-alive
connection the engine closed (sent again on a fresh one), one failed call with the engine
still healthy (it stays in rotation), and versions credited by the gateway never newer than
the weights that served the call."""

import asyncio
import json
import threading
import time

import httpx
import pytest
from aiohttp import web

from consumers.gateway import Gateway
from consumers.http import ServerThread

pytestmark = pytest.mark.timeout(60)

PROMPT = [1, 294, 201]


def sse(events):
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


# what vLLM 0.32 streams for a chat call with n=2, logprobs and return_token_ids (recorded
# from the real server, texts shortened)
VLLM_CHAT_STREAM = [
    {"object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
     "prompt_token_ids": PROMPT},
    {"object": "chat.completion.chunk", "choices": [
        {"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
     "prompt_token_ids": PROMPT},
    {"object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"content": "a"}, "logprobs": {"content": [{"token": "a", "logprob": -5.7}]},
         "finish_reason": None, "token_ids": [225]}]},
    {"object": "chat.completion.chunk", "choices": [
        {"index": 1, "delta": {"content": "b"}, "logprobs": {"content": [{"token": "b", "logprob": -5.4}]},
         "finish_reason": None, "token_ids": [67]}]},
    {"object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"content": ""}, "logprobs": {"content": [{"token": "", "logprob": -0.1}]},
         "finish_reason": "stop", "stop_reason": None, "token_ids": [2]}]},
    {"object": "chat.completion.chunk", "choices": [
        {"index": 1, "delta": {"content": "c"}, "logprobs": {"content": [{"token": "c", "logprob": -5.3}]},
         "finish_reason": "length", "stop_reason": None, "token_ids": [30]}]},
    {"object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}},
]

# SGLang 0.5's whole chat answer with return_prompt_token_ids and return_token_ids
SGLANG_CHAT = {
    "object": "chat.completion", "metadata": {"weight_version": "7"},
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "a"}, "finish_reason": "stop",
                 "logprobs": {"content": [{"token": "a", "logprob": -1.5}, {"token": "", "logprob": -0.2}]},
                 "prompt_token_ids": PROMPT, "response_token_ids": [225, 2]}]}


async def healthy(request):
    return web.json_response({"status": "ok"})


def scripted_engine(chat):
    async def handle(request):
        body = await request.json()
        answer = chat(body)
        if body.get("stream"):
            return web.Response(text=sse(answer), content_type="text/event-stream")
        return web.json_response(answer)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    app.router.add_get("/health", healthy)
    return ServerThread(app, name="engine")


def test_vllm_streamed_chat_and_sglang_chat_are_recorded():
    seen = []

    def chat(body):
        seen.append(body)
        return VLLM_CHAT_STREAM if body.get("stream") else SGLANG_CHAT

    with scripted_engine(chat) as engine, ServerThread(Gateway([engine.url]).app(), name="gateway") as gw:
        http = httpx.Client(base_url=gw.url, timeout=10)
        relayed = http.post("/sessions/v/v1/chat/completions", json={"model": "m", "messages": [], "stream": True, "n": 2})
        assert relayed.status_code == 200 and relayed.text == sse(VLLM_CHAT_STREAM)  # passed through unchanged
        calls = http.get("/sessions/v").json()
        assert calls["protocol_error"] is None
        assert calls["calls"] == [
            {"prompt_ids": PROMPT, "completion_ids": [225, 2], "logprobs": [-5.7, -0.1], "finish_reason": "stop",
             "version": 0},
            {"prompt_ids": PROMPT, "completion_ids": [67, 30], "logprobs": [-5.4, -5.3], "finish_reason": "length",
             "version": 0}]
        http.post("/sessions/s/v1/chat/completions", json={"model": "m", "messages": []})
        assert http.get("/sessions/s").json()["calls"] == [
            {"prompt_ids": PROMPT, "completion_ids": [225, 2], "logprobs": [-1.5, -0.2], "finish_reason": "stop",
             "version": 7}]  # SGLang stamps its version in metadata
    # every call asks for what each engine needs to return ids and log-probs
    assert all(b["return_token_ids"] and b["return_prompt_token_ids"] and b["logprobs"] is True for b in seen)


def test_a_chunk_that_carries_tokens_without_ids_is_a_protocol_error():
    broken = [VLLM_CHAT_STREAM[0], {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": "stop",
                                                 "logprobs": None}]}]
    with scripted_engine(lambda body: broken) as engine, ServerThread(Gateway([engine.url]).app(), name="gw") as gw:
        httpx.post(f"{gw.url}/sessions/x/v1/chat/completions", json={"messages": [], "stream": True})
        record = httpx.get(f"{gw.url}/sessions/x").json()
    assert "no token_ids" in record["protocol_error"] and record["calls"] == []


class ClosingEngine:
    """A raw HTTP/1.1 engine that answers the first request of each connection with
    keep-alive, then closes the connection when the next request on it arrives, unread: a
    keep-alive connection the engine closed as the gateway reused it."""

    def __init__(self):
        self.requests = self.connections = 0
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def serve():
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(asyncio.start_server(self.handle, "127.0.0.1", 0))
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        ready.wait(10)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def handle(self, reader, writer):
        self.connections += 1
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        self.requests += 1
        body = json.dumps({"object": "text_completion", "choices": [
            {"index": 0, "text": "a", "token_ids": [5], "prompt_token_ids": PROMPT, "finish_reason": "length",
             "logprobs": {"token_logprobs": [-1.0], "tokens": ["a"]}}]}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: keep-alive\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        await reader.read(1)  # the next request on this connection: closed unanswered
        writer.close()

    def stop(self):
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_a_request_on_a_keep_alive_connection_the_engine_closed_is_sent_again_on_a_fresh_one():
    engine = ClosingEngine()
    gateway = Gateway([engine.url])
    try:
        with ServerThread(gateway.app(), name="gateway") as gw:
            http = httpx.Client(base_url=gw.url, timeout=10)
            for _ in range(4):
                answer = http.post("/sessions/k/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
                assert answer.status_code == 200, answer.text
            record = http.get("/sessions/k").json()
    finally:
        engine.stop()
    # calls 1 and 3 open a pooled connection; 2 and 4 reuse it, closed: each is sent again
    assert record["infra_error"] is None and len(record["calls"]) == 4
    assert engine.requests == 4 and gateway.retried == 2
    assert gateway.engines[0].up and gateway.engines[0].failures == 0


def test_one_failed_call_does_not_take_a_healthy_engine_out_of_rotation():
    calls = []

    async def chat(request):
        calls.append(1)
        if len(calls) == 1:  # the first call breaks off mid-answer
            response = web.StreamResponse()
            await response.prepare(request)
            await response.write(b"data: {")
            request.transport.close()
            return response
        return web.json_response({"choices": [{"index": 0, "token_ids": [5], "finish_reason": "length",
                                               "logprobs": {"content": [{"logprob": -1.0}]}}],
                                  "prompt_token_ids": PROMPT})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", healthy)
    with ServerThread(app, name="engine") as engine:
        gateway = Gateway([engine.url])
        with ServerThread(gateway.app(), name="gateway") as gw:
            http = httpx.Client(base_url=gw.url, timeout=10)
            failed = http.post("/sessions/a/v1/chat/completions", json={"messages": [], "stream": True})
            assert "infra_error" in failed.text
            assert http.get("/sessions/a").json()["infra_error"] is not None
            # the engine answered /health: still up, and the next session is served
            assert gateway.engines[0].up and gateway.engines[0].failures == 1
            assert http.post("/sessions/b/v1/chat/completions", json={"messages": []}).status_code == 200
            assert len(http.get("/sessions/b").json()["calls"]) == 1


def test_an_unstamped_call_is_credited_with_the_older_of_its_start_and_end_versions():
    release = threading.Event()

    def chat(body):
        release.wait(10)  # the call stays in flight until the test lets it go
        return {"choices": [{"index": 0, "token_ids": [5], "finish_reason": "length",
                             "logprobs": {"content": [{"logprob": -1.0}]}}], "prompt_token_ids": PROMPT}

    async def handle(request):
        body = await request.json()
        return web.json_response(await asyncio.get_running_loop().run_in_executor(None, chat, body))

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    with ServerThread(app, name="engine") as engine, \
            ServerThread(Gateway([engine.url]).app(), name="gateway") as gw:
        http = httpx.Client(base_url=gw.url, timeout=10)
        inflight = threading.Thread(target=http.post, args=("/sessions/a/v1/chat/completions",),
                                    kwargs={"json": {"messages": []}})
        inflight.start()
        deadline = time.monotonic() + 10
        while http.get("/engines").json()["engines"][0]["outstanding"] != 1:
            assert time.monotonic() < deadline, "the call never reached the engine"
            time.sleep(0.01)
        http.post("/weight_version", json={"version": 3})  # the publisher's, after the engine's push
        release.set()
        inflight.join(10)
        http.post("/sessions/b/v1/chat/completions", json={"messages": []})
        assert http.get("/sessions/a").json()["calls"][0]["version"] == 0  # in flight across the push
        assert http.get("/sessions/b").json()["calls"][0]["version"] == 3


def test_calls_held_during_a_push_go_on_credited_with_the_new_version():
    def chat(body):
        return {"choices": [{"index": 0, "token_ids": [5], "finish_reason": "length",
                             "logprobs": {"content": [{"logprob": -1.0}]}}], "prompt_token_ids": PROMPT}

    with scripted_engine(chat) as engine, ServerThread(Gateway([engine.url]).app(), name="gateway") as gw:
        http = httpx.Client(base_url=gw.url, timeout=10)
        assert http.post("/engines/hold", json={"engine": engine.url}).json()["engines"][0]["held"] is True
        held = threading.Thread(target=http.post, args=("/sessions/h/v1/chat/completions",),
                                kwargs={"json": {"messages": []}})
        held.start()
        deadline = time.monotonic() + 10
        while http.get("/engines").json()["engines"][0]["waiting"] != 1:  # waiting in the gateway
            assert time.monotonic() < deadline, "the call was not held"
            time.sleep(0.01)
        assert held.is_alive() and http.get("/sessions/h").json()["calls"] == []
        http.post("/weight_version", json={"engine": engine.url, "version": 2})  # the push is done
        held.join(10)
        assert http.get("/sessions/h").json()["calls"][0]["version"] == 2
        # a failed push releases its hold without a new version
        http.post("/engines/hold", json={"engine": None})
        http.post("/engines/release", json={"engine": None})
        http.post("/sessions/r/v1/chat/completions", json={"messages": []})
        assert http.get("/sessions/r").json()["calls"][0]["version"] == 2
        assert http.post("/engines/hold", json={"engine": "http://elsewhere"}).status_code == 400
