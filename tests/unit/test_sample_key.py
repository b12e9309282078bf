"""`SampleKey`, the identity of one attempt: a value (equal and hashed by its four fields),
ordered by epoch, group, sample, then attempt, immutable, and named by `member` the way
`parse_member` reads back."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.scheduler import SampleKey, member, parse_member

_KEYS = st.builds(SampleKey, *(st.integers(0, 2**31) for _ in range(4)))


@given(st.lists(_KEYS, max_size=20))
def test_keys_sort_by_epoch_group_sample_then_attempt(keys):
    assert sorted(keys) == sorted(keys, key=lambda k: (k.epoch, k.group, k.sample, k.attempt))


@given(_KEYS)
def test_a_key_is_a_value_named_by_its_member(key):
    again = SampleKey(key.epoch, key.group, key.sample, key.attempt)
    assert again == key and hash(again) == hash(key) and {key: 1}[again] == 1
    assert parse_member(member(key)) == key and parse_member(member(key).encode()) == key


def test_a_key_cannot_be_changed_and_says_its_fields():
    key = SampleKey(1, 2, 3, 4)
    with pytest.raises(AttributeError):
        key.attempt = 5  # type: ignore[misc]
    assert repr(key) == "SampleKey(epoch=1, group=2, sample=3, attempt=4)"
    assert key != SampleKey(1, 2, 3, 5) and key < SampleKey(1, 2, 3, 5) < SampleKey(1, 2, 4, 0)
