"""`trainer.loop.update`: PPO minibatches and epochs against a proximal policy fixed before
the first optimizer step, checked against a hand-computed update; one minibatch and one
epoch reuse the gradient pass's log-probs (one forward pass) and give the two-pass update."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from trainer.loop import combine, update
from domain.model import TinyConfig, TinyTransformer
from trainer.objective import GRPOObjective, Rows

V = 6  # vocabulary


class Table(nn.Module):
    """logits of the next token = W[this token]: gradients simple enough to write by hand."""

    accepts_segment_ids = True

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.randn(V, V, generator=torch.Generator().manual_seed(seed)) * 0.3)

    def forward(self, ids, position_ids=None, segment_ids=None):
        return self.W[ids]


class PlainEngine(nn.Module):
    """What `update` needs of a DeepSpeed engine: module, device, backward, step (plain SGD)."""

    def __init__(self, module: nn.Module, lr: float) -> None:
        super().__init__()
        self.module, self.device = module, torch.device("cpu")
        self.opt = torch.optim.SGD(module.parameters(), lr=lr)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.opt.step()
        self.opt.zero_grad()


def rows(seed: int = 1, n: int = 4, width: int = 6) -> Rows:
    """n rows of one chain each: a prompt token, then loss tokens; mixed-sign advantages."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (n, width), generator=g)
    loss_mask = torch.zeros(n, width, dtype=torch.bool)
    loss_mask[:, 1:] = True
    loss_mask[1, 4:] = False  # rows of different lengths
    segments = torch.ones(n, width, dtype=torch.long)
    segments[1, 4:] = 0
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:n, None].expand(n, width).clone() * loss_mask
    behaviour = torch.where(loss_mask, -np.log(V) - 0.2 * torch.rand(n, width, generator=g), torch.zeros(()))
    return Rows(tokens=tokens, positions=torch.arange(width).expand(n, width).clone(), segments=segments,
                loss_mask=loss_mask, advantages=adv, logprobs=behaviour,
                versions=torch.where(loss_mask, 0, -1))


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def by_hand(W: np.ndarray, r: Rows, slices: list[tuple[int, int]], epochs: int, lr: float,
            eps_low: float = 0.2, eps_high: float = 0.28) -> tuple[np.ndarray, list[float]]:
    """SGD on the decoupled PPO loss written out: for a loss token t with previous token u,
    d loss / d W[u] = -(w A r / N) (onehot(t) - softmax(W[u])) unless the clip wins, where
    it is 0. Returns the weights and each update's clipped share."""
    tok, mask = r.tokens.numpy(), r.loss_mask.numpy()
    adv, behaviour = r.advantages.numpy(), r.logprobs.numpy()
    W0, W = W.astype(np.float64), W.astype(np.float64).copy()
    prox = {(i, t): log_softmax(W0[tok[i, t - 1]])[tok[i, t]] for i, t in zip(*np.nonzero(mask))}
    clipped_share = []
    for _ in range(epochs):
        for a, b in slices:
            grad, n, clipped = np.zeros_like(W), int(mask[a:b].sum()), 0
            for i, t in zip(*np.nonzero(mask[a:b])):
                i += a
                u, v, A = tok[i, t - 1], tok[i, t], adv[i, t]
                logp = log_softmax(W[u])
                ratio = np.exp(logp[v] - prox[i, t])
                if (A > 0 and ratio > 1 + eps_high) or (A < 0 and ratio < 1 - eps_low):
                    clipped += 1
                    continue
                w = np.exp(prox[i, t] - behaviour[i, t])
                grad[u] -= (w * A * ratio / n) * (np.eye(V)[v] - np.exp(logp))
            W -= lr * grad
            clipped_share.append(clipped / n)
    return W, clipped_share


