"""One rank of a two-rank trainer pool with one batch share (`share = 2`), for
`test_pool.py`: run with `torchrun --nproc_per_node 2 -m tests.integration.pool_ranks
REDIS_CONFIG_JSON OUT_DIR STEPS`. Each rank writes `OUT_DIR/rank{R}.json`: the records its
scheduler logged and what its rows held."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.config import RedisConfig, build
from trainer.pool import Pool
from trainer.rollout_scheduler import RolloutScheduler


class NoPublisher:
    def load(self, variables, version):
        return None


def main() -> None:
    config, out, steps = build(RedisConfig, json.loads(sys.argv[1])), Path(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    pool = Pool(share=2, timeout_s=120)
    logged: list[dict] = []
    rows: list[int] = []
    model = torch.nn.Linear(2, 2)
    data = [{"task_id": list(range(2 * i, 2 * i + 2))} for i in range(steps)]
    with RolloutScheduler(None, None, NoPublisher(), width=64, rows=2, groups=2, ahead=0,
                          max_lag=0, redis=config, shard=pool.shard, pool=pool,
                          step_timeout_s=60, log=lambda rec: logged.append(rec.fields())) as sched:
        for batch in sched.tasks(data):
            rows.append(int(sched(batch, model).loss_mask.sum()))
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps({"logged": logged, "rows": rows}, default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
