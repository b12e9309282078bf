"""Weights flow back to the rollout side: the trainer's facade pushes the model through a
RedisPublisher each step, the in-process consumer's PolicySource loads each new version
between calls, and the packed rows of later steps carry (and were sampled by) the new
versions."""

import pytest
import torch

from domain.envs import VOCAB, ArithmeticEnv
from consumers.sources.policy import PolicySource
from consumers.weights import RedisWeights, WeightsLoader
from pipeline import wire
from pipeline.redis_io import connect
from producers.publishers import RedisPublisher
from domain.model import TinyConfig, TinyTransformer
from trainer.objective import GRPOObjective
from trainer.rollout_scheduler import RolloutScheduler

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

CONFIG = TinyConfig(vocab=VOCAB.size, d_model=16, n_layers=1, n_heads=2, max_positions=64)


def test_consumers_load_each_pushed_version_and_later_rows_carry_it():
    env = ArithmeticEnv(op="add")
    source = PolicySource(env=env, model_config=CONFIG, max_new_tokens=4, seed=0)
    model = TinyTransformer(CONFIG)  # version 0 on both sides: the config's initialisation
    snapshots = {0: {k: v.clone() for k, v in model.state_dict().items()}}
    objective = GRPOObjective()
    gen = torch.Generator().manual_seed(0)
    # an untrained model seldom says <eos> within 4 tokens: its sessions truncate, and the
    # single-turn RLVR policy trains them on their verifier reward
    with RolloutScheduler(objective, source, None, width=64, rows=4, groups=2, ahead=1,
                          max_lag=1, tasks=env.tasks, truncation="score", slots=4) as sched:
        sched.weights = RedisPublisher(sched.r, sched.keys, chunk_bytes=8192)
        source.weights = WeightsLoader(RedisWeights(connect(sched.redis_config), sched.keys))
        seen = []
        for step, batch in enumerate(sched.tasks([{"task_id": list(range(i * 4, i * 4 + 4))} for i in range(4)])):
            if step:  # this call pushes version `step` (the trainer's updates so far)
                snapshots[step] = {k: v.clone() for k, v in model.state_dict().items()}
            rows = sched(batch, model)
            versions = rows.versions[rows.loss_mask]
            assert versions.numel() > 0
            seen.append(sorted(set(versions.tolist())))
            # every token was sampled by the version it carries: rescoring under that
            # version's weights gives back the behaviour log-probs
            for v in set(versions.tolist()):
                scorer = TinyTransformer(CONFIG)
                scorer.load_state_dict(snapshots[v])
                with torch.no_grad():
                    logp = objective.packed_log_probs(scorer, rows)
                at = rows.loss_mask & (rows.versions == v)
                assert torch.allclose(logp[at], rows.logprobs[at], atol=1e-4), (step, v)
            with torch.no_grad():  # a stand-in for the optimizer step
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        announced = [wire.from_fields(f, wire.Weights) for _, f in sched.r.xrange(sched.keys.weights)]
    assert seen[0] == [0]
    assert max(seen[2]) >= 1 and max(seen[3]) >= 2, seen
    assert all(min(s) >= step - 1 for step, s in enumerate(seen)), seen  # max_lag=1
    assert [a.version for a in announced] == [1, 2, 3]
    assert all(a.location == f"redis:{sched.keys.weights_blob(a.version)}" and len(a.digest) == 64
               and a.size > 0 for a in announced)
    assert source.weights.version >= 2 and source.weights.fetches >= 2
