"""Poison entries in the live pipeline (a real admission consumer and a real rollout
consumer on real Redis, 7 and the embedded 6.2): garbage bytes, a wrong schema version,
NaN and infinite rewards, token ids beyond the vocabulary, negative durations and oversized
messages, on every stream they can reach. Each ends in the dead-letter stream with its
reason, or is refused by its producer with a clear error; each is counted
(`rollstream_dead_letters_total`); the consumers keep running and the run still trains
every task. The message-size limit holds on both ends (`max_message_bytes`).

What is not poison is not dead-lettered: a chain longer than a packed row trains as a
truncation, a COMPLETED rollout without a reward is a failed attempt (`unscored`), and a
group that can never fit the rows is refused with a record field and a metric."""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict

import msgpack
import pytest

from consumers.sources.scripted import ScriptedSource
from pipeline import wire
from pipeline.chains import merge_calls
from pipeline.metrics import Metrics
from pipeline.sessions import Call, Status, Task
from tests.integration.helpers import Trainer, admitted_tasks, resubmitted, wait_until

LIMIT = 32 * 1024  # max_message_bytes of every process here
VOCAB = 1000
SCHEDULER = {"groups": 2, "rows": 8, "width": 64}
STEPS = 3
NOBODY = (0, 0, 900, 0, 0)  # shard, epoch, group, sample, attempt: an attempt never submitted
SCRIPT = [  # what the rollout consumer's source returns, refused by the consumer itself
    {"task": "t1.0", "sample": 0, "attempt": 0, "tokens": 1000},  # completion ids up to 1099 >= VOCAB
    {"task": "t1.1", "sample": 1, "attempt": 0, "calls": 20, "tokens": 200},  # 8000 tokens: past LIMIT
]


def _result(chains=(), **fields) -> dict:
    """The wire map of a result naming NOBODY, with `fields` replaced (after encoding)."""
    tree = msgpack.unpackb(wire.encode(wire.Result(*NOBODY, "poison", Status.COMPLETED, 1.0, chains=chains)),
                           raw=False)
    return {**tree, **fields}


def _entry(tree: dict) -> dict:
    return {wire.FIELD: msgpack.packb(tree, use_bin_type=True)}


def _chain(prompt: int, completion: int, top: int = 5) -> tuple:
    ids = list(range(1, prompt + 1))
    return tuple(merge_calls([Call(ids, [top] * completion, [-0.5] * completion, 0)]))


GARBAGE = {wire.FIELD: b"\xc1\xc1 not msgpack"}
POISON_RESULTS = {  # the dead letter's reason, for each poisoned result
    "reward: must be finite, got nan": _entry(_result(reward=math.nan)),
    "reward: must be finite, got inf": _entry(_result(reward=math.inf)),
    "components.format: must be finite, got nan": _entry(_result(components={"format": math.nan})),
    f"chains.tokens: token id 5000 is beyond the vocabulary of {VOCAB} (the config's vocab)": _entry(_result(_chain(3, 1, top=5000))),
    "timings.finished: 5.0 is before timings.started 10.0: a negative duration":
        _entry(_result(timings={"started": 10.0, "finished": 5.0})),
    "timings.env_s: must be >= 0, got -1.0": _entry(_result(timings={"env_s": -1.0})),
    "v: schema version 1 is not supported (this is 2)": _entry(_result(v=1)),
    "message: ": _entry(_result(error="x" * (LIMIT + 10))),  # oversized: checked below
    "message: not msgpack": GARBAGE,
}


def _dead(r, keys) -> dict[str, list[str]]:
    out = defaultdict(list)
    for _, f in r.xrange(keys.dead):
        out[f[b"stream"].decode()].append(f[b"reason"].decode())
    return out


def _counted(metrics: Metrics) -> Counter:
    return Counter({(s.labels["stream"], s.labels["reason"]): s.value
                    for family in metrics.registry.collect() if family.name == "rollstream_dead_letters"
                    for s in family.samples if s.name.endswith("_total")})


