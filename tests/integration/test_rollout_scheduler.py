"""The trainer's facade end to end: embedded Redis, in-process admission and rollout
consumers, real packing; and a failing source failing the call."""

from collections import Counter

import pytest
import redis

from consumers.sources.scripted import ScriptedSource
from pipeline.errors import ConfigError
from consumers.sources.sleep import SleepSource
from producers.trainer_link import StepFailed
from trainer.rollout_scheduler import RolloutScheduler, VocabError

pytestmark = pytest.mark.timeout(120)


class Publisher:
    def __init__(self):
        self.loads = []

    def load(self, variables, version):
        self.loads.append((variables, version))


def batches(n, size=4):
    return [{"task_id": list(range(i * size, (i + 1) * size))} for i in range(n)]


@pytest.mark.redis
def test_each_call_returns_the_packed_rows_of_its_batch_and_logs_a_record():
    records, pub = [], Publisher()
    with RolloutScheduler(None, SleepSource(median_s=0.005, seed=0), pub, width=128, rows=4,
                          groups=2, ahead=1, max_lag=1, log=records.append) as sched:
        for i, batch in enumerate(sched.tasks(batches(4))):
            rows = sched(batch, f"weights-{i}")
            assert tuple(rows.tokens.shape) == (4, 128)
            assert int(rows.loss_mask.sum()) == 4 * 2 * 16  # 4 groups x 2 samples x 16 tokens
        assert [r.groups for r in records] == [4, 4, 4, 4]
        assert [r.updates for r in records] == [0, 1, 2, 3]
        assert all(r.lag <= 1 for r in records) and all(r.waited >= 0 for r in records)
        assert all(r.metrics["reward_mean"] >= 0 for r in records)
    # weights are pushed whenever the served version falls sync_every (1) behind
    assert pub.loads == [("weights-1", 1), ("weights-2", 2), ("weights-3", 3)]


@pytest.mark.redis
def test_a_source_that_raises_fails_the_call_with_its_traceback():
    source = ScriptedSource(rules=[{"task": "2", "sample": 0, "raise": "environment exploded"}])
    with RolloutScheduler(None, source, Publisher(), width=64, rows=4, groups=2, ahead=0,
                          max_lag=0) as sched:
        stream = iter(sched.tasks(batches(2, size=2)))
        sched(next(stream), None)
        with pytest.raises(StepFailed, match="environment exploded"):
            sched(next(stream), None)


class LosesRedisOnce(SleepSource):
    """Its first session raises what a weights fetch raises while Redis restarts."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.raised = 0

    def run(self, request):
        if not self.raised:
            self.raised += 1
            raise redis.exceptions.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        return super().run(request)


@pytest.mark.redis
def test_a_source_that_loses_redis_fails_the_attempt_not_the_step():
    records = []
    source = LosesRedisOnce(median_s=0.002, seed=0)
    with RolloutScheduler(None, source, Publisher(), width=64, rows=4, groups=2, ahead=0,
                          max_lag=1, log=records.append) as sched:
        for batch in sched.tasks(batches(2, size=2)):
            sched(batch, None)
    assert source.raised == 1
    assert [r.groups for r in records] == [2, 2]
    assert +Counter(records[0].resubmitted) == {"infra_error": 1}


def test_a_filtered_sampling_source_without_support_capacity_is_refused():
    class TopK(SleepSource):
        filtered = True

    with pytest.raises(ValueError, match="support_capacity"):
        RolloutScheduler(None, TopK(), Publisher(), width=64, rows=2)


def test_construction_refuses_a_staleness_bound_below_ahead_plus_sync_every():
    with pytest.raises(ValueError, match="max_lag"):
        RolloutScheduler(None, SleepSource(), Publisher(), width=64, rows=2, ahead=2, max_lag=1)


@pytest.mark.redis
def test_status_shows_a_live_pipeline(capsys):
    import json
    import time

    from rollstream import cli, status

    with RolloutScheduler(None, SleepSource(median_s=5.0, sigma=0.0, seed=0), Publisher(),
                          width=64, rows=4, groups=2, ahead=1, max_lag=1, admission="stream",
                          slots=3) as sched:
        stream = iter(sched.tasks(batches(3, size=2)))
        next(stream)
        # stream mode backfills at registration: (ahead + 1) batches' worth is submitted
        deadline = time.monotonic() + 20
        while True:
            snap = status.collect(sched.r, sched.keys)
            work = snap["streams"].get(sched.keys.work, {"groups": [{"pending": 0}]})["groups"][0]
            # three slots busy (pending), the rest waits in the stream (lag)
            if snap["in_flight"] == 8 and work["pending"] == 3 and snap["consumers_alive"]:
                break
            assert time.monotonic() < deadline, snap
            time.sleep(0.05)
        assert work["lag"] == 5
        url = sched.redis_config.url
        assert cli.main(["status", "--url", url, "--namespace", sched.keys.namespace,
                         "--json"]) == 0
        printed = json.loads(capsys.readouterr().out)
        assert printed["in_flight"] == 8 and printed["namespace"] == sched.keys.namespace


def test_status_never_shows_credentials():
    from rollstream.status import redact

    assert redact("rediss://user:s3cret@redis.example:6380/0") == "rediss://redis.example:6380/0"
    assert "s3cret" not in redact("redis://:s3cret@host/1")


@pytest.mark.redis
def test_a_dead_in_process_consumer_fails_the_call_at_once():
    import time

    class Crashing:
        """Kills the rollout consumer: a BaseException is no source error (that would be a
        failed step), it takes the consumer's thread down."""

        def run(self, request):
            raise SystemExit("the rollout thread is gone")

    with RolloutScheduler(None, Crashing(), Publisher(), width=64, rows=2, groups=1, ahead=0,
                          max_lag=0, step_timeout_s=600) as sched:
        stream = iter(sched.tasks(batches(1, size=1)))
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="consumer died"):
            sched(next(stream), None)
        assert time.monotonic() - start < 30


