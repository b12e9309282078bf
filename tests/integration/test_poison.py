"""Poison entries on every input stream land in the dead stream with their reason; the
consumers keep running."""

from __future__ import annotations

import math
from collections import defaultdict

import msgpack
import pytest

from consumers.sources.scripted import ScriptedSource
from pipeline import wire
from pipeline.sessions import Status
from producers.trainer_link import StepFailed
from tests.integration.helpers import Trainer, resubmitted, wait_until

SCHEDULER = {"groups": 2, "rows": 8, "width": 64}
GARBAGE = {b"m": b"\xc1\xc1 not msgpack"}


def _packed(**fields) -> dict:
    return {b"m": msgpack.packb(fields, use_bin_type=True)}


def _dead_by_stream(r, keys) -> dict[str, list[str]]:
    out = defaultdict(list)
    for _, f in r.xrange(keys.dead):
        out[f[b"stream"].decode()].append(f[b"reason"].decode())
    return out


@pytest.mark.timeout(60)
def test_poison_on_every_input_stream_is_dead_lettered_with_its_reason(threads, r, keys):
    admission = threads.admission(block_ms=50, lease_s=5, scheduler=SCHEDULER)
    # the attempt the forged result names runs until the consumer stops: it is surely still
    # running when the forgery arrives, however loaded the machine
    source = ScriptedSource(rules=[{"task": "t0.0", "sample": 0, "attempt": 0, "duration_s": 600.0}],
                            default={"duration_s": 0.005})
    consumer = threads.consumer(source, slots=8, block_ms=50, lease_s=5, grace_s=1)
    trainer = Trainer(r, keys, tasks=2)
    trainer.open()
    r.xadd(keys.tasks(0), GARBAGE)
    r.xadd(keys.tasks(0), _packed(v=99, k="open", shard=0, epoch=3))
    r.xadd(keys.tasks(0), {b"x": b"no m field"})
    r.xadd(keys.tasks(0), _packed(v=wire.SCHEMA_VERSION, k="open", shard=1, epoch=3))  # another shard's
    r.xadd(keys.weights, GARBAGE)
    r.xadd(keys.work, GARBAGE)
    r.xadd(keys.control, GARBAGE)
    trainer.handover()
    # the forgery must come after the attempt it names was submitted: a result read with the
    # epoch's opening, ahead of it, names nothing yet. The attempt's work entry stays until it
    # ends (in 600 s), so an entry that is not the garbage says the batch was submitted.
    wait_until(lambda: any(f != GARBAGE for _, f in r.xrange(keys.work)), 20, "the first attempts submitted")
    # a result with a NaN reward that names the running attempt: dead-lettered, and
    # the attempt is finished as infra_error (resubmitted) instead of waiting for it
    no_chains = msgpack.unpackb(wire.encode(wire.Result(0, 0, 0, 0, 0, "x", Status.COMPLETED)))["chains"]
    r.xadd(keys.results(0), _packed(
        v=wire.SCHEMA_VERSION, k="result", shard=0, epoch=0, group=0, sample=0, attempt=0, consumer="x",
        status="completed", reward=math.nan, components={}, chains=no_chains, truncation=None,
        timings={}, error=None))
    first = trainer.wait(timeout_s=20)
    assert dict(resubmitted([first])) == {"infra_error": 1}
    trainer.handover()
    trainer.wait(timeout_s=20)

    dead = _dead_by_stream(r, keys)
    assert sorted(dead) == sorted([keys.tasks(0), keys.weights, keys.work, keys.results(0)])
    tasks = " | ".join(dead[keys.tasks(0)])
    assert len(dead[keys.tasks(0)]) == 4
    assert "not msgpack" in tasks and "schema version 99" in tasks and "m: missing" in tasks
    assert "shard 1 on shard 0" in tasks
    assert "not msgpack" in dead[keys.weights][0] and "not msgpack" in dead[keys.work][0]
    assert dead[keys.results(0)] == ["reward: must be finite, got nan"]
    assert admission.stats["dead_letters"] == 6 and admission.stats["salvaged"] == 1
    assert consumer.stats["dead_letters"] == 1
    # the weights and control garbage, counted by the consumer's listener: a thread of its own,
    # which nothing orders before the trainer's steps
    wait_until(lambda: consumer.stats["bad_broadcasts"] >= 2, 20, "the listener to read the garbage")
    assert consumer.stats["bad_broadcasts"] == 2


@pytest.mark.timeout(60)
def test_a_refused_handover_fails_its_step_and_the_run_goes_on(threads, r, keys):
    threads.admission(block_ms=50, lease_s=5, scheduler=SCHEDULER)
    threads.consumer(ScriptedSource(default={"duration_s": 0.002}), slots=4, block_ms=50, lease_s=5,
                     grace_s=1)
    trainer = Trainer(r, keys, tasks=2)
    trainer.run(2, timeout_s=20)
    trainer.writer.handover(0, 7, updates=7)  # batch 7 was never registered
    with pytest.raises(StepFailed, match="refused: step 7 handed over before batch 7"):
        trainer.writer.wait_ready(0, 7, 20)
    trainer.handover()
    assert trainer.wait(timeout_s=20).step == 2
    reasons = [f[b"reason"].decode() for _, f in r.xrange(keys.dead)]
    assert len(reasons) == 1 and reasons[0].startswith("protocol: step 7")
