"""A real vLLM server in the loop (vLLM 0.32 on CPU, from its own virtual environment,
`consumers.vllm_server`; skipped with the reason where it is not installed): pushes land
(a long prompt's served log-probs are the new weights', through a reset prefix cache), a push
with requests in flight loses none and credits each with the weights that served it, the
gateway records every answer shape vLLM produces; and docs/engines.md's recipe runs as
written (`examples/vllm/`): vLLM, the gateway, the admission and a consumer as processes,
and `rollstream trainer` trains the model directory on vLLM's rollouts, a push every step.

The recipe starts its own server, first; the other tests share one for the module (each
about 20-40 s to start). The model is a tiny Qwen2 with a trained BPE tokenizer
(`trainer.hf_dir`), served in float32 so that its log-probs are the trainer's to about
1e-6."""

from __future__ import annotations

import copy
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from consumers.gateway import Gateway
from consumers.http import ServerThread
from consumers.vllm_server import VLLMServer, missing, venv
from pipeline import wire
from pipeline.processes import free_port
from pipeline.ready import expand
from producers.engine_publishers import VLLMPublisher
from tests.integration.test_recipes import SERVER, recipe, records, run_subs, watching
from trainer.hf_dir import write_model_dir

WHY = missing()
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300),
              pytest.mark.skipif(WHY is not None, reason=f"vLLM cannot run here: {WHY}")]

NAME = "tiny"
LONG = [int(t) for t in torch.randint(3, 290, (400,), generator=torch.Generator().manual_seed(1))]
CLOSE = 1e-4  # float32 engine against the float32 trainer: about 1e-6 apart


PROMPTS = [{"prompt": f"c:{d}=", "answer": str(d)} for d in (0, 1)]  # copy a bit


@pytest.mark.redis
@SERVER
def test_vllm_recipe(tmp_path, redis_url, namespace, r, keys):
    """docs/engines.md: vLLM, the gateway, the admission and a consumer (CompletionsSource)
    as processes and `rollstream trainer` pushing every step (ahead 0): every trained token
    was served by the trainer's own version, and their log-probs agree; vLLM ends serving
    the last pushed weights."""
    engine, gateway, steps = free_port(), free_port(), 3
    subs = {**run_subs(redis_url, "vllm", namespace, steps=steps), "~/.cache/rollstream/vllm-venv": str(venv()),
            "--port 8100": f"--port {engine}", "127.0.0.1:8100": f"127.0.0.1:{engine}",
            "--port 8000": f"--port {gateway}", "127.0.0.1:8000": f"127.0.0.1:{gateway}"}
    with watching(r, keys.ready(0)) as readies, recipe("vllm", tmp_path, subs, timeout_s=240) as run:
        last = steps - 1
        vllm = f"http://127.0.0.1:{engine}"
        assert httpx.get(f"{vllm}/weight_info").json() == {"weight_version": str(last)}
        assert [e["version"] for e in httpx.get(f"http://127.0.0.1:{gateway}/engines").json()["engines"]] == [last]
        served = served_next(vllm, LONG[:40])
    rows = records(run.cwd / "steps.jsonl")
    assert [row["step"] for row in rows] == list(range(steps))
    assert [row["pushed"] for row in rows] == [None, *range(1, steps)]  # the served version advances every step
    assert all(row["lag"] == 0 and row["resubmitted"].get("stale", 0) == 0 for row in rows)
    for row in rows:  # every trained token was served by the trainer's version: their log-probs agree
        train = row["train"]
        assert train["mismatch_tokens"] == train["loss_tokens"] > 0
        assert train["mismatch_abs"] < CLOSE and train["mismatch_over"] == 0.0, train
    print("mismatch_abs per step:", [row["train"]["mismatch_abs"] for row in rows])
    # the trained rows carry each step's version, sampled by vLLM
    versions = [expand(wire.from_fields(f, wire.Ready).arrays) for f in readies]
    assert [sorted(set(a["versions"][a["loss_mask"]].tolist())) for a in versions] == [[s] for s in range(steps)]
    # what vLLM served at the end is the last pushed directory's weights
    assert gap(served, hf(run.cwd / "weights" / f"v{last}"), LONG[:40]) < CLOSE


