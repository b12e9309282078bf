"""Publishers for external engines (`producers.engines`): the weights are written to the
shared path, then SGLang's `/update_weights_from_disk` or vLLM's `/collective_rpc` is
called on every engine, with retries; tested against `rollstream engine` itself (which
serves both) and a minimal aiohttp server that records what it is sent."""

import json

import httpx
import pytest
import torch
from aiohttp import web

from consumers.engine import Engine
from consumers.gateway import Gateway
from consumers.http import ServerThread
from consumers.sources.envs import VOCAB
from producers.engines import EnginePushError, SGLangPublisher, VLLMPublisher
from trainer.model import TinyConfig, TinyTransformer

pytestmark = pytest.mark.timeout(60)

CONFIG = TinyConfig(vocab=VOCAB.size, d_model=16, n_layers=1, n_heads=2, max_positions=24)


def trained(seed):
    return TinyTransformer(TinyConfig(**{**CONFIG.__dict__, "seed": seed}))


@pytest.mark.parametrize("kind", [SGLangPublisher, VLLMPublisher])
def test_each_publisher_makes_the_local_engine_serve_the_version(tmp_path, kind):
    engine = Engine(TinyTransformer(CONFIG))
    with ServerThread(engine.app(), name="engine") as e, \
            ServerThread(Gateway([e.url]).app(), name="gateway") as gw:
        publisher = kind([e.url], tmp_path / "w", gateways=[gw.url], timeout_s=10)
        for version in (1, 2):
            model = trained(version)
            published = publisher.load(model, version)
            assert engine.version == version
            assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in model.state_dict().items())
            assert published.location == f"file://{tmp_path / 'w' / f'v{version}.safetensors'}"
            assert len(published.digest) == 64 and published.size > 0
        engines = httpx.get(f"{gw.url}/engines").json()["engines"]
        assert [g["version"] for g in engines] == [2]  # credited to unstamped answers
        publisher.close()
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == [
        "v1.safetensors", "v1.safetensors.sha256", "v2.safetensors", "v2.safetensors.sha256"]


class Recorder:
    """An engine stand-in: answers `script` statuses in turn (then 200) and records bodies."""

    def __init__(self, script=(), answer=None):
        self.script, self.answer = list(script), answer if answer is not None else {"success": True}
        self.bodies = []
        app = web.Application()
        app.router.add_post("/update_weights_from_disk", self.handle)
        app.router.add_post("/collective_rpc", self.handle)
        self.server = ServerThread(app, name="recorder")

    async def handle(self, request):
        self.bodies.append((request.path, await request.json()))
        status = self.script.pop(0) if self.script else 200
        return web.json_response(self.answer if status == 200 else {"error": "busy"}, status=status)


def test_bodies_retries_and_refusals_against_a_recording_server(tmp_path):
    flaky = Recorder(script=[503, 502])
    try:
        publisher = SGLangPublisher([flaky.server.url], tmp_path / "w", retries=2, backoff_s=0.01,
                                    load_format="safetensors")
        publisher.load(trained(1), 7)
        assert [p for p, _ in flaky.bodies] == ["/update_weights_from_disk"] * 3
        assert flaky.bodies[-1][1] == {"model_path": str(tmp_path / "w" / "v7.safetensors"),
                                       "weight_version": "7", "load_format": "safetensors"}
        flaky.script = [503, 503, 503]
        with pytest.raises(EnginePushError, match="failed 3 time"):
            publisher.load(trained(1), 8)
    finally:
        flaky.server.stop()
    refusing = Recorder(script=[400])
    vllm = Recorder(answer={"results": [None]})
    unhappy = Recorder(answer={"success": False, "message": "shape mismatch"})
    try:
        with pytest.raises(EnginePushError, match="refused"):
            SGLangPublisher([refusing.server.url], tmp_path / "w", retries=3, backoff_s=0.01).load(trained(1), 9)
        assert len(refusing.bodies) == 1  # a 4xx is not retried
        with pytest.raises(EnginePushError, match="shape mismatch"):
            SGLangPublisher([unhappy.server.url], tmp_path / "w").load(trained(1), 9)
        VLLMPublisher([vllm.server.url], tmp_path / "w", kwargs={"is_checkpoint_format": True}).load(trained(1), 10)
        assert vllm.bodies == [("/collective_rpc", {"method": "reload_weights", "kwargs": {
            "is_checkpoint_format": True, "weights_path": str(tmp_path / "w" / "v10.safetensors"),
            "weight_version": "10"}})]
    finally:
        for r in (refusing, vllm, unhappy):
            r.server.stop()


def test_an_unreachable_engine_fails_after_its_retries_and_bad_options_are_refused(tmp_path):
    with ServerThread(web.Application(), name="gone") as gone:
        url = gone.url
    publisher = SGLangPublisher([url], tmp_path / "w", retries=1, backoff_s=0.01, timeout_s=2)
    with pytest.raises(EnginePushError, match="failed 2 time.*ConnectError"):
        publisher.load(trained(1), 1)
    with pytest.raises(ValueError, match="engines"):
        SGLangPublisher("http://one", tmp_path)
    with pytest.raises(ValueError, match="layout"):
        VLLMPublisher(["http://one"], tmp_path, layout="zip")
    with pytest.raises(TypeError, match="save_pretrained"):
        VLLMPublisher(["http://one"], tmp_path, layout="hf").load(trained(1), 1)


def test_the_hf_layout_writes_a_checkpoint_directory_the_engine_loads(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB.size, n_positions=32)
    torch.manual_seed(0)
    served, pushed = GPT2LMHeadModel(config).eval(), GPT2LMHeadModel(config)
    engine = Engine(served)
    with ServerThread(engine.app(), name="engine") as e:
        publisher = SGLangPublisher([e.url], tmp_path / "w", layout="hf", keep=1)
        published = publisher.load(pushed, 3)
        publisher.load(pushed, 4)
    assert engine.version == 4 and published.location == f"file://{tmp_path / 'w' / 'v3'}"
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["v4"]
    assert json.loads((tmp_path / "w" / "v4" / "config.json").read_text())["n_embd"] == 16
    assert torch.equal(served.state_dict()["transformer.wte.weight"], pushed.state_dict()["transformer.wte.weight"])
