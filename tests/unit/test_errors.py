"""The one error path of every command (`pipeline.errors`) and what feeds it: config
messages that name the field they are close to or the section they belong to, metrics
addresses with `+shard` / `+rank`, a Redis URL's user, sources that cannot be loaded, and
waits for Redis that a stop ends."""

from __future__ import annotations

import threading

import pytest
import redis

from consumers.sources import load_source
from pipeline.config import (
    AdmissionConfig, ConfigError, ConsumerConfig, RedisConfig, SchedulerConfig, build, metrics_address,
)
from pipeline.errors import CommandError, guarded
from pipeline.redis_io import Interrupted, Outage, RedisUnavailable, ride_out
from trainer.run_config import RunConfig


def refused(model, data) -> str:
    with pytest.raises(ConfigError) as err:
        build(model, data)
    return str(err.value)


@pytest.mark.parametrize("model, data, says", [
    (SchedulerConfig, {"grups": 4}, "grups: Extra inputs are not permitted (did you mean groups?)"),
    (RunConfig, {"sheduler": {}}, "sheduler: Extra inputs are not permitted (did you mean scheduler?)"),
    (ConsumerConfig, {"redis": {"pasword_env": "X"}}, "(did you mean redis.password_env?)"),
    (RunConfig, {"lr": 0.1}, "lr: Extra inputs are not permitted (did you mean trainer.optimizer.lr?)"),
    (RunConfig, {"model": {"kind": "tiny"}}, "model: Extra inputs are not permitted (did you mean trainer.model?)"),
    (RunConfig, {"model": {}, "optimizer": {}, "zero_stage": 1},
     "model, optimizer, zero_stage: Extra inputs are not permitted here; they are fields of the trainer "
     "section: put them under `trainer:`"),
    (ConsumerConfig, {"xyzzy": 1}, "xyzzy: Extra inputs are not permitted"),  # nothing close: no hint
])
def test_an_unknown_field_names_the_field_it_is_close_to_or_its_section(model, data, says):
    msg = refused(model, data)
    assert says in msg and msg.count("did you mean") <= len(data)
    if model is ConsumerConfig and "xyzzy" in data:
        assert "did you mean" not in msg


def test_metrics_addresses_take_the_shard_or_the_rank_as_a_port_offset():
    assert metrics_address("127.0.0.1:9400") == ("127.0.0.1", 9400)
    assert metrics_address(":9400") == ("127.0.0.1", 9400)
    assert metrics_address("[::1]:0") == ("::1", 0)
    assert metrics_address("0.0.0.0:9400+shard", ("shard",), shard=3) == ("0.0.0.0", 9403)
    assert metrics_address("127.0.0.1:9500+rank", ("rank",)) == ("127.0.0.1", 9500)  # the offset unknown yet
    for addr, offsets, says in [("9400", (), "must be host:port"), ("h:9400+rank", ("shard",), "+rank means nothing"),
                                ("h:9400+", ("shard",), "host:port+shard"), ("h:0+shard", ("shard",), "port 0"),
                                ("h:65535+shard", ("shard",), None)]:
        if says is None:
            with pytest.raises(ValueError, match="past 65535"):
                metrics_address(addr, offsets, shard=1)
            continue
        with pytest.raises(ValueError, match=says.replace("+", r"\+")):
            metrics_address(addr, offsets)
    assert build(AdmissionConfig, {}).metrics_addr == "127.0.0.1:9400+shard"
    assert build(RunConfig, {}).metrics_addr == "127.0.0.1:9500+rank"
    assert "+rank means nothing here (only +shard)" in refused(AdmissionConfig, {"metrics_addr": "h:1+rank"})
    assert "+shard means nothing here (give a port, or port 0 for a free one)" in refused(
        ConsumerConfig, {"metrics_addr": "h:1+shard"})


def test_a_urls_user_is_the_user_and_a_second_one_is_refused():
    assert RedisConfig(url="redis://nobody@127.0.0.1:6379/0").user == "nobody"
    assert RedisConfig(url="redis://a%40b@h:1/0").user == "a@b"
    assert RedisConfig(url="redis://h:1/0", username="u").user == "u"
    assert RedisConfig(url="redis://h:1/0").user is None
    assert RedisConfig(url="redis://u@h:1/0", username="u").user == "u"
    assert "url names user 'a' and username is 'b'" in refused(RedisConfig, {"url": "redis://a@h:1/0", "username": "b"})
    assert "password_env" in refused(RedisConfig, {"url": "redis://a:secret@h:1/0"})


def test_a_source_that_cannot_be_loaded_is_a_config_error_naming_source_or_source_args():
    cases = [("no_such_module_xyz:S", {}, "source: cannot import no_such_module_xyz"),
             ("consumers.sources.sleep:Nope", {}, "source: consumers.sources.sleep has no Nope"),
             ("consumers.sources.sleep", {}, "source: must be module:name"),
             ("consumers.sources.sleep:SleepSource", {"env": "x"}, "source_args: .* got an unexpected keyword"),
             ("consumers.sources.sleep:SleepSource", {"median_s": -1}, "source_args: .* refused them: need median_s >= 0"),
             ("consumers.sources.harness:HarnessSource",
              {"gateway": "http://g", "harness": "true", "verifier": "no_such_module_xyz:verify"},
              "source_args.verifier: cannot import no_such_module_xyz")]
    for spec, args, says in cases:
        with pytest.raises(ConfigError, match=says):
            load_source(spec, args)


def test_guarded_prints_one_line_and_the_exit_code_and_the_traceback_only_when_debugging(capsys):
    def config() -> int:
        raise ConfigError("config x.yaml: slots: bad")

    def runtime() -> int:
        raise CommandError("cannot reach Redis at redis://h:1/0 (redis.url): refused")

    def bug() -> int:
        raise KeyError("a bug keeps its traceback")

    assert guarded("rollstream consumer", config, config="x.yaml") == 2
    assert capsys.readouterr().err == "rollstream consumer: config x.yaml: slots: bad\n"
    assert guarded("rollstream status", runtime, config="c.yaml") == 1
    assert capsys.readouterr().err == ("rollstream status: cannot reach Redis at redis://h:1/0 (redis.url): "
                                       "refused (config c.yaml)\n")
    assert guarded("rollstream status", runtime, debug=True) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last)") and err.endswith("(redis.url): refused\n")
    with pytest.raises(KeyError):
        guarded("rollstream x", bug)


def test_a_stop_ends_a_wait_for_redis_at_once():
    stop = threading.Event()
    stop.set()
    outage = Outage("trainer 0: reading ready", 300, stop=stop)
    with pytest.raises(Interrupted, match="trainer 0: reading ready: stopped while Redis was unreachable"):
        outage.pause(redis.exceptions.ConnectionError("refused"))

    # an outage it would ride out for two hours ends when the stop comes
    stop = threading.Event()
    calls = []

    def unreachable():
        calls.append(1)
        raise redis.exceptions.ConnectionError("refused")

    threading.Timer(0.1, stop.set).start()
    with pytest.raises(Interrupted):
        ride_out(unreachable, what="test", total_s=7200, stop=stop, sleep=lambda s: pytest.fail("slept"))
    assert calls
    # without a stop, the outage still ends with RedisUnavailable past total_s
    with pytest.raises(RedisUnavailable):
        ride_out(unreachable, what="test", total_s=0.01, sleep=lambda s: None)
