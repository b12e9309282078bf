"""`rollstream engine`: the OpenAI shapes with token ids, log-probs and the weight version,
streaming, clear 4xx errors, and loading new weight versions (admin endpoints). A real
aiohttp server on an ephemeral port of 127.0.0.1."""

import json

import httpx
import pytest
import torch
from openai import OpenAI

from consumers.cpu_engine import CharTokenizer, Engine, build
from consumers.http import ServerThread
from domain.envs import VOCAB
from producers.publishers import DirectoryPublisher
from domain.model import TinyConfig, TinyTransformer
from trainer.objective import next_token_log_probs

pytestmark = pytest.mark.timeout(60)

CONFIG = TinyConfig(vocab=VOCAB.size, d_model=16, n_layers=1, n_heads=2, max_positions=24)
GUESS = [{"role": "user", "content": "<guess>"}]


@pytest.fixture
def engine():
    return Engine(TinyTransformer(CONFIG), name="tiny")


@pytest.fixture
def server(engine):
    with ServerThread(engine.app(), name="engine") as s:
        yield s


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def rescored(model, prompt, completion, temperature=1.0):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        return next_token_log_probs(model(ids), ids, temperature=temperature)[0, len(prompt):]


def test_chat_returns_token_ids_log_probs_and_the_version(http, engine):
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": GUESS, "max_tokens": 5,
                                                "logprobs": True, "temperature": 0.7})
    assert r.status_code == 200, r.text
    body = r.json()
    (choice,) = body["choices"]
    assert body["object"] == "chat.completion" and body["weight_version"] == 0
    assert body["prompt_token_ids"] == [VOCAB.bos, VOCAB["<guess>"]]
    ids = choice["token_ids"]
    logprobs = [c["logprob"] for c in choice["logprobs"]["content"]]
    assert 1 <= len(ids) == len(logprobs) <= 5
    assert choice["finish_reason"] == ("stop" if ids[-1] == VOCAB.eos else "length")
    expected = rescored(engine.model, body["prompt_token_ids"], ids, 0.7)
    assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-5)
    assert CharTokenizer().encode(choice["message"]["content"]) == [t for t in ids if t != VOCAB.eos]
    assert body["usage"]["completion_tokens"] == len(ids)


def test_completions_take_token_ids_and_sample_n_choices(http):
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": [1, 3, 9], "max_tokens": 4,
                                           "logprobs": 0, "n": 3})
    body = r.json()
    assert r.status_code == 200 and len(body["choices"]) == 3
    for c in body["choices"]:
        assert c["prompt_token_ids"] == [1, 3, 9]
        assert len(c["token_ids"]) == len(c["logprobs"]["token_logprobs"])
    # text prompts are tokenised with the vocabulary; <tNN> names an id without a token
    r = http.post("/v1/completions", json={"prompt": "<bos>c:3=<t60>", "max_tokens": 1})
    assert r.json()["prompt_token_ids"] == [VOCAB.bos, *VOCAB.encode("c:3="), 60]
    assert r.json()["choices"][0]["logprobs"] is None  # not asked for


def test_streaming_gives_the_same_tokens_as_a_whole_answer_under_one_seed(server):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    whole = client.chat.completions.create(model="tiny", messages=GUESS, max_tokens=6, logprobs=True,
                                           seed=7).to_dict()
    chunks = [c.to_dict() for c in client.chat.completions.create(
        model="tiny", messages=GUESS, max_tokens=6, logprobs=True, seed=7, stream=True)]
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    logprobs = [x["logprob"] for c in chunks for ch in c["choices"] if ch.get("logprobs")
                for x in ch["logprobs"]["content"]]
    assert ids == whole["choices"][0]["token_ids"]
    assert logprobs == [x["logprob"] for x in whole["choices"][0]["logprobs"]["content"]]
    assert "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"]) == \
        whole["choices"][0]["message"]["content"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert all(c["weight_version"] == 0 for c in chunks)
    # completions stream too
    stream = client.completions.create(model="tiny", prompt=[1, 3], max_tokens=3, logprobs=0, stream=True)
    parts = [c.to_dict() for c in stream]
    assert sum(len(c["choices"][0].get("token_ids", [])) for c in parts) == parts[-1]["usage"]["completion_tokens"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"model": "tiny"}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "€"}]}, "messages"),
    ("/v1/chat/completions", {"messages": GUESS, "temperature": 0}, "temperature"),
    ("/v1/chat/completions", {"messages": GUESS, "top_p": 0.9}, "top_p"),
    ("/v1/chat/completions", {"messages": GUESS, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": GUESS, "max_tokens": "3"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": GUESS, "n": 99}, "n"),
    ("/v1/completions", {"prompt": [1, 999]}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2], "logprobs": 5}, "logprobs"),
    ("/v1/completions", {"prompt": "c" * 30}, "prompt"),
])
def test_bad_requests_get_a_4xx_naming_the_field(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_a_full_context_is_refused_with_its_code_and_a_non_json_body_is_named(http):
    err = http.post("/v1/completions", json={"prompt": [1] * 24}).json()["error"]
    assert err["code"] == "context_length_exceeded"
    r = http.post("/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", content=b"[1]")
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]


def test_admin_endpoints_load_new_versions_between_requests(http, engine, tmp_path):
    other = TinyTransformer(TinyConfig(**{**CONFIG.__dict__, "seed": 5}))
    published = DirectoryPublisher(tmp_path / "w").load(other, 3)
    r = http.post("/update_weights_from_disk", json={"model_path": published.location.removeprefix("file://")})
    assert r.status_code == 200 and r.json()["success"] is True and r.json()["weight_version"] == "3"
    assert engine.version == 3 and http.get("/get_weight_version").json() == {"weight_version": "3"}
    body = http.post("/v1/chat/completions", json={"messages": GUESS, "max_tokens": 4, "logprobs": True}).json()
    assert body["weight_version"] == 3
    ids = body["choices"][0]["token_ids"]
    expected = rescored(other, body["prompt_token_ids"], ids)
    assert torch.allclose(torch.tensor([c["logprob"] for c in body["choices"][0]["logprobs"]["content"]]),
                          expected, atol=1e-5)
    # vLLM's shape: a directory (the newest v<N>.safetensors), an explicit version
    DirectoryPublisher(tmp_path / "w").load(TinyTransformer(CONFIG), 4)
    r = http.post("/collective_rpc", json={"method": "reload_weights",
                                           "kwargs": {"weights_path": str(tmp_path / "w"), "weight_version": "9"}})
    assert r.status_code == 200 and engine.version == 9
    r = http.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "missing")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model_path"
    r = http.post("/collective_rpc", json={"method": "sleep"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "method"
    assert engine.version == 9


def test_tiny_spec_uses_the_trainer_default_and_hf_directories_build_from_config(tmp_path):
    tiny = build("tiny")
    assert tiny.context == 64 and tiny.model.config.vocab == VOCAB.size
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 16, "vocab_size": VOCAB.size,
        "n_positions": 32}))
    engine = build(str(tmp_path / "hf"))
    with ServerThread(engine.app(), name="engine") as s:
        body = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": GUESS, "max_tokens": 3,
                                                                 "logprobs": True}, timeout=30).json()
    assert body["prompt_token_ids"] == [VOCAB.bos, VOCAB["<guess>"]]
    assert len(body["choices"][0]["token_ids"]) == len(body["choices"][0]["logprobs"]["content"])
    with pytest.raises(ValueError, match="config.json"):
        build(str(tmp_path))
