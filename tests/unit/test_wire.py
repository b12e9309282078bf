import math

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pipeline import wire
from pipeline.chains import merge_calls, merge_ratio
from pipeline.packing import Rollout
from pipeline.ready import ReadyRecord
from pipeline.sessions import Call, Session, Status, Task
from pipeline.wire import (
    SCHEMA_VERSION,
    Cancel,
    Handover,
    Open,
    Ready,
    Record,
    Registration,
    Result,
    SchemaError,
    Weights,
    Work,
    decode,
    encode,
    from_fields,
    to_fields,
)

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def call(n_prompt=3, n_completion=2, version=1, support=False):
    return Call(
        prompt_ids=list(range(1, n_prompt + 1)),
        completion_ids=list(range(100, 100 + n_completion)),
        logprobs=[-0.5 - i for i in range(n_completion)],
        version=version,
        support=np.arange(n_completion * 3).reshape(n_completion, 3) - 1 if support else None,
    )


def chains(*calls):
    return tuple(merge_calls(calls))


def result(**kw):
    fields = {
        "shard": 0, "epoch": 1, "group": 2, "sample": 3, "attempt": 0, "consumer": "pod-a",
        "status": Status.COMPLETED, "reward": 1.0, "components": {"format": 0.5},
        "chains": chains(call(), call(support=True)), "truncation": None, "timings": {"run_s": 1.25},
        "error": None,
    }
    fields.update(kw)
    return Result(**fields)


TASK = Task("t-1", {"prompt": "2+2?", "answer": 4, "tags": ["a", None, 1.5, b"x", {"k": True}]})

EXAMPLES = [
    Open(0, 3),
    Registration(1, 0, 7, (TASK, Task("t-2"))),
    Registration(0, 0, 0, ()),
    Handover(0, 1, 5, 5, None),
    Handover(0, 1, 5, 5, 4),
    Handover(0, 1, 5, 5, 4, 0),
    Handover(0, 1, 5, 5, None, 11),
    Work(0, 1, 2, 3, 1, TASK, 4, 1.7e9, "stale"),
    Work(0, 1, 2, 3, 0, TASK, 4),
    Cancel(0, 1, 2, 3, 1, "stale"),
    result(),
    result(chains=(), reward=None, status=Status.INFRA_ERROR, error="Traceback ...\nBoom"),
    result(chains=chains(call(0, 0), call(5, 0, support=True)), status=Status.TRUNCATED, truncation="length"),
    result(chains=chains(call(3, 2), Call([1, 2, 3, 100, 101, 7], [8], [-0.25], 2))),  # one merged chain
    Weights(3, "s3://bucket/v3", "sha256:abc", 123),
    Open(1, 4, {"groups": 8, "max_lag": 2, "admission": "stream", "timeout_s": None}),
    Record(0, 1, 2, 2, 1, 1, 4, {}, 3, 0, 1, 0.25, {}, refused=1, surplus=2, overlong=3),
    Ready(0, 1, 3, 3, {}, None, error="Traceback ...\nBoom"),
    Ready(0, 1, 2, 2, {
        "tokens": np.arange(12, dtype=np.int32).reshape(3, 4),
        "advantages": np.linspace(-1, 1, 8, dtype=np.float32),
        "positions": np.arange(5, dtype=np.int64),
        "weights": np.ones((2, 2, 2), dtype=np.float64),
        "mask": np.array([True, False, True]),
        "bytes": np.arange(4, dtype=np.uint8),
        "scalar": np.array(2.5, dtype=np.float32),
        "empty": np.zeros((0, 3), dtype=np.int32),
    }, ReadyRecord(updates=2, version=2, lag=0, groups=1, resubmitted={"stale": 1}, cancelled=0, abandoned=0,
                   cut=0, waited=0.5, metrics={"reward_mean": 0.5}, admitted=((4, 1, "t1.0"),), packed=(4,))),
    Record(0, 1, 2, 2, 1, 1, 4, {"stale": 2, "infra_error": 1}, 3, 0, 1, 0.25, {"reward_mean": 0.5}),
]


def raw(msg):
    return msgpack.unpackb(encode(msg), raw=False)


def refused(data, field, match=None, **kw):
    if not isinstance(data, (bytes, bytearray)):
        data = msgpack.packb(data, use_bin_type=True)
    with pytest.raises(SchemaError) as info:
        decode(data, **kw)
    assert info.value.field == field, str(info.value)
    assert str(info.value) == f"{field}: {info.value.reason}"
    if match:
        assert match in info.value.reason
    return info.value


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    out = decode(encode(msg))
    assert type(out) is type(msg)
    assert out == msg
    assert decode(encode(msg), expect=type(msg)) == msg
    assert from_fields(to_fields(msg)) == msg


def test_equality_sees_array_contents():
    assert result() != result(chains=chains(call(version=2), call(support=True)))
    assert result() != result(chains=chains(call()))
    ready = EXAMPLES[-2]
    other = Ready(**{**ready.__dict__, "arrays": {**ready.arrays, "bytes": np.arange(1, 5, dtype=np.uint8)}})
    assert ready != other
    assert Open(0, 1) != Weights(0, "x", "", 0) and Open(0, 1) != (0, 1)


