"""`Result.from_session` makes its chains' wire form straight from the session's calls; it must
encode byte for byte as the same chains built and converted by `encode`'s general path."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import wire
from pipeline.chains import merge_calls
from pipeline.sessions import Call, Session, Status
from pipeline.wire import Result, decode, encode, to_fields


def _call(prompt, completion, version, support=None, start=0):
    n = len(completion)
    return Call(np.asarray(prompt, "<i4"), np.asarray(completion, "<i4"),
                -np.linspace(0.1, 3.0, n, dtype="<f4") - start * 1e-3, version, support)


def _extending(prompt, completions, versions, extra=(7, 8)):
    """Calls whose prompts repeat the previous call's prompt and completion, then `extra`."""
    calls = []
    for i, (completion, version) in enumerate(zip(completions, versions)):
        calls.append(_call(prompt, completion, version, start=i))
        prompt = [*prompt, *completion, *extra]
    return calls


def _built(result: Result, session: Session) -> Result:
    """The same result with its chains built by `merge_calls`: `encode` converts and checks them."""
    return Result(result.shard, result.epoch, result.group, result.sample, result.attempt,
                  result.consumer, result.status, result.reward, dict(result.components),
                  tuple(merge_calls(session.calls)), result.truncation,
                  dict(result.timings), result.error)


rng = np.random.default_rng(5)
ONE_K = _call(rng.integers(0, 50_000, 256), rng.integers(0, 50_000, 768), 3)
SESSIONS = {
    "one 1k-token call": Session(Status.COMPLETED, 0.25, {"x": 1.0}, [ONE_K], None,
                                 {"run_s": 1e-5, "started": 1.0, "finished": 2.0}),
    "merged calls, three versions": Session(Status.COMPLETED, 1.0, calls=_extending(
        [1, 2, 3], [[10, 11], [12], [13, 14, 15], [16]], [1, 1, 2, 4])),
    "two chains": Session(Status.TRUNCATED, 0.0, calls=[
        *_extending([1, 2], [[5, 6], [7]], [2, 3]), _call([9, 9, 9], [4, 4], 3)], truncation="turns"),
    "a call that completed nothing": Session(Status.AGENT_ERROR, 0.0, calls=[
        _call([1, 2], [], 5), _call([3], [6, 7, 8, 9, 10, 11, 12, 13, 14], 5)]),
    "nine tokens, a byte and a bit": Session(Status.COMPLETED, 1.0, calls=[_call([1], list(range(8)), 0)]),
    "numpy numbers in the maps": Session(Status.COMPLETED, np.float64(0.5), {"r": np.float64(0.5)},
                                         [_call([1], [2], 1)], None, {"run_s": np.float64(2.0)}),
    "support": Session(Status.COMPLETED, 1.0, calls=[
        _call([1, 2], [3, 4], 1, support=np.array([[3, -1], [4, 9]])), _call([8], [9], 2)]),
    "infra error, no calls": Session(Status.INFRA_ERROR, calls=[], timings={"run_s": 0.5}),
    "cancelled, no calls": Session(Status.CANCELLED),
}


@pytest.mark.parametrize("name", list(SESSIONS))
def test_from_session_encodes_byte_for_byte_as_the_general_path(name):
    session = SESSIONS[name]
    result = Result.from_session(0, 1, 2, 3, 4, session, "pod-a", error="tb" if not session.calls else None)
    built = _built(result, session)
    assert not built.chains or not wire._merged_checked(built.chains)  # the general path: every check made
    data = encode(result)
    assert data == encode(built)
    assert to_fields(result) == {wire.FIELD: data}
    assert decode(data) == result == built


def test_a_changed_result_is_encoded_from_its_own_chains():
    result = Result.from_session(0, 1, 2, 3, 4, SESSIONS["two chains"], "pod-a")
    cut = wire.fit_width(result, 4)
    assert cut is not None and [len(c) for c in cut.chains] == [4, 4]
    assert decode(encode(cut)) == cut
    other = dataclasses.replace(result, chains=result.chains[:1])
    assert decode(encode(other)) == other and len(decode(encode(other)).chains) == 1


