"""The frontier's numbers, live: the admission consumer's `rollstream_session_duration_seconds`
(every session's slot seconds, by status), `rollstream_trained_session_seconds` (those of
the rollouts the steps trained) and `rollstream_held_session_seconds` (those of the results
held for groups not trained yet) agree exactly with what the results and Ready streams say,
on a run with every kind of waste: failures, a cancel, a timeout, surplus oversamples and a
truncation masked out of the loss."""

from __future__ import annotations

from collections import defaultdict

import pytest

from pipeline import wire
from pipeline.metrics import Metrics
from pipeline.ready import expand
from pipeline.scheduler import SampleKey, member
from pipeline.sessions import Status
from tests.integration.helpers import Trainer, wait_until

STEPS = 5
SCHEDULER = {"groups": 2, "oversample": 1, "ahead": 1, "max_lag": 1, "max_attempts": 3,
             "timeout_s": 0.5, "truncation": "mask", "rows": 8, "width": 64}
SCRIPT = [
    {"task": "t1.0", "sample": 0, "attempt": 0, "status": "infra_error", "reward": None},
    {"task": "t1.1", "sample": 1, "attempt": 0, "status": "cancelled", "reward": None},
    {"task": "t2.0", "sample": 0, "attempt": 0, "duration_s": 3.0},  # past the timeout
    {"task": "t2.1", "sample": 0, "status": "truncated", "reward": None},  # masked, yet packed
    {"task": "t3.2", "sample": 2, "duration_s": 0.2},  # the oversample: surplus, cancelled
]


def _slot_s(result: wire.Result) -> float:
    return result.timings["finished"] - result.timings["started"]


def _trained_attempts(readies: list[wire.Ready], results: list[wire.Result]) -> list[wire.Result]:
    """The attempt each step trained of each (group, sample) it marks trained: the sample's
    latest attempt that ended by itself (one is admitted, and none runs after it)."""
    trained = set()
    for ready in readies:
        arrays = expand(ready.arrays)
        mask = arrays["rollout_trained"].astype(bool)
        trained.update(zip(arrays["rollout_group"][mask].tolist(), arrays["rollout_sample"][mask].tolist()))
    latest: dict[tuple[int, int], wire.Result] = {}
    for res in results:
        pair = (res.group, res.sample)
        if pair in trained and res.status is not Status.CANCELLED and (
                pair not in latest or res.attempt > latest[pair].attempt):
            latest[pair] = res
    assert set(latest) == trained
    return list(latest.values())


@pytest.mark.timeout(90)
def test_live_slot_seconds_match_the_streams_exactly(threads, r, keys):
    from consumers.sources.scripted import ScriptedSource

    metrics = Metrics()
    adm = threads.admission(block_ms=20, lease_s=5, scheduler=SCHEDULER, metrics=metrics)
    source = ScriptedSource(rules=SCRIPT, default={"duration_s": 0.02})
    threads.consumer(source, slots=6, block_ms=20, lease_s=5, grace_s=1)
    readies = Trainer(r, keys, tasks=3).run(STEPS, timeout_s=40)
    get = metrics.registry.get_sample_value

    def results() -> list[wire.Result]:
        return [wire.from_fields(f, wire.Result) for _, f in r.xrange(keys.results(0))]

    def observed(name: str, status: str) -> float:
        return get(name, {"shard": "0", "status": status}) or 0.0

    def quiet() -> bool:  # no work left to run, and every result read and counted
        counted = sum(observed("rollstream_session_duration_seconds_count", s.value) for s in Status)
        last = r.xinfo_stream(keys.work)["last-generated-id"]
        taken = all(g["pending"] == 0 and g["last-delivered-id"] == last for g in r.xinfo_groups(keys.work))
        return adm.sched.in_flight == 0 and taken and counted == len(results())

    wait_until(quiet, 30, "the run's last sessions to end and be counted")
    every = results()
    by_status: dict[str, list[float]] = defaultdict(list)
    for res in every:
        by_status[res.status.value].append(_slot_s(res))
    assert {"completed", "infra_error", "cancelled", "truncated"} <= set(by_status)
    for status, spans in by_status.items():
        assert observed("rollstream_session_duration_seconds_count", status) == len(spans)
        assert observed("rollstream_session_duration_seconds_sum", status) == pytest.approx(sum(spans), rel=1e-9)

    trained = _trained_attempts(readies, every)
    assert get("rollstream_trained_session_seconds_count", {"shard": "0"}) == len(trained)
    trained_s = get("rollstream_trained_session_seconds_sum", {"shard": "0"})
    assert trained_s == pytest.approx(sum(map(_slot_s, trained)), rel=1e-9)
    # the masked truncation was packed and is not counted as trained: busy, and wasted
    assert all(res.status is not Status.TRUNCATED for res in trained)
    # the last batch's complete groups wait for a handover that never comes: held
    held = [res for res in every if member(SampleKey(res.epoch, res.group, res.sample, res.attempt)) in adm.held()]
    assert len(held) == 3 * SCHEDULER["groups"]
    held_s = get("rollstream_held_session_seconds", {"shard": "0"})
    assert held_s == pytest.approx(sum(map(_slot_s, held)), rel=1e-9)
    busy = sum(sum(spans) for spans in by_status.values())
    assert 0.1 < 1 - (trained_s + held_s) / busy < 0.9  # the timeout's half second alone is a tenth
