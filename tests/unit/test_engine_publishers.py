"""Publishers for external engines (`producers.engine_publishers`): the weights are written to the
shared path, then SGLang's `/update_weights_from_disk` or vLLM's pause, reload, cache reset,
version and resume are called on every engine; tested against `rollstream engine` itself
(which serves both) and a minimal aiohttp server that records what it is sent. The real
vLLM server: tests/integration/test_vllm.py."""

import json

import httpx
import pytest
import torch
from aiohttp import web
from safetensors.torch import load_file

from consumers.cpu_engine import Engine
from consumers.gateway import Gateway
from consumers.http import ServerThread
from domain.envs import VOCAB
from producers.engine_publishers import EnginePushError, SGLangPublisher, VLLMPublisher, write_hf_dir
from domain.model import TinyConfig, TinyTransformer

pytestmark = pytest.mark.timeout(60)

CONFIG = TinyConfig(vocab=VOCAB.size, d_model=16, n_layers=1, n_heads=2, max_positions=24)
VLLM_PUSH = ["/pause", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume"]


def trained(seed):
    return TinyTransformer(TinyConfig(**{**CONFIG.__dict__, "seed": seed}))


def gpt2(seed=0, **over):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**{"n_layer": 1, "n_head": 2, "n_embd": 16, "vocab_size": VOCAB.size,
                                         "n_positions": 32, **over})).eval()