def test_round_trip_keeps_dtypes_shapes_and_writable_arrays():
    ready = decode(encode(EXAMPLES[-2]))
    for name, arr in EXAMPLES[-2].arrays.items():
        assert ready.arrays[name].dtype == arr.dtype and ready.arrays[name].shape == arr.shape
        assert ready.arrays[name].flags.writeable
    res = decode(encode(result()))
    c = res.chains[1]
    assert c.tokens.dtype == np.dtype("<i4") and c.logprobs.dtype == np.dtype("<f4")
    assert c.loss_mask.dtype == bool and c.versions.dtype == np.dtype("<i4")
    assert c.support.shape == (5, 3) and (c.support[:3] == -1).all() and c.support[3, 0] == -1
    assert c.support[3:].tolist() == call(support=True).support.tolist()
    c.logprobs[3] = -9.0  # a decoded array is writable and not shared with the other chain
    assert res.chains[0].logprobs[3] == np.float32(-0.5)
    # when one chain has support, every chain carries one of the same width (all -1 here)
    assert res.chains[0].support.shape == (5, 3) and (res.chains[0].support == -1).all()
    assert isinstance(res.status, Status) and res.status is Status.COMPLETED


def test_arrays_travel_as_packed_little_endian_bytes():
    msg = raw(result())
    assert (msg["v"], msg["k"]) == (SCHEMA_VERSION, "result") == (2, "result")
    c = msg["chains"]
    assert sorted(c) == sorted(["lengths", "calls", "call_tokens", "tokens", "loss_mask", "logprobs",
                                "versions", "version_runs", "support"])
    assert c["lengths"] == np.array([5, 5], "<i4").tobytes()
    assert c["calls"] == np.array([1, 1], "<i4").tobytes()
    assert c["call_tokens"] == np.array([5, 5], "<i8").tobytes()
    assert c["tokens"] == np.array([1, 2, 3, 100, 101] * 2, "<i4").tobytes()
    assert c["loss_mask"] == bytes([0b00011000, 0b11]) == np.packbits([0, 0, 0, 1, 1] * 2, bitorder="little").tobytes()
    # log-probs and support travel for loss (completion) tokens only, versions as runs
    assert c["logprobs"] == np.array([-0.5, -1.5] * 2, "<f4").tobytes()
    assert (c["versions"], c["version_runs"]) == (np.array([1], "<i4").tobytes(), np.array([4], "<i4").tobytes())
    two = raw(result(chains=chains(call(version=1), call(version=2), call(version=2), call(version=1))))
    assert np.frombuffer(two["chains"]["versions"], "<i4").tolist() == [1, 2, 1]
    assert np.frombuffer(two["chains"]["version_runs"], "<i4").tolist() == [2, 4, 2]
    support = np.full((4, 3), -1, "<i4")
    support[2:] = np.arange(6).reshape(2, 3) - 1
    assert c["support"] == {"shape": [4, 3], "data": support.tobytes()}
    assert raw(result(chains=chains(call())))["chains"]["support"] is None
    arrays = raw(EXAMPLES[-2])["arrays"]
    assert arrays["tokens"] == {"dtype": "<i4", "shape": [3, 4], "data": np.arange(12, dtype="<i4").tobytes()}
    assert arrays["mask"]["dtype"] == "|b1" and arrays["scalar"]["shape"] == []
    # bin, not str and not arrays of numbers, in the msgpack bytes themselves
    packed = encode(Result(0, 0, 0, 0, 0, "c", Status.COMPLETED, chains=chains(Call([7], [], [], 0))))
    assert b"tokens\xc4\x04\x07\x00\x00\x00" in packed


def test_big_endian_arrays_are_sent_little_endian():
    arr = np.arange(3, dtype=">i8")
    msg = Ready(0, 0, 0, 0, {"a": arr}, None)
    assert raw(msg)["arrays"]["a"]["dtype"] == "<i8"
    out = decode(encode(msg)).arrays["a"]
    assert out.dtype == np.dtype("<i8") and out.tolist() == [0, 1, 2]


def test_session_round_trip():
    session = Session(Status.TRUNCATED, 0.5, {"x": 1.0}, [call(), call(support=True)], "length", {"run_s": 2.0})
    res = Result.from_session(0, 1, 2, 3, 4, session, "pod-b", error="tb")
    assert (res.shard, res.epoch, res.group, res.sample, res.attempt) == (0, 1, 2, 3, 4)
    assert (res.consumer, res.error) == ("pod-b", "tb")
    back = decode(encode(res))
    assert back.oldest_version == 1
    rollout = back.rollout()
    expect = Rollout.from_session(3, session)
    assert isinstance(rollout, Rollout) and rollout.sample == 3
    assert rollout.status is Status.TRUNCATED and rollout.reward == 0.5 and rollout.truncation == "length"
    assert rollout.components == {"x": 1.0} and rollout.timings == {"run_s": 2.0}
    assert len(rollout.chains) == len(expect.chains) == 2
    for got, want in zip(rollout.chains, expect.chains, strict=True):
        for name in ("tokens", "loss_mask", "logprobs", "versions"):
            assert np.array_equal(getattr(got, name), getattr(want, name)), name
        assert (got.calls, got.call_tokens) == (want.calls, want.call_tokens)
    assert rollout.chains[1].support.tolist() == expect.chains[1].support.tolist()
    assert rollout.chains is back.chains  # no merge, no copy on the admission side


