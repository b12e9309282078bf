"""PolicySource, PromptSetSource and the tiny environments: behaviour log-probs, weight
versions loaded between calls, cancellation, limits."""

import json
import threading

import pytest
import torch

from domain.envs import VOCAB, ArithmeticEnv, GuessEnv, score
from consumers.sources.policy import PolicySource
from consumers.sources.prompts import PromptSetSource
from pipeline.sessions import SessionRequest, Status, Task
from producers.publishers import DirectoryPublisher
from domain.model import TinyConfig, TinyTransformer
from trainer.objective import next_token_log_probs

CONFIG = TinyConfig(vocab=VOCAB.size, d_model=16, n_layers=1, n_heads=2, max_positions=128)
EOS = VOCAB.eos


def request(task="5", served=lambda: 0, cancelled=None, sample=0):
    return SessionRequest(Task(task), group=0, sample=sample, attempt=0, submitted_version=0,
                          deadline=None, cancelled=cancelled or threading.Event(), served_version=served)


def eos_model(bias, seed=0):
    """A model whose next token is `<eos>` with a logit of about 3 * bias (never for bias < 0)."""
    m = TinyTransformer(TinyConfig(**{**CONFIG.__dict__, "seed": seed}))
    with torch.no_grad():
        m.ln_f.weight[0] = 0.0
        m.ln_f.bias[0] = 3.0
        m.embed.weight[EOS] = 0.0
        m.embed.weight[EOS, 0] = bias
    return m


def rescored(model, call, temperature):
    ids = torch.cat([torch.as_tensor(call.prompt_ids), torch.as_tensor(call.completion_ids)]).long()[None]
    with torch.no_grad():
        logp = next_token_log_probs(model(ids), ids, temperature=temperature)[0]
    return logp[len(call.prompt_ids):]


def test_reported_log_probs_are_the_temperature_scaled_log_softmax_at_the_sampled_tokens():
    source = PolicySource(env=ArithmeticEnv(op="copy", digits=3), model_config=CONFIG, temperature=0.7,
                          max_new_tokens=6, seed=1)
    for task in ("1", "2", "3"):
        session = source.run(request(task))
        assert session.status is Status.TRUNCATED and session.truncation == "max_new_tokens"
        (call,) = session.calls
        assert call.version == 0 and len(call.completion_ids) == 6
        expected = rescored(TinyTransformer(CONFIG), call, 0.7)
        assert torch.allclose(torch.as_tensor(call.logprobs), expected, atol=1e-5)
        assert 0.0 <= session.reward <= 1.0


def test_sampling_is_reproducible_per_seed_and_request():
    make = lambda: PolicySource(env=ArithmeticEnv(), model_config=CONFIG, max_new_tokens=4, seed=3)
    a, b = make().run(request("9")), make().run(request("9"))
    assert a.calls == b.calls
    assert make().run(request("9", sample=1)).calls != a.calls


def test_sessions_are_delayed_by_a_seeded_log_normal_draw_that_leaves_the_samples_alone():
    make = lambda **kw: PolicySource(env=ArithmeticEnv(), model_config=CONFIG, max_new_tokens=2, seed=3, **kw)
    delayed, plain = make(delay_median_s=0.5, delay_sigma=1.0, delay_cap=4.0), make()
    draws = [delayed.draw_delay_s(torch.Generator().manual_seed(i)) for i in range(400)]
    assert draws == [delayed.draw_delay_s(torch.Generator().manual_seed(i)) for i in range(400)]
    draws.sort()
    assert 0.4 < draws[200] < 0.6 and draws[-1] == pytest.approx(2.0)  # median, cap x median
    assert draws[360] > 3 * draws[200]  # a heavy tail: the 90th percentile ~3.6x the median
    assert plain.draw_delay_s(torch.Generator().manual_seed(0)) == 0.0
    fast = make(delay_median_s=0.001)
    a, b = fast.run(request("4")), plain.run(request("4"))
    assert list(a.calls[0].completion_ids) == list(b.calls[0].completion_ids)  # the delay's draw is apart
    cancelled = threading.Event()
    cancelled.set()
    slow = make(delay_median_s=3600.0, delay_sigma=0.0)
    assert slow.run(request("4", cancelled=cancelled)).status is Status.CANCELLED  # no hour's wait
    with pytest.raises(ValueError, match="delay_median_s"):
        make(delay_median_s=-1.0)


