"""GRPOObjective: proximal rescoring of packed rows and the decoupled PPO loss.

Rescoring (`packed_log_probs`) runs the packed `[rows, width]` batch through the model with
no attention across chains and returns, per token, log p(token | the previous tokens of
its chain): 0 at chain starts and on padding. Three ways to run a model:

- ``segments``: models that take `segment_ids` (the built-in `TinyTransformer`, or any
  module with `accepts_segment_ids = True`) get input_ids, position_ids and segment_ids.
- ``mask4d``: Hugging Face causal LMs whose attention implementation is ``eager`` or
  ``sdpa`` (Llama, GPT-2, Qwen, Mistral, ...) get position_ids and a 4-D additive attention
  mask `[B, 1, T, T]` (0 where query t may attend key s: s <= t in the same chain; the
  dtype's minimum elsewhere). transformers passes a 4-D mask through as given
  (`masking_utils._preprocess_mask_arguments` returns early on `ndim == 4`), and an
  additive float mask is what both its eager and sdpa kernels (and the 4.4x releases, which
  demand the "inverted" form) accept. Padding attends to itself so no softmax row is empty.
- ``per_chain``: anything else (flash or flex attention, unknown models): each chain is
  run alone, with positions 0..n-1. Slow, but exact.

`GRPOObjective(attention="auto")` picks the first that applies; name one to force it.

With filtered sampling (`rows.support` present), each token's log-prob is renormalised over
its sampling support: log p = z_tok - logsumexp(z over support ∪ {tok}), z = logits /
temperature; a support row with no entries (all -1) means the full vocabulary.

The loss (`loss`) is decoupled PPO (AReaL, arXiv:2505.24298) with clip-higher (DAPO):

    r_t   = exp(logp_new - logp_prox)                      (the policy ratio)
    w_t   = exp(logp_prox - logp_behav)                    (behavior_importance, detached)
    s_t   = min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)
    loss  = - sum_{t in L} w_t s_t / |L|                   (token mean over loss tokens L)

With `importance_cap`, `cap_mode="clamp"` uses min(w_t, cap); `cap_mode="mask"` drops the
tokens with w_t > cap from the sum (they still count in |L|). `loss_tokens` overrides |L|:
`trainer.loop.global_tokens` gives the count over every data-parallel rank over the world
size, so that the ranks' averaged gradients are those of the step's global token mean.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from domain.model import TinyTransformer, block_causal_mask

if TYPE_CHECKING:
    from pipeline.packing import PackedBatch

Attention = Literal["auto", "segments", "mask4d", "per_chain"]
_HF_MASK4D = ("eager", "sdpa")


@dataclass(frozen=True)
class Rows:
    """A packed batch as torch tensors (`[rows, width]`, support `[rows, width, k]`)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    segments: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    logprobs: torch.Tensor
    versions: torch.Tensor
    support: torch.Tensor | None = None

    @classmethod
    def from_packed(cls, packed: PackedBatch, device: torch.device | str = "cpu") -> Rows:
        """Tensors of a `PackedBatch`: ids as int64, log-probs and advantages as float32."""

        def t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

        return cls(
            tokens=t(packed.tokens, torch.long),
            positions=t(packed.positions, torch.long),
            segments=t(packed.segments, torch.long),
            loss_mask=t(packed.loss_mask, torch.bool),
            advantages=t(packed.advantages, torch.float32),
            logprobs=t(packed.logprobs, torch.float32),
            versions=t(packed.versions, torch.long),
            support=None if packed.support is None else t(packed.support, torch.long),
        )

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], device: torch.device | str = "cpu") -> Rows:
        """Tensors of a packed step received as named arrays (a `wire.Ready`)."""
        parts = {"support": None, **{f.name: arrays[f.name] for f in fields(cls) if f.name in arrays}}
        return cls.from_packed(SimpleNamespace(**parts), device)  # type: ignore[arg-type]

    def slice(self, start: int, stop: int) -> Rows:
        """Rows start..stop-1."""
        parts: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            parts[f.name] = None if value is None else value[start:stop]
        return Rows(**parts)