def test_oldest_version_is_the_oldest_completion_token():
    session = Session(Status.COMPLETED, 1.0, calls=[call(version=4), Call([1, 2, 3, 100, 101], [5], [-1.0], 6),
                                                    Call([9], [8], [-1.0], 5)])
    assert Result.from_session(0, 0, 0, 0, 0, session, "c").oldest_version == 4
    assert Result.from_session(0, 0, 0, 0, 0, Session(Status.INFRA_ERROR), "c").oldest_version is None


def test_a_multi_turn_session_carries_each_prompt_token_once():
    """Three turns whose prompts extend each other: the result carries one chain of the
    conversation, not the three prompts, so it encodes smaller than the calls alone."""
    system = list(range(1, 201))  # a 200-token system prompt + task
    turns = [(system, list(range(300, 340)))]  # (prompt, completion)
    for t in (1, 2):
        prompt, completion = turns[-1]
        tool = list(range(500 + 100 * t, 560 + 100 * t))  # 60 tokens of tool output
        turns.append((prompt + completion + tool, list(range(1000 + 50 * t, 1040 + 50 * t))))
    calls = [Call(p, c, [-0.5] * len(c), version=3) for p, c in turns]
    session = Session(Status.COMPLETED, 1.0, calls=calls)
    data = encode(Result.from_session(0, 0, 0, 0, 0, session, "c"))
    call_tokens = sum(len(c.prompt_ids) + len(c.completion_ids) for c in calls)
    (chain,) = decode(data).chains
    assert len(chain) == len(turns[-1][0]) + len(turns[-1][1]) == 440
    assert call_tokens == 240 + 340 + 440
    assert (chain.calls, chain.call_tokens) == (3, call_tokens)
    assert merge_ratio([chain]) == pytest.approx(1 - 440 / call_tokens)
    # on the wire: the chain's tokens once, not each call's prompt again
    tokens = msgpack.unpackb(data)["chains"]["tokens"]
    assert len(tokens) == 4 * len(chain)
    # the calls' arrays alone (prompt and completion ids, log-probs; 4 bytes each) are larger
    calls_bytes = sum(len(c.prompt_ids) * 4 + len(c.completion_ids) * 8 for c in calls)
    assert calls_bytes == 4560
    assert len(data) < 0.8 * calls_bytes


def test_numpy_scalars_are_accepted_on_encode():
    msg = Record(np.int64(0), 1, 2, 2, 1, 1, 4, {"stale": np.int32(2)}, 0, 0, 0, np.float32(0.5),
                 {"m": np.float64(0.25)})
    out = decode(encode(msg))
    assert out.shard == 0 and type(out.shard) is int and out.resubmitted == {"stale": 2}
    assert type(out.waited) is float and out.metrics == {"m": 0.25}


def test_expect():
    data = encode(Open(0, 1))
    assert decode(data, expect=(Work, Open)) == Open(0, 1)
    err = refused(data, "k", expect=Work)
    assert "work" in err.reason and "open" in err.reason
    refused(data, "k", expect=(Work, Cancel))


def test_fields_helpers():
    fields = to_fields(Open(2, 3))
    assert list(fields) == [b"m"] and isinstance(fields[b"m"], bytes)
    assert from_fields({"m": fields[b"m"]}) == Open(2, 3)  # a client that decodes field names
    for bad in ({}, {b"x": fields[b"m"]}, None):
        with pytest.raises(SchemaError) as info:
            from_fields(bad)
        assert info.value.field == "m"
    with pytest.raises(SchemaError) as info:
        from_fields({b"m": "text"})
    assert info.value.field == "m"
    with pytest.raises(SchemaError) as info:
        from_fields(fields, expect=Work)
    assert info.value.field == "k"


def test_dead_letter_fields():
    big = b"\x01" * (wire.DEAD_LETTER_BYTES + 10)
    out = wire.dead_letter_fields("rs:{ns}:results:0", b"1-0", "calls.0.logprobs: must be finite", {b"m": big, b"x": b"y"})
    assert out[b"stream"] == b"rs:{ns}:results:0" and out[b"id"] == b"1-0"
    assert out[b"reason"] == b"calls.0.logprobs: must be finite"
    assert out[b"m"] == big[: wire.DEAD_LETTER_BYTES] and out[b"size"] == str(len(big)).encode()
    assert out[b"fields"] == b"m,x"
    assert all(isinstance(k, bytes) and isinstance(v, bytes) for k, v in out.items())
    empty = wire.dead_letter_fields("s", "2-1", "m: missing", {"other": "\udcff"})
    assert empty[b"m"] == b"" and empty[b"size"] == b"0" and empty[b"id"] == b"2-1"
    assert empty[b"fields"] == b"other"


# ---------------------------------------------------------------- malformations


