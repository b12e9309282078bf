"""Agent harnesses end to end: a multi-turn harness written with the `openai` client trains
through the recording gateway and the local engine (DeepSpeed trainer, RolloutScheduler,
embedded Redis, the engine following the run's weights stream); an engine going down
mid-session ends that rollout INFRA_ERROR and resubmits it; a crashing harness is admitted
as AGENT_ERROR and scored. Real servers on 127.0.0.1, real Redis."""

import math
import time
from collections import Counter

import pytest
import torch

from consumers.cpu_engine import RedisFollower
from domain.envs import VOCAB, GuessEnv
from consumers.sources.harness import HarnessSource
from pipeline.chains import merge_calls
from pipeline.sessions import Status
from producers.publishers import RedisPublisher
from tests.integration.harness_stack import Capture, GuessHarness, Stack, eos_biased, verify
from trainer.run_config import TrainerConfig
from domain.model import TinyConfig, TinyTransformer
from trainer.objective import GRPOObjective, next_token_log_probs
from trainer.rollout_scheduler import RolloutScheduler

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]

TINY = {"vocab": VOCAB.size, "d_model": 16, "n_layers": 1, "n_heads": 2, "max_positions": 32}


def batches(n, size=4):
    return [{"task_id": list(range(i * size, i * size + size))} for i in range(n)]


class Snapshots:
    """A publisher that keeps each version's weights, in front of another one."""

    def __init__(self, inner=None):
        self.inner, self.states = inner, {}

    def load(self, variables, version):
        module = getattr(variables, "module", variables)
        self.states[version] = {k: v.detach().clone() for k, v in module.state_dict().items()}
        return None if self.inner is None else self.inner.load(variables, version)


def rescore(state, call):
    model = TinyTransformer(TinyConfig(**TINY))
    model.load_state_dict(state)
    ids = torch.cat([torch.as_tensor(call.prompt_ids), torch.as_tensor(call.completion_ids)]).long()[None]
    with torch.no_grad():
        return next_token_log_probs(model(ids), ids)[0, len(call.prompt_ids):]


def test_a_multi_turn_openai_harness_trains_through_the_gateway_and_the_local_engine():
    from trainer.deepspeed_engine import build_engine
    from trainer.loop import train

    from pipeline.config import build

    config = build(TrainerConfig, {"model": {"tiny": TINY}, "device": "cpu", "zero_stage": 0,
                                   "optimizer": {"lr": 1e-2}})
    engine = build_engine(config)
    eos_biased(engine.module)  # replies end with <eos> often, like a chat model's
    local = TinyTransformer(TinyConfig(**TINY))
    local.load_state_dict(engine.module.state_dict())  # version 0 on both sides
    stack = Stack(local)
    harness = GuessHarness()
    env = GuessEnv(n=8, max_turns=3)
    source = Capture(HarnessSource(gateway=stack.url, harness=harness, verifier=verify, max_turns=3,
                                   max_tokens=32, timeout_s=60))
    objective = GRPOObjective(temperature=1.0)
    publisher = Snapshots()
    publisher.states[0] = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    try:
        with RolloutScheduler(objective, source, publisher, width=64, rows=8, groups=4, ahead=1, max_lag=1,
                              tasks=env.tasks, slots=4) as sched:
            publisher.inner = RedisPublisher(sched.r, sched.keys)
            follower = RedisFollower(stack.engine, sched.redis_config, block_ms=100)
            try:
                history = train(engine, sched, objective, batches(4), steps=3)
                deadline = time.monotonic() + 10  # the last push reaches the engine
                while stack.engine.version < sched.published and time.monotonic() < deadline:
                    time.sleep(0.01)
            finally:
                follower.stop()
    finally:
        stack.close()
        source.inner.close()

    assert [s.step for s in history] == [0, 1, 2]
    assert all(math.isfinite(s.loss) and s.tokens > 0 for s in history)
    assert all(s.record.groups == 4 and s.record.lag <= 1 for s in history)
    assert follower.failure is None and stack.engine.version == 2  # pushed before steps 1 and 2
    sessions = [s for _, s in source.sessions if s.status is not Status.CANCELLED]
    assert sessions and all(s.status in (Status.COMPLETED, Status.TRUNCATED) for s in sessions)
    # what the gateway recorded is what the engine answered, call for call
    seen = {member(url): calls for url, calls in harness.seen.items()}
    for request, s in source.sessions:
        if s.status is Status.CANCELLED:
            continue
        raw_calls = seen[(request.task.id, request.group, request.sample, request.attempt)]
        assert len(s.calls) == len(raw_calls)
        for call, raw in zip(s.calls, raw_calls):
            assert call.prompt_ids.tolist() == raw["prompt_ids"] and call.version == raw["version"]
            assert call.completion_ids.tolist() == raw["completion_ids"]
            assert torch.allclose(torch.as_tensor(call.logprobs), torch.tensor(raw["logprobs"]))
    # every call's log-probs are its version's: the engine loaded the pushed weights
    versions = Counter(c.version for s in sessions for c in s.calls)
    assert versions[0] and max(versions) >= 1, versions
    for s in sessions:
        for call in s.calls:
            expected = rescore(publisher.states[call.version], call)
            assert torch.allclose(torch.as_tensor(call.logprobs), expected, atol=1e-4), call.version
    # multi-turn sessions merge into chains
    multi = [s for s in sessions if len(s.calls) > 1]
    assert multi and any(len(merge_calls(s.calls)) < len(s.calls) for s in multi)
    assert any(s.record.metrics.get("merge_ratio", 0) > 0 for s in history)


