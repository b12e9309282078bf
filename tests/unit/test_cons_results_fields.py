"""`wire.results_fields` encodes a batch of sessions with the per-token checks run once over
their arrays joined: each result it takes has exactly the fields `result_fields` gives it;
a batch holding one value that a check refuses (NaN, +inf, -inf, a log-prob above 0, a
token id past the vocabulary or below 0) is left whole to `result_fields`, which refuses
that session with its own field and reason and encodes the others."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import wire
from pipeline.sessions import Call, Session, Status
from tests.unit.test_wire_merged import CHANGES, SESSION_CHANGES, SESSIONS, _call, _changed, _entry
from tests.unit.test_wire_merged import sessions as any_sessions


def _plain(i: int, prompt: int = 256, completion: int = 768, vocab: int = 50_000) -> Session:
    rng = np.random.default_rng(i)
    call = _call(rng.integers(0, vocab, prompt), rng.integers(0, vocab, completion), i % 3)
    return Session(Status.COMPLETED, i / 100, {"x": 1.0}, [call], None,
                   {"submitted": 0.5, "started": 1.0, "finished": 2.0 + i})


def _items(sessions: list[Session]) -> list[tuple]:
    return [(0, 1, i, 3, 4, s, "pod-a", "tb" if not s.calls else None) for i, s in enumerate(sessions)]


def _each(items: list[tuple], vocab: int | None) -> list:
    return [_entry(wire.result_fields, *item, vocab=vocab) for item in items]


@pytest.mark.parametrize("vocab", [None, 50_000, 10])
def test_a_batch_has_the_fields_of_each_result_alone(vocab):
    sessions = [_plain(i) for i in range(40)] + list(SESSIONS.values()) + [_plain(50 + i, 3, i) for i in range(5)]
    items = _items(sessions)
    batch = wire.results_fields(items, vocab=vocab)
    each = _each(items, vocab)
    assert len(batch) == len(items)
    for made, alone in zip(batch, each):
        if made is not None:
            assert made == alone
    taken = sum(made is not None for made in batch)
    if vocab == 10:  # every 1k-token call has ids past 10: the joint check refuses, each alone
        assert taken == 0
    else:  # the plain calls of one version, more than one chunk of joined arrays of them
        assert taken >= 45 and 45 * 1024 > wire._JOINED_TOKENS


def test_an_empty_batch_and_one_of_other_sessions():
    assert wire.results_fields([]) == []
    others = [s for name, s in SESSIONS.items() if name != "one 1k-token call" and len(s.calls) != 1]
    assert wire.results_fields(_items(others)) == [None] * len(others)


BAD = {
    "a NaN log-prob": ("logprobs", 5, np.nan),
    "a +inf log-prob": ("logprobs", 7, np.inf),
    "a -inf log-prob": ("logprobs", 0, -np.inf),
    "a positive log-prob": ("logprobs", 767, 0.5),
    "a token past the vocabulary": ("completion_ids", 3, 50_000),
    "a negative prompt token": ("prompt_ids", 0, -1),
    "the most negative token": ("completion_ids", 767, -2**31),
}


@pytest.mark.parametrize("where", [0, 17, 39])  # in the first, a middle and the last chunk
@pytest.mark.parametrize("name", list(BAD))
def test_one_bad_value_is_refused_as_alone_and_the_others_encode(name, where):
    field, at, value = BAD[name]
    sessions = [_plain(i) for i in range(40)]
    call = sessions[where].calls[0]
    getattr(call, field)[at] = value  # changed after making it, as a source may
    items = _items(sessions)
    assert wire.results_fields(items, vocab=50_000) == [None] * 40  # each then alone
    each = _each(items, 50_000)
    refusal = each[where]
    assert isinstance(refusal, tuple) and refusal[0] == "SchemaError"
    assert refusal[1].startswith(f"{'chains.tokens' if field != 'logprobs' else 'chains.logprobs'}: ")
    assert all(type(e) is dict for i, e in enumerate(each) if i != where)
    assert each[:where] + each[where + 1:] == [e for e in wire.results_fields(
        items[:where] + items[where + 1:], vocab=50_000)]


def test_calls_made_unchecked_are_checked_in_the_batch():
    """A source may make its calls without `Call`'s checks (`Call.trusted`): the batch's
    checks are then the only ones."""
    good = _plain(1).calls[0]
    bad = Call.trusted(good.prompt_ids.copy(), good.completion_ids.copy(), good.logprobs.copy(), 1)
    bad.logprobs[3] = np.nan
    sessions = [_plain(0), Session(Status.COMPLETED, 0.5, calls=[bad]), _plain(2)]
    items = _items(sessions)
    assert wire.results_fields(items) == [None] * 3
    each = _each(items, None)
    assert type(each[0]) is dict and type(each[2]) is dict and each[1][0] == "SchemaError"


@pytest.mark.parametrize("vocab", [None, 64])
@pytest.mark.parametrize("name", [*CHANGES, *SESSION_CHANGES])
def test_a_session_changed_after_making_is_never_taken_otherwise_than_alone(name, vocab):
    """Each of the changes `result_fields` is tested against, amid plain sessions: whatever
    the batch takes has the fields `result_fields` gives, and a session it refuses is left
    to it."""
    if name in CHANGES:
        changed = _changed(CHANGES[name])
    else:
        changed = _changed(lambda c: None)
        SESSION_CHANGES[name](changed)
    sessions = [_plain(0, 3, 4, 64), changed, _plain(1, 3, 4, 64)]
    items = _items(sessions)
    try:
        batch = wire.results_fields(items, vocab=vocab)
    except (AttributeError, TypeError) as exc:  # as `result_fields` raises them (the general path)
        with pytest.raises(type(exc)):
            wire.result_fields(*items[1], vocab=vocab)
        return

    def alone(item):
        try:
            return _entry(wire.result_fields, *item, vocab=vocab)
        except (AttributeError, TypeError) as exc:
            return type(exc).__name__

    each = [alone(item) for item in items]
    for made, fields in zip(batch, each):
        assert made is None or made == fields
    if type(each[1]) is not dict:
        assert batch[1] is None


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(any_sessions(), max_size=6), st.sampled_from([None, 2**31, 1000]))
def test_any_batch_has_the_fields_of_each_result_alone(batch_sessions, vocab):
    items = _items(batch_sessions)
    each = _each(items, vocab)
    for made, alone in zip(wire.results_fields(items, vocab=vocab), each):
        assert made is None or made == alone