def test_garbage_non_map_and_oversize():
    refused(b"", "message")
    refused(b"\xc1", "message")
    refused(b"\xa3ab", "message")  # truncated str
    refused(b"\xa2\xff\xfe", "message")  # str that is not UTF-8
    refused(encode(Open(0, 0)) + b"\x00", "message")  # trailing bytes
    refused(b"\x91" * 5000, "message")  # nested too deeply for the unpacker
    refused(b"\xdd\xff\xff\xff\xff", "message")  # claims 4G array elements
    refused([1, 2], "message", "map")
    refused("open", "message", "map")
    refused(None, "message")
    refused({1: 2}, "message")  # non-str map key
    with pytest.raises(SchemaError) as info:
        decode("not bytes")
    assert info.value.field == "message"
    data = encode(EXAMPLES[-2])
    refused(data, "message", "exceeds", max_bytes=len(data) - 1)
    assert decode(data, max_bytes=len(data)) == EXAMPLES[-2]
    assert wire.MAX_MESSAGE_BYTES == 64 * 1024 * 1024
    refused(b"\x00" * (wire.MAX_MESSAGE_BYTES + 1), "message", "exceeds")


def test_oversize_encode():
    msg = Ready(0, 0, 0, 0, {"a": np.zeros(1000, np.float64)}, None)
    with pytest.raises(SchemaError) as info:
        encode(msg, max_bytes=4000)
    assert info.value.field == "message" and "exceeds" in info.value.reason
    assert len(encode(msg, max_bytes=9000)) > 8000


def test_version_and_kind():
    good = raw(Open(0, 0))
    refused({**good, "v": 3}, "v")
    refused({**good, "v": 1}, "v", "schema version 1 is not supported")
    refused({**good, "v": True}, "v")
    refused({**good, "v": 1.0}, "v")
    refused({**good, "v": "1"}, "v")
    refused({k: v for k, v in good.items() if k != "v"}, "v", "missing")
    refused({**good, "k": "nope"}, "k", "nope")
    refused({**good, "k": 3}, "k")
    refused({k: v for k, v in good.items() if k != "k"}, "k")


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_missing_and_extra_fields(msg):
    good = raw(msg)
    for name in good:
        if name in type(msg).ADDED:  # a writer that predates the field leaves it out
            older = decode(msgpack.packb({k: v for k, v in good.items() if k != name}))
            assert getattr(older, name) == getattr(type(msg)(**{
                f: getattr(msg, f) for f in type(msg).SPEC if f not in type(msg).ADDED}), name)
        elif name not in ("v", "k"):
            refused({k: v for k, v in good.items() if k != name}, name, "missing")
    refused({**good, "extra": 1}, "extra", "unknown")


def test_ints_are_strict():
    good = raw(Cancel(0, 1, 2, 3, 4, "r"))
    refused({**good, "attempt": True}, "attempt", "int")
    refused({**good, "attempt": -1}, "attempt", ">= 0")
    refused({**good, "attempt": 1.0}, "attempt", "int")
    refused({**good, "group": "2"}, "group")
    refused({**good, "shard": None}, "shard")
    refused({**good, "epoch": 2**64 - 1}, "epoch", "int64")
    refused({**good, "reason": ""}, "reason", "empty")
    refused({**good, "reason": b"r"}, "reason", "str")
    with pytest.raises(SchemaError) as info:
        encode(Cancel(0, 1, 2, 3, -1, "r"))
    assert info.value.field == "attempt"
    with pytest.raises(SchemaError) as info:
        encode(Open(False, 0))
    assert info.value.field == "shard"


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_floats(bad):
    good = raw(result())
    refused({**good, "reward": bad}, "reward", "finite")
    refused({**good, "components": {"format": bad}}, "components.format", "finite")
    refused({**good, "timings": {"run_s": bad}}, "timings.run_s")
    with pytest.raises(SchemaError) as info:
        encode(result(components={"x": bad}))
    assert info.value.field == "components.x"
    work = raw(Work(0, 0, 0, 0, 0, TASK, 0, 1.0))
    refused({**work, "deadline": bad}, "deadline")
    rec = raw(EXAMPLES[-1])
    refused({**rec, "waited": bad}, "waited")
    refused({**rec, "metrics": {"m": bad}}, "metrics.m")


def test_float_fields():
    good = raw(result())
    refused({**good, "reward": True}, "reward", "float")
    refused({**good, "reward": "1.0"}, "reward", "float")
    refused({**good, "timings": {"run_s": -1.0}}, "timings.run_s", ">= 0")
    refused({**good, "components": []}, "components", "map")
    assert decode(msgpack.packb({**good, "reward": 1})).reward == 1.0  # an int is a number
    assert type(decode(msgpack.packb({**good, "reward": 1})).reward) is float
    with pytest.raises(SchemaError) as info:
        encode(result(reward=10**400))
    assert info.value.field == "reward"
    rec = raw(EXAMPLES[-1])
    refused({**rec, "waited": -0.5}, "waited", ">= 0")
    refused({**rec, "resubmitted": {"stale": -1}}, "resubmitted.stale")
    refused({**rec, "resubmitted": {"stale": 1.5}}, "resubmitted.stale")
    refused({**rec, "lag": -1}, "lag")


