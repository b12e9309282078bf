"""One rank of a data-parallel trainer taking one update on its split of a fixed packed
batch, for `test_loss_ranks.py`: run with `torchrun --nproc_per_node N -m
tests.integration.loss_ranks OUT_DIR`. Rank r of N trains rows `split(N)[r]` (uneven token
counts) twice, from the same initial weights: with the global token normalisation
(`trainer.loop.update`) and with each rank's own token mean (`GRPOObjective.loss` without
`loss_tokens`, what the loop did before). Rank 0 writes `OUT_DIR/weights-N.npz` with each
result's parameters under `global/NAME` and `local/NAME`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from pipeline.config import build
from trainer.run_config import TrainerConfig
from trainer.deepspeed_engine import build_engine, whole_weights
from trainer.loop import update
from trainer.objective import GRPOObjective, Rows

ROWS, WIDTH, VOCAB = 4, 16, 32
# rank r of N trains rows SPLITS[N][r]: one rank gets a row with few loss tokens, the other many
SPLITS = {1: [(0, 4)], 2: [(0, 1), (1, 4)]}


def rows() -> Rows:
    """Four rows of one or two chains; row 0 holds 14 loss tokens, the others 2 to 5."""
    g = torch.Generator().manual_seed(0)
    segments = torch.zeros(ROWS, WIDTH, dtype=torch.long)
    loss_mask = torch.zeros(ROWS, WIDTH, dtype=torch.bool)
    chains = {0: [(0, 16, 2)], 1: [(0, 6, 3), (6, 10, 8)], 2: [(0, 8, 4)], 3: [(0, 5, 2), (5, 12, 9)]}
    positions = torch.zeros(ROWS, WIDTH, dtype=torch.long)
    for r, spans in chains.items():
        for s, (a, b, prompt) in enumerate(spans, start=1):
            segments[r, a:b] = s
            positions[r, a:b] = torch.arange(b - a)
            loss_mask[r, a + prompt:b] = True
    advantages = torch.where(loss_mask, torch.randn(ROWS, WIDTH, generator=g), torch.zeros(()))
    logprobs = torch.where(loss_mask, -3.0 - torch.rand(ROWS, WIDTH, generator=g), torch.zeros(()))
    return Rows(tokens=torch.randint(0, VOCAB, (ROWS, WIDTH), generator=g), positions=positions,
                segments=segments, loss_mask=loss_mask, advantages=advantages, logprobs=logprobs,
                versions=torch.where(loss_mask, 0, -1))


def engine() -> object:
    config = build(TrainerConfig, {
        "model": {"tiny": {"vocab": VOCAB, "d_model": 16, "n_layers": 1, "n_heads": 2,
                           "max_positions": WIDTH}},
        "optimizer": {"type": "SGD", "lr": 0.5}, "gradient_clipping": 0.0, "zero_stage": 0,
        "device": "cpu", "seed": 0})
    return build_engine(config)


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    a, b = SPLITS[world][rank]
    mine = rows().slice(a, b)
    objective = GRPOObjective()
    glob = engine()
    results = {"initial": {k: v.clone() for k, v in whole_weights(glob.module).state_dict().items()}}
    update(glob, objective, mine)
    results["global"] = whole_weights(glob.module).state_dict()
    local = engine()
    new = objective.packed_log_probs(local, mine)
    loss, _ = objective.loss(new, mine, new.detach())  # each rank's own token mean
    local.backward(loss)
    local.step()
    results["local"] = whole_weights(local.module).state_dict()
    if rank == 0:
        arrays = {f"{kind}/{name}": t.detach().float().numpy()
                  for kind, state in results.items() for name, t in state.items()}
        np.savez(out / f"weights-{world}.npz", **arrays)
    dist.barrier()  # every rank done before any tears its groups down
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