def warm_start(path: Path, target: float = 0.4) -> None:
    """Teach the model at `path` the answers' form (a bit, then eos) until it says the
    answer with probability `target` on average (supervised, in place): so that some
    rollouts of a group succeed and others fail, and GRPO has advantages to train on."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = hf(path).train()
    rows = [tok.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True,
                                    tokenize=True, return_dict=False) + [*tok.encode(p["answer"]), tok.eos_token_id]
            for p in PROMPTS]
    ids = torch.tensor(rows)  # one length: c:<bit>= and a bit
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(200):
        logp = torch.log_softmax(model(ids).logits[:, -3:-1].float(), -1)
        said = logp.gather(-1, ids[:, -2:, None])[..., 0].sum(-1)
        if float(said.detach().exp().mean()) >= target:
            break
        optimizer.zero_grad()
        (-said.mean()).backward()
        optimizer.step()
    assert float(said.detach().exp().mean()) >= target
    model.eval().save_pretrained(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = write_model_dir(tmp_path_factory.mktemp("vllm") / "model")
    warm_start(path)
    return path


@pytest.fixture(scope="module")
def vllm(model_dir, tmp_path_factory):
    server = VLLMServer(model_dir, port=free_port(), log=tmp_path_factory.mktemp("vllm-log") / "vllm.log",
                        options={"name": NAME})
    yield server
    server.stop()


@pytest.fixture
def gateway(vllm):
    gw = Gateway([vllm.url])
    with ServerThread(gw.app(), name="gateway") as server:
        gw.url = server.url
        yield gw


def hf(path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()


def nudged(model, seed: int, scale: float = 0.02) -> torch.nn.Module:
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return other


def served_next(url: str, prompt: list[int]) -> dict[int, float]:
    """vLLM's top-20 log-probs of the token after `prompt` (one sampled token)."""
    answer = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": NAME, "prompt": prompt, "max_tokens": 1, "logprobs": 20, "return_tokens_as_token_ids": True})
    top = answer.json()["choices"][0]["logprobs"]["top_logprobs"][0]
    return {int(k.split(":")[1]): v for k, v in top.items()}


def gap(served: dict[int, float], model, prompt: list[int]) -> float:
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)
    return max(abs(v - float(logp[k])) for k, v in served.items())