def _as_rows(rows: Rows | PackedBatch, device: torch.device | str) -> Rows:
    return rows if isinstance(rows, Rows) else Rows.from_packed(rows, device)


def attention_kind(model: nn.Module) -> Attention:
    """How `packed_log_probs` runs `model` under ``attention="auto"`` (module docstring)."""
    inner = getattr(model, "module", model)  # DeepSpeed engines and DDP wrap the model
    if isinstance(inner, TinyTransformer) or getattr(inner, "accepts_segment_ids", False):
        return "segments"
    if getattr(getattr(inner, "config", None), "_attn_implementation", None) in _HF_MASK4D:
        return "mask4d"
    return "per_chain"


def additive_mask(segments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[B, 1, T, T]` float mask: 0 where allowed (block-diagonal causal), dtype min elsewhere."""
    allowed = block_causal_mask(segments)
    return torch.zeros(allowed.shape, dtype=dtype, device=segments.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )


def _param_dtype(model: nn.Module) -> torch.dtype:
    p = next(model.parameters(), None)
    return torch.float32 if p is None else p.dtype


def _logits(
    model: nn.Module, kind: str, ids: torch.Tensor, pos: torch.Tensor, seg: torch.Tensor
) -> torch.Tensor:
    """Logits `[B, T, V]` of one forward pass: with segment_ids (``segments``), a 4-D mask
    (``mask4d``) or as one plain causal sequence per row (anything else)."""
    if kind == "segments":
        return model(ids, position_ids=pos, segment_ids=seg)
    if kind == "mask4d":
        mask = additive_mask(seg, _param_dtype(getattr(model, "module", model)))
        return model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False).logits
    out = model(input_ids=ids, position_ids=pos, use_cache=False)
    return out.logits if hasattr(out, "logits") else out


def next_token_log_probs(
    logits: torch.Tensor, tokens: torch.Tensor, support: torch.Tensor | None = None, temperature: float = 1.0
) -> torch.Tensor:
    """`[B, T]`: at t >= 1, log p(tokens[t]) under logits[t - 1] (renormalised over
    `support[t]` where it has entries); 0 at t = 0. Callers mask chain starts and padding."""
    z = logits[:, :-1].float() / temperature
    target = tokens[:, 1:]
    tok = z.gather(-1, target[..., None]).squeeze(-1)
    lse = torch.logsumexp(z, dim=-1)
    if support is not None:
        sup = support[:, 1:]
        has = sup >= 0
        sup_z = z.gather(-1, sup.clamp(min=0)).masked_fill(~has, float("-inf"))
        present = (sup == target[..., None]).any(-1)
        extra = tok.masked_fill(present, float("-inf"))[..., None]
        lse = torch.where(has.any(-1), torch.logsumexp(torch.cat([sup_z, extra], -1), -1), lse)
    return F.pad(tok - lse, (1, 0))


def continues_chain(segments: torch.Tensor) -> torch.Tensor:
    """`[B, T]` bool: token t has a predecessor in its chain (same nonzero segment at t - 1)."""
    prev = F.pad(segments[:, :-1], (1, 0))
    return (segments == prev) & (segments != 0)


@dataclass(frozen=True)
class GRPOObjective:
    """Decoupled PPO over packed rows (module docstring).

    `eps_low`/`eps_high`: clip range of the policy ratio (clip-higher by default);
    `importance_cap`: cap on behavior_importance (None: no cap); `cap_mode`: ``clamp`` the
    weight to the cap or ``mask`` tokens above it; `temperature`: the sampling temperature
    the engines used (logits are divided by it); `attention`: how rescoring runs the model;
    `micro_rows`: rows per forward pass (None: all at once).
    """

    eps_low: float = 0.2
    eps_high: float = 0.28
    importance_cap: float | None = None
    cap_mode: Literal["clamp", "mask"] = "clamp"
    temperature: float = 1.0
    attention: Attention = "auto"
    micro_rows: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.eps_low < 1 or self.eps_high < 0:
            raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {self.eps_low}, {self.eps_high}")
        if self.importance_cap is not None and self.importance_cap <= 0:
            raise ValueError(f"importance_cap must be > 0 or None, got {self.importance_cap}")
        if self.cap_mode not in ("clamp", "mask"):
            raise ValueError(f"cap_mode must be 'clamp' or 'mask', got {self.cap_mode!r}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.attention not in ("auto", "segments", "mask4d", "per_chain"):
            raise ValueError(f"unknown attention {self.attention!r}")
        if self.micro_rows is not None and self.micro_rows < 1:
            raise ValueError(f"micro_rows must be >= 1 or None, got {self.micro_rows}")

    def packed_log_probs(self, model: nn.Module, rows: Rows | PackedBatch) -> torch.Tensor:
        """`[rows, width]` log-prob of each token given its chain's previous tokens under
        `model` (0 at chain starts and padding); differentiable."""
        device = next(model.parameters()).device
        rows = _as_rows(rows, device)
        kind = attention_kind(model) if self.attention == "auto" else self.attention
        run: Callable[[nn.Module, Rows], torch.Tensor]
        run = self._per_chain if kind == "per_chain" else lambda m, r: self._packed(m, r, kind)
        n = rows.tokens.shape[0]
        step = self.micro_rows or max(n, 1)
        parts = [run(model, rows.slice(i, i + step)) for i in range(0, n, step)]
        return torch.cat(parts) if parts else torch.zeros_like(rows.logprobs)

    def _packed(self, model: nn.Module, rows: Rows, kind: Attention) -> torch.Tensor:
        logits = _logits(model, kind, rows.tokens, rows.positions, rows.segments)
        logp = next_token_log_probs(logits, rows.tokens, rows.support, self.temperature)
        return torch.where(continues_chain(rows.segments), logp, torch.zeros_like(logp))

    def _per_chain(self, model: nn.Module, rows: Rows) -> torch.Tensor:
        """Run each chain alone (positions 0..n-1) and scatter its log-probs into the rows."""
        seg = rows.segments.cpu().numpy()
        width = seg.shape[1]
        kind = "segments" if attention_kind(model) == "segments" else "plain"
        index, values = [], []
        for r in range(seg.shape[0]):
            bounds = np.flatnonzero(np.diff(seg[r], prepend=0, append=0))
            for a, b in zip(bounds[:-1], bounds[1:], strict=True):
                if seg[r, a] == 0:
                    continue
                ids = rows.tokens[r : r + 1, a:b]
                pos = torch.arange(b - a, device=ids.device)[None]
                logits = _logits(model, kind, ids, pos, torch.ones_like(ids))
                sup = None if rows.support is None else rows.support[r : r + 1, a:b]
                values.append(next_token_log_probs(logits, ids, sup, self.temperature)[0])
                index.append(torch.arange(r * width + a, r * width + b, device=ids.device))
        flat = torch.zeros(rows.tokens.numel(), device=rows.tokens.device)
        if values:
            flat = flat.index_put((torch.cat(index),), torch.cat(values))
        return flat.view_as(rows.logprobs)

    def loss(
        self,
        new_logp: torch.Tensor,
        rows: Rows | PackedBatch,
        proximal_logp: torch.Tensor,
        *,
        trainer_version: int | None = None,
        loss_tokens: float | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The decoupled PPO loss and its metrics (see `loss_metrics`)."""
        rows = _as_rows(rows, new_logp.device)
        if new_logp.shape != rows.tokens.shape or proximal_logp.shape != rows.tokens.shape:
            raise ValueError(
                f"log-probs of shape {tuple(new_logp.shape)} / {tuple(proximal_logp.shape)} "
                f"for rows of shape {tuple(rows.tokens.shape)}"
            )
        mask = rows.loss_mask
        prox = proximal_logp.detach().float()
        ratio = torch.exp(torch.where(mask, new_logp.float() - prox, torch.zeros_like(prox)))
        clipped = ratio.clamp(1 - self.eps_low, 1 + self.eps_high)
        adv = rows.advantages.float()
        surrogate = torch.minimum(ratio * adv, clipped * adv)
        weight = torch.exp(torch.where(mask, prox - rows.logprobs, torch.zeros_like(prox)))
        keep = mask
        if self.importance_cap is not None and self.cap_mode == "clamp":
            weight = weight.clamp(max=self.importance_cap)
        elif self.importance_cap is not None:
            keep = mask & (weight <= self.importance_cap)
        count = float(mask.sum()) if loss_tokens is None else loss_tokens
        total = torch.where(keep, weight * surrogate, torch.zeros_like(surrogate)).sum()
        loss = -total / (count if count > 0 else 1.0)
        metrics = self.loss_metrics(ratio, rows, prox, trainer_version)
        metrics["loss"] = float(loss.detach())
        return loss, metrics

    def loss_metrics(
        self, ratio: torch.Tensor, rows: Rows, proximal_logp: torch.Tensor, trainer_version: int | None
    ) -> dict[str, float]:
        """Metrics over the loss tokens L (NaN where a mean has no tokens):

        - ``loss_tokens``: |L|;
        - ``clip_fraction``: share of L where the clipped term wins (A > 0 and
          r > 1 + eps_high, or A < 0 and r < 1 - eps_low), i.e. the gradient is cut;
        - ``importance_mean``/``importance_max``: behavior_importance before any cap;
          ``importance_capped``: share of L above `importance_cap`;
        - the training-inference mismatch over the tokens the trainer's own version served
          (``mismatch_*``: see `mismatch`).
        """
        with torch.no_grad():
            mask = rows.loss_mask
            n = int(mask.sum())
            adv = rows.advantages
            clipped = ((adv > 0) & (ratio > 1 + self.eps_high)) | ((adv < 0) & (ratio < 1 - self.eps_low))
            log_w = (proximal_logp - rows.logprobs)[mask]
            weight = torch.exp(log_w)
            cap = self.importance_cap
            return {
                "loss_tokens": float(n),
                "clip_fraction": float((clipped & mask).sum()) / n if n else float("nan"),
                "importance_mean": float(weight.mean()) if n else float("nan"),
                "importance_max": float(weight.max()) if n else float("nan"),
                "importance_capped": float((weight > cap).float().mean()) if n and cap is not None else 0.0,
                **mismatch(proximal_logp, rows, trainer_version),
            }


MISMATCH_THRESHOLD = 0.1
"""|logp_prox - logp_behav| (nats) beyond which a token counts in ``mismatch_over``."""


def mismatch(proximal_logp: torch.Tensor, rows: Rows, trainer_version: int | None,
             threshold: float = MISMATCH_THRESHOLD) -> dict[str, float]:
    """Training-inference mismatch: how far the engines' behaviour log-probs b_t are from
    the trainer's proximal log-probs p_t on the loss tokens served by `trainer_version`
    (the weights the trainer holds, so p_t and b_t come from the same weights; tokens of
    other versions differ by staleness, not by engine). With d = p_t - b_t there:

    - ``mismatch_abs``: mean |d|; ``mismatch_over``: share of those tokens with |d| >
      `threshold`;
    - ``mismatch_kl``: the k3 estimate of KL(behaviour || proximal), mean of exp(d) - 1 - d;
      ``mismatch_k1``: mean of -d;
    - ``mismatch_tokens``: how many tokens that is (0 when `trainer_version` is None; the
      means are then NaN).

    A wrong temperature, a stale KV cache after a reload, a log-prob mode that ignores the
    temperature, or a lower-precision engine shows here first."""
    with torch.no_grad():
        same = torch.zeros_like(rows.loss_mask)
        if trainer_version is not None:
            same = rows.loss_mask & (rows.versions == trainer_version)
        d = (proximal_logp.float() - rows.logprobs.float())[same]
        if not d.numel():
            return {"mismatch_abs": float("nan"), "mismatch_over": float("nan"), "mismatch_kl": float("nan"),
                    "mismatch_k1": float("nan"), "mismatch_tokens": 0.0}
        return {"mismatch_abs": float(d.abs().mean()), "mismatch_over": float((d.abs() > threshold).float().mean()),
                "mismatch_kl": float((torch.exp(d) - 1 - d).mean()), "mismatch_k1": float((-d).mean()),
                "mismatch_tokens": float(d.numel())}