def same_weights(model, other):
    return all(torch.equal(other.state_dict()[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("kind", [SGLangPublisher, VLLMPublisher])
def test_each_publisher_makes_the_local_engine_serve_the_version(tmp_path, kind):
    served = gpt2(0)
    engine = Engine(served)
    with ServerThread(engine.app(), name="engine") as e, \
            ServerThread(Gateway([e.url]).app(), name="gateway") as gw:
        publisher = kind([e.url], tmp_path / "w", gateways=[gw.url], timeout_s=10)
        for version in (1, 2):
            model = gpt2(version)
            published = publisher.load(model, version)
            assert engine.version == version and same_weights(model, served)
            assert published.location == f"file://{tmp_path / 'w' / f'v{version}'}"
            assert len(published.digest) == 64 and published.size > 0
        engines = httpx.get(f"{gw.url}/engines").json()["engines"]
        assert [g["version"] for g in engines] == [2]  # credited to unstamped answers
        assert len(publisher.seconds) == 2
        publisher.close()
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["v1", "v2"]


def test_the_file_layout_for_engines_that_load_a_file(tmp_path):
    engine = Engine(TinyTransformer(CONFIG))
    with ServerThread(engine.app(), name="engine") as e:
        publisher = SGLangPublisher([e.url], tmp_path / "w", layout="file")
        model = trained(1)
        published = publisher.load(model, 1)
        assert engine.version == 1 and same_weights(model, engine.model)
        assert published.location == f"file://{tmp_path / 'w' / 'v1.safetensors'}"
    with pytest.raises(ValueError, match="vLLM reloads a Hugging Face directory"):
        VLLMPublisher(["http://one"], tmp_path, layout="file")


class Recorder:
    """An engine stand-in: answers each path's scripted statuses in turn (then 200 with
    `answers[path]`, default `{}`) and records (path, query, body)."""

    def __init__(self, script=None, answers=None):
        self.script = {path: list(codes) for path, codes in (script or {}).items()}
        self.answers = answers or {}
        self.calls = []
        app = web.Application()
        for path in ("/update_weights_from_disk", *VLLM_PUSH, "/weight_version"):
            app.router.add_post(path, self.handle)
        app.router.add_get("/server_info", self.handle)
        app.router.add_get("/version", self.handle)
        self.server = ServerThread(app, name="recorder")

    async def handle(self, request):
        body = await request.json() if request.can_read_body else None
        self.calls.append((request.path, dict(request.query), body))
        codes = self.script.get(request.path) or []
        status = codes.pop(0) if codes else 200
        if status == 200:
            return web.json_response(self.answers.get(request.path, {}))
        return web.json_response({"error": {"message": f"scripted {status}", "type": "InternalServerError",
                                            "code": status}}, status=status)

    def paths(self):
        return [p for p, _, _ in self.calls]


def test_the_vllm_push_pauses_reloads_resets_stamps_and_resumes(tmp_path):
    vllm = Recorder()
    try:
        publisher = VLLMPublisher([vllm.server.url], tmp_path / "w", kwargs={"is_checkpoint_format": True})
        publisher.load(gpt2(1), 10)
        assert vllm.paths() == VLLM_PUSH
        assert vllm.calls[0][1] == {"mode": "wait"}
        assert vllm.calls[1][2] == {"method": "reload_weights", "kwargs": {
            "is_checkpoint_format": True, "weights_path": str(tmp_path / "w" / "v10")}}
        assert vllm.calls[3][2] == {"new_version": "10"}
    finally:
        vllm.server.stop()


def test_a_refused_reload_raises_at_once_and_the_engine_resumes(tmp_path):
    # vLLM answers 500 to a reload that raised (here: what vLLM 0.32 says to weight_version)
    vllm = Recorder(script={"/collective_rpc": [500]})
    try:
        publisher = VLLMPublisher([vllm.server.url], tmp_path / "w", retries=3, backoff_s=0.01)
        with pytest.raises(EnginePushError, match="collective_rpc refused \\(500\\): scripted 500"):
            publisher.load(gpt2(1), 1)
        assert vllm.paths() == ["/pause", "/collective_rpc", "/resume"]  # no retry; resumed
    finally:
        vllm.server.stop()


def test_a_pause_that_fails_still_resumes_the_engine(tmp_path):
    vllm = Recorder(script={"/pause": [503, 503]})
    try:
        publisher = VLLMPublisher([vllm.server.url], tmp_path / "w", retries=1, backoff_s=0.01)
        with pytest.raises(EnginePushError, match="pause failed 2 time"):
            publisher.load(gpt2(1), 1)
        assert vllm.paths() == ["/pause", "/pause", "/resume"]
    finally:
        vllm.server.stop()


def test_unavailable_answers_are_retried_and_their_last_failure_raises(tmp_path):
    flaky = Recorder(script={"/update_weights_from_disk": [503, 502]}, answers={
        "/update_weights_from_disk": {"success": True}})
    try:
        publisher = SGLangPublisher([flaky.server.url], tmp_path / "w", retries=2, backoff_s=0.01,
                                    load_format="safetensors")
        publisher.load(gpt2(1), 7)
        assert flaky.paths() == ["/update_weights_from_disk"] * 3
        assert flaky.calls[-1][2] == {"model_path": str(tmp_path / "w" / "v7"), "weight_version": "7",
                                      "load_format": "safetensors"}
        flaky.script["/update_weights_from_disk"] = [503, 503, 503]
        with pytest.raises(EnginePushError, match="failed 3 time"):
            publisher.load(gpt2(1), 8)
    finally:
        flaky.server.stop()


def test_sglang_refusals_raise_with_the_engines_message(tmp_path):
    refusing = Recorder(script={"/update_weights_from_disk": [400]})
    unhappy = Recorder(answers={"/update_weights_from_disk": {"success": False, "message": "shape mismatch"}})
    try:
        with pytest.raises(EnginePushError, match="refused"):
            SGLangPublisher([refusing.server.url], tmp_path / "w", retries=3, backoff_s=0.01).load(gpt2(1), 9)
        assert len(refusing.calls) == 1  # a 4xx is not retried
        with pytest.raises(EnginePushError, match="shape mismatch"):
            SGLangPublisher([unhappy.server.url], tmp_path / "w").load(gpt2(1), 9)
    finally:
        for r in (refusing, unhappy):
            r.server.stop()


def test_a_vllm_without_pause_gets_the_reload_and_the_reset_alone(tmp_path):
    old = Recorder(script={"/pause": [404]}, answers={"/version": {"version": "0.10.0"}})
    try:
        publisher = VLLMPublisher([old.server.url], tmp_path / "w")
        publisher.load(gpt2(1), 1)
        publisher.load(gpt2(2), 2)
        assert old.paths() == ["/pause", "/version", "/collective_rpc", "/reset_prefix_cache",
                               "/collective_rpc", "/reset_prefix_cache"]
    finally:
        old.server.stop()


@pytest.mark.parametrize("answers, error", [
    ({"/server_info": {"vllm_config": {"model_config": {"logprobs_mode": "raw_logprobs"}}}},
     "--logprobs-mode raw_logprobs: its log-probs ignore the sampling temperature"),
    ({"/server_info": {"vllm_config": {"model_config": {"logprobs_mode": "processed_logprobs"}}},
      "/version": {"version": "0.32.0"}}, None),
])
def test_preflight_refuses_log_probs_that_ignore_the_temperature(tmp_path, answers, error):
    vllm = Recorder(answers=answers)
    try:
        publisher = VLLMPublisher([vllm.server.url], tmp_path / "w")
        if error is None:
            publisher.preflight()
        else:
            with pytest.raises(EnginePushError, match=error):
                publisher.preflight()
    finally:
        vllm.server.stop()


def test_preflight_names_the_dev_mode_a_server_lacks(tmp_path):
    with ServerThread(web.Application(), name="plain") as plain:
        with pytest.raises(EnginePushError, match="VLLM_SERVER_DEV_MODE=1"):
            VLLMPublisher([plain.url], tmp_path / "w").preflight()


def test_an_unreachable_engine_fails_after_its_retries_and_bad_options_are_refused(tmp_path):
    with ServerThread(web.Application(), name="gone") as gone:
        url = gone.url
    publisher = SGLangPublisher([url], tmp_path / "w", retries=1, backoff_s=0.01, timeout_s=2)
    with pytest.raises(EnginePushError, match="failed 2 time.*ConnectError"):
        publisher.load(gpt2(1), 1)
    with pytest.raises(ValueError, match="engines"):
        SGLangPublisher("http://one", tmp_path)
    with pytest.raises(ValueError, match="layout"):
        SGLangPublisher(["http://one"], tmp_path, layout="zip")
    with pytest.raises(ValueError, match="pause_mode"):
        VLLMPublisher(["http://one"], tmp_path, pause_mode="later")
    with pytest.raises(TypeError, match="Hugging Face model"):
        VLLMPublisher(["http://one"], tmp_path / "t").load(trained(1), 1)
    assert list((tmp_path / "t").iterdir()) == []  # nothing half-written


def test_hf_directories_keep_tied_weights_shard_and_take_a_base_for_state_dicts(tmp_path):
    from transformers import AutoModelForCausalLM

    model = gpt2(3)  # GPT-2 ties lm_head.weight to transformer.wte.weight
    whole = write_hf_dir(tmp_path / "one", model)
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["config.json", "model.safetensors"]
    tensors = load_file(str(tmp_path / "one" / "model.safetensors"))
    assert set(tensors) == set(model.state_dict())  # the tied head too, under its own name
    assert torch.equal(tensors["lm_head.weight"], tensors["transformer.wte.weight"])

    # a state dict (what a ZeRO-3 push hands over) takes its config from the base directory;
    # past max_shard_bytes the weights are sharded with an index
    state = {k: v.clone() for k, v in model.state_dict().items()}
    sharded = write_hf_dir(tmp_path / "many", state, base=tmp_path / "one", max_shard_bytes=4096)
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and set(index["weight_map"]) == set(state)
    assert sorted(p.name for p in (tmp_path / "many").glob("*.safetensors")) == files
    assert sharded.size > whole.size and len(sharded.digest) == 64  # a header per file
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "many", local_files_only=True)
    assert same_weights(model, loaded)
    engine = Engine(gpt2(4))
    assert engine.load_path(tmp_path / "many", 5) == 5 and same_weights(model, engine.model)
    with pytest.raises(TypeError, match="base=<model directory>"):
        write_hf_dir(tmp_path / "none", state)
