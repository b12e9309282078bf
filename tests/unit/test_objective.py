"""GRPOObjective: packed rescoring equals per-chain scoring, the loss by hand, gradients."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch

from pipeline.chains import Chain
from pipeline.packing import Group, PackedBatch, Rollout, pack
from pipeline.sessions import Status
from domain.model import TinyConfig, TinyTransformer
from trainer.objective import GRPOObjective, Rows, attention_kind, next_token_log_probs

VOCAB = 64
ModelCall = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _chain(rng: np.random.Generator, n: int) -> Chain:
    loss = np.zeros(n, dtype=bool)
    loss[n // 2 :] = True
    return Chain(
        tokens=rng.integers(0, VOCAB, n, dtype=np.int32),
        loss_mask=loss,
        logprobs=np.where(loss, -1.0, 0).astype(np.float32),
        versions=np.where(loss, 2, -1).astype(np.int32),
    )


def packed_rows(seed: int = 0, rows: int = 3, width: int = 24) -> PackedBatch:
    """Several chains per row, some rows not full."""
    rng = np.random.default_rng(seed)
    groups = [
        Group(
            g,
            tuple(
                Rollout(s, Status.COMPLETED, (_chain(rng, int(rng.integers(2, 10))),), reward=float(s))
                for s in range(3)
            ),
        )
        for g in range(3)
    ]
    batch = pack(groups, rows=rows, width=width)
    assert (batch.segments.max(axis=1) >= 2).any(), "the test needs rows holding several chains"
    return batch


def reference_log_probs(model: torch.nn.Module, batch: PackedBatch, call: ModelCall) -> torch.Tensor:
    """Each chain alone through `call(model, ids, positions)`; independent of the objective."""
    out = torch.zeros(batch.tokens.shape)
    for r in range(batch.rows):
        for s in range(1, int(batch.segments[r].max()) + 1):
            cols = np.flatnonzero(batch.segments[r] == s)
            ids = torch.from_numpy(batch.tokens[r, cols]).long()[None]
            logits = call(model, ids, torch.arange(len(cols))[None])
            logp = torch.log_softmax(logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
            out[r, cols[1:]] = logp
    return out


def tiny_call(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return model(ids, position_ids=pos)


def hf_call(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, position_ids=pos).logits


def hf_model(kind: str, attn: str) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    else:
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0
        )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.eval()


# ---------------------------------------------------------------- packed == unpacked


def test_tiny_model_packed_equals_each_chain_alone() -> None:
    model = TinyTransformer(TinyConfig(vocab=VOCAB, max_positions=64))
    batch = packed_rows()
    assert attention_kind(model) == "segments"
    with torch.no_grad():
        packed = GRPOObjective().packed_log_probs(model, batch)
        alone = reference_log_probs(model, batch, tiny_call)
        per_chain = GRPOObjective(attention="per_chain").packed_log_probs(model, batch)
        micro = GRPOObjective(micro_rows=1).packed_log_probs(model, batch)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(per_chain, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(micro, packed, atol=1e-6, rtol=1e-6)
    starts = torch.from_numpy(batch.positions == 0)
    assert (packed[starts] == 0).all()


def test_leaking_attention_or_positions_would_be_caught() -> None:
    """The comparison above is sensitive: one sequence per row differs from the chains."""
    model = TinyTransformer(TinyConfig(vocab=VOCAB, max_positions=64))
    batch = packed_rows()
    rows = Rows.from_packed(batch)
    with torch.no_grad():
        leaky = model(rows.tokens, position_ids=rows.positions, segment_ids=(rows.segments > 0).long())
        wrong_pos = model(rows.tokens, segment_ids=rows.segments)
        alone = reference_log_probs(model, batch, tiny_call)
    later = torch.from_numpy((batch.segments > 1) & (batch.positions > 0))
    for logits in (leaky, wrong_pos):
        logp = next_token_log_probs(logits, rows.tokens)
        assert (logp - alone)[later].abs().max() > 1e-3


@pytest.mark.parametrize(
    ("kind", "attn"), [("llama", "sdpa"), ("llama", "eager"), ("gpt2", "sdpa"), ("gpt2", "eager")]
)
def test_hf_model_packed_equals_each_chain_alone(kind: str, attn: str) -> None:
    model = hf_model(kind, attn)
    assert attention_kind(model) == "mask4d"
    batch = packed_rows(seed=1)
    with torch.no_grad():
        packed = GRPOObjective().packed_log_probs(model, batch)
        alone = reference_log_probs(model, batch, hf_call)
        per_chain = GRPOObjective(attention="per_chain").packed_log_probs(model, batch)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(per_chain, alone, atol=1e-5, rtol=1e-5)


def test_unknown_attention_falls_back_to_per_chain() -> None:
    model = hf_model("llama", "sdpa")
    model.config._attn_implementation = "flash_attention_2"
    assert attention_kind(model) == "per_chain"


# ---------------------------------------------------------------- support


def test_support_renormalises_over_the_sampling_support() -> None:
    logits = torch.tensor([[[0.0, 1.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0]]])
    tokens = torch.tensor([[0, 2]])
    full = next_token_log_probs(logits, tokens)
    assert full[0, 0] == 0
    assert full[0, 1].item() == pytest.approx(2 - math.log(sum(math.exp(z) for z in range(4))))
    support = torch.tensor([[[-1, -1, -1], [2, 0, -1]]])
    assert next_token_log_probs(logits, tokens, support)[0, 1].item() == pytest.approx(
        2 - math.log(math.exp(2) + 1)
    )
    missing = torch.tensor([[[-1, -1, -1], [0, 1, -1]]])  # the token joins its support
    expected = 2 - math.log(math.exp(2) + math.exp(0) + math.exp(1))
    assert next_token_log_probs(logits, tokens, missing)[0, 1].item() == pytest.approx(expected)
    unfiltered = torch.full((1, 2, 3), -1)
    torch.testing.assert_close(next_token_log_probs(logits, tokens, unfiltered), full)
    halved = next_token_log_probs(logits, tokens, temperature=2.0)[0, 1].item()
    assert halved == pytest.approx(1 - math.log(sum(math.exp(z / 2) for z in range(4))))


def test_full_support_rows_match_unfiltered_scoring() -> None:
    model = TinyTransformer(TinyConfig(vocab=VOCAB, max_positions=64))
    rows = Rows.from_packed(packed_rows())
    everything = torch.arange(VOCAB).expand(*rows.tokens.shape, VOCAB)
    with_support = Rows(**{**rows.__dict__, "support": everything})
    with torch.no_grad():
        a = GRPOObjective().packed_log_probs(model, rows)
        b = GRPOObjective().packed_log_probs(model, with_support)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- the loss by hand

LOG = math.log


def hand_rows() -> tuple[Rows, torch.Tensor, torch.Tensor]:
    """One row of 4 tokens; t0 is a prompt token. Per loss token t1..t3:
    behaviour p = .5, .5, .25; proximal p = .5, .25, .5; new p = .75, .1, .5; A = 1, -1, 1.
    So w = 1, .5, 2 and r = 1.5, .4, 1."""
    rows = Rows(
        tokens=torch.tensor([[5, 6, 7, 8]]),
        positions=torch.tensor([[0, 1, 2, 3]]),
        segments=torch.tensor([[1, 1, 1, 1]]),
        loss_mask=torch.tensor([[False, True, True, True]]),
        advantages=torch.tensor([[0.0, 1.0, -1.0, 1.0]]),
        logprobs=torch.tensor([[0.0, LOG(0.5), LOG(0.5), LOG(0.25)]]),
        versions=torch.tensor([[-1, 5, 5, 4]]),
    )
    proximal = torch.tensor([[0.0, LOG(0.5), LOG(0.25), LOG(0.5)]])
    new = torch.tensor([[0.0, LOG(0.75), LOG(0.1), LOG(0.5)]], requires_grad=True)
    return rows, new, proximal


def test_loss_and_metrics_by_hand() -> None:
    rows, new, proximal = hand_rows()
    loss, m = GRPOObjective().loss(new, rows, proximal, trainer_version=5)
    # t1: min(1.5, 1.28) = 1.28 (clipped); t2: min(-.4, -.8) = -.8 (clipped); t3: 1
    assert loss.item() == pytest.approx(-(1 * 1.28 + 0.5 * -0.8 + 2 * 1.0) / 3, rel=1e-5)
    assert m["loss_tokens"] == 3 and m["clip_fraction"] == pytest.approx(2 / 3)
    assert m["importance_mean"] == pytest.approx(3.5 / 3, rel=1e-5) and m["importance_max"] == pytest.approx(
        2.0
    )
    assert m["importance_capped"] == 0.0
    # mismatch over version-5 loss tokens t1, t2: d = log(prox / behav) = 0, log .5
    d = LOG(0.5)
    assert m["mismatch_tokens"] == 2
    assert m["mismatch_kl"] == pytest.approx((math.exp(d) - 1 - d) / 2, rel=1e-5)
    assert m["mismatch_k1"] == pytest.approx(-d / 2, rel=1e-5)
    assert m["mismatch_abs"] == pytest.approx(-d / 2, rel=1e-5)
    assert m["mismatch_over"] == 0.5  # |log .5| = 0.69 > 0.1; 0 is not
    loss.backward()
    assert new.grad is not None  # only the unclipped t3 gets a gradient: -w r A / 3
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, 0.0, 0.0, -2 / 3]]))


@pytest.mark.parametrize(
    ("mode", "expected", "capped"),
    [("clamp", -(1.28 - 0.4 + 1.5) / 3, 1 / 3), ("mask", -(1.28 - 0.4) / 3, 1 / 3)],
)
def test_importance_cap_clamp_and_mask(mode: str, expected: float, capped: float) -> None:
    rows, new, proximal = hand_rows()
    loss, m = GRPOObjective(importance_cap=1.5, cap_mode=mode).loss(new, rows, proximal)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert m["importance_capped"] == pytest.approx(capped)
    assert m["importance_max"] == pytest.approx(2.0)  # reported before the cap
    assert m["mismatch_tokens"] == 0 and math.isnan(m["mismatch_kl"])


def test_symmetric_clip_and_loss_token_override() -> None:
    rows, new, proximal = hand_rows()
    loss, m = GRPOObjective(eps_low=0.2, eps_high=0.6).loss(new, rows, proximal, loss_tokens=6)
    # t1 no longer clipped (1.5 < 1.6): 1 * 1.5; t2 still clipped; divided by 6
    assert loss.item() == pytest.approx(-(1.5 - 0.4 + 2.0) / 6, rel=1e-5)
    assert m["clip_fraction"] == pytest.approx(1 / 3)


def test_no_loss_tokens_gives_zero_loss_and_a_graph() -> None:
    rows, new, proximal = hand_rows()
    empty = Rows(**{**rows.__dict__, "loss_mask": torch.zeros_like(rows.loss_mask)})
    loss, m = GRPOObjective().loss(new, empty, proximal)
    loss.backward()
    assert loss.item() == 0 and m["loss_tokens"] == 0 and math.isnan(m["clip_fraction"])


def test_loss_refuses_mismatched_shapes() -> None:
    rows, new, proximal = hand_rows()
    with pytest.raises(ValueError, match="shape"):
        GRPOObjective().loss(new[:, :3], rows, proximal)
    with pytest.raises(ValueError, match="eps_low"):
        GRPOObjective(eps_low=1.5)
    with pytest.raises(ValueError, match="cap_mode"):
        GRPOObjective(cap_mode="drop")  # type: ignore[arg-type]


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_one_step_moves_the_log_prob_with_the_advantage(sign: float) -> None:
    model = TinyTransformer(TinyConfig(vocab=VOCAB, max_positions=64, seed=3))
    rng = np.random.default_rng(0)
    batch = pack(
        [Group(0, (Rollout(0, Status.COMPLETED, (_chain(rng, 12),), reward=1.0),))], rows=1, width=16
    )
    rows = Rows.from_packed(batch)
    only = torch.zeros_like(rows.loss_mask)
    only[0, 9] = True  # one loss token, so the first-order change is its own
    rows = Rows(**{**rows.__dict__, "loss_mask": only, "advantages": only.float() * sign})
    objective = GRPOObjective()
    with torch.no_grad():
        before = objective.packed_log_probs(model, rows)
    rows = Rows(**{**rows.__dict__, "logprobs": before})  # on-policy: behaviour = proximal
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loss, _ = objective.loss(objective.packed_log_probs(model, rows), rows, before)
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after = objective.packed_log_probs(model, rows)
    assert sign * (after[0, 9] - before[0, 9]).item() > 0


def test_tiny_model_init_is_deterministic_and_leaves_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    a, b = TinyTransformer(TinyConfig(seed=7)), TinyTransformer(TinyConfig(seed=7))
    c = TinyTransformer(TinyConfig(seed=8))
    assert torch.equal(torch.random.get_rng_state(), state)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.embed.weight, c.embed.weight)
    with pytest.raises(ValueError, match="max_positions"):
        a(torch.zeros(1, 2, dtype=torch.long), position_ids=torch.tensor([[0, 600]]))


def test_tiny_model_learns_a_rewarded_token() -> None:
    """A few policy-gradient steps raise the probability of the rewarded continuation."""
    torch.manual_seed(0)
    model = TinyTransformer(TinyConfig(vocab=16, d_model=32, n_layers=1, n_heads=2, max_positions=16))
    tokens = np.array([1, 2, 3, 4], dtype=np.int32)
    good = Chain(tokens, np.array([0, 0, 1, 1], bool), np.zeros(4, np.float32), np.full(4, 0, np.int32))
    bad_tokens = np.array([1, 2, 9, 9], dtype=np.int32)
    bad = Chain(bad_tokens, np.array([0, 0, 1, 1], bool), np.zeros(4, np.float32), np.full(4, 0, np.int32))
    group = Group(
        0,
        (Rollout(0, Status.COMPLETED, (good,), reward=1.0), Rollout(1, Status.COMPLETED, (bad,), reward=0.0)),
    )
    rows = Rows.from_packed(pack([group], rows=1, width=8))
    objective = GRPOObjective()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with torch.no_grad():
        start = objective.packed_log_probs(model, rows)
    for _ in range(20):
        with torch.no_grad():
            proximal = objective.packed_log_probs(model, rows)
        step_rows = Rows(**{**rows.__dict__, "logprobs": proximal})
        loss, _ = objective.loss(objective.packed_log_probs(model, step_rows), step_rows, proximal)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        end = objective.packed_log_probs(model, rows)
    assert rows.tokens[0, :4].tolist() == [1, 2, 3, 4], "the rewarded chain is packed first"
    assert (end[0, 2:4] - start[0, 2:4]).sum() > 0.5
    assert (end[0, 6:8] - start[0, 6:8]).sum() < 0
