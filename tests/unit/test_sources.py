"""The sleep and scripted sources, without Redis."""

import asyncio
import threading
import time

import numpy as np
import pytest

from consumers.sources import load_source
from consumers.sources.scripted import (
    AsyncScriptedSource,
    Outcome,
    ScriptedError,
    ScriptedSource,
)
from consumers.sources.sleep import SleepSource
from pipeline.chains import merge_calls
from pipeline.sessions import SessionRequest, Status, Task


def request(task="t0.0", sample=0, attempt=0, served=3, cancelled=None):
    return SessionRequest(Task(task), 0, sample, attempt, 0, None,
                          cancelled if cancelled is not None else threading.Event(), lambda: served)


def test_sleep_source_builds_from_source_args_and_makes_valid_sessions():
    source = load_source("consumers.sources.sleep:SleepSource",
                         {"median_s": 0.001, "calls": 3, "seed": 5, "status_mix": {"agent_error": 1.0}})
    session = source.run(request(served=7))
    assert session.status is Status.AGENT_ERROR and 0.0 <= session.reward <= 1.0
    assert len(session.calls) == 3 and all(c.version == 7 for c in session.calls)
    assert all((c.logprobs <= 0).all() for c in session.calls)
    assert len(merge_calls(session.calls)) == 1  # each call extends the previous one
    again = source.run(request(served=7))
    assert np.array_equal(again.calls[2].completion_ids, session.calls[2].completion_ids)  # seeded


def test_sleep_source_durations_are_capped_log_normal():
    source = SleepSource(median_s=1.0, sigma=2.0, cap=3.0, seed=1)
    import random

    rng = random.Random(0)
    draws = [source.duration_s(rng) for _ in range(2000)]
    assert max(draws) == pytest.approx(3.0) and 0.8 < float(np.median(draws)) < 1.2


def test_sleep_source_honours_cancellation_promptly():
    event = threading.Event()
    threading.Timer(0.05, event.set).start()
    began = time.monotonic()
    session = SleepSource(median_s=10.0, sigma=0.0, calls=2).run(request(cancelled=event))
    assert session.status is Status.CANCELLED and time.monotonic() - began < 1.0


def test_scripted_rules_match_by_task_sample_and_attempt():
    source = ScriptedSource(rules=[
        {"task": "t1.*", "sample": [0, 2], "attempt": 0, "status": "infra_error", "reward": None},
        {"task": "t2.0", "raise": "boom"},
    ], default={"reward": 0.25})
    assert source.run(request("t1.4", sample=2)).status is Status.INFRA_ERROR
    assert source.run(request("t1.4", sample=1)).reward == 0.25
    assert source.run(request("t1.4", sample=0, attempt=1)).status is Status.COMPLETED
    with pytest.raises(ScriptedError, match="boom"):
        source.run(request("t2.0"))
    with pytest.raises(ValueError, match="unknown outcome fields"):
        ScriptedSource(rules=[{"stauts": "completed"}])


def test_scripted_outcome_function_and_cancellation():
    source = ScriptedSource(outcome=lambda req: Outcome(duration_s=5.0))
    event = threading.Event()
    event.set()
    assert source.run(request(cancelled=event)).status is Status.CANCELLED


def test_async_scripted_source_is_cancelled_through_its_event():
    async def main():
        event = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, event.set)
        return await AsyncScriptedSource(default={"duration_s": 5.0}).arun(request(cancelled=event))

    assert asyncio.run(main()).status is Status.CANCELLED


def test_sleep_source_draws_statuses_by_their_weights_and_each_attempt_its_own_session():
    source = SleepSource(median_s=0.0, seed=2, vocab=50,
                         status_mix={"completed": 3.0, "agent_error": 1.0, "truncated": 0.0})
    sessions = [source.run(request(task=f"t{i}.0")) for i in range(2000)]
    counts = {s: sum(x.status is s for x in sessions) for s in Status}
    assert counts[Status.TRUNCATED] == 0 and 0.70 < counts[Status.COMPLETED] / 2000 < 0.80
    assert all(0.0 <= x.reward < 1.0 for x in sessions)
    tokens = {bytes(x.calls[0].completion_ids) for x in sessions}
    assert len(tokens) > 1900  # every attempt its own window (of some 66k offsets)
    again = SleepSource(median_s=0.0, seed=2, vocab=50,
                        status_mix={"completed": 3.0, "agent_error": 1.0, "truncated": 0.0})
    assert again.run(request(task="t7.0")).calls[0] == sessions[7].calls[0]  # seeded


@pytest.mark.parametrize("calls", [1, 3])
def test_sleep_source_sessions_are_those_its_calls_and_session_would_make_checked(calls):
    from pipeline.sessions import Call, Session
    source = SleepSource(median_s=0.0, seed=4, vocab=300, calls=calls, prompt_tokens=20, completion_tokens=9,
                         status_mix={"completed": 1.0, "infra_error": 1.0})
    for i in range(50):
        session = source.run(request(task=f"t{i}.0", served=i % 3))
        checked = Session(session.status, session.reward, calls=[
            Call(c.prompt_ids, c.completion_ids, c.logprobs, c.version) for c in session.calls],
            timings=dict(session.timings))
        assert session == checked and vars(session).keys() == vars(checked).keys()
        for made, call in zip(session.calls, checked.calls):
            assert vars(made).keys() == vars(call).keys()
            for name in ("prompt_ids", "completion_ids", "logprobs"):
                got, want = getattr(made, name), getattr(call, name)
                assert got.dtype == want.dtype and got.flags.c_contiguous and got.ndim == 1


def test_sleep_source_checks_a_served_version_that_is_not_a_plain_int():
    source = SleepSource(median_s=0.0, seed=4)
    assert source.run(request(served=np.int64(5))).calls[0].version == 5
    with pytest.raises(ValueError, match="Call.version must be >= 0"):
        source.run(request(served=-1))
