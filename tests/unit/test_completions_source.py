"""`CompletionsSource`: environments of `domain.envs` sampled through the recording
gateway by an OpenAI-compatible engine (`rollstream engine` here, real servers on ephemeral
ports; vLLM: tests/integration/test_vllm.py). Multi-turn calls merge into one chain and
carry the engine's ids, log-probs and versions; a prompt set speaks a Hugging Face model
directory's tokenizer; failures end INFRA_ERROR, a cancel CANCELLED, a wrong set-up raises."""

import threading

import pytest
import torch

from consumers.cpu_engine import Engine
from consumers.cpu_engine import build as build_engine
from consumers.gateway import Gateway
from consumers.http import ServerThread
from consumers.sources.completions import CompletionsSource
from domain.envs import VOCAB
from pipeline.chains import merge_calls
from pipeline.sessions import SessionRequest, Status, Task
from tests.integration.harness_stack import eos_biased
from domain.model import TinyConfig, TinyTransformer
from trainer.objective import next_token_log_probs

pytestmark = pytest.mark.timeout(120)

CONFIG = TinyConfig(vocab=VOCAB.size, d_model=16, n_layers=1, n_heads=2, max_positions=48)


def request(task="3", sample=0, cancelled=None):
    return SessionRequest(Task(task), group=0, sample=sample, attempt=0, submitted_version=0, deadline=None,
                          cancelled=cancelled or threading.Event(), served_version=lambda: 0)


class Stack:
    def __init__(self, engine):
        self.engine = engine
        self.engine_server = ServerThread(engine.app(), name="engine")
        self.gateway = Gateway([self.engine_server.url], health_interval_s=0.1)
        self.gateway_server = ServerThread(self.gateway.app(), name="gateway")
        self.url = self.gateway_server.url

    def close(self):
        self.gateway_server.stop()
        self.engine_server.stop()


@pytest.fixture
def guess():
    model = TinyTransformer(CONFIG)
    eos_biased(model)  # replies end with <eos> often
    stack = Stack(Engine(model, name="tiny"))
    yield stack
    stack.close()


def rescore(model, call):
    ids = torch.cat([torch.as_tensor(call.prompt_ids), torch.as_tensor(call.completion_ids)]).long()[None]
    with torch.no_grad():
        return next_token_log_probs(model(ids), ids)[0, len(call.prompt_ids):]


def test_multi_turn_episodes_merge_into_one_chain_with_the_engines_log_probs(guess):
    source = CompletionsSource(gateway=guess.url, env="guess", env_args={"n": 8, "max_turns": 3},
                               max_new_tokens=3, seed=1)
    guess.engine.version = 4  # stamped by the engine on every answer
    sessions = [source.run(request(str(t), sample=t)) for t in range(8)]
    assert {s.status for s in sessions} <= {Status.COMPLETED, Status.TRUNCATED}
    multi = [s for s in sessions if len(s.calls) > 1]
    assert multi, [len(s.calls) for s in sessions]
    for s in sessions:
        for prev, call in zip(s.calls, s.calls[1:]):
            # the next prompt is the previous prompt + completion (eos included) + the game's answer
            assert list(call.prompt_ids[:len(prev.prompt_ids) + len(prev.completion_ids)]) == [
                *prev.prompt_ids, *prev.completion_ids]
        assert len(merge_calls(s.calls)) == 1
        for call in s.calls:
            assert call.version == 4
            torch.testing.assert_close(torch.as_tensor(call.logprobs), rescore(guess.engine.model, call),
                                       atol=1e-5, rtol=0)
        if s.status is Status.COMPLETED:
            assert s.calls[-1].completion_ids[-1] == VOCAB.eos and s.reward is not None
    # a fixed seed draws the same session again
    again = source.run(request("0", sample=0))
    assert [list(c.completion_ids) for c in again.calls] == [list(c.completion_ids) for c in sessions[0].calls]
    assert source.model == "tiny"  # the first model the engine lists
    assert guess.gateway.sessions == {}  # every session freed


def test_a_prompt_set_speaks_the_model_directory_s_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from trainer.hf_dir import write_model_dir

    model_dir = write_model_dir(tmp_path / "model", hidden=32, layers=1, heads=2, kv_heads=1, max_positions=64)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [{"prompt": f"c:{d}=", "answer": str(d)} for d in range(4)]
    stack = Stack(build_engine(str(model_dir)))
    try:
        source = CompletionsSource(gateway=stack.url, env="prompts", env_args={"prompts": prompts,
                                                                               "tokenizer": str(model_dir)},
                                   max_new_tokens=2, temperature=0.7)
        for task in range(4):
            s = source.run(request(str(task)))
            (call,) = s.calls
            expected = tok.apply_chat_template([{"role": "user", "content": prompts[task]["prompt"]}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
            assert list(call.prompt_ids) == list(expected)
            said, ended = source.env.vocab.until_eos(call.completion_ids)
            # scored on what it said, also when cut at max_new_tokens
            assert s.reward == float(tok.decode(said).strip() == prompts[task]["answer"])
            assert (s.status, s.truncation) == ((Status.COMPLETED, None) if ended else
                                                (Status.TRUNCATED, "max_new_tokens"))
    finally:
        stack.close()


def test_failures_end_infra_error_a_cancel_cancelled_and_a_wrong_set_up_raises(guess):
    source = CompletionsSource(gateway=guess.url, env="guess", max_new_tokens=2)
    cancelled = threading.Event()
    cancelled.set()
    assert source.run(request(cancelled=cancelled)).status is Status.CANCELLED
    guess.engine_server.stop()
    failed = source.run(request())
    assert failed.status is Status.INFRA_ERROR and failed.calls == []
    unreachable = CompletionsSource(gateway="http://127.0.0.1:9", env="guess", model="tiny")
    assert unreachable.run(request()).status is Status.INFRA_ERROR
    with pytest.raises(ValueError, match="max_new_tokens"):
        CompletionsSource(gateway=guess.url, env="guess", max_new_tokens=0)


def test_an_engine_refusing_the_call_fails_the_step(guess):
    source = CompletionsSource(gateway=guess.url, env="guess", model="tiny", temperature=1.0, max_new_tokens=2)
    source.temperature = -1.0  # the engine answers 400, naming the field
    with pytest.raises(RuntimeError, match="refused the call \\(400\\).*temperature"):
        source.run(request())