def test_two_minibatches_take_the_hand_computed_update():
    model = Table()
    W0 = model.W.detach().numpy().copy()
    r = rows()
    _, metrics = update(PlainEngine(model, lr=8.0), GRPOObjective(), r, minibatches=2)
    expected, clipped = by_hand(W0, r, [(0, 2), (2, 4)], epochs=1, lr=8.0)
    np.testing.assert_allclose(model.W.detach().numpy(), expected, atol=1e-4)
    assert metrics["updates"] == 2 and metrics["loss_tokens"] == float(r.loss_mask.sum())
    # the first minibatch's step moved the second's ratio out of the clip range: only a
    # proximal policy fixed before the first step shows it (unclipped, w r = p_new / p_behav
    # whatever the proximal policy)
    assert clipped == [0.0, pytest.approx(0.3)] and metrics["clip_fraction_last"] == pytest.approx(0.3)
    # not one update on all rows
    one, _ = by_hand(W0, r, [(0, 4)], epochs=1, lr=8.0)
    assert np.abs(expected - one).max() > 1e-3


def test_the_clip_acts_from_the_second_update_on():
    model = Table()
    W0 = model.W.detach().numpy().copy()
    r = rows()
    _, metrics = update(PlainEngine(model, lr=8.0), GRPOObjective(), r, epochs=3)
    expected, clipped = by_hand(W0, r, [(0, 4)], epochs=3, lr=8.0)
    np.testing.assert_allclose(model.W.detach().numpy(), expected, atol=1e-4)
    assert clipped[0] == 0 and clipped[-1] > 0  # the ratio is 1 at the first update
    assert metrics["clip_fraction_first"] == 0 and metrics["clip_fraction_last"] == pytest.approx(clipped[-1])
    assert metrics["updates"] == 3


def test_one_minibatch_one_epoch_is_one_forward_pass_and_the_two_pass_update():
    config = TinyConfig(vocab=V, d_model=16, n_layers=1, n_heads=2, max_positions=8)
    fast, slow = TinyTransformer(config), TinyTransformer(config)
    slow.load_state_dict(fast.state_dict())
    r, objective = rows(), GRPOObjective()
    calls = []
    fast.register_forward_hook(lambda *_: calls.append(1))
    update(PlainEngine(fast, lr=0.1), objective, r)
    assert len(calls) == 1
    engine = PlainEngine(slow, lr=0.1)  # the rescoring pass, then the gradient pass
    with torch.no_grad():
        proximal = objective.packed_log_probs(slow, r)
    loss, _ = objective.loss(objective.packed_log_probs(engine, r), r, proximal)
    engine.backward(loss)
    engine.step()
    for (name, a), b in zip(fast.state_dict().items(), slow.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=name)
    assert any(not torch.equal(a, b) for a, b in zip(fast.state_dict().values(),
                                                      TinyTransformer(config).state_dict().values()))


def test_bad_minibatches_and_epochs_are_refused():
    engine = PlainEngine(Table(), lr=0.1)
    with pytest.raises(ValueError, match="5 minibatches"):
        update(engine, GRPOObjective(), rows(), minibatches=5)
    with pytest.raises(ValueError, match="epochs"):
        update(engine, GRPOObjective(), rows(), epochs=0)


def test_combine_counts_each_row_once_and_weights_by_tokens():
    a = {"loss_tokens": 2.0, "clip_fraction": 0.0, "importance_max": 1.5, "mismatch_tokens": 0.0,
         "mismatch_abs": float("nan"), "loss": 1.0}
    b = {"loss_tokens": 6.0, "clip_fraction": 0.5, "importance_max": 2.0, "mismatch_tokens": 4.0,
         "mismatch_abs": 0.1, "loss": 3.0}
    out = combine([a, b, a, b], minibatches=2)
    assert out["loss_tokens"] == 8 and out["mismatch_tokens"] == 4 and out["importance_max"] == 2.0
    assert out["clip_fraction"] == pytest.approx(0.375) and out["loss"] == pytest.approx(2.5)
    assert out["mismatch_abs"] == pytest.approx(0.1) and out["updates"] == 4
    assert out["clip_fraction_first"] == 0.0 and out["clip_fraction_last"] == 0.5


def test_the_run_config_refuses_more_minibatches_than_rows():
    from pipeline.config import ConfigError, build
    from trainer.run_config import RunConfig

    assert build(RunConfig, {"trainer": {"minibatches": 2, "epochs": 3}}).trainer.epochs == 3
    with pytest.raises(ConfigError, match="minibatches"):
        build(RunConfig, {"trainer": {"minibatches": 9}, "scheduler": {"rows": 8}})
    with pytest.raises(ConfigError, match="epochs"):
        build(RunConfig, {"trainer": {"epochs": 0}})
