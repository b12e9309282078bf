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
