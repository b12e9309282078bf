"""A built-in tiny causal transformer that runs packed rows natively.

`TinyTransformer(TinyConfig(...))` is a pre-norm decoder (learned absolute positions,
multi-head attention, GELU MLP, tied input/output embeddings). Its forward takes
`input_ids`, `position_ids` and `segment_ids` (all `[B, T]`) and attends block-diagonally:
token t attends to token s only when s <= t and both carry the same nonzero segment id, so
the chains packed in one row never see each other and each chain's positions restart at 0.
A padding token (segment 0) attends to itself only, which keeps its softmax finite.

Initialisation is deterministic from `TinyConfig.seed` (a private generator; the global
torch RNG is untouched), so two processes building the same config hold the same weights.
The defaults train on two CPU cores in minutes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TinyConfig:
    """Shape of a `TinyTransformer`; `d_ff` defaults to 4 * d_model."""

    vocab: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_positions: int = 512
    d_ff: int | None = None
    seed: int = 0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        for name in ("vocab", "d_model", "n_layers", "n_heads", "max_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"TinyConfig.{name} must be >= 1, got {getattr(self, name)}")


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """`[B, 1, T, T]` bool: query t may attend key s (s <= t, same nonzero segment, or s == t)."""
    t = segment_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    real = (segment_ids != 0)[:, :, None]
    diag = torch.eye(t, dtype=torch.bool, device=segment_ids.device)
    return ((same & real & causal) | diag)[:, None]


class _Block(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        d_ff = cfg.d_ff or 4 * cfg.d_model
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.up = nn.Linear(cfg.d_model, d_ff)
        self.down = nn.Linear(d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


def vocab_size(model: nn.Module) -> int:
    """The number of token ids `model` embeds (a TinyTransformer or a Hugging Face model)."""
    config = getattr(model, "config", None)
    return int(getattr(config, "vocab", None) or config.vocab_size)


def context_size(model: nn.Module) -> int | None:
    """The positions `model` embeds (`max_positions`, `max_position_embeddings`), if it says."""
    config = getattr(model, "config", None)
    return getattr(config, "max_positions", None) or getattr(config, "max_position_embeddings", None)


class TinyTransformer(nn.Module):
    """Pre-norm causal transformer with block-diagonal (per segment) attention."""

    def __init__(self, config: TinyConfig | None = None) -> None:
        super().__init__()
        self.config = config or TinyConfig()
        cfg = self.config
        with torch.random.fork_rng(devices=[]):  # torch's default init draws from the global RNG
            self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
            self.pos = nn.Embedding(cfg.max_positions, cfg.d_model)
            self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
            self.ln_f = nn.LayerNorm(cfg.d_model)
        self._init_weights()

    def _init_weights(self) -> None:
        """Normal(0, init_std) matrices (output projections scaled by 1/sqrt(2 n_layers)),
        zero biases, unit norms; drawn from a generator seeded by `config.seed`."""
        gen = torch.Generator().manual_seed(self.config.seed)
        scaled = math.sqrt(2 * self.config.n_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.startswith("ln") or ".ln" in name:
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    std = self.config.init_std / (
                        scaled if name.endswith(("proj.weight", "down.weight")) else 1
                    )
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits `[B, T, vocab]`. Without segment_ids the whole row is one sequence; without
        position_ids positions count from 0 along the row."""
        b, t = input_ids.shape
        if segment_ids is None:
            segment_ids = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
        if t and int(position_ids.max()) >= self.config.max_positions:
            raise ValueError(
                f"position {int(position_ids.max())} is beyond max_positions={self.config.max_positions}"
            )
        x = self.embed(input_ids) + self.pos(position_ids)
        mask = block_causal_mask(segment_ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.ln_f(x) @ self.embed.weight.T