def test_a_weight_push_mid_session_is_loaded_before_the_next_call(tmp_path):
    pub = DirectoryPublisher(tmp_path, keep=2)
    pub.load(eos_model(3.0), 1)
    pub.load(eos_model(1.5, seed=5), 2)
    served = [1, 2]  # version 1 served for the first call, then 2
    source = PolicySource(env=GuessEnv(n=8, max_turns=3), model_config=CONFIG, max_new_tokens=4,
                          weights=str(tmp_path), seed=0)
    session = source.run(request(served=lambda: served.pop(0) if len(served) > 1 else served[0]))
    assert [c.version for c in session.calls] == [1, 2, 2]
    assert session.status is Status.COMPLETED and session.reward == 0.0  # three invalid guesses
    for call, model in zip(session.calls, (eos_model(3.0), eos_model(1.5, 5), eos_model(1.5, 5))):
        assert torch.allclose(torch.as_tensor(call.logprobs), rescored(model, call, 1.0), atol=1e-5)
    assert session.calls[0].logprobs[0] != pytest.approx(session.calls[1].logprobs[0], abs=1e-3)
    # the calls extend each other: prompt + completion + the environment's answer
    first, second = session.calls[:2]
    assert list(second.prompt_ids) == [*first.prompt_ids, *first.completion_ids, VOCAB["<invalid>"]]
    assert source.weights.fetches == 2


def test_a_newer_version_without_weights_to_load_it_from_is_an_error():
    source = PolicySource(env=ArithmeticEnv(), model_config=CONFIG, max_new_tokens=2)
    with pytest.raises(RuntimeError, match="version 4 is served"):
        source.run(request(served=lambda: 4))


def test_cancellation_stops_a_session_between_tokens(tmp_path):
    DirectoryPublisher(tmp_path).load(eos_model(-5.0), 1)  # never ends on its own
    source = PolicySource(env=ArithmeticEnv(), model_config=CONFIG, max_new_tokens=120,
                          weights=str(tmp_path))
    cancelled = threading.Event()

    def served() -> int:  # the cancel arrives once the session is under way
        cancelled.set()
        return 1

    session = source.run(request(served=served, cancelled=cancelled))
    assert session.status is Status.CANCELLED and session.calls == []
    already = threading.Event()
    already.set()
    assert source.run(request(cancelled=already)).status is Status.CANCELLED


def test_token_turn_and_context_limits_truncate_with_the_reason(tmp_path):
    DirectoryPublisher(tmp_path / "long").load(eos_model(-5.0), 1)
    long = PolicySource(env=ArithmeticEnv(op="reverse", digits=3), model_config=CONFIG, max_new_tokens=5,
                        weights=str(tmp_path / "long"))
    s = long.run(request(served=lambda: 1))
    assert (s.status, s.truncation, len(s.calls[0].completion_ids)) == (Status.TRUNCATED, "max_new_tokens", 5)
    assert s.reward is not None and 0.0 <= s.reward <= 1.0
    short = PolicySource(env=ArithmeticEnv(op="reverse", digits=3), model_config=CONFIG, max_new_tokens=5,
                         max_tokens=9, weights=str(tmp_path / "long"))
    s = short.run(request(served=lambda: 1))  # the prompt <bos>r:ddd= is 7 tokens
    assert (s.status, s.truncation, len(s.calls[0].completion_ids)) == (Status.TRUNCATED, "max_tokens", 2)

    DirectoryPublisher(tmp_path / "eos").load(eos_model(3.0), 1)
    turns = PolicySource(env=GuessEnv(max_turns=3), model_config=CONFIG, max_new_tokens=3,
                         max_turns=2, weights=str(tmp_path / "eos"), seed=0)
    s = turns.run(request(served=lambda: 1))
    assert (s.status, s.truncation, len(s.calls)) == (Status.TRUNCATED, "max_turns", 2)


