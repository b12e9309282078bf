import json
from pathlib import Path

import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config import (
    AdmissionConfig,
    ConfigError,
    ConsumerConfig,
    RedisConfig,
    SchedulerConfig,
    build,
    load,
    load_scheduler_section,
)


def refused(model, data, *needles):
    with pytest.raises(ConfigError) as info:
        build(model, data)
    message = str(info.value)
    assert message.startswith(f"invalid {model.__name__}: ")
    for needle in needles:
        assert needle in message, message
    return message


def test_defaults_validate():
    s = SchedulerConfig()
    assert (s.groups, s.oversample, s.group_size, s.max_lag, s.ahead, s.sync_every) == (4, 0, 4, 1, 1, 1)
    assert (s.estimator, s.truncation, s.admission) == ("group", "mask", "batch")
    assert build(SchedulerConfig, {}) == s
    a = build(AdmissionConfig, {})
    assert a.redis.url == "redis://127.0.0.1:6379/0" and a.redis.namespace == "default" and a.shard == 0
    assert a.scheduler == s
    c = build(ConsumerConfig, {})
    assert c.slots == 8 and c.source == "consumers.sources.sleep:SleepSource"


def test_group_size_counts_oversample():
    assert build(SchedulerConfig, {"groups": 8, "oversample": 2}).group_size == 10


def test_max_lag_bound():
    msg = refused(SchedulerConfig, {"max_lag": 2, "ahead": 2, "sync_every": 2}, "max_lag=2", "= 3")
    assert "ahead + sync_every - 1" in msg
    assert build(SchedulerConfig, {"max_lag": 3, "ahead": 2, "sync_every": 2}).max_lag == 3
    assert build(SchedulerConfig, {"max_lag": 0, "ahead": 0, "sync_every": 1}).max_lag == 0
    refused(SchedulerConfig, {"max_lag": 0, "ahead": 1}, "max_lag=0", "= 1")


def test_admit_and_batch_size():
    refused(SchedulerConfig, {"admit": 9, "batch_size": 8}, "admit=9", "batch_size=8")
    assert build(SchedulerConfig, {"admit": 8, "batch_size": 8}).admit == 8
    assert build(SchedulerConfig, {"admit": 9}).admit == 9  # batch size not known yet
    refused(SchedulerConfig, {"admit": 0}, "admit")


def test_inflight_samples_at_least_one_group():
    refused(SchedulerConfig, {"inflight_samples": 5, "groups": 4, "oversample": 2}, "inflight_samples=5", "= 6")
    assert build(SchedulerConfig, {"inflight_samples": 6, "groups": 4, "oversample": 2}).inflight_samples == 6


