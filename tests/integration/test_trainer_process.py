"""`rollstream trainer` as processes: a failure on one rank raising on every rank,
first_reader_batch, checkpoint/resume that neither drops nor repeats a task, SIGTERM. Two
ranks under ZeRO-3 and a Hugging Face model directory run as the documented recipes
(tests/integration/test_recipes.py)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from pipeline import wire
from pipeline.config import build
from pipeline.keys import Keys, admission_group
from trainer.run_config import RunConfig
from rollstream.local import LocalRun
from trainer.main import batches

pytestmark = pytest.mark.timeout(300)

# Each test starts a DeepSpeed trainer or two (~15 s each on two cores): one Redis each. The
# pipeline's own tests cover both Redis versions; the resume test runs on the embedded 6.2.
SERVER = pytest.mark.parametrize("redis_url", ["server"], indirect=True)
EMBEDDED = pytest.mark.parametrize("redis_url", ["embedded"], indirect=True)

BATCH = 4  # tasks per step per share
GROUPS = 4


def run_config(redis_config, folder: Path, **over) -> RunConfig:
    data = {
        "redis": redis_config.model_dump(mode="json"),
        "metrics_addr": "127.0.0.1:0",
        "trainer": {"model": {"kind": "tiny", "tiny": {"vocab": 64, "d_model": 32, "n_layers": 1,
                                                       "n_heads": 2, "max_positions": 32}},
                    "optimizer": {"type": "AdamW", "lr": 5e-3}, "device": "cpu", "zero_stage": 1},
        "scheduler": {"groups": GROUPS, "width": 64, "rows": 2, "ahead": 1, "max_lag": 1,
                      "truncation": "score"},
        "data": {"env": "arithmetic", "env_args": {"op": "copy", "digits": 1}, "batch_size": BATCH},
        "steps": 4, "record": str(folder / "record-{rank}.jsonl"), "step_timeout_s": 120.0,
        **over,
    }
    return build(RunConfig, data)


def records(folder: Path, rank: int = 0) -> list[dict]:
    path = folder / f"record-{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def expected_tasks(config: RunConfig, step: int, shard: int, shards: int) -> list[str]:
    it = batches(config.data, shard, shards, start=step)
    return [str(t) for t in next(it)["task_id"]]


def weight_versions(r, keys: Keys) -> list[int]:
    return [wire.from_fields(f, wire.Weights).version for _, f in r.xrange(keys.weights)]


def source_args(config: RunConfig, redis_config, **over) -> dict:
    return {"env": "arithmetic", "env_args": {"op": "copy", "digits": 1},
            "model_config": config.trainer.model.tiny.model_dump(), "max_new_tokens": 1,
            "weights": {"redis": redis_config.model_dump(mode="json")}, **over}


SOURCE = "tests.integration.policy_sources:TestPolicySource"


def finish(run: LocalRun, timeout_s: float = 240.0) -> list[int]:
    try:
        return run.wait_trainer(timeout_s)
    finally:
        run.stop()


@SERVER
def test_a_failure_on_one_rank_raises_on_every_rank(tmp_path, redis_config, r, keys):
    config = run_config(redis_config, tmp_path, steps=4)
    broken = expected_tasks(config, 1, 1, 2)[:1]  # a task of rank 1's second batch
    run = LocalRun(config, tmp_path, ranks=2, consumers=1, slots=8, source=SOURCE,
                   source_args=source_args(config, redis_config, fail_tasks=broken))
    run.start()
    codes = finish(run)
    logs = {p.log.stem: p.output() for p in run.trainers}
    assert codes[0] != 0 and codes[1] != 0, run.logs()
    for name, text in logs.items():  # both raise at the agreement point, naming rank 1
        assert "PoolFailed" in text and "rank 1:" in text and "environment is broken" in text, (name, text[-3000:])
    assert "rank 0:" not in logs["trainer-0"].split("PoolFailed")[-1]
    # neither rank trained the failed step
    assert max((row["step"] for row in records(tmp_path, 0)), default=-1) <= 1


@SERVER
def test_first_reader_batch_shares_one_batch_across_two_ranks(tmp_path, redis_config, r, keys):
    config = run_config(redis_config, tmp_path, steps=3, share=2)
    run = LocalRun(config, tmp_path, ranks=2, consumers=1, slots=8, launcher="torchrun")
    run.start()
    codes = finish(run)
    assert codes == [0], run.logs()
    first, second = records(tmp_path, 0), records(tmp_path, 1)
    assert [row["step"] for row in first] == [0, 1, 2]
    for a, b in zip(first, second, strict=True):
        assert a["shard"] == b["shard"] == 0
        assert a["tasks"] == b["tasks"] == [t for t in a["tasks"]]
        assert sorted(a["tasks"], key=int) == expected_tasks(config, a["step"], 0, 1)
        assert a["loss"] == b["loss"] and a["tokens"] == b["tokens"]  # the same rows
    # only the first reader registered: nothing was written to shard 1's task stream
    assert r.xlen(keys.tasks(1)) == 0


def _admitted_everything(r, stream: str) -> bool:
    """The admission consumer has read and committed every entry of `stream`."""
    last = r.xinfo_stream(stream)["last-generated-id"]
    name = admission_group(0)
    group = next(g for g in r.xinfo_groups(stream) if g["name"] in (name, name.encode()))
    return group["last-delivered-id"] == last and group["pending"] == 0


@EMBEDDED
@pytest.mark.parametrize("admission", ["batch", "stream"])
def test_a_killed_trainer_resumes_from_its_checkpoint_without_dropping_or_repeating_a_task(
        tmp_path, redis_config, r, keys, admission):
    scheduler = {**run_config(redis_config, tmp_path).scheduler.model_dump(), "admission": admission}
    config = run_config(redis_config, tmp_path, steps=7, scheduler=scheduler,
                        checkpoint={"dir": str(tmp_path / "ckpt"), "every": 2})
    # slow sessions, so that the killed run leaves work in flight; in stream admission task
    # 1 runs for seconds while steps train the tasks after it, so the checkpoint the trainer
    # resumes from is past a task still outstanding (and past tasks trained ahead of it)
    slow = {"1": 6.0} if admission == "stream" else {}
    run = LocalRun(config, tmp_path, ranks=1, consumers=1, slots=8, source=SOURCE,
                   source_args=source_args(config, redis_config, delay_s=0.2, slow_tasks=slow))
    run.start()
    deadline = time.monotonic() + 200
    while len(records(tmp_path)) < 4 and time.monotonic() < deadline:  # steps 0..3 done
        assert run.trainers[0].alive, run.logs()
        time.sleep(0.05)
    # the consumer is frozen, so the killed run's work stays in flight until the resumed
    # run opens its epoch (the resumed trainer takes longer to start than a batch takes)
    run.consumers[0].signal(signal.SIGSTOP)
    run.trainers[0].kill()  # kill -9 mid-run: the newest checkpoint is at step 4 (or 2)
    first = records(tmp_path)
    killed_epoch = first[-1]["epoch"]
    run.start_trainer()  # the same command: resumes from the newest checkpoint
    while int(r.get(keys.epoch(0)) or 0) <= killed_epoch + 1 and time.monotonic() < deadline + 120:
        assert run.trainers[0].alive, run.logs()
        time.sleep(0.05)
    while not _admitted_everything(r, keys.tasks(0)):  # the admission consumer reads the new epoch
        assert time.monotonic() < deadline + 150, run.logs()
        time.sleep(0.05)
    run.consumers[0].signal(signal.SIGCONT)
    codes = finish(run)
    assert codes == [0], run.logs()
    rows = records(tmp_path)
    resumed = [row for row in rows if row["run"] != first[0]["run"]]
    at = resumed[0]["step"]
    assert at in (2, 4) and at <= len(first)
    lineage = [row for row in first if row["step"] < at] + resumed
    assert [row["step"] for row in lineage] == list(range(7))
    trained = [task for row in lineage for task in row["tasks"]]
    assert len(trained) == len(set(trained)), "a task trained twice"
    if admission == "batch":
        assert sorted(trained, key=int) == [str(t) for t in range(7 * BATCH)]  # none dropped
    else:
        # every task of the batches the lineage read is trained once, dropped with a cause,
        # or still outstanding in the final checkpoint (a resumed run would register it
        # first); tasks of later batches may have been trained ahead
        left = outstanding(tmp_path / "ckpt")
        dropped = [task for row in lineage for task, _ in row["dropped_tasks"]]
        ended = set(trained) | set(dropped) | set(left)
        assert {str(t) for t in range(7 * BATCH)} <= ended
        assert not set(trained) & set(left) and not set(dropped) & set(left)
        ahead = [t for row in lineage for t in row["tasks"] if int(t) // BATCH > row["step"]]
        assert ahead, "no step trained a task of a later batch: the stream path was not exercised"
    assert all(row["epoch"] > killed_epoch for row in resumed)
    # the new epoch cancelled what the killed run left in flight
    cancels = [wire.from_fields(f, wire.Cancel) for _, f in r.xrange(keys.control)]
    assert any(c.epoch == killed_epoch and c.reason == "epoch" for c in cancels)
    # versions only grow across the restart: the resumed run pushes its checkpoint's weights
    # first, under a version past every one the killed run announced
    assert resumed[0]["pushed"] is not None
    assert resumed[0]["pushed"] > max(row["pushed"] or 0 for row in first)
    pushed = [row["pushed"] for row in lineage if row["pushed"] is not None]
    assert pushed == sorted(set(pushed))


def outstanding(ckpt: Path) -> list[str]:
    """The task ids the newest checkpoint's task-stream position carries (rank 0)."""
    import msgpack

    name = (ckpt / "latest").read_text().strip()
    data = msgpack.unpackb((ckpt / name / "rollstream-rank0.msgpack").read_bytes(), raw=False)
    return [task_id for task_id, _ in data["carry"]]


@SERVER
def test_sigterm_stops_after_the_step_checkpoints_and_exits_zero(tmp_path, redis_config, r, keys):
    config = run_config(redis_config, tmp_path, steps=50,
                        checkpoint={"dir": str(tmp_path / "ckpt"), "every": 0})
    run = LocalRun(config, tmp_path, ranks=1, consumers=1, slots=8)
    run.start()
    deadline = time.monotonic() + 200
    while len(records(tmp_path)) < 2 and time.monotonic() < deadline:
        assert run.trainers[0].alive, run.logs()
        time.sleep(0.05)
    run.trainers[0].signal(signal.SIGTERM)
    codes = finish(run)
    assert codes == [0], run.logs()
    done = len(records(tmp_path))
    assert 2 <= done < 50
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"step{done:08d}"
