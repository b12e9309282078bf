"""Fuzzing the config loader: for every config model, arbitrary mappings (the model's own
field names, nested sections included, and unknown ones, with values of every type), their
YAML and JSON files, and arbitrary YAML-like text either give a valid config or raise
`ConfigError`, whose every clause names the offending field (`scheduler.max_lag: ...`);
never another exception.

`ROLLSTREAM_PROPERTY_EXAMPLES=N` sets the examples per test (default 20; raise it for a
soak run).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from pipeline.config import (
    AdmissionConfig, ConfigError, ConsumerConfig, RedisConfig, SchedulerConfig, _name, build, load)

EXAMPLES = int(os.environ.get("ROLLSTREAM_PROPERTY_EXAMPLES", "20"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MODELS = (SchedulerConfig, RedisConfig, AdmissionConfig, ConsumerConfig)

scalars = (st.none() | st.booleans() | st.integers(-3, 70_000) | st.integers() | st.floats()
           | st.sampled_from([math.nan, math.inf, "", "0", "1.5", "redis://h:1/0", "rediss://h", "a:b", "x.y:Z",
                              "batch", "stream", "mask", "rloo", "127.0.0.1:0", "run-1"])
           | st.text(max_size=8))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


def _section(model: type[BaseModel]) -> st.SearchStrategy[dict]:
    """Mappings over `model`'s fields (a nested model's own fields for a section), plus
    unknown keys, with values of any type."""
    fields = {}
    for name, info in model.model_fields.items():
        sub = info.annotation if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel) else None
        fields[name] = (_section(sub) | values) if sub is not None else values
    known = st.fixed_dictionaries({}, optional=fields)
    # unknown keys of any text but the one-line message's separators ("; " between
    # clauses, ": " after a field's name), which a reader could not tell from the message
    keys = st.text(max_size=6).filter(lambda k: "; " not in k and ": " not in k)
    unknown = st.dictionaries(keys | st.integers(), values, max_size=2)
    return st.builds(lambda a, b, extra: {**a, **b} if extra else a, known, unknown, st.booleans())


def _names_the_fields(model: type[BaseModel], message: str, data: dict) -> None:
    assert message.startswith(f"invalid {model.__name__}: "), message
    for clause in message.removeprefix(f"invalid {model.__name__}: ").split("; "):
        where, sep, reason = clause.partition(": ")
        assert sep and reason, clause
        if where == "(config)":  # a cross-field rule names its fields in the reason
            assert "=" in reason, clause
            continue
        names = {*model.model_fields, *(_name(key) for key in data), *(repr(str(key)) for key in data)}
        assert any(where == name or where.startswith(f"{name}.") for name in names), clause


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
@FUZZ
@given(data=st.data())
def test_mappings_build_or_name_the_field(model, data):
    raw = data.draw(_section(model), label="config")
    try:
        config = build(model, raw)
    except ConfigError as err:
        _names_the_fields(model, str(err), raw)
        return
    assert isinstance(config, model)
    assert set(map(str, raw)) <= set(model.model_fields)
    assert build(model, config.model_dump(mode="json")) == config  # what loads, dumps and loads again


def _load_text(model: type[BaseModel], text: str, suffix: str):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"config{suffix}"
        path.write_text(text, encoding="utf-8")
        return load(model, path)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
@FUZZ
@given(data=st.data(), suffix=st.sampled_from([".yaml", ".json"]))
def test_config_files_load_or_name_the_field(model, data, suffix):
    raw = data.draw(_section(model), label="config")
    try:
        text = json.dumps(raw) if suffix == ".json" else yaml.safe_dump(raw)
    except (TypeError, ValueError):  # not representable in the format (a non-str key in JSON)
        return
    try:
        config = _load_text(model, text, suffix)
    except ConfigError as err:
        if str(err).startswith("invalid "):
            _names_the_fields(model, str(err), raw)
        return
    assert isinstance(config, model)


yaml_pieces = st.sampled_from([
    "groups", "redis", "scheduler", "url", "slots", ": ", ":", "\n", "  ", "- ", "-", "[", "]", "{", "}", ",",
    "'", '"', "#", "&a ", "*a", "!!str ", "!!int ", "!!float ", "!!binary ", "!!timestamp ", "!!python/name:os.system",
    "!!set ", "? ", "|", ">", "~", "null", "true", "yes", "1", "-1", "0x1F", "1e400", ".nan", ".inf", "2001-12-14",
    "2001-13-45", "2001-02-30 25:61:61", "99999999999999999999", "\t", "%YAML 1.1\n", "---\n", "...\n", "\x00",
    "é", "\ufeff",
])


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
@FUZZ
@given(pieces=st.lists(yaml_pieces | st.text(max_size=4), max_size=24), suffix=st.sampled_from([".yaml", ".json"]))
def test_arbitrary_text_loads_or_is_refused(model, pieces, suffix):
    try:
        assert isinstance(_load_text(model, "".join(pieces), suffix), model)
    except ConfigError as err:
        assert str(err)


@pytest.mark.parametrize("text", ["groups: 2001-13-01", "scheduler: {groups: 2001-02-30}", "a: 1\nb: 2001-12-14 99:00:00",
                                  "groups: 1" + "0" * 5000, "!!float ", "!!int ", "slots: !!bool x",
                                  "slots: !!timestamp x", "slots: !!int 0b"])
def test_values_yaml_cannot_construct_are_a_config_error(text, tmp_path):
    """Found by the fuzzing: a YAML timestamp that is not a date (month 13), or an explicit
    tag on a value it cannot convert (`!!float` of nothing, `!!bool x`), made the loader
    raise PyYAML's ValueError, IndexError, KeyError or AttributeError instead of
    ConfigError naming the file."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="c.yaml"):
        load(AdmissionConfig, path)


def test_the_default_size_limit_is_the_wires():
    from pipeline import config, wire

    assert config.MAX_MESSAGE_BYTES == wire.MAX_MESSAGE_BYTES
    assert build(AdmissionConfig, {}).max_message_bytes == build(ConsumerConfig, {}).max_message_bytes == wire.MAX_MESSAGE_BYTES
    assert build(AdmissionConfig, {}).vocab is None
    refused = pytest.raises(ConfigError, match="max_message_bytes")
    with refused:
        build(ConsumerConfig, {"max_message_bytes": 10})
