"""`rollstream gateway`: per-session recording of token ids, log-probs, finish reasons and
versions (whole and streamed answers), limits, load balancing with session affinity, an
engine going down and coming back, and clear errors. Real aiohttp servers (engines and the
gateway) on ephemeral ports of 127.0.0.1, driven by the official `openai` client."""

import time

import httpx
import numpy as np
import openai
import pytest
from aiohttp import web
from openai import OpenAI

from consumers.cpu_engine import Engine
from consumers.gateway import RECORD_KEYS, Gateway
from consumers.http import ServerThread
from domain.envs import VOCAB
from pipeline.chains import merge_calls
from pipeline.sessions import Call
from domain.model import TinyConfig, TinyTransformer

pytestmark = pytest.mark.timeout(60)

CONFIG = TinyConfig(vocab=VOCAB.size, d_model=16, n_layers=1, n_heads=2, max_positions=48)
GUESS = [{"role": "user", "content": "<guess>"}]


class Fleet:
    """Engines and a gateway over them, each a real server; engines can be stopped and
    started again on their port."""

    def __init__(self, engines: int = 1, **gateway_options):
        self.engines = [Engine(TinyTransformer(CONFIG), name="tiny") for _ in range(engines)]
        self.servers = [ServerThread(e.app(), name="engine") for e in self.engines]
        self.ports = [s.port for s in self.servers]
        self.gateway = Gateway([s.url for s in self.servers], health_interval_s=0.1, **gateway_options)
        self.server = ServerThread(self.gateway.app(), name="gateway")
        self.http = httpx.Client(base_url=self.server.url, timeout=30)

    def client(self, sid: str) -> OpenAI:
        return OpenAI(base_url=f"{self.server.url}/sessions/{sid}/v1", api_key="x", max_retries=0)

    def record(self, sid: str) -> dict:
        r = self.http.get(f"/sessions/{sid}")
        assert r.status_code == 200, r.text
        return r.json()

    def stop_engine(self, i: int) -> None:
        self.servers[i].stop()

    def start_engine(self, i: int) -> None:
        self.servers[i] = ServerThread(self.engines[i].app(), port=self.ports[i], name="engine")

    def close(self) -> None:
        self.http.close()
        self.server.stop()
        for s in self.servers:
            s.stop()


@pytest.fixture
def fleet():
    f = Fleet()
    yield f
    f.close()


def test_a_chat_call_is_recorded_with_exactly_the_engine_s_ids_log_probs_and_version(fleet):
    answer = fleet.client("s1").chat.completions.create(model="tiny", messages=GUESS, max_tokens=4).to_dict()
    (call,) = fleet.record("s1")["calls"]
    assert tuple(call) == RECORD_KEYS
    choice = answer["choices"][0]
    assert call["prompt_ids"] == answer["prompt_token_ids"] == [VOCAB.bos, VOCAB["<guess>"]]
    assert call["completion_ids"] == choice["token_ids"]
    assert call["logprobs"] == [c["logprob"] for c in choice["logprobs"]["content"]]  # asked for by the gateway
    assert call["finish_reason"] == choice["finish_reason"] and call["version"] == 0
    assert fleet.record("s1")["infra_error"] is None
    # the version follows the engine's weights
    fleet.engines[0].load_state(fleet.engines[0].model.state_dict(), 5)
    fleet.client("s1").chat.completions.create(model="tiny", messages=GUESS, max_tokens=2)
    assert [c["version"] for c in fleet.record("s1")["calls"]] == [0, 5]
    assert fleet.http.delete("/sessions/s1").json() == {"deleted": True}
    assert fleet.http.get("/sessions/s1").status_code == 404


@pytest.mark.parametrize("chat", [True, False])
def test_streamed_calls_are_recorded_whole_and_passed_through(fleet, chat):
    client = fleet.client("st")
    if chat:
        chunks = [c.to_dict() for c in client.chat.completions.create(
            model="tiny", messages=GUESS, max_tokens=5, stream=True, n=2)]
    else:
        chunks = [c.to_dict() for c in client.completions.create(
            model="tiny", prompt=[VOCAB.bos, 3, 4], max_tokens=5, stream=True, n=2)]
    calls = fleet.record("st")["calls"]
    assert len(calls) == 2  # one per choice
    for index, call in enumerate(calls):
        streamed = [t for c in chunks for ch in c["choices"] if ch["index"] == index for t in ch.get("token_ids", [])]
        assert call["completion_ids"] == streamed and len(call["logprobs"]) == len(streamed)
        assert call["finish_reason"] in ("stop", "length")
        assert all(lp <= 0 for lp in call["logprobs"])


