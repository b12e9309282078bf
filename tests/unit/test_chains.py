"""Sessions to chains: merge on extension, placement of masks/log-probs/versions/support."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.chains import Chain, chains_from_arrays, chains_to_arrays, merge_calls, merge_ratio
from pipeline.sessions import Call


def test_call_extending_previous_prompt_and_completion_continues_the_chain() -> None:
    first = Call([1, 2, 3], [4, 5], [-0.1, -0.2], version=3)
    second = Call([1, 2, 3, 4, 5, 6, 7], [8], [-0.3], version=4)
    (chain,) = merge_calls([first, second])
    assert chain.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert chain.loss_mask.tolist() == [False, False, False, True, True, False, False, True]
    np.testing.assert_allclose(chain.logprobs, [0, 0, 0, -0.1, -0.2, 0, 0, -0.3], rtol=1e-6)
    assert chain.versions.tolist() == [-1, -1, -1, 3, 3, -1, -1, 4]
    assert chain.tokens.dtype == np.int32 and chain.logprobs.dtype == np.float32
    assert chain.versions.dtype == np.int32 and chain.loss_mask.dtype == bool
    assert chain.calls == 2 and chain.support is None


def test_prompt_equal_to_previous_context_continues_with_no_extra_tokens() -> None:
    chains = merge_calls([Call([1], [2], [-1.0], 0), Call([1, 2], [3], [-1.0], 0)])
    assert len(chains) == 1 and chains[0].tokens.tolist() == [1, 2, 3]


def test_rewritten_context_opens_a_new_chain() -> None:
    calls = [
        Call([1, 2, 3], [4, 5], [-0.1, -0.2], 0),
        Call([1, 2, 3, 4, 9, 6], [7], [-0.3], 1),  # completion token 5 replaced: no extension
        Call([1, 2], [3], [-0.5], 1),  # shorter than the previous context
    ]
    chains = merge_calls(calls)
    assert [c.tokens.tolist() for c in chains] == [[1, 2, 3, 4, 5], [1, 2, 3, 4, 9, 6, 7], [1, 2, 3]]
    assert [c.loss_mask.sum() for c in chains] == [2, 1, 1]


def test_only_the_previous_call_is_extended() -> None:
    a = Call([1], [2], [-1.0], 0)
    b = Call([5], [6], [-1.0], 0)
    c = Call([1, 2, 3], [4], [-1.0], 0)  # extends a, but b came in between
    assert len(merge_calls([a, b, c])) == 3


def test_merge_ratio_counts_call_tokens_saved() -> None:
    calls = [
        Call([1, 2, 3], [4, 5], [-0.1, -0.2], 0),  # 5 call tokens
        Call([1, 2, 3, 4, 5, 6, 7], [8], [-0.3], 0),  # 8 call tokens, merged
        Call([1, 2, 9], [1], [-0.5], 0),  # 4 call tokens, a new chain
    ]
    chains = merge_calls(calls)
    assert [len(c) for c in chains] == [8, 4]
    assert [c.call_tokens for c in chains] == [13, 4]
    assert merge_ratio(chains) == pytest.approx(1 - 12 / 17)
    assert merge_ratio(merge_calls(calls[2:])) == 0.0
    assert merge_ratio([]) == 0.0 and merge_calls([]) == []


def test_support_is_placed_on_completion_tokens_and_padded() -> None:
    first = Call([1, 2], [3], [-0.1], 0, support=np.array([[3, 7]]))
    second = Call([1, 2, 3, 4], [5, 6], [-0.2, -0.3], 0, support=np.array([[5, 1, 2], [6, -1, -1]]))
    (chain,) = merge_calls([first, second])
    assert chain.support is not None and chain.support.shape == (6, 3)
    assert chain.support.tolist() == [
        [-1, -1, -1],
        [-1, -1, -1],
        [3, 7, -1],
        [-1, -1, -1],
        [5, 1, 2],
        [6, -1, -1],
    ]


def test_arrays_round_trip() -> None:
    calls = [
        Call([1, 2, 3], [4, 5], [-0.1, -0.2], 2, support=np.array([[4, 1], [5, 2]])),
        Call([9], [8], [-0.3], 3),
    ]
    chains = merge_calls(calls)
    arrays = chains_to_arrays(chains)
    assert arrays["tokens"].dtype == np.dtype("<i4") and arrays["lengths"].tolist() == [5, 2]
    back = chains_from_arrays(arrays)
    for a, b in zip(chains, back, strict=True):
        for name in ("tokens", "loss_mask", "logprobs", "versions"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        assert (a.calls, a.call_tokens) == (b.calls, b.call_tokens)
    assert back[0].support is not None and back[0].support[3:].tolist() == [[4, 1], [5, 2]]
    assert back[1].support is not None and (back[1].support == -1).all()


def test_arrays_with_wrong_lengths_are_refused() -> None:
    arrays = chains_to_arrays(merge_calls([Call([1], [2], [-1.0], 0)]))
    arrays["lengths"] = np.array([3], dtype=np.int32)
    with pytest.raises(ValueError, match="lengths sum to 3"):
        chains_from_arrays(arrays)


def test_chain_rejects_mismatched_arrays() -> None:
    with pytest.raises(ValueError, match="loss_mask"):
        Chain(np.zeros(3, np.int32), np.zeros(2, bool), np.zeros(3, np.float32), np.zeros(3, np.int32))


def test_trusted_chain_is_the_checked_one() -> None:
    """`Chain.trusted` (the decoder's) sets the same fields `Chain` would, with no checks."""
    tokens, loss = np.arange(4, dtype=np.int32), np.array([0, 1, 1, 0], bool)
    logprobs, versions = np.where(loss, -0.5, 0).astype(np.float32), np.where(loss, 2, -1).astype(np.int32)
    for support in (None, np.full((4, 2), -1, np.int32)):
        checked = Chain(tokens, loss, logprobs, versions, support, calls=2, call_tokens=9)
        trusted = Chain.trusted(tokens, loss, logprobs, versions, support, 2, 9)
        assert type(trusted) is Chain and vars(trusted) == vars(checked)
        assert len(trusted) == 4 and trusted.loss_tokens == 2 and trusted.head(2).tokens.tolist() == [0, 1]
        served = Chain.trusted(tokens, loss, logprobs, versions, support, 2, 9, served=[2])
        assert served.oldest_version == checked.oldest_version == 2
    unserved = Chain(tokens, np.zeros(4, bool), np.zeros(4, np.float32), np.full(4, -1, np.int32))
    assert unserved.oldest_version is None
    assert Chain.trusted(*(getattr(unserved, f) for f in ("tokens", "loss_mask", "logprobs", "versions")),
                         None, 1, 4, served=[]).oldest_version is None


@settings(max_examples=60, deadline=None)
@given(
    turns=st.lists(
        st.tuples(
            st.lists(st.integers(0, 50), max_size=5),
            st.lists(st.integers(0, 50), min_size=1, max_size=5),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_a_growing_conversation_is_one_chain(turns: list[tuple[list[int], list[int]]]) -> None:
    context: list[int] = []
    calls, completions = [], []
    for turn, (extra, completion) in enumerate(turns):
        context = context + extra
        calls.append(Call(list(context), completion, [-0.5] * len(completion), version=turn))
        completions.extend(completion)
        context = context + completion
    (chain,) = merge_calls(calls)
    assert chain.tokens.tolist() == context
    assert chain.tokens[chain.loss_mask].tolist() == completions
    assert chain.calls == len(turns)
    assert (chain.versions[~chain.loss_mask] == -1).all()
    assert (chain.logprobs[~chain.loss_mask] == 0).all()