def test_sessions_in_parallel_threads_use_models_of_their_own(tmp_path):
    DirectoryPublisher(tmp_path).load(eos_model(-5.0), 1)
    source = PolicySource(env=ArithmeticEnv(), model_config=CONFIG, max_new_tokens=30,
                          weights=str(tmp_path), seed=0)
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.setdefault(i, source.run(request(str(i), served=lambda: 1))))
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 4 and 1 < source.models <= 4
    serial = PolicySource(env=ArithmeticEnv(), model_config=CONFIG, max_new_tokens=30,
                          weights=str(tmp_path), seed=0)
    assert all(serial.run(request(str(i), served=lambda: 1)).calls == results[i].calls for i in range(4))
    assert source.weights.fetches == 1


def test_environments_map_task_ids_to_problems_and_score_in_zero_one():
    env = ArithmeticEnv(op="add")
    assert env.problem(Task("12")) == env.problem(Task("12"))
    assert [t.payload for t in env.tasks({"task_id": [12]})] == [env.problem(Task("12"))]
    p = env.problem(Task("12"))
    episode = env.start(Task("x", p))
    assert episode.prompt == [VOCAB.bos, *VOCAB.encode(p["prompt"])]
    right = episode.step(VOCAB.encode(p["answer"]) + [EOS])
    assert right.done and right.reward == 1.0 and right.components == {"exact": 1.0, "eos": 1.0}
    assert score("183", "18") == pytest.approx(2 / 3) and score("7", "77") == 0.5
    assert ArithmeticEnv(op="reverse").problem(Task("x", {"prompt": "r:12=", "answer": "21"}))["answer"] == "21"

    game = GuessEnv(n=8, max_turns=3).start(Task("g", {"secret": 5}))
    assert game.step(VOCAB.encode("3") + [EOS]).reply == [VOCAB["<higher>"]]
    assert game.step(VOCAB.encode("7") + [EOS]).reply == [VOCAB["<lower>"]]
    last = game.step(VOCAB.encode("5") + [EOS])
    assert last.done and last.reply == [VOCAB["<correct>"]] and last.reward == pytest.approx(1 / 3)
    assert GuessEnv().start(Task("g", {"secret": 2})).step(VOCAB.encode("2")).reward == 1.0


def test_prompt_set_source_scores_one_completion_per_session(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in [{"prompt": "1+1=", "answer": "2"},
                                                      {"prompt": "2+2=", "answer": ""}]))
    DirectoryPublisher(tmp_path / "w").load(eos_model(3.0), 1)
    source = PromptSetSource(prompts=str(path), model_config=CONFIG, max_new_tokens=3,
                             weights={"directory": str(tmp_path / "w")}, seed=0)
    wrong, right = source.run(request("0", served=lambda: 1)), source.run(request("3", served=lambda: 1))
    assert (wrong.status, wrong.reward, right.status, right.reward) == (Status.COMPLETED, 0.0, Status.COMPLETED, 1.0)
    assert list(right.calls[0].prompt_ids) == [VOCAB.bos, *VOCAB.encode("2+2=")]
    with pytest.raises(ValueError, match="needs 'prompt' and 'answer'"):
        PromptSetSource(prompts=[{"question": "?"}], model_config=CONFIG)


def test_a_hugging_face_config_builds_the_policy():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=VOCAB.size, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                      max_position_embeddings=64)
    source = PolicySource(env=ArithmeticEnv(), model_config=config, temperature=0.8, max_new_tokens=3, seed=0)
    (call,) = source.run(request("4")).calls
    model = source._free[0].model
    ids = torch.cat([torch.as_tensor(call.prompt_ids), torch.as_tensor(call.completion_ids)]).long()[None]
    with torch.no_grad():
        logp = next_token_log_probs(model(input_ids=ids).logits, ids, temperature=0.8)[0]
    assert torch.allclose(torch.as_tensor(call.logprobs), logp[len(call.prompt_ids):], atol=1e-5)