@pytest.mark.timeout(90)
def test_every_poison_is_dead_lettered_counted_and_the_run_still_trains(threads, r, keys):
    adm_metrics, con_metrics = Metrics(), Metrics()
    admission = threads.admission(block_ms=50, lease_s=5, scheduler=SCHEDULER, vocab=VOCAB,
                                  max_message_bytes=LIMIT, metrics=adm_metrics)
    consumer = threads.consumer(ScriptedSource(rules=SCRIPT, default={"duration_s": 0.005}), slots=4,
                                block_ms=50, lease_s=5, grace_s=1, vocab=VOCAB, max_message_bytes=LIMIT,
                                metrics=con_metrics)
    trainer = Trainer(r, keys, tasks=2)
    trainer.open()
    big = _entry({"v": wire.SCHEMA_VERSION, "k": "registration", "shard": 0, "epoch": 0, "batch": 9,
                  "tasks": [{"id": "huge", "payload": {"text": "x" * LIMIT}}]})
    for fields in (GARBAGE, _entry({"v": 99, "k": "open", "shard": 0, "epoch": 3}), big):
        r.xadd(keys.tasks(0), fields)
    for fields in POISON_RESULTS.values():
        r.xadd(keys.results(0), fields)
    work = msgpack.unpackb(wire.encode(wire.Work(0, 0, 900, 1, 0, Task("w"), 0)), raw=False)
    r.xadd(keys.work, GARBAGE)
    r.xadd(keys.work, _entry({**work, "v": 1}))  # names its attempt: the consumer fails it
    r.xadd(keys.work, _entry({**work, "sample": 2, "task": {"id": "w", "payload": {"text": "x" * LIMIT}}}))

    readies = []
    for _ in range(STEPS):
        trainer.handover()
        readies.append(trainer.wait(timeout_s=30))

    # the run trained every task; the two sessions the consumer refused were resubmitted
    assert sorted(admitted_tasks(readies)) == [f"t{b}.{i}" for b in range(STEPS) for i in range(2)]
    assert dict(resubmitted(readies)) == {"infra_error": 2}
    deadline = time.monotonic() + 10
    while sum(map(len, _dead(r, keys).values())) < 17 and time.monotonic() < deadline:
        time.sleep(0.05)
    dead = _dead(r, keys)

    # every poison is in the dead-letter stream with its reason
    assert sorted(dead) == sorted([keys.tasks(0), keys.results(0), keys.work])
    results = dead[keys.results(0)]
    assert len(results) == len(POISON_RESULTS) + 2
    for reason in POISON_RESULTS:
        assert any(got.startswith(reason) for got in results), (reason, results)
    oversized = [got for got in results if got.startswith("message: ") and "exceeds the limit" in got]
    assert len(oversized) == 1 and oversized[0].endswith(f"bytes exceeds the limit of {LIMIT}")
    refused_here = [got for got in results if got.startswith("invalid session from ScriptedSource")]
    assert len(refused_here) == 2
    assert any(f"token id 1099 is beyond the vocabulary of {VOCAB} (the config's vocab)" in got for got in refused_here)
    assert any(f"exceeds the limit of {LIMIT}" in got for got in refused_here)
    tasks = " | ".join(dead[keys.tasks(0)])
    assert len(dead[keys.tasks(0)]) == 3 and "not msgpack" in tasks and "schema version 99" in tasks
    assert f"exceeds the limit of {LIMIT}" in tasks
    work_reasons = " | ".join(dead[keys.work])
    assert len(dead[keys.work]) == 3 and "not msgpack" in work_reasons and "schema version 1" in work_reasons
    assert f"exceeds the limit of {LIMIT}" in work_reasons
    # nothing is lost: a dead letter keeps the entry's bytes
    kept = {f[b"m"] for _, f in r.xrange(keys.dead)}
    assert GARBAGE[wire.FIELD] in kept and POISON_RESULTS["reward: must be finite, got nan"][wire.FIELD] in kept

    # the work entries that named their attempt got an infra_error result from the consumer
    failed = sorted((m.sample, m.status, m.consumer) for m in _decodable(r, keys)
                    if m.group == 900 and m.consumer != "poison")
    assert failed == [(1, Status.INFRA_ERROR, consumer.name), (2, Status.INFRA_ERROR, consumer.name)]

    # each was counted, by stream and reason (the offending field)
    counted = _counted(adm_metrics)
    assert counted[("results:0", "reward")] == 2 and counted[("results:0", "message")] == 2
    for field in ("components.format", "chains.tokens", "timings.finished", "timings.env_s", "v"):
        assert counted[("results:0", field)] == 1, field
    assert counted[("tasks:0", "message")] == 2 and counted[("tasks:0", "v")] == 1
    assert sum(counted.values()) == admission.stats["dead_letters"] == 12
    assert admission.stats["salvaged"] == len(POISON_RESULTS) - 1  # all but the garbage name an attempt
    assert _counted(con_metrics) == {("work", "message"): 2, ("work", "v"): 1, ("results:0", "invalid session"): 2}
    assert consumer.stats["dead_letters"] == 3 and consumer.stats["salvaged"] == 2
    assert consumer.stats["invalid_sessions"] == 2
    # and both consumers are still running
    assert all(thread.is_alive() for _, thread, _ in threads.running) and not threads.errors