@pytest.mark.parametrize(
    "data, field",
    [
        ({"oversample": -1}, "oversample"),
        ({"groups": 0}, "groups"),
        ({"sync_every": 0}, "sync_every"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": float("nan")}, "timeout_s"),
        ({"width": 0}, "width"),
        ({"truncation": "drop"}, "truncation"),
        ({"estimator": "ppo"}, "estimator"),
        ({"admission": "greedy"}, "admission"),
        ({"grups": 4}, "grups"),
        ({"groups": "four"}, "groups"),
    ],
)
def test_field_rules(data, field):
    msg = refused(SchedulerConfig, data, f"{field}: ")
    if field == "truncation":
        assert "'mask', 'score' or 'zero'" in msg
    if field == "grups":
        assert "Extra inputs are not permitted" in msg


def test_every_offending_field_is_named():
    msg = refused(SchedulerConfig, {"estimator": "x", "truncation": "y", "oversample": -1},
                  "estimator: ", "truncation: ", "oversample: ")
    assert msg.count(";") == 2


def test_nested_fields_are_dotted():
    refused(AdmissionConfig, {"scheduler": {"max_lag": -1}}, "scheduler.max_lag: ")
    refused(AdmissionConfig, {"redis": {"namespace": "a b"}}, "redis.namespace: ")
    refused(ConsumerConfig, {"redis": {"bogus": 1}}, "redis.bogus: ")
    # a cross-field rule names its model and the values it compared
    refused(AdmissionConfig, {"scheduler": {"max_lag": 0, "ahead": 2}}, "scheduler: ", "max_lag=0")


@pytest.mark.parametrize("url", ["http://localhost:6379", "localhost:6379", "", "redis:/x"])
def test_redis_url_scheme(url):
    refused(RedisConfig, {"url": url}, "url must start with redis://")
    refused(AdmissionConfig, {"redis": {"url": url}}, "redis.url: ", "url must start")


@pytest.mark.parametrize("url", ["redis://:s3cret@h:1/0", "rediss://user:s3cret@h:6380/2", "http://u:s3cret@h"])
def test_a_password_in_the_url_is_refused_without_showing_it(url):
    message = refused(AdmissionConfig, {"redis": {"url": url}}, "redis.url: ")
    assert "s3cret" not in message


@pytest.mark.parametrize("url", ["redis://h:1/0", "rediss://user@h:6380/2", "unix:///tmp/redis.sock"])
def test_redis_url_accepted(url):
    assert build(RedisConfig, {"url": url}).url == url


def test_redis_password(tmp_path, monkeypatch):
    monkeypatch.setenv("RS_TEST_PW", "s3cret")
    assert build(RedisConfig, {"password_env": "RS_TEST_PW"}).password() == "s3cret"
    monkeypatch.setenv("RS_TEST_PW", "")
    assert build(RedisConfig, {"password_env": "RS_TEST_PW"}).password() is None
    f = tmp_path / "pw"
    f.write_text("fromfile\n")
    assert build(RedisConfig, {"password_file": str(f), "password_env": "RS_TEST_PW"}).password() == "fromfile"
    assert build(RedisConfig, {"password_env": None}).password() is None


def test_consumer_grace():
    refused(ConsumerConfig, {"grace_s": 301, "lease_s": 30}, "grace_s=301", "lease_s=30")
    assert build(ConsumerConfig, {"grace_s": 300, "lease_s": 30}).grace_s == 300
    refused(ConsumerConfig, {"source": "not a path"}, "source: ")


def test_models_are_frozen():
    s = SchedulerConfig()
    with pytest.raises(pydantic.ValidationError):
        s.groups = 3


def test_load_yaml(tmp_path):
    p = tmp_path / "admission.yaml"
    p.write_text("shard: 2\nscheduler:\n  groups: 8\n  oversample: 2\n  truncation: score\nredis:\n  namespace: exp1\n")
    cfg = load(AdmissionConfig, p)
    assert cfg.shard == 2 and cfg.scheduler.group_size == 10 and cfg.scheduler.truncation == "score"
    assert cfg.redis.namespace == "exp1"
    assert load(AdmissionConfig, str(p)) == cfg


def test_load_json(tmp_path):
    p = tmp_path / "scheduler.json"
    p.write_text(json.dumps({"groups": 2, "admission": "stream", "inflight_samples": 64}))
    cfg = load(SchedulerConfig, p)
    assert (cfg.groups, cfg.admission, cfg.inflight_samples) == (2, "stream", 64)


def test_load_empty_file_is_defaults(tmp_path):
    p = tmp_path / "empty.yaml"
    p.write_text("")
    assert load(SchedulerConfig, p) == SchedulerConfig()


def test_load_refuses(tmp_path):
    cases = {
        "list.yaml": ("- 1\n- 2\n", "must be a mapping", "list"),
        "scalar.yaml": ("3\n", "must be a mapping", "int"),
        "list.json": ("[1]", "must be a mapping", "list"),
        "bad.yaml": ("groups: [1, 2\n", "not valid YAML", None),
        "bad.json": ("{groups: 1}", "not valid JSON", None),
        "invalid.yaml": ("scheduler:\n  max_lag: -1\n", "scheduler.max_lag", None),
    }
    for name, (text, needle, extra) in cases.items():
        p = tmp_path / name
        p.write_text(text)
        with pytest.raises(ConfigError) as info:
            load(AdmissionConfig, p)
        assert needle in str(info.value), (name, str(info.value))
        if extra:
            assert extra in str(info.value)
    with pytest.raises(ConfigError, match="cannot read config"):
        load(SchedulerConfig, tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="cannot read config"):
        load(SchedulerConfig, tmp_path)  # a directory


def test_load_refuses_non_utf8(tmp_path):
    p = tmp_path / "binary.yaml"
    p.write_bytes(b"\xff\xfe\x00groups: 4\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load(SchedulerConfig, p)


def test_redis_url_scheme_is_case_insensitive():
    assert build(RedisConfig, {"url": "REDIS://x:6379"}).url == "REDIS://x:6379"


@pytest.mark.parametrize("data,needle", [
    ({"groups": True}, "groups"), ({"groups": "4"}, "groups"), ({"groups": 4.0}, "groups"),
    ({"timeout_s": float("inf")}, "timeout_s"),
])
def test_values_are_not_coerced(data, needle):
    refused(SchedulerConfig, data, needle)


values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
FIELDS = sorted(SchedulerConfig.model_fields)
scheduler_dicts = st.dictionaries(
    st.sampled_from(FIELDS) | st.text(max_size=8),
    st.integers(-3, 12) | st.sampled_from(["group", "rloo", "mask", "zero", "stream", "batch"]) | values,
    max_size=8,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scheduler_dicts)
def test_build_validates_or_raises_config_error(data):
    try:
        cfg = build(SchedulerConfig, data)
    except ConfigError as err:
        assert str(err).startswith("invalid SchedulerConfig: ")
        return
    assert isinstance(cfg, SchedulerConfig)
    assert set(data) <= set(FIELDS)
    assert cfg.max_lag >= cfg.ahead + cfg.sync_every - 1
    if cfg.inflight_samples is not None:
        assert cfg.inflight_samples >= cfg.group_size


@settings(max_examples=100, deadline=None)
@given(st.one_of(values, st.dictionaries(st.integers() | st.text(max_size=4), values, max_size=3)))
def test_build_any_value(data):
    try:
        assert isinstance(build(AdmissionConfig, data), AdmissionConfig)
    except ConfigError:
        pass


def test_stream_registers_a_task_window_sized_from_the_inflight_target():
    from pipeline.config import SchedulerConfig

    assert SchedulerConfig(admission="batch", ahead=2, max_lag=2).registered_ahead == 2
    stream = {"admission": "stream", "groups": 8, "batch_size": 32}
    assert SchedulerConfig(**stream, ahead=1).registered_ahead == 6  # 3 x (ahead + 1) batches
    # 256 samples in flight = one batch of groups of 8: three batches registered ahead
    assert SchedulerConfig(**stream, inflight_samples=256).registered_ahead == 3
    assert SchedulerConfig(**stream, inflight_samples=256, ahead=4, max_lag=4).registered_ahead == 4
    assert SchedulerConfig(**stream, supply=1, ahead=2, max_lag=2).registered_ahead == 2
    assert SchedulerConfig(**stream, supply=9).registered_ahead == 9


def test_the_scheduler_section_of_a_trainer_or_admission_config(tmp_path):
    examples = Path(__file__).resolve().parents[2] / "examples" / "local"
    admission = load_scheduler_section(examples / "admission.yaml")
    trainer = load_scheduler_section(examples / "trainer.yaml")
    assert (admission.groups, admission.max_lag, admission.batch_size) == (16, 1, None)
    assert (trainer.groups, trainer.max_lag, trainer.batch_size) == (16, 1, 8)  # from data.batch_size
    own = tmp_path / "own.json"
    own.write_text('{"scheduler": {"groups": 4, "batch_size": 6}, "data": {"batch_size": 8}}')
    assert load_scheduler_section(own).batch_size == 6  # the section's own wins
    own.write_text('{"scheduler": {"groups": 4, "max_lag": 0}}')
    with pytest.raises(ConfigError, match=f"config {own}: scheduler: .*max_lag"):
        load_scheduler_section(own)
