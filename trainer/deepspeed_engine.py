"""A DeepSpeed engine for one trainer rank, from a `TrainerConfig`.

    engine = build_engine(config)       # deepspeed.DeepSpeedEngine; engine.module is the model
    loss = ...; engine.backward(loss); engine.step()

`build_engine` picks the device (cuda when available under ``device: auto``) and the
distributed backend (nccl on GPU, gloo on CPU), and, when torch.distributed is not yet
initialised, initialises it itself: from the launcher's environment (`RANK`, `WORLD_SIZE`,
`MASTER_ADDR`, `MASTER_PORT`, as `deepspeed`/`torchrun` set them) or, with none, as a
single rank (world size 1, an in-process store: no port), so DeepSpeed never falls back to MPI
discovery. On a machine without CUDA it sets ``DS_ACCELERATOR=cpu`` before DeepSpeed is
imported (DeepSpeed compiles a small shared-memory op with g++ on first use, ~40 s, then
cached under ~/.cache/torch_extensions).

The DeepSpeed config is generated: one micro-batch per step (the trainer hands it the whole
packed `[rows, width]` batch; the loss is a token mean), the optimizer (torch
implementations), ZeRO stage 0/1/2/3, gradient clipping; `config.deepspeed` is merged over it
(nested dicts merged key by key).

Under ZeRO-3 each rank holds only its partition of every parameter; forward passes gather
them through DeepSpeed's module hooks, but a weight push needs them whole: `whole_weights`
gathers them one at a time, every rank taking part, into CPU copies on the publishing rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.run_config import TrainerConfig

log = logging.getLogger(__name__)


def device_of(config: TrainerConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def backend_of(config: TrainerConfig) -> str:
    if config.backend != "auto":
        return config.backend
    return "nccl" if device_of(config).type == "cuda" else "gloo"


def init_distributed(backend: str) -> None:
    """Initialise torch.distributed once: from the launcher's environment, or one rank."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        # one rank: an in-process store, no port (a free port picked, then bound, can be
        # taken in between by another process binding port 0)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "0")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
        dist.init_process_group(backend, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    log.info("torch.distributed: %s, rank %d of %d", backend, dist.get_rank(), dist.get_world_size())


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), dict) else value
    return out


def deepspeed_config(config: TrainerConfig) -> dict[str, Any]:
    """The DeepSpeed config dict `build_engine` passes (module docstring)."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world,
        "optimizer": config.optimizer.deepspeed(),
        "zero_optimization": {"stage": config.zero_stage},
        "gradient_clipping": config.gradient_clipping,
        "steps_per_print": 10**9,  # the trainer logs its own steps
        "wall_clock_breakdown": False,
    }
    return _merge(ds, config.deepspeed)


def build_model(config: TrainerConfig) -> nn.Module:
    """The model `config.model` describes, with the initial weights the rollout side's
    `PolicySource(model_config=config.model.build())` builds too (version 0 matches)."""
    from consumers.sources.policy import build_model as build

    return build(config.model.build()).train()


def build_engine(config: TrainerConfig, model: nn.Module | None = None) -> Any:
    """A `deepspeed.DeepSpeedEngine` training `model` (default: `build_model(config)`)."""
    device = device_of(config)
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    backend = backend_of(config)
    init_distributed(backend)
    import deepspeed  # after DS_ACCELERATOR is set

    # DeepSpeed's ZeRO-3 calls torch.distributed collectives that torch has renamed; the
    # warning would repeat on every step, through the progress output
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated",
                            category=FutureWarning)

    torch.manual_seed(config.seed)
    model = build_model(config) if model is None else model
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=deepspeed_config(config), dist_init_required=False)
    log.info("DeepSpeed engine: ZeRO stage %d, %s, %s on %s", config.zero_stage,
             config.optimizer.type, backend, engine.device)
    return engine


def whole_weights(variables: Any, *, keep: bool = True) -> Any:
    """What a weight push publishes. Without partitioned parameters (ZeRO 0/1/2, a state
    dict) that is `variables` itself. Under ZeRO-3 it is a state dict of CPU copies, every
    key of `module.state_dict()` (tied weights under each of their names), gathered one
    parameter at a time, so no device ever holds more than one whole parameter beyond its
    partition. Every rank must call it (each gather is a collective); only where `keep` is
    true (the publishing rank) are the copies made, elsewhere it returns None."""
    module = getattr(variables, "module", variables)
    if not isinstance(module, nn.Module) or not any(hasattr(p, "ds_id") for p in module.parameters()):
        return variables
    import deepspeed

    copies: dict[int, torch.Tensor | None] = {}  # by identity: a tied weight is gathered once
    names: dict[str, int] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        names[name] = id(tensor)
        if id(tensor) in copies:
            continue
        gathered = (deepspeed.zero.GatheredParameters([tensor], modifier_rank=None)
                    if hasattr(tensor, "ds_id") else contextlib.nullcontext())  # buffers are whole
        with gathered:
            copies[id(tensor)] = tensor.detach().to("cpu", copy=True) if keep else None
    return {name: copies[i] for name, i in names.items()} if keep else None