def test_a_multi_turn_conversation_records_calls_that_merge_into_one_chain(fleet):
    client, messages = fleet.client("mt"), list(GUESS)
    fleet.engines[0].model = eos_biased()  # <eos> is likely: replies end both ways
    for _turn in range(6):
        answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
        messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                     {"role": "user", "content": "<higher>"}]
    calls = fleet.record("mt")["calls"]
    assert len(calls) == 6
    for before, after in zip(calls, calls[1:]):
        # the reply's text round-trips to its ids, closed by <eos> (sampled, or added by the
        # template after a reply cut at max_tokens), then the new message
        head = before["prompt_ids"] + before["completion_ids"]
        closing = [] if before["finish_reason"] == "stop" else [VOCAB.eos]
        assert after["prompt_ids"] == head + closing + [VOCAB["<higher>"]]
    chains = merge_calls([Call(c["prompt_ids"], c["completion_ids"], c["logprobs"], c["version"]) for c in calls])
    assert len(chains) == 1 and chains[0].calls == 6


def eos_biased():
    m = TinyTransformer(CONFIG)
    import torch

    with torch.no_grad():
        m.ln_f.weight[0], m.ln_f.bias[0] = 0.0, 3.0
        m.embed.weight[VOCAB.eos] = 0.0
        m.embed.weight[VOCAB.eos, 0] = 1.5
    return m