def _decodable(r, keys) -> list[wire.Result]:
    out = []
    for _, fields in r.xrange(keys.results(0)):
        try:
            out.append(wire.from_fields(fields, wire.Result))
        except wire.SchemaError:
            pass  # the poison injected above
    return out


@pytest.mark.timeout(30)
def test_the_producer_refuses_an_oversized_message_and_writes_nothing(r, keys):
    from producers.trainer_link import TaskWriter

    writer = TaskWriter(r, keys, 0, max_message_bytes=LIMIT)
    writer.open(0)
    with pytest.raises(wire.SchemaError, match=f"registration refused, not written: .* exceeds the limit of {LIMIT}"):
        writer.register(0, 0, [Task("huge", {"text": "x" * LIMIT})])
    with pytest.raises(wire.SchemaError, match="weights refused, not written"):
        writer.announce_weights(1, "x" * LIMIT)
    assert r.xlen(keys.tasks(0)) == 1 and r.xlen(keys.weights) == 0
    writer.register(0, 0, [Task("small", {"text": "x" * 100})])  # and the writer goes on
    assert r.xlen(keys.tasks(0)) == 2


def _family(metrics: Metrics, name: str) -> float:
    return sum(s.value for family in metrics.registry.collect() if family.name == name
               for s in family.samples if s.name.endswith("_total"))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("truncation", ["mask", "score"])
def test_over_long_unscored_and_unpackable_rollouts_are_handled_and_visible(threads, r, keys, truncation):
    """Three things a run must survive, each visible in the step's record and a metric:
    t0.0's first sample has a 96-token chain (width 64): cut to the row and trained as a
    truncation under the run's policy, not dead-lettered nor burnt as infra_error; t0.1's
    first sample completes without a reward: resubmitted as `unscored`, the step trains;
    every sample of t1.0 is 6 chains of 48 tokens, more than the 4 rows of 64 hold: the
    group is refused at packing and the step goes on without it."""
    metrics = Metrics()
    script = [{"task": "t0.0", "sample": 0, "tokens": 48},
              {"task": "t0.1", "sample": 0, "attempt": 0, "reward": None},
              {"task": "t1.0", "calls": 6, "tokens": 24}]
    threads.admission(block_ms=20, scheduler={"groups": 2, "rows": 4, "width": 64,
                                              "truncation": truncation, "ahead": 0, "max_lag": 0},
                      vocab=VOCAB, metrics=metrics)
    threads.consumer(ScriptedSource(rules=script, default={"tokens": 8}), slots=4, block_ms=20)
    trainer = Trainer(r, keys, tasks=2, ahead=0)
    trainer.open()
    steps = []
    for _ in range(2):
        trainer.handover()
        steps.append(trainer.wait(timeout_s=30).record)
    first, second = steps
    assert first.overlong == 1 and first.refused == 0
    assert [t for _, _, t in first.admitted] and len(first.packed) == 2  # both groups train
    assert first.resubmitted["unscored"] == 1
    refused_group = [g for g, _, t in second.admitted if t == "t1.0"]
    assert second.refused == 1 and second.cut == 0
    assert len(second.packed) == 1 and refused_group[0] not in second.packed
    assert second.refused_groups[0][1].startswith("group of")
    assert _dead(r, keys) == {}  # none of it is poison
    # the metrics count what a transaction committed, after its EXEC: the step's Ready can
    # reach the trainer a moment before the admission thread counts it
    wait_until(lambda: _family(metrics, "rollstream_groups_refused") >= 1, 5.0, "groups_refused counted")
    assert _family(metrics, "rollstream_rollouts_overlong") == 1
    assert _family(metrics, "rollstream_groups_refused") == 1
    # the over-long sample trains under the policy: masked, or on its verifier reward
    ready = trainer.readies[0]
    trained = ready.arrays["rollout_trained"].tolist()
    assert trained.count(False) == (1 if truncation == "mask" else 0)