tokens = st.lists(st.integers(0, 2**31 - 1), max_size=12)


@st.composite
def sessions(draw):
    calls = []
    prompt = draw(tokens)
    for _ in range(draw(st.integers(0, 4))):
        completion = draw(tokens)
        logprobs = draw(st.lists(st.floats(-30.0, 0.0, width=32), min_size=len(completion),
                                 max_size=len(completion)))
        calls.append(Call(prompt, completion, logprobs, draw(st.integers(0, 3))))
        continues = draw(st.booleans())
        prompt = [*prompt, *completion, *draw(tokens)] if continues else draw(tokens)
    return Session(draw(st.sampled_from(list(Status))), calls=calls)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sessions())
def test_any_merged_session_encodes_as_the_general_path(session):
    result = Result.from_session(0, 0, 0, 0, 0, session, "c")
    built = Result(0, 0, 0, 0, 0, "c", session.status, chains=tuple(merge_calls(session.calls)))
    assert encode(result) == encode(built)
    assert decode(encode(result)) == result


def _entry(make, *args, **kwargs):
    """What `make` returns, or the kind and message of the ValueError it raises."""
    try:
        return make(*args, **kwargs)
    except ValueError as exc:
        return type(exc).__name__, str(exc)


def _general(session, vocab, error=None):
    result = Result.from_session(0, 1, 2, 3, 4, session, "pod-a", error)
    wire.check_result(result, vocab=vocab)
    return to_fields(result)


@pytest.mark.parametrize("vocab", [None, 50_000, 10])
@pytest.mark.parametrize("name", list(SESSIONS))
def test_result_fields_are_those_of_the_checked_result(name, vocab):
    session = SESSIONS[name]
    error = "tb" if not session.calls else None
    assert _entry(wire.result_fields, 0, 1, 2, 3, 4, session, "pod-a", error, vocab=vocab) == \
        _entry(_general, session, vocab, error)


def _changed(change):
    """A one-call session whose call `change` altered after it was made."""
    call = _call([1, 2, 3], [4, 5, 6, 7], 2)
    change(call)
    return Session(Status.COMPLETED, 0.5, calls=[call], timings={"started": 1.0, "finished": 2.0})


CHANGES = {
    "a positive log-prob": lambda c: c.logprobs.__setitem__(1, 0.5),
    "a NaN log-prob": lambda c: c.logprobs.__setitem__(0, np.nan),
    "an -inf log-prob": lambda c: c.logprobs.__setitem__(3, -np.inf),
    "a log-prob less": lambda c: setattr(c, "logprobs", c.logprobs[:-1]),
    "a negative prompt token": lambda c: c.prompt_ids.__setitem__(0, -3),
    "a negative completion token": lambda c: c.completion_ids.__setitem__(2, -1),
    "a token past the vocabulary": lambda c: c.completion_ids.__setitem__(0, 99),
    "int64 token ids": lambda c: setattr(c, "prompt_ids", c.prompt_ids.astype("<i8")),
    "a list of token ids": lambda c: setattr(c, "completion_ids", [4, 5, 6, 7]),
    "float64 log-probs": lambda c: setattr(c, "logprobs", c.logprobs.astype("<f8")),
    "a negative version": lambda c: setattr(c, "version", -1),
    "a numpy version": lambda c: setattr(c, "version", np.int64(3)),
    "a bool version": lambda c: setattr(c, "version", True),
    "a 2-d prompt": lambda c: setattr(c, "prompt_ids", c.prompt_ids.reshape(1, 3)),
    "a strided completion": lambda c: setattr(c, "completion_ids", np.arange(8, dtype="<i4")[::2]),
    "support": lambda c: setattr(c, "support", np.full((4, 2), 5, "<i4")),
    "no completion": lambda c: (setattr(c, "completion_ids", c.completion_ids[:0]),
                                setattr(c, "logprobs", c.logprobs[:0])),
}
SESSION_CHANGES = {
    "a negative duration": lambda s: setattr(s, "timings", {"started": 2.0, "finished": 1.0}),
    "a NaN reward": lambda s: setattr(s, "reward", float("nan")),
    "a numpy reward": lambda s: setattr(s, "reward", np.float32(0.25)),
    "a status as str": lambda s: setattr(s, "status", "completed"),
    "an unknown status": lambda s: setattr(s, "status", "done"),
    "a bad component": lambda s: setattr(s, "components", {"x": "y"}),
    "a negative timing": lambda s: setattr(s, "timings", {"run_s": -1.0}),
    "a truncation": lambda s: setattr(s, "truncation", "turns"),
    "a non-UTF-8 truncation": lambda s: setattr(s, "truncation", "\ud800"),
    "calls as a tuple": lambda s: setattr(s, "calls", tuple(s.calls)),
    "not a call": lambda s: setattr(s, "calls", [object()]),
}