def test_turn_and_context_limits_truncate_the_session(fleet):
    assert fleet.http.put("/sessions/lim", json={"max_turns": 2}).status_code == 200
    client = fleet.client("lim")
    for _ in range(2):
        client.chat.completions.create(model="tiny", messages=GUESS, max_tokens=1)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=GUESS, max_tokens=1)
    assert err.value.code == "max_turns"
    rec = fleet.record("lim")
    assert rec["truncated"] == "max_turns" and len(rec["calls"]) == 2
    # context: prompt + completion reaching max_tokens, or the engine's own context
    fleet.http.put("/sessions/ctx", json={"max_tokens": 4})
    fleet.client("ctx").completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=1)
    assert fleet.record("ctx")["truncated"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        fleet.client("ctx2").completions.create(model="tiny", prompt=[1] * 48, max_tokens=1)
    assert fleet.record("ctx2")["truncated"] == "max_tokens" and fleet.record("ctx2")["calls"] == []
    # a closed session (wall clock, cancel) refuses calls
    fleet.http.post("/sessions/lim2/close", json={"reason": "wall_clock"})  # unknown: 404
    fleet.client("lim2").chat.completions.create(model="tiny", messages=GUESS, max_tokens=1)
    assert fleet.http.post("/sessions/lim2/close", json={"reason": "wall_clock"}).json()["closed"] == "wall_clock"
    with pytest.raises(openai.BadRequestError) as err:
        fleet.client("lim2").chat.completions.create(model="tiny", messages=GUESS, max_tokens=1)
    assert err.value.code == "session_closed"


def test_bad_requests_are_clear_4xx_and_engine_refusals_pass_through(fleet):
    r = fleet.http.post("/sessions/b/v1/chat/completions", content=b"{oops")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = fleet.http.post("/sessions/b/v1/chat/completions", json={"messages": GUESS, "stream": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    r = fleet.http.post("/sessions/b/v1/chat/completions", json={"messages": GUESS, "top_p": 0.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"  # the engine's answer
    assert fleet.record("b")["calls"] == [] and fleet.record("b")["infra_error"] is None
    assert fleet.http.put("/sessions/b", json={"max_turns": 0}).json()["error"]["param"] == "max_turns"
    assert fleet.http.get("/sessions/nope").status_code == 404
    assert fleet.http.post("/weight_version", json={"version": 2, "engine": "http://x"}).status_code == 400


def test_an_engine_down_mid_session_flags_it_and_comes_back_after_a_probe(fleet):
    client = fleet.client("down")
    client.chat.completions.create(model="tiny", messages=GUESS, max_tokens=2)
    fleet.stop_engine(0)
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="tiny", messages=GUESS, max_tokens=2)
    assert err.value.status_code == 502
    rec = fleet.record("down")
    assert "unreachable" in rec["infra_error"] and len(rec["calls"]) == 1
    engines = fleet.http.get("/engines")
    assert engines.status_code == 503 and engines.json()["engines"][0]["up"] is False
    # a new session while no engine is up fails as infrastructure too
    with pytest.raises(openai.APIStatusError):
        fleet.client("other").chat.completions.create(model="tiny", messages=GUESS, max_tokens=2)
    assert fleet.record("other")["infra_error"] == "no inference engine is up"
    fleet.start_engine(0)
    deadline = time.monotonic() + 10
    while not fleet.http.get("/engines").json()["engines"][0]["up"]:
        assert time.monotonic() < deadline, "the gateway never saw the engine come back"
        time.sleep(0.05)
    fleet.client("again").chat.completions.create(model="tiny", messages=GUESS, max_tokens=2)
    assert len(fleet.record("again")["calls"]) == 1


def test_sessions_spread_over_engines_and_stick_to_theirs():
    f = Fleet(engines=2)
    try:
        for sid in ("a", "b", "c", "d"):
            for _ in range(2):
                f.client(sid).chat.completions.create(model="tiny", messages=GUESS, max_tokens=1)
        used = {sid: f.gateway.sessions[sid].engine.url for sid in "abcd"}
        counts = [e["calls"] for e in f.http.get("/engines").json()["engines"]]
        assert counts == [4, 4] and len(set(used.values())) == 2
        # with its engine down, a session's next call is the infrastructure's failure;
        # new sessions go to the engine still up
        down = used["a"]
        f.stop_engine([s.url for s in f.servers].index(down))
        with pytest.raises(openai.APIStatusError):
            f.client("a").chat.completions.create(model="tiny", messages=GUESS, max_tokens=1)
        f.client("e").chat.completions.create(model="tiny", messages=GUESS, max_tokens=1)
        assert f.gateway.sessions["e"].engine.url != down
    finally:
        f.close()


def test_an_engine_without_token_ids_is_a_protocol_error():
    async def plain(request):  # an OpenAI server that returns text only
        return web.json_response({"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                               "finish_reason": "stop", "logprobs": None}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", plain)
    with ServerThread(app, name="plain") as engine, \
            ServerThread(Gateway([engine.url]).app(), name="gateway") as gw:
        client = OpenAI(base_url=f"{gw.url}/sessions/p/v1", api_key="x", max_retries=0)
        assert client.chat.completions.create(model="m", messages=GUESS).choices[0].message.content == "hi"
        rec = httpx.get(f"{gw.url}/sessions/p").json()
    assert "token_ids" in rec["protocol_error"] and rec["calls"] == []


def test_log_probs_are_never_positive_and_match_the_call_schema(fleet):
    fleet.client("c").completions.create(model="tiny", prompt="<bos>c:3=", max_tokens=3)
    (call,) = fleet.record("c")["calls"]
    c = Call(call["prompt_ids"], call["completion_ids"], call["logprobs"], call["version"])
    assert np.all(c.logprobs <= 0) and c.version == 0


def test_the_cli_parses_engine_and_gateway_options():
    from rollstream.cli import parser

    args = parser().parse_args(["gateway", "--engine", "http://a:1", "--engine", "http://b:2", "--port", "9",
                                "--temperature", "0.7"])
    assert args.engine == ["http://a:1", "http://b:2"] and args.port == 9 and args.temperature == 0.7
    args = parser().parse_args(["engine", "--model", "tiny", "--port", "8", "--weights-dir", "/w"])
    assert (args.model, args.port, args.weights_dir, args.weights_redis) == ("tiny", 8, "/w", None)
    with pytest.raises(SystemExit):
        parser().parse_args(["gateway", "--port", "9"])  # --engine is required


def test_the_engine_follows_the_run_a_process_config_names(tmp_path):
    from consumers.cpu_engine import _weights_redis
    from rollstream.cli import parser
    from pipeline.config import ConfigError

    config = tmp_path / "consumer.yaml"
    config.write_text("redis: {url: 'rediss://r:6380/0', namespace: exp1, username: rs-consumer,\n"
                      "        password_file: /run/secrets/redis, tls_ca_file: /etc/ca.pem}\nslots: 4\n")
    got = _weights_redis(parser().parse_args(["engine", "--redis-config", str(config)]))
    assert (got.url, got.namespace, got.username, got.password_file) == (
        "rediss://r:6380/0", "exp1", "rs-consumer", "/run/secrets/redis")
    plain = _weights_redis(parser().parse_args(["engine", "--weights-redis", "redis://r:1/0", "--namespace", "n"]))
    assert (plain.url, plain.namespace, plain.username) == ("redis://r:1/0", "n", None)
    assert _weights_redis(parser().parse_args(["engine"])) is None
    with pytest.raises(ConfigError, match="give one"):
        _weights_redis(parser().parse_args(["engine", "--redis-config", str(config), "--weights-redis", "redis://r:1/0"]))
    config.write_text("redis: {url: 'redis://r:1/0', pasword_env: X}\n")
    with pytest.raises(ConfigError, match="pasword_env"):
        _weights_redis(parser().parse_args(["engine", "--redis-config", str(config)]))