def rescored(model, call: dict, temperature: float = 1.0) -> torch.Tensor:
    """The log-prob of each of the call's completion tokens under `model`."""
    ids = torch.tensor([call["prompt_ids"] + call["completion_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float() / temperature, -1)
    n = len(call["prompt_ids"])
    return logp[n - 1:-1].gather(-1, torch.tensor(call["completion_ids"])[:, None])[:, 0]


class SteppedPublisher(VLLMPublisher):
    """Once vLLM is paused (its calls in flight drained), sets `paused` and goes on when
    `proceed` is set (it is, unless a test clears it)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.paused, self.proceed = threading.Event(), threading.Event()
        self.proceed.set()

    def _pause(self, engine: str) -> bool:
        paused = super()._pause(engine)
        self.paused.set()
        self.proceed.wait(60)
        return paused


@pytest.mark.redis
def test_pushes_land_through_a_reset_cache_and_requests_in_flight_finish_under_their_weights(
        vllm, gateway, model_dir, tmp_path):
    base = hf(model_dir)
    new = nudged(base, 1)
    publisher = SteppedPublisher([vllm.url], tmp_path / "w", gateways=[gateway.url], timeout_s=120)
    publisher.preflight()
    publisher.load(base, 1)
    assert gap(served_next(vllm.url, LONG), base, LONG) < CLOSE  # the long prompt is cached now

    # six long streamed calls in flight, then a push; four calls sent while it is under way
    http = httpx.Client(base_url=gateway.url, timeout=120)
    first_chunk = threading.Barrier(7)
    answers: dict[str, int] = {}
    ended: dict[str, float] = {}

    def streamed(sid: str) -> None:
        with http.stream("POST", f"/sessions/{sid}/v1/completions", json={
                "model": NAME, "prompt": LONG[:50], "max_tokens": 500, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            first_chunk.wait(60)
            for _ in lines:
                pass
            answers[sid], ended[sid] = r.status_code, time.monotonic()

    def whole(sid: str) -> None:
        r = http.post(f"/sessions/{sid}/v1/chat/completions", json={
            "model": NAME, "messages": [{"role": "user", "content": "c:3="}], "max_tokens": 20})
        answers[sid] = r.status_code

    running = [threading.Thread(target=streamed, args=(f"old{i}",)) for i in range(6)]
    for t in running:
        t.start()
    first_chunk.wait(60)
    publisher.paused.clear()
    publisher.proceed.clear()
    push = threading.Thread(target=publisher.load, args=(new, 2))
    pausing = time.monotonic()
    push.start()
    publisher.paused.wait(60)  # vLLM drained the six and is paused; the gateway holds new calls
    late = [threading.Thread(target=whole, args=(f"new{i}",)) for i in range(4)]
    for t in late:
        t.start()
    deadline = time.monotonic() + 60
    while httpx.get(f"{gateway.url}/engines").json()["engines"][0]["waiting"] < 4:
        assert time.monotonic() < deadline, "the late calls were not held"
        time.sleep(0.01)
    publisher.proceed.set()
    for t in [push, *running, *late]:
        t.join(120)
    assert answers == {sid: 200 for sid in answers} and len(answers) == 10
    assert min(ended.values()) > pausing  # the six were in flight when the push began

    # every call is recorded, credited with the weights that served it: its log-probs say so
    weights = {1: base, 2: new}
    for sid in answers:
        record = http.get(f"/sessions/{sid}").json()
        assert record["infra_error"] is None and record["protocol_error"] is None
        (call,) = record["calls"]
        assert call["version"] == (1 if sid.startswith("old") else 2), sid
        assert len(call["completion_ids"]) == (500 if sid.startswith("old") else len(call["logprobs"]))
        got = torch.tensor(call["logprobs"])
        assert float((got - rescored(weights[call["version"]], call)).abs().max()) < CLOSE, sid
    # the long prompt cached under version 1 is served by version 2
    served = served_next(vllm.url, LONG)
    assert gap(served, new, LONG) < CLOSE and gap(served, base, LONG) > 100 * CLOSE
    assert httpx.get(f"{vllm.url}/weight_info").json() == {"weight_version": "2"}

    # the control: a bare reload (no pause, no cache reset) keeps serving the cached prompt's
    # old KV, which the publisher's reset does not
    httpx.post(f"{vllm.url}/collective_rpc", timeout=60, json={
        "method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "w" / "v1")}})
    assert gap(served_next(vllm.url, LONG), base, LONG) > 100 * CLOSE
    publisher.load(base, 3)
    assert gap(served_next(vllm.url, LONG), base, LONG) < CLOSE
    publisher.close()


def sse_choices(text: str) -> dict[int, dict]:
    """A streamed answer's choices, assembled: token ids, log-probs, finish reason, prompt."""
    out: dict[int, dict] = {}
    prompt = None
    for line in text.splitlines():
        if not line.startswith("data:") or line.strip() == "data: [DONE]":
            continue
        event = json.loads(line[5:])
        prompt = event.get("prompt_token_ids") or prompt
        for c in event["choices"]:
            acc = out.setdefault(c["index"], {"ids": [], "logprobs": [], "finish": None, "prompt": None})
            acc["ids"] += c.get("token_ids") or []
            lp = c.get("logprobs") or {}
            acc["logprobs"] += [x["logprob"] for x in lp.get("content", [])] or lp.get("token_logprobs") or []
            acc["finish"] = c.get("finish_reason") or acc["finish"]
            acc["prompt"] = c.get("prompt_token_ids") or acc["prompt"] or prompt
    return out


def whole_choices(answer: dict, chat: bool) -> dict[int, dict]:
    return {c["index"]: {"ids": c["token_ids"], "finish": c["finish_reason"],
                         "logprobs": [x["logprob"] for x in c["logprobs"]["content"]] if chat
                         else c["logprobs"]["token_logprobs"],
                         "prompt": c.get("prompt_token_ids") or answer.get("prompt_token_ids")}
            for c in answer["choices"]}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [True, False])
def test_the_gateway_records_every_answer_shape_vllm_produces(vllm, gateway, model_dir, tmp_path, chat, stream):
    base = hf(model_dir)
    VLLMPublisher([vllm.url], tmp_path / "w", gateways=[gateway.url]).load(base, 5)
    http = httpx.Client(base_url=gateway.url, timeout=60)
    body = {"model": NAME, "n": 3, "max_tokens": 40, "seed": 7, "temperature": 0.8, "stream": stream,
            "stop_token_ids": list(range(3, 40))}  # most choices stop before 40 tokens
    body |= {"messages": [{"role": "user", "content": "c:37="}]} if chat else {"prompt": LONG[:20]}
    answer = http.post(f"/sessions/s/v1/{'chat/completions' if chat else 'completions'}", json=body)
    assert answer.status_code == 200, answer.text
    expected = sse_choices(answer.text) if stream else whole_choices(answer.json(), chat)
    record = http.get("/sessions/s").json()
    assert record["protocol_error"] is None and record["infra_error"] is None
    assert len(record["calls"]) == 3 == len(expected)
    for call, i in zip(record["calls"], sorted(expected), strict=True):
        e = expected[i]
        assert (call["prompt_ids"], call["completion_ids"], call["logprobs"], call["finish_reason"]) == (
            e["prompt"], e["ids"], e["logprobs"], e["finish"])
        assert call["version"] == 5  # told by the publisher
        # the engine's log-probs are the model's at the request's temperature
        mine = rescored(base, call, temperature=0.8)
        assert float((torch.tensor(call["logprobs"]) - mine).abs().max()) < CLOSE
    assert {c["finish_reason"] for c in record["calls"]} <= {"stop", "length"}
    assert "stop" in {c["finish_reason"] for c in record["calls"]}