@pytest.mark.parametrize("vocab", [None, 64])
@pytest.mark.parametrize("name", [*CHANGES, *SESSION_CHANGES])
def test_result_fields_refuse_a_session_changed_after_making_as_the_checked_result(name, vocab):
    if name in CHANGES:
        session = _changed(CHANGES[name])
    else:
        session = _changed(lambda c: None)
        SESSION_CHANGES[name](session)

    def general():
        try:
            return _general(session, vocab)
        except (AttributeError, TypeError) as exc:
            return type(exc).__name__
    def fast():
        try:
            return wire.result_fields(0, 1, 2, 3, 4, session, "pod-a", vocab=vocab)
        except (AttributeError, TypeError) as exc:
            return type(exc).__name__
    assert _entry(fast) == _entry(general)


def test_result_fields_refuse_a_result_over_the_size_limit_as_encode():
    session = SESSIONS["one 1k-token call"]
    size = len(_general(session, None)[wire.FIELD])
    assert wire.result_fields(0, 1, 2, 3, 4, session, "pod-a", max_bytes=size) == _general(session, None)
    with pytest.raises(wire.SchemaError, match=f"{size} bytes exceeds the limit of {size - 1}"):
        wire.result_fields(0, 1, 2, 3, 4, session, "pod-a", max_bytes=size - 1)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sessions(), st.sampled_from([None, 2**31, 1000]))
def test_any_session_has_the_result_fields_of_the_general_path(session, vocab):
    assert _entry(wire.result_fields, 0, 1, 2, 3, 4, session, "pod-a", vocab=vocab) == \
        _entry(_general, session, vocab)


def test_a_session_of_one_plain_call_is_encoded_straight_from_it():
    session = SESSIONS["one 1k-token call"]
    direct = wire._one_call_result(0, 1, 2, 3, 4, session, "pod-a", None, 50_000, wire.MAX_MESSAGE_BYTES)
    assert direct is not None and {wire.FIELD: direct} == _general(session, 50_000)
    assert wire._one_call_result(0, 1, 2, 3, 4, _changed(CHANGES["a positive log-prob"]), "pod-a", None,
                                 None, wire.MAX_MESSAGE_BYTES) is None


EDGES = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1]


@pytest.mark.parametrize("edge", EDGES)
def test_result_fields_pack_every_size_of_int_and_str_as_msgpack_does(edge):
    """The direct path packs with msgspec: the same bytes as `msgpack.packb` for each size
    class of ints, strings, maps and binaries the result carries."""
    text = "é" * min(edge, 70_000)
    timings = {"run_s": float(edge), "started": edge, "finished": edge + 0.5, **{f"t{i}": i for i in range(edge % 20)}}
    session = Session(Status.TRUNCATED, edge / 3, {"n": edge}, [_call(range(edge % 300), range(edge % 70), 1)],
                      text, timings)
    for group in (edge, 7):
        assert _entry(wire.result_fields, 0, 1, group, 3, 4, session, text or "c", text) == \
            _entry(lambda g=group: to_fields(Result.from_session(0, 1, g, 3, 4, session, text or "c", text)))
    assert wire._one_call_result(0, 1, 7, 3, 4, session, "c", None, None, wire.MAX_MESSAGE_BYTES) is not None