def test_enums():
    good = raw(result())
    refused({**good, "status": "done"}, "status", "completed")
    refused({**good, "status": 1}, "status")
    work = raw(Work(0, 0, 0, 0, 0, TASK, 0, None, None))
    refused({**work, "cause": "boredom"}, "cause", "unscored")
    for cause in wire.CAUSES:
        assert decode(msgpack.packb({**work, "cause": cause})).cause == cause
    with pytest.raises(SchemaError) as info:
        encode(Work(0, 0, 0, 0, 0, TASK, 0, None, "whim"))
    assert info.value.field == "cause"


def test_tasks():
    reg = raw(EXAMPLES[1])
    refused({**reg, "tasks": {"id": "x"}}, "tasks", "array")
    refused({**reg, "tasks": [{"id": "", "payload": {}}]}, "tasks.0.id", "empty")
    refused({**reg, "tasks": [{"id": "a", "payload": {}}, {"id": "b"}]}, "tasks.1.payload", "missing")
    refused({**reg, "tasks": [{"id": "a", "payload": {}, "x": 1}]}, "tasks.0.x", "unknown")
    refused({**reg, "tasks": [{"id": "a", "payload": [1]}]}, "tasks.0.payload", "map")
    refused({**reg, "tasks": ["a"]}, "tasks.0", "map")
    ext = {"id": "a", "payload": {"when": msgpack.ExtType(5, b"")}}
    refused({**reg, "tasks": [ext]}, "tasks.0.payload.when", "ExtType")
    nested = {"id": "a", "payload": {"deep": {"b": {"c": 1}}}}
    assert decode(msgpack.packb({**reg, "tasks": [nested]})).tasks[0].payload == nested["payload"]


def test_task_payloads_on_encode():
    for payload, field in [({1: "a"}, "task.payload"), ({"a": {2: 1}}, "task.payload.a"),
                           ({"a": {1, 2}}, "task.payload.a"), ({"a": 2**64}, "task.payload.a")]:
        with pytest.raises(SchemaError) as info:
            encode(Work(0, 0, 0, 0, 0, Task("t", payload), 0))
        assert info.value.field == field
    deep: dict = {}
    for _ in range(200):
        deep = {"d": deep}
    with pytest.raises(SchemaError, match="nested"):
        encode(Work(0, 0, 0, 0, 0, Task("t", deep), 0))
    cyclic: dict = {}
    cyclic["self"] = cyclic
    with pytest.raises(SchemaError, match="nested"):
        encode(Work(0, 0, 0, 0, 0, Task("t", cyclic), 0))
    # tuples and numpy scalars travel as msgpack arrays and numbers
    out = decode(encode(Work(0, 0, 0, 0, 0, Task("t", {"a": (1, np.int64(2))}), 0)))
    assert out.task.payload == {"a": [1, 2]}


def test_an_old_v1_result_with_calls_is_refused_by_version():
    old = {**raw(result()), "v": 1}
    del old["chains"]
    old["calls"] = [{"prompt_ids": b"\x01\x00\x00\x00", "completion_ids": b"", "logprobs": b"",
                     "version": 0, "support": None}]
    refused(old, "v", "schema version 1 is not supported (this is 2)")


