"""The trainer's validated configuration: `RunConfig`, the file of `rollstream trainer
--config trainer.yaml` (examples/*/trainer.yaml), whose `trainer:` section is a
`TrainerConfig` (the model, the optimizer, the ZeRO stage, the backend).

    config = load(RunConfig, "trainer.yaml").trainer     # pipeline.config.load
    engine = build_engine(config)                       # trainer.deepspeed_engine

The `trainer:` section:

```yaml
model:  {kind: tiny, tiny: {vocab: 64, d_model: 64, n_layers: 2, n_heads: 4, max_positions: 64}}
optimizer: {type: AdamW, lr: 0.001, weight_decay: 0.0, betas: [0.9, 0.999]}
zero_stage: 1           # 0 (plain data parallel), 1, 2 or 3 (parameters partitioned)
gradient_clipping: 1.0
backend: auto           # gloo on CPU, nccl on GPU
device: auto            # cuda when available, else cpu
seed: 0
minibatches: 1          # PPO: optimizer steps per pass over the step's rows (slices of rows)
epochs: 1               # PPO: passes over the step's rows (the clip acts from the second step)
deepspeed: {}           # extra DeepSpeed config keys, merged over the generated ones
```

`model.kind: hf` builds a Hugging Face causal LM from `model.hf`, the arguments of
`transformers.AutoConfig.for_model` (`{model_type: gpt2, n_layer: 2, ...}`); nothing is
downloaded. Like `pipeline.config`, every model refuses unknown fields and is strict about
types, so a bad config fails at start with the field named (`ConfigError`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config import (
    MAX_MESSAGE_BYTES,
    MetricsTargets,
    RedisConfig,
    SchedulerConfig,
    _Model,
    metrics_address,
)
from domain.model_config import ModelConfig


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
    zero_stage: Literal[0, 1, 2, 3] = 1
    gradient_clipping: float = Field(1.0, ge=0, description="max global grad norm; 0: off")
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    minibatches: int = Field(1, ge=1, description="PPO minibatches per step: optimizer steps on "
                             "consecutive slices of the step's rows")
    epochs: int = Field(1, ge=1, description="PPO passes over the step's rows")
    deepspeed: dict[str, Any] = Field(
        default_factory=dict, description="extra DeepSpeed config, merged over the generated one")

    @model_validator(mode="after")
    def _backend(self) -> TrainerConfig:
        if self.backend == "nccl" and self.device == "cpu":
            raise ValueError("backend=nccl needs device=cuda (or auto on a GPU machine)")
        return self


# ---------------------------------------------------------------------------- the trainer process


class ObjectiveConfig(_Model):
    """`trainer.objective.GRPOObjective`'s arguments."""

    eps_low: float = Field(0.2, ge=0, lt=1)
    eps_high: float = Field(0.28, ge=0)
    importance_cap: float | None = Field(None, gt=0)
    cap_mode: Literal["clamp", "mask"] = "clamp"
    temperature: float = Field(1.0, gt=0, description="the engines' sampling temperature")
    micro_rows: int | None = Field(None, ge=1, description="rows per forward pass (None: all)")


class DataConfig(_Model):
    """The task stream: batches of `batch_size` consecutive task ids per batch share, with
    each task's problem from the environment the rollout consumers run (same env_args)."""

    env: str = Field("arithmetic", description="a name of domain.envs.ENVS")
    env_args: dict[str, Any] = Field(default_factory=dict)
    batch_size: int = Field(16, ge=1, description="tasks per step per batch share")
    first_task: int = Field(0, ge=0, description="id of the first task")

    @model_validator(mode="after")
    def _env(self) -> DataConfig:
        from domain.envs import ENVS

        if self.env not in ENVS:
            raise ValueError(f"env {self.env!r} is not one of {sorted(ENVS)}")
        return self


