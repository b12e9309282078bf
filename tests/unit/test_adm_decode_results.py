"""`wire.decode_results`, the admission consumer's decoding of a read batch of results at
once, against `decode` + `check_result` of each entry alone: on valid results it gives the
same messages (values, dtypes, chains and their oldest versions); on damaged ones, other
kinds and results the run's vocabulary refuses, it takes nothing that those refuse (None:
the entry is decoded alone, which refuses it with its field and reason)."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from pipeline import wire
from pipeline.chains import Chain, SpanChain
from pipeline.sessions import Call, Session, Status
from tests.unit.test_fuzz_wire import FUZZ, KINDS
from tests.unit.test_wire import MESSAGES
from tests.unit.test_wire_compiled import damaged


def alone(data: bytes, vocab: int | None) -> wire.Result | None:
    """The entry decoded and checked alone, None where that refuses it."""
    try:
        msg = wire.decode(data, wire.Result)
        wire.check_result(msg, vocab=vocab)
    except wire.SchemaError:
        return None
    return msg  # type: ignore[return-value]


def same(a: wire.Result, b: wire.Result) -> None:
    assert type(a) is type(b) and list(vars(a)) == list(vars(b)) and a == b
    assert a.oldest_version == b.oldest_version
    for x, y in zip(a.chains, b.chains):
        if x.span is not None:  # one span of loss tokens, one version: kept as the wire has it
            first, n, version = x.span
            assert type(x) is SpanChain and x.loss_tokens == n == int(np.count_nonzero(y.loss_mask))
            assert np.flatnonzero(y.loss_mask).tolist() == list(range(first, first + n))
            assert (y.versions[y.loss_mask] == version).all()
            assert np.array_equal(x.span_logprobs, y.logprobs[y.loss_mask])
        else:
            assert type(x) is Chain and [f.name for f in dataclasses.fields(x)] == list(vars(x))[:7]
        for name in ("tokens", "loss_mask", "logprobs", "versions"):
            u, v = getattr(x, name), getattr(y, name)
            assert u.dtype == v.dtype and u.shape == v.shape and u.flags.writeable == v.flags.writeable


def check_batch(datas: list[bytes], vocab: int | None = None) -> list[wire.Result | None]:
    """`decode_results` of `datas`: each taken entry as decoded alone, nothing taken that
    decoding alone refuses."""
    batch = wire.decode_results(datas, vocab=vocab)
    assert len(batch) == len(datas)
    for data, got in zip(datas, batch):
        want = alone(data, vocab)
        if got is not None:
            assert want is not None, "taken, but refused alone"
            same(got, want)
    return batch


def result(sample: int, calls: list[tuple[int, int, int]], reward: float | None = 1.0,
           seed: int = 0) -> bytes:
    """A result's bytes: calls of (prompt, completion, version) lengths, each opening a chain
    or continuing the last (a prompt that repeats the conversation so far)."""
    rng = np.random.default_rng(seed)
    made: list[Call] = []
    conversation: list[int] = []
    for prompt, completion, version in calls:
        ids = rng.integers(0, 1000, prompt + completion).tolist()
        head = conversation if prompt >= len(conversation) and conversation and sample % 2 else []
        prompt_ids = (head + ids[: prompt - len(head)]) if head else ids[:prompt]
        completion_ids = ids[prompt:]
        made.append(Call(prompt_ids, completion_ids, -rng.random(completion).astype(np.float32), version))
        conversation = prompt_ids + completion_ids
    session = Session(Status.COMPLETED, reward, calls=made, timings={"started": 0.0, "finished": 1.0})
    return wire.encode(wire.Result.from_session(0, 0, 1, sample, 0, session, "test"))


def test_a_batch_of_results_decodes_as_each_alone():
    datas = [result(s, [(5 + s, 3 + s % 4, s % 3)], seed=s) for s in range(9)]  # padding bits and not
    datas += [result(9, [(8, 8, 0), (20, 4, 1)]), result(10, [(3, 0, 0)]), result(11, [])]
    datas += [result(12, [(2, 3, 4), (9, 2, 4), (1, 1, 5)], reward=None)]
    assert all(got is not None for got in check_batch(datas))


def test_damaged_entries_are_left_to_decoding_alone_and_the_rest_taken():
    good = [result(s, [(7, 5, 1)], seed=s) for s in range(3)]
    tree = msgpack.unpackb(good[1], raw=False)
    tree["chains"]["version_runs"] = b""
    other = wire.encode(wire.Handover(0, 0, 1, 1))
    got = check_batch([good[0], msgpack.packb(tree, use_bin_type=True), b"\xc1", other, good[2]])
    assert [x is not None for x in got] == [True, False, False, False, True]


def test_a_token_past_the_vocabulary_leaves_the_batch_to_decoding_alone():
    datas = [result(s, [(7, 5, 1)], seed=s) for s in range(3)]
    assert all(x is not None for x in check_batch(datas, vocab=1000))
    assert check_batch(datas, vocab=10) == [None, None, None]


def test_a_negative_duration_is_left_to_decoding_alone():
    tree = msgpack.unpackb(result(0, [(4, 4, 0)]), raw=False)
    tree["timings"] = {"started": 2.0, "finished": 1.0}
    assert check_batch([msgpack.packb(tree, use_bin_type=True)]) == [None]


@FUZZ
@given(data=st.data())
def test_generated_results_decode_as_alone(data):
    datas = [wire.encode(data.draw(MESSAGES[wire.Result], label="result")) for _ in range(3)]
    check_batch(datas)


@FUZZ
@given(data=st.data())
def test_damaged_messages_are_taken_only_as_decoded_alone(data):
    cls = data.draw(st.sampled_from(KINDS), label="kind")
    trees = [damaged(wire.Result, data), damaged(cls, data)]
    check_batch([msgpack.packb(tree, use_bin_type=True) for tree in trees])


def test_each_result_holds_only_its_own_arrays():
    """A held rollout keeps its own tokens alive, not its read batch's."""
    datas = [result(s, [(6, 4, 0), (9, 3, 1)] if s % 2 else [(6, 4, 0)], seed=s) for s in range(4)]
    results = check_batch(datas)
    for r in results:
        assert r is not None
        owners = {id(getattr(c, name).base if getattr(c, name).base is not None else getattr(c, name))
                  for c in r.chains for name in ("tokens",)}
        assert len(owners) == 1
        for name in ("tokens", "loss_mask", "logprobs", "versions"):
            whole = getattr(r.chains[0], name)
            whole = whole if whole.base is None else whole.base
            assert whole.size == sum(len(c) for c in r.chains)