def test_chains():
    good = raw(result(chains=chains(call(), call(support=True))))
    c = good["chains"]

    def with_chains(**change):
        return {**good, "chains": {**c, **change}}

    def i4(*values):
        return np.array(values, "<i4").tobytes()

    refused(with_chains(lengths=i4(5, 4)), "chains.tokens", "the lengths sum to 9")
    refused(with_chains(lengths=i4(5, 5, 0)), "chains.calls", "2 entries for 3 chains")
    refused(with_chains(lengths=i4(11, -1)), "chains.lengths", ">= 0")
    refused(with_chains(lengths=c["lengths"][:-1]), "chains.lengths", "multiple of 4")
    refused(with_chains(calls=i4(1)), "chains.calls", "1 entries for 2 chains")
    refused(with_chains(calls=i4(1, 0)), "chains.calls", ">= 1")
    refused(with_chains(call_tokens=np.array([5, 5, 5], "<i8").tobytes()), "chains.call_tokens", "3 entries")
    refused(with_chains(call_tokens=np.array([5, 4], "<i8").tobytes()), "chains.call_tokens", "chain's length")
    refused(with_chains(call_tokens=i4(5, 5)), "chains.call_tokens", "1 entries")  # <i8, not <i4
    refused(with_chains(tokens=c["tokens"][:-4]), "chains.tokens", "9 entries")
    refused(with_chains(tokens=c["tokens"][:-1]), "chains.tokens", "multiple of 4")
    refused(with_chains(tokens=i4(1, 2, 3, 100, -1, 1, 2, 3, 100, 101)), "chains.tokens", ">= 0")
    refused(with_chains(tokens=[1, 2]), "chains.tokens", "bytes")
    def bits(*mask):
        return np.packbits(mask, bitorder="little").tobytes()

    refused(with_chains(loss_mask=c["loss_mask"][:-1]), "chains.loss_mask", "1 bytes for 10 bits")
    refused(with_chains(loss_mask=c["loss_mask"] + b"\x00"), "chains.loss_mask", "3 bytes for 10 bits")
    refused(with_chains(loss_mask=bits(*[0, 0, 0, 1, 1] * 2, 1)), "chains.loss_mask", "padding bits")
    refused(with_chains(loss_mask=bits(*[0, 0, 1, 1, 1] * 2)), "chains.logprobs", "4 entries for 6 loss tokens")
    refused(with_chains(loss_mask=bits(*[0, 0, 0, 1, 1] * 2), logprobs=c["logprobs"] + c["logprobs"]),
            "chains.logprobs", "8 entries for 4")
    refused(with_chains(logprobs=np.array([-0.5] * 3, "<f4").tobytes()), "chains.logprobs", "3 entries for 4")
    refused(with_chains(logprobs=b"\x00" * 7), "chains.logprobs", "multiple of 4")
    for bad in (np.nan, np.inf, -np.inf, 0.1):
        refused(with_chains(logprobs=np.array([-0.5, bad, -0.5, -1.5], "<f4").tobytes()), "chains.logprobs",
                "finite and <= 0")
    ok = decode(msgpack.packb(with_chains(logprobs=np.array([-0.5, 5e-5, -0.5, -1.5], "<f4").tobytes())))
    assert ok.chains[0].logprobs[4] == np.float32(5e-5)  # engine rounding above 0 is tolerated
    refused(with_chains(versions=i4(1, 1)), "chains.version_runs", "1 runs for 2 versions")
    refused(with_chains(versions=i4(-1)), "chains.versions", ">= 0")
    refused(with_chains(versions=i4(1, 2), version_runs=i4(4, 0)), "chains.version_runs", ">= 1")
    refused(with_chains(version_runs=i4(3)), "chains.version_runs", "cover 3 tokens, not the 4 loss tokens")
    refused(with_chains(version_runs=i4(5)), "chains.version_runs", "cover 5 tokens")
    back = decode(msgpack.packb(with_chains(versions=i4(1, 7), version_runs=i4(3, 1))))
    assert back.chains[0].versions.tolist() == [-1, -1, -1, 1, 1] and back.chains[1].versions.tolist()[3:] == [1, 7]
    refused({**good, "chains": {k: v for k, v in c.items() if k != "versions"}}, "chains.versions", "missing")
    refused({**good, "chains": {k: v for k, v in c.items() if k != "support"}}, "chains.support", "missing")
    refused(with_chains(extra=b""), "chains.extra", "unknown")
    refused({**good, "chains": [c]}, "chains", "map")
    refused({**good, "chains": None}, "chains", "map")
    empty = decode(msgpack.packb(with_chains(**{k: b"" for k in c if k != "support"}, support=None)))
    assert empty.chains == ()


def test_chains_support():
    good = raw(result())
    c = good["chains"]

    def with_support(support):
        return {**good, "chains": {**c, "support": support}}

    data = np.array([[7, 8], [9, -1], [-1, -1], [4, 5]], "<i4").tobytes()
    back = decode(msgpack.packb(with_support({"shape": [4, 2], "data": data})))
    assert back.chains[0].support.tolist() == [[-1, -1]] * 3 + [[7, 8], [9, -1]]  # prompt rows all -1
    assert back.chains[1].support.tolist()[3:] == [[-1, -1], [4, 5]]
    assert decode(msgpack.packb(with_support(None))).chains[0].support is None
    refused(with_support({"shape": [2, 4], "data": data}), "chains.support.shape", "[4, k]")
    refused(with_support({"shape": [8], "data": data}), "chains.support.shape")
    refused(with_support({"shape": [4, 3], "data": data}), "chains.support.data", "bytes for shape")
    refused(with_support({"shape": [4, 2], "data": data[:-1]}), "chains.support.data")
    refused(with_support({"shape": [4, -2], "data": data}), "chains.support.shape.1")
    refused(with_support({"shape": [4, 2], "data": np.full(8, -2, "<i4").tobytes()}), "chains.support", ">= -1")
    refused(with_support({"shape": [4, 2]}), "chains.support.data", "missing")
    refused(with_support({"shape": [4, 2], "data": data, "dtype": "<i4"}), "chains.support.dtype", "unknown")
    refused(with_support(data), "chains.support")


def test_results_of_anything_but_chains_are_refused_on_encode():
    with pytest.raises(SchemaError) as info:
        encode(result(chains=(call(),)))
    assert info.value.field == "chains"
    with pytest.raises(SchemaError) as info:
        bad = chains(call())[0]
        bad.logprobs[3] = 0.5
        encode(result(chains=(bad,)))
    assert info.value.field == "chains.logprobs"
    for name, value, off in (("logprobs", -1.0, 0), ("versions", 0, -1), ("support", 3, -1)):
        bad = chains(call(support=True))[0]
        getattr(bad, name)[0] = value  # a prompt token: it would not survive the wire
        with pytest.raises(SchemaError) as info:
            encode(result(chains=(bad,)))
        assert (info.value.field, info.value.reason) == (f"chains.{name}", f"must be {off} off loss tokens")