def member(base_url):
    """(task, group, sample, attempt) of a HarnessSource session URL (`.../sessions/{id}/v1`)."""
    task, group, sample, attempt, _ = base_url.rstrip("/").split("/")[-2].rsplit(".", 4)
    return task, int(group), int(sample), int(attempt)


class FixedPublisher:
    """Announces versions by name only; the engine keeps version 0 (no push is needed here)."""

    def load(self, variables, version):
        return None


def run_scheduler(source, steps, **options):
    env = GuessEnv(n=8, max_turns=3)
    model = TinyTransformer(TinyConfig(**TINY))
    records = []
    with RolloutScheduler(GRPOObjective(), source, FixedPublisher(), width=64, rows=8, groups=4, ahead=1,
                          max_lag=10, tasks=env.tasks, **options) as sched:
        for step, batch in enumerate(sched.tasks(batches(steps + 1))):
            sched(batch, model)
            records.append(sched.record)
            if step + 1 == steps:
                break
    return records


def test_an_engine_down_mid_session_ends_it_infra_error_and_resubmits_it():
    stack = None

    def kill_after_first_call(ctx, turn):
        if not state["killed"] and turn == 0:
            state["killed"] = ctx.base_url
            stack.stop_engine()  # the session's next call finds the engine gone

    state = {"killed": None}
    model = TinyTransformer(TinyConfig(**TINY))
    stack = Stack(model)
    harness = GuessHarness(after_call=kill_after_first_call)
    source = Capture(HarnessSource(gateway=stack.url, harness=lambda ctx: restart_after(ctx), verifier=verify,
                                   max_turns=3))

    def restart_after(ctx):
        try:
            return harness(ctx)
        finally:
            if state["killed"] == ctx.base_url:
                stack.start_engine()  # back for the resubmitted attempt (the gateway probes it)

    try:
        records = run_scheduler(source, 2, slots=1)
    finally:
        stack.close()
        source.inner.close()
    failed = [(r, s) for r, s in source.sessions if s.status is Status.INFRA_ERROR]
    assert len(failed) == 1, [(r.attempt, s.status) for r, s in source.sessions]
    request, session = failed[0]
    assert request.attempt == 0 and len(session.calls) == 1 and session.reward is None
    retried = [(r, s) for r, s in source.sessions
               if (r.group, r.sample) == (request.group, request.sample) and r.attempt == 1]
    assert retried and retried[0][1].status in (Status.COMPLETED, Status.TRUNCATED)
    assert sum(r.resubmitted.get("infra_error", 0) for r in records) == 1
    # only the admitted statuses trained: every packed rollout is completed or truncated
    for r in records:
        assert r.groups == 4
        assert r.metrics["share_completed"] + r.metrics.get("share_truncated", 0) == pytest.approx(1.0)


def test_a_harness_that_crashes_is_admitted_as_agent_error_and_scored():
    model = TinyTransformer(TinyConfig(**TINY))
    stack = Stack(model)
    harness = GuessHarness()

    def crashing(ctx):
        if member(ctx.base_url)[2] == 0:
            harness(ctx)
            raise RuntimeError("the agent's tool failed")
        return harness(ctx)

    source = Capture(HarnessSource(gateway=stack.url, harness=crashing, verifier=verify, max_turns=3))
    try:
        records = run_scheduler(source, 2, slots=4)
    finally:
        stack.close()
        source.inner.close()
    crashed = [s for r, s in source.sessions if r.sample == 0 and s.status is not Status.CANCELLED]
    assert crashed and all(s.status is Status.AGENT_ERROR and s.reward == 0.0 and s.calls for s in crashed)
    for r in records:
        assert r.groups == 4 and not any(r.resubmitted.values())  # admitted, never resubmitted
        assert r.metrics["share_agent_error"] == pytest.approx(0.25)  # sample 0 of each group of 4
