"""`TrainerConfig`: the trainer process's validated configuration (YAML or JSON).

    config = load(TrainerConfig, "trainer.yaml")        # pipeline.config.load
    engine = build_engine(config)                       # trainer.engine

```yaml
model:  {kind: tiny, tiny: {vocab: 64, d_model: 64, n_layers: 2, n_heads: 4, max_positions: 64}}
optimizer: {type: AdamW, lr: 0.001, weight_decay: 0.0, betas: [0.9, 0.999]}
zero_stage: 1           # 0 (plain data parallel), 1 or 2
gradient_clipping: 1.0
backend: auto           # gloo on CPU, nccl on GPU
device: auto            # cuda when available, else cpu
seed: 0
deepspeed: {}           # extra DeepSpeed config keys, merged over the generated ones
```

`model.kind: hf` builds a Hugging Face causal LM from `model.hf`, the arguments of
`transformers.AutoConfig.for_model` (`{model_type: gpt2, n_layer: 2, ...}`); nothing is
downloaded. Like `pipeline.config`, every model refuses unknown fields and is strict about
types, so a bad config fails at start with the field named (`ConfigError`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from pipeline.config import _Model
from trainer.model import TinyConfig


class TinyModelConfig(_Model):
    """The fields of `trainer.model.TinyConfig`."""

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

    @model_validator(mode="after")
    def _hf(self) -> ModelConfig:
        if self.kind == "hf" and not (self.hf and "model_type" in self.hf):
            raise ValueError("model.kind=hf needs model.hf with a model_type")
        return self

    def build(self) -> Any:
        """A `TinyConfig`, or a `transformers.PretrainedConfig` (what `PolicySource`'s
        `model_config` and `consumers.sources.policy.build_model` take)."""
        if self.kind == "tiny":
            return self.tiny.build()
        from transformers import AutoConfig

        hf = dict(self.hf or {})
        hf.setdefault("attn_implementation", "sdpa")  # packed rows run with a 4-D mask
        return AutoConfig.for_model(**hf)


class OptimizerConfig(_Model):
    """The DeepSpeed optimizer block (torch implementations: nothing is compiled)."""

    type: Literal["AdamW", "Adam", "SGD"] = "AdamW"
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.999], min_length=2, max_length=2)
    momentum: float = Field(0.0, ge=0, description="SGD only")

    def deepspeed(self) -> dict[str, Any]:
        if self.type == "SGD":
            params: dict[str, Any] = {"lr": self.lr, "weight_decay": self.weight_decay,
                                      "momentum": self.momentum}
        else:
            params = {"lr": self.lr, "weight_decay": self.weight_decay, "betas": list(self.betas),
                      "torch_adam": True}
        return {"type": self.type, "params": params}


class TrainerConfig(_Model):
    """One trainer rank: model, optimizer, ZeRO stage, distributed backend."""

    model: ModelConfig = ModelConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    zero_stage: Literal[0, 1, 2] = 1
    gradient_clipping: float = Field(1.0, ge=0, description="max global grad norm; 0: off")
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    deepspeed: dict[str, Any] = Field(
        default_factory=dict, description="extra DeepSpeed config, merged over the generated one")

    @model_validator(mode="after")
    def _backend(self) -> TrainerConfig:
        if self.backend == "nccl" and self.device == "cpu":
            raise ValueError("backend=nccl needs device=cuda (or auto on a GPU machine)")
        return self
