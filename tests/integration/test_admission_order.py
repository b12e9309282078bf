"""The admission consumer applies its inputs in entry-id order across its streams, also when
one stream holds more entries than one read returns (a backlog of results behind a
handover): an event is never applied before entries that reached Redis earlier."""

import time

import pytest

from consumers import journal
from consumers.admission import Admission
from pipeline import wire
from pipeline.config import AdmissionConfig, build
from pipeline.sessions import Call, Session, Status, Task

pytestmark = pytest.mark.timeout(60)

SCHEDULER = {"admission": "stream", "groups": 4, "batch_size": 2, "admit": 2, "max_lag": 1,
             "width": 64, "rows": 4}


def _result(group: int, sample: int) -> dict:
    session = Session(Status.COMPLETED, 1.0, calls=[Call([1, 2], [3], [-0.5], 0)],
                      timings={"started": 0.0, "finished": 1.0})
    return wire.to_fields(wire.Result.from_session(0, 0, group, sample, 0, session, "test"))


def _past(r, entry_id: bytes) -> None:
    """Wait until the server's clock is past the millisecond of `entry_id`."""
    ms = int(entry_id.split(b"-")[0])
    deadline = time.monotonic() + 5
    while True:
        seconds, micros = r.time()
        if seconds * 1000 + micros // 1000 > ms:
            return
        assert time.monotonic() < deadline, "the server's clock did not advance"


def _journal(r, keys) -> list[str]:
    return [type(event).__name__.lower() for event, _ in journal.events(r, keys, 0)]


@pytest.mark.parametrize("read_count", [3, 256])
def test_a_handover_behind_a_backlog_of_results_is_applied_after_them(r, keys, redis_config, read_count):
    config = build(AdmissionConfig, {"redis": redis_config.model_dump(), "scheduler": SCHEDULER,
                                     "block_ms": 1, "trim_every_s": 3600.0, "lease_s": 3600.0})
    adm = Admission(config, r, snapshot_every=10_000, read_count=read_count)
    tasks = keys.tasks(0)
    r.xadd(tasks, wire.to_fields(wire.Open(0, 0)))
    r.xadd(tasks, wire.to_fields(wire.Registration(0, 0, 0, (Task("a"), Task("b")))))
    r.xadd(tasks, wire.to_fields(wire.Handover(0, 0, 0, 0, None)))
    while adm.poll_once(1):
        pass
    assert adm.sched.in_flight == 8  # two groups of four, attempt 0 each
    # eight results, then (later ids) the weights and the trainer's next batch
    for group in range(2):
        for sample in range(4):
            last = r.xadd(keys.results(0), _result(group, sample))
    # ids of different streams are ordered by their milliseconds only (each stream counts
    # its own sequence within one), so each append waits for the server's next millisecond
    _past(r, last)
    last = r.xadd(keys.weights, wire.to_fields(wire.Weights(1, "mem://1", "", 0)))
    _past(r, last)
    r.xadd(tasks, wire.to_fields(wire.Registration(0, 0, 1, (Task("c"), Task("d")))))
    while adm.poll_once(1):
        pass
    kinds = _journal(r, keys)
    assert kinds[:3] == ["open", "register", "handover"]
    later = kinds[kinds.index("handover") + 1:]
    assert later == ["finish"] * 8 + ["publish", "register"]
    ready = wire.from_fields(r.xrange(keys.ready(0))[0][1], wire.Ready)
    assert ready.step == 0 and ready.record.groups == 2
    assert r.xpending(keys.results(0), adm.group)["pending"] == 0
    assert r.xpending(tasks, adm.group)["pending"] == 0
