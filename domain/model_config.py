"""The model's validated configuration, read by the trainer (`RunConfig.trainer.model`) and by
`rollstream engine --model FILE`, so both build the same model: the built-in tiny
transformer (`TinyModelConfig`) or a Hugging Face causal LM (`ModelConfig.kind: hf`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from domain.model import TinyConfig
from pipeline.config import _Model


class TinyModelConfig(_Model):
    """The fields of `domain.model.TinyConfig`."""

    vocab: int = Field(64, ge=1)
    d_model: int = Field(64, ge=1)
    n_layers: int = Field(2, ge=1)
    n_heads: int = Field(4, ge=1)
    max_positions: int = Field(64, ge=1)
    d_ff: int | None = Field(None, ge=1)
    seed: int = 0
    init_std: float = Field(0.02, gt=0)

    @model_validator(mode="after")
    def _heads(self) -> TinyModelConfig:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        return self

    def build(self) -> TinyConfig:
        return TinyConfig(**self.model_dump())


class ModelConfig(_Model):
    """Which model the trainer trains: the built-in tiny transformer or an HF causal LM."""

    kind: Literal["tiny", "hf"] = "tiny"
    tiny: TinyModelConfig = TinyModelConfig()
    hf: dict[str, Any] | None = Field(
        None, description="transformers.AutoConfig.for_model(**hf), e.g. {model_type: gpt2, n_layer: 2}")
    path: str | None = Field(
        None, description="a local Hugging Face model directory (config and weights; nothing is downloaded)")

    @model_validator(mode="after")
    def _hf(self) -> ModelConfig:
        if self.kind == "hf" and not (self.path or (self.hf and "model_type" in self.hf)):
            raise ValueError("model.kind=hf needs model.path, or model.hf with a model_type")
        if self.path and self.hf:
            raise ValueError("model.path and model.hf exclude each other")
        if self.path and self.kind != "hf":
            raise ValueError("model.path needs model.kind=hf")
        return self

    def build(self) -> Any:
        """A `TinyConfig`, a `transformers.PretrainedConfig`, or the local model directory
        (what `PolicySource`'s `model_config` and `consumers.sources.policy.build_model` take)."""
        if self.kind == "tiny":
            return self.tiny.build()
        if self.path:
            return self.path
        from transformers import AutoConfig

        hf = dict(self.hf or {})
        hf.setdefault("attn_implementation", "sdpa")  # packed rows run with a 4-D mask
        return AutoConfig.for_model(**hf)