def write_char_tokenizer(path):
    """A character-level Hugging Face tokenizer (bos <s>, eos </s>) saved to `path`, built
    offline with the `tokenizers` library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "0123456789+=: abcdefghijklmnopqrstuvwxyz"
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(["<pad>", "<s>", "</s>", *chars])},
                               merges=[], unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(path)
    return fast


def test_a_prompt_set_speaks_the_tokenizer_of_a_hugging_face_model_directory(tmp_path):
    transformers = pytest.importorskip("transformers")
    model_dir = tmp_path / "model"
    fast = write_char_tokenizer(model_dir)
    config = transformers.GPT2Config(vocab_size=len(fast), n_layer=1, n_head=2, n_embd=16, n_positions=32,
                                     bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    prompts = [{"prompt": "2+3=", "answer": "5"}, {"prompt": "c:7=", "answer": "7"}]
    source = PromptSetSource(prompts=prompts, model_config=str(model_dir), max_new_tokens=3, seed=0)
    env = source.env
    assert (env.vocab.size, env.vocab.bos, env.vocab.eos) == (len(fast), fast.bos_token_id, fast.eos_token_id)
    episode = env.start(Task("0"))
    assert episode.prompt == [fast.bos_token_id, *fast.encode("2+3=", add_special_tokens=False)]
    five, four = fast.encode("5", add_special_tokens=False), fast.encode("4", add_special_tokens=False)
    assert episode.step([*five, fast.eos_token_id]).reward == 1.0
    assert episode.step([*four, fast.eos_token_id]).reward == 0.0
    for task in ("0", "1", "2", "3"):  # sessions sample the model and score its text
        session = source.run(request(task))
        (call,) = session.calls
        assert list(call.prompt_ids) == env.start(Task(task)).prompt
        said, _ = env.vocab.until_eos(call.completion_ids)
        answer = prompts[int(task) % 2]["answer"]
        assert session.reward == float(fast.decode(said).strip() == answer)
        ids = torch.cat([torch.as_tensor(call.prompt_ids), torch.as_tensor(call.completion_ids)]).long()[None]
        with torch.no_grad():
            logp = next_token_log_probs(source._free[0].model(input_ids=ids).logits, ids, temperature=1.0)[0]
        assert torch.allclose(torch.as_tensor(call.logprobs), logp[len(call.prompt_ids):], atol=1e-5)
    # the same from config: the prompts environment with a tokenizer directory
    named = PolicySource(env="prompts", env_args={"prompts": prompts, "tokenizer": str(model_dir)},
                         model_config=str(model_dir), max_new_tokens=2, seed=0)
    assert named.env.start(Task("1")).prompt == [fast.bos_token_id, *fast.encode("c:7=", add_special_tokens=False)]
    with pytest.raises(ValueError, match="no tokenizer at"):
        PromptSetSource(prompts=prompts, tokenizer=str(tmp_path), model_config=CONFIG)
    with pytest.raises(ValueError, match="verifier must be one of"):
        PromptSetSource(prompts=prompts, verifier="fuzzy", model_config=CONFIG)


def test_models_built_for_concurrent_sessions_are_whole_and_equal(tmp_path):
    """Sessions in threads each take a model of the pool, building one when none is free;
    Hugging Face construction is not thread-safe (global init patches, the meta device, the
    global RNG), so the pool builds one at a time and every copy is version 0 exactly. Each
    session waits, holding its model, until all eight hold one (at its first check of the
    served version), so that seven models are built however the threads are scheduled."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=VOCAB.size, n_layer=1, n_head=2, n_embd=16, n_positions=32)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    for model_config in (str(tmp_path / "model"), config):
        source = PolicySource(env=ArithmeticEnv(), model_config=model_config, max_new_tokens=1, seed=0)
        errors = []
        together = threading.Barrier(8, timeout=60)

        def session(i: int) -> None:
            waited = []

            def served() -> int:
                if not waited:
                    waited.append(together.wait())  # noqa: B023 (joined within this iteration)
                return 0

            try:
                source.run(request(str(i), sample=i, served=served))  # noqa: B023 (joined within this iteration)
            except Exception as exc:  # collected and asserted below
                errors.append(exc)  # noqa: B023 (joined within this iteration)

        threads = [threading.Thread(target=session, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert source.models == len(source._free) == 8
        first, *others = [dict(p.model.state_dict()) for p in source._free]
        for state in others:
            assert all(t.device.type == "cpu" and torch.equal(t, first[k]) for k, t in state.items())