@pytest.mark.redis
def test_max_message_bytes_refuses_an_oversized_registration_and_writes_nothing():
    from pipeline.sessions import Task
    from pipeline.wire import SchemaError

    def big(batch):
        return [Task(str(i), {"blob": "x" * 4096}) for i in batch["task_id"]]

    with RolloutScheduler(None, SleepSource(median_s=0.002, seed=0), Publisher(), width=64, rows=2,
                          groups=2, tasks=big, max_message_bytes=2048) as sched:
        with pytest.raises(SchemaError, match="refused"):
            next(iter(sched.tasks(batches(1))))
        assert sched.r.xlen(sched.keys.tasks(0)) == 1  # the epoch's Open, not the registration


@pytest.mark.redis
def test_rows_beyond_the_models_context_are_refused_naming_the_setting():
    # chains of 32 tokens for a model of 16 positions (ids beyond the vocabulary:
    # tests/integration/test_start_errors.py, through `rollstream trainer`)
    with RolloutScheduler(None, SleepSource(median_s=0.005, seed=0, vocab=64), Publisher(), width=128,
                          rows=4, groups=2, vocab=64, context=16) as sched:
        with pytest.raises(VocabError, match=r"position 31, beyond the model's 16 positions.*scheduler.width"):
            sched(next(iter(sched.tasks(batches(1)))), None)


# ------------------------------------------------------------- one scheduler config per run


def _facade(redis_config, **rules):
    return RolloutScheduler(None, None, Publisher(), width=64, rows=4, groups=2, redis=redis_config,
                            step_timeout_s=20, **rules)


@pytest.mark.redis
@pytest.mark.parametrize("redis_url", ["server"], indirect=True)
def test_a_trainer_whose_scheduler_config_differs_from_the_running_admission_is_refused_at_start(
        redis_config, r, threads):
    threads.admission(shard=0, block_ms=20, scheduler={"groups": 2, "width": 64, "rows": 4,
                                                       "ahead": 1, "max_lag": 1})
    with pytest.raises(ConfigError) as info:
        _facade(redis_config, ahead=1, max_lag=2, admission="stream")
    message = str(info.value)
    assert "max_lag: 2 != 1" in message and "admission: 'stream' != 'batch'" in message
    assert "groups" not in message  # only the fields that differ
    with _facade(redis_config, ahead=1, max_lag=1) as sched:  # the same section starts
        assert sched.config.max_lag == 1


@pytest.mark.redis
@pytest.mark.parametrize("redis_url", ["server"], indirect=True)
def test_an_admission_started_under_another_config_refuses_the_trainer_s_epoch(redis_config, r, keys, threads):
    with _facade(redis_config, ahead=0, max_lag=0, max_attempts=5) as sched:
        stream = iter(sched.tasks(batches(2, size=2)))
        batch = next(stream)  # the epoch is opened before any admission consumer runs
        threads.admission(shard=0, block_ms=20, scheduler={"groups": 2, "width": 64, "rows": 4,
                                                           "ahead": 0, "max_lag": 0})
        with pytest.raises(StepFailed, match=r"max_attempts: 5 != 3"):
            sched(batch, None)
    dead = [f[b"reason"].decode() for _, f in r.xrange(keys.dead)]
    assert any("scheduler config differs" in reason for reason in dead)