class PublisherConfig(_Model):
    """Where the weights go: Redis (chunked safetensors), a shared directory, or external
    inference engines that load each version from a shared directory (`producers.engine_publishers`:
    `vllm`, `sglang`; each push is told to the `gateways` too)."""

    kind: Literal["redis", "directory", "vllm", "sglang"] = "redis"
    path: str | None = Field(None, description="the directory (kind: directory, vllm, sglang)")
    keep: int = Field(2, ge=1, description="versions kept; older ones expire")
    engines: list[str] = Field(default_factory=list, description="engine base URLs (kind: vllm, sglang)")
    gateways: list[str] = Field(default_factory=list, description="recording gateways told each version")
    timeout_s: float = Field(300.0, gt=0, description="per engine request (kind: vllm, sglang)")
    retries: int = Field(3, ge=0, description="retries of a failed engine request (kind: vllm, sglang)")
    pause_mode: Literal["wait", "keep", "abort"] = Field(
        "wait", description="vLLM's /pause mode around a reload (kind: vllm)")

    @model_validator(mode="after")
    def _path(self) -> PublisherConfig:
        if self.kind != "redis" and not self.path:
            raise ValueError(f"publisher.kind={self.kind} needs publisher.path")
        if self.kind in ("vllm", "sglang") and not self.engines:
            raise ValueError(f"publisher.kind={self.kind} needs publisher.engines (their URLs)")
        if self.kind not in ("vllm", "sglang") and (self.engines or self.gateways):
            raise ValueError("publisher.engines and publisher.gateways need publisher.kind=vllm or sglang")
        for url in (*self.engines, *self.gateways):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"publisher: {url!r} is not an http(s) URL")
        return self


class CheckpointConfig(_Model):
    """DeepSpeed checkpoints plus the data position and the scheduler's counters."""

    dir: str | None = Field(None, description="checkpoint directory (None: no checkpoints)")
    every: int = Field(0, ge=0, description="steps between checkpoints (0: only on stop and at the end)")
    keep: int = Field(2, ge=1, description="checkpoints kept")
    resume: Literal["auto", "never", "require"] = Field(
        "auto", description="auto: resume from the latest checkpoint when there is one")


class RunConfig(_Model):
    """`rollstream trainer --config FILE`: one trainer process (one DeepSpeed rank)."""

    redis: RedisConfig = RedisConfig()
    metrics_addr: str = Field(
        "127.0.0.1:9500+rank", description="host:port of /metrics, /healthz and /readyz; +rank adds "
        "the rank to the port (rank 0: 9500, rank 1: 9501), port 0 picks a free one")
    metrics_targets: MetricsTargets = None
    trainer: TrainerConfig = TrainerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    objective: ObjectiveConfig = ObjectiveConfig()
    data: DataConfig = DataConfig()
    publisher: PublisherConfig = PublisherConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    steps: int = Field(100, ge=1, description="training steps in all (a resumed run counts from 0)")
    share: int = Field(1, ge=1, description="ranks reading one batch share (first_reader_batch)")
    step_timeout_s: float = Field(3600.0, gt=0)
    max_message_bytes: int = Field(
        MAX_MESSAGE_BYTES, ge=1024, description="largest entry the trainer writes (bigger: refused, "
        "nothing written) or reads (bigger: dead-lettered); as the admission consumers'")
    record: str | None = Field(
        None, description="JSON lines, one per step (StepRecord.row() and the trained tasks); "
        "{rank} is replaced by the rank")

    @field_validator("metrics_addr")
    @classmethod
    def _metrics_addr(cls, addr: str) -> str:
        metrics_address(addr, ("rank",))
        return addr

    @model_validator(mode="after")
    def _resume(self) -> RunConfig:
        if self.checkpoint.resume == "require" and not self.checkpoint.dir:
            raise ValueError("checkpoint.resume=require needs checkpoint.dir")
        if self.trainer.minibatches > self.scheduler.rows:
            raise ValueError(f"trainer.minibatches={self.trainer.minibatches} is more than the "
                             f"scheduler.rows={self.scheduler.rows} a step packs")
        return self