def test_ready_arrays():
    good = raw(EXAMPLES[-2])
    arr = good["arrays"]["tokens"]

    def with_array(**change):
        return {**good, "arrays": {**good["arrays"], "x": {**arr, **change}}}

    for dtype in ("|O", "<U4", "<c8", "<M8[s]", ">i4", "V8", "int32", None):
        refused(with_array(dtype=dtype), "arrays.x.dtype")
    refused(with_array(data=arr["data"][:-1]), "arrays.x.data", "bytes for shape")
    refused(with_array(data=arr["data"][:-4]), "arrays.x.data", "bytes for shape")
    refused(with_array(shape=[4, 4]), "arrays.x.data")
    refused(with_array(shape=[3, True]), "arrays.x.shape.1")
    refused(with_array(shape=[1] * 33, data=b"\x00" * 4), "arrays.x.shape", "dimensions")
    refused(with_array(shape=12), "arrays.x.shape")
    refused(with_array(dtype="|b1", shape=[2], data=b"\x01\x02"), "arrays.x.data", "0 or 1")
    refused(with_array(dtype="<f4", shape=[1], data=np.array([np.nan], "<f4").tobytes()), "arrays.x.data", "finite")
    refused(with_array(data=list(range(12))), "arrays.x.data", "bytes")
    refused({**good, "arrays": {"x": [1, 2]}}, "arrays.x", "map")
    refused({**good, "arrays": {1: arr}}, "message")  # non-str key: refused by the unpacker
    refused({**good, "record": [1]}, "record", "map")
    assert decode(msgpack.packb(with_array(shape=[12]))).arrays["x"].shape == (12,)


def test_ready_refuses_object_dtype_on_encode():
    for bad in (np.array([object(), 1], dtype=object), np.array(["ab"]), np.array([1 + 2j])):
        with pytest.raises(SchemaError) as info:
            encode(Ready(0, 0, 0, 0, {"bad": bad}, None))
        assert info.value.field == "arrays.bad.dtype"
    with pytest.raises(SchemaError) as info:
        encode(Ready(0, 0, 0, 0, {"x": np.array([1.0, np.inf])}, None))
    assert info.value.field == "arrays.x.data"
    with pytest.raises(SchemaError) as info:
        encode(Ready(0, 0, 0, 0, {"x": [1, 2]}, None))
    assert info.value.field == "arrays.x"


def test_encode_refuses_non_messages_and_unpackable_strings():
    with pytest.raises(TypeError):
        encode({"v": 1, "k": "open"})
    with pytest.raises(SchemaError) as info:
        encode(Cancel(0, 0, 0, 0, 0, "\udcff"))
    assert info.value.field == "message"


def test_schema_error_is_a_value_error():
    err = SchemaError("calls.2.logprobs", "must be finite")
    assert isinstance(err, ValueError)
    assert (err.field, err.reason, str(err)) == ("calls.2.logprobs", "must be finite", "calls.2.logprobs: must be finite")


# ---------------------------------------------------------------- generated messages

u = st.integers(0, 2**63 - 1)
small = st.integers(0, 1000)
finite = st.floats(allow_nan=False, allow_infinity=False)
nonneg = st.floats(min_value=0.0, allow_nan=False, allow_infinity=False)
names = st.text(max_size=8)
native = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | finite | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(names, inner, max_size=3),
    max_leaves=8,
)
tasks = st.builds(Task, st.text(min_size=1, max_size=8), st.dictionaries(names, native, max_size=3))
token_lists = st.lists(st.integers(0, 2**31 - 1), max_size=6)


@st.composite
def calls(draw):
    completion = draw(token_lists)
    n = len(completion)
    logprobs = draw(st.lists(st.floats(-30.0, 0.0, width=32), min_size=n, max_size=n))
    support = None
    if draw(st.booleans()):
        k = draw(st.integers(0, 3))
        support = draw(hnp.arrays(np.int32, (n, k), elements=st.integers(-1, 2**31 - 1)))
    return Call(draw(token_lists), completion, logprobs, draw(small), support)


sample_key = (small, small, small, small, small)
arrays = st.dictionaries(
    names,
    hnp.arrays(
        st.sampled_from(sorted(wire.ARRAY_DTYPES)),
        hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3),
        elements={"allow_nan": False, "allow_infinity": False},
    ),
    max_size=3,
)
MESSAGES = {  # a strategy per message kind
    Open: st.builds(Open, u, u),
    Registration: st.builds(Registration, u, u, u, st.lists(tasks, max_size=3).map(tuple)),
    Handover: st.builds(Handover, u, u, u, u, st.none() | u, st.none() | u),
    Work: st.builds(Work, *sample_key, tasks, u, st.none() | nonneg, st.none() | st.sampled_from(wire.CAUSES)),
    Cancel: st.builds(Cancel, *sample_key, st.text(min_size=1, max_size=8)),
    Result: st.builds(
        Result, *sample_key, st.text(min_size=1, max_size=8), st.sampled_from(Status), st.none() | finite,
        st.dictionaries(names, finite, max_size=3), st.lists(calls(), max_size=3).map(lambda cs: chains(*cs)),
        st.none() | st.text(max_size=8), st.dictionaries(names, nonneg, max_size=3), st.none() | st.text(max_size=30),
    ),
    Weights: st.builds(Weights, u, st.text(min_size=1, max_size=8), st.text(max_size=8), u),
    Ready: st.builds(
        Ready, small, small, small, small, arrays,
        st.none() | st.builds(
            ReadyRecord, updates=small, version=small, lag=small, groups=small,
            resubmitted=st.dictionaries(names, small, max_size=3), cancelled=small, abandoned=small, cut=small,
            waited=nonneg, metrics=st.dictionaries(names, finite, max_size=3), refused=small,
            admitted=st.lists(st.tuples(small, small, st.text(max_size=8)), max_size=3).map(tuple),
            packed=st.lists(small, max_size=3).map(tuple),
            dropped=st.lists(st.tuples(small, small, st.text(max_size=8), st.sampled_from(wire.CAUSES)),
                             max_size=2).map(tuple)),
        st.none() | st.text(max_size=30)),
    Record: st.builds(
        Record, *[small] * 7, st.dictionaries(names, small, max_size=3), small, small, small, nonneg,
        st.dictionaries(names, finite, max_size=3),
    ),
}
messages = st.one_of(*MESSAGES.values())
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=6)
    | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
FIELD_NAMES = sorted({name for cls in wire._KINDS.values() for name in cls.SPEC})
message_like = st.builds(
    lambda kind, fields: {"v": SCHEMA_VERSION, "k": kind, **fields},
    st.sampled_from(sorted(wire._KINDS)),
    st.dictionaries(st.sampled_from(FIELD_NAMES), msgpack_values, max_size=14),
)


def decodes_or_refuses(data):
    try:
        msg = decode(data)
    except SchemaError as err:
        assert isinstance(err.field, str) and err.reason
        return None
    assert isinstance(msg, wire.Message)
    assert decode(encode(msg)) == msg  # what decode accepts, encode accepts and round-trips
    return msg


@FUZZ
@given(messages)
def test_generated_messages_round_trip(msg):
    assert decode(encode(msg)) == msg


@FUZZ
@given(st.binary(max_size=200))
def test_fuzz_bytes(data):
    decodes_or_refuses(data)


@FUZZ
@given(st.one_of(msgpack_values, message_like))
def test_fuzz_structures(value):
    decodes_or_refuses(msgpack.packb(value, use_bin_type=True))


def paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths(v, prefix + (i,))


@FUZZ
@given(messages, st.data())
def test_fuzz_mutations(msg, data):
    tree = raw(msg)
    where = data.draw(st.sampled_from(list(paths(tree))[1:]))
    parent = tree
    for step in where[:-1]:
        parent = parent[step]
    if isinstance(parent, dict) and data.draw(st.booleans()):
        del parent[where[-1]]
    else:
        parent[where[-1]] = data.draw(msgpack_values)
    decodes_or_refuses(msgpack.packb(tree, use_bin_type=True))


@FUZZ
@given(messages, st.data())
def test_fuzz_truncation_and_bit_flips(msg, data):
    encoded = bytearray(encode(msg))
    i = data.draw(st.integers(0, len(encoded) - 1))
    if data.draw(st.booleans()):
        encoded[i] ^= 1 << data.draw(st.integers(0, 7))
        decodes_or_refuses(bytes(encoded))
    else:
        refused(bytes(encoded[:i]), "message")


@pytest.mark.parametrize("change, field", [
    (lambda c: c.logprobs.__setitem__(0, 0.5), "chains.logprobs"),
    (lambda c: c.logprobs.__setitem__(0, np.nan), "chains.logprobs"),
    (lambda c: c.completion_ids.__setitem__(0, -7), "chains.tokens"),
    (lambda c: setattr(c, "version", -2), "chains.versions"),
])
def test_from_session_refuses_what_encode_refuses_of_calls_changed_after_making(change, field):
    """Calls are checked when made; `from_session` checks the merged chains once more (a
    source may change its calls after), so that `encode` need not check them again: the
    refusal is the one `encode` gives of the same chains built any other way."""
    made = call()
    change(made)
    session = Session(Status.COMPLETED, 1.0, calls=[made])
    with pytest.raises(SchemaError) as from_session:
        Result.from_session(0, 0, 0, 0, 0, session, "c")
    built = Result(0, 0, 0, 0, 0, "c", Status.COMPLETED, 1.0, chains=tuple(merge_calls([made])))
    with pytest.raises(SchemaError) as encoded:
        encode(built)
    assert from_session.value.field == encoded.value.field == field
    assert str(from_session.value) == str(encoded.value)


def test_a_merged_result_encodes_as_one_built_from_the_same_chains():
    session = Session(Status.COMPLETED, 0.5, {"x": 1.0}, [call(), call(version=3)], None, {"run_s": 2.0})
    merged = Result.from_session(0, 1, 2, 3, 4, session, "c")
    built = Result(0, 1, 2, 3, 4, "c", Status.COMPLETED, 0.5, {"x": 1.0}, tuple(merge_calls(session.calls)),
                   None, {"run_s": 2.0})
    assert encode(merged) == encode(built) and decode(encode(merged)) == merged
