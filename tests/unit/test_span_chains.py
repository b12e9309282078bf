"""A `SpanChain` (one span of loss tokens served by one version, as a single call's result
decodes) is a `Chain` whose per-token arrays are made only when read: packing, the `Ready`'s
arrays and the step's metrics read its span instead, and give what the same chain with its
arrays gives, value for value and dtype for dtype."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import wire
from pipeline.chains import Chain, SpanChain
from pipeline.packing import Group, Rollout, pack
from pipeline.ready import compact, expand
from pipeline.session_metrics import session_metrics
from pipeline.sessions import Status


def span_chain(rng: np.random.Generator, length: int, first: int, n: int, version: int) -> SpanChain:
    tokens = rng.integers(0, 70_000, length).astype(np.int32)
    logprobs = -rng.random(n).astype(np.float32)
    return SpanChain.of(tokens, first, logprobs, version, 1, length)


def plain(chain: Chain) -> Chain:
    """The same chain with its arrays made."""
    return Chain(chain.tokens, chain.loss_mask, chain.logprobs, chain.versions, chain.support, chain.calls,
                 chain.call_tokens)


def groups_of(rng: np.random.Generator, sizes: list[int], versions: list[int], truncated: list[bool],
              make: bool) -> list[Group]:
    groups = []
    for g, size in enumerate(sizes):
        rollouts = []
        for s in range(size):
            length = int(rng.integers(2, 40))
            first = int(rng.integers(0, length - 1))
            n = int(rng.integers(1, length - first + 1))
            chain = span_chain(rng, length, first, n, versions[(g + s) % len(versions)])
            status = Status.TRUNCATED if truncated[(g * 7 + s) % len(truncated)] else Status.COMPLETED
            rollouts.append(Rollout(s, status, (plain(chain) if make else chain,), float(rng.random())))
        groups.append(Group(g, tuple(rollouts)))
    return groups


def same_arrays(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert np.array_equal(a[name], b[name], equal_nan=True), name


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6),
       versions=st.lists(st.integers(0, 9), min_size=1, max_size=4),
       truncated=st.lists(st.booleans(), min_size=1, max_size=5), seed=st.integers(0, 2**16))
def test_spans_pack_into_the_ready_and_metrics_their_arrays_would(sizes, versions, truncated, seed):
    spans = groups_of(np.random.default_rng(seed), sizes, versions, truncated, make=False)
    made = groups_of(np.random.default_rng(seed), sizes, versions, truncated, make=True)
    a = pack(spans, rows=4, width=64, truncation="mask")
    b = pack(made, rows=4, width=64, truncation="mask")
    assert (a.spans is not None) == bool(a.groups) and b.spans is None
    same_arrays(compact(a), compact(b))
    same_arrays(expand(compact(a)), expand(compact(b)))
    assert session_metrics(spans, a, updates=12) == session_metrics(made, b, updates=12)
    assert a.completion_tokens == b.completion_tokens
    # nothing the admission reads made a chain's per-token arrays
    assert not any({"loss_mask", "logprobs", "versions"} & set(vars(c)) for g in spans for r in g.rollouts
                   for c in r.chains)


def test_one_chain_without_a_span_packs_every_chain_by_its_arrays():
    rng = np.random.default_rng(3)
    spans = groups_of(rng, [3, 2], [4, 5], [False], make=False)
    mixed = [spans[0], Group(1, tuple(Rollout(r.sample, r.status, (plain(r.chains[0]),), r.reward)
                                      for r in spans[1].rollouts))]
    a, b = pack(mixed, rows=4, width=64), pack(spans, rows=4, width=64)
    assert a.spans is None and b.spans is not None
    same_arrays(compact(a), compact(b))


def test_adjacent_spans_of_one_version_make_one_run():
    rng = np.random.default_rng(0)
    chains = [span_chain(rng, 10, 2, 5, 7), span_chain(rng, 10, 0, 10, 7), span_chain(rng, 10, 9, 1, 8)]
    group = Group(0, tuple(Rollout(s, Status.COMPLETED, (c,), 1.0) for s, c in enumerate(chains)))
    arrays = compact(pack([group], rows=1, width=30))
    assert arrays["versions"].tolist() == [7, 8] and arrays["version_runs"].tolist() == [15, 1]
    assert arrays["versions"].dtype == np.int32 and arrays["version_runs"].dtype == np.int32


def test_token_ids_travel_as_uint16_when_every_one_fits_else_as_int32():
    rng = np.random.default_rng(1)
    small = SpanChain.of(np.array([1, 65_535, 3], np.int32), 1, np.array([-0.5], np.float32), 0, 1, 3)
    large = SpanChain.of(np.array([1, 65_536, 3], np.int32), 1, np.array([-0.5], np.float32), 0, 1, 3)
    for chain, dtype in ((small, np.uint16), (large, np.int32)):
        arrays = compact(pack([Group(0, (Rollout(0, Status.COMPLETED, (chain,), 1.0),))], rows=1, width=8))
        assert arrays["tokens"].dtype == dtype
        assert expand(arrays)["tokens"][0, :3].tolist() == chain.tokens.tolist()
        assert expand(arrays)["tokens"].dtype == np.int32
    del rng


def test_a_ready_of_float_token_ids_is_refused_by_name():
    chain = span_chain(np.random.default_rng(2), 6, 1, 3, 0)
    arrays = compact(pack([Group(0, (Rollout(0, Status.COMPLETED, (chain,), 1.0),))], rows=1, width=8))
    arrays["tokens"] = arrays["tokens"].astype(np.float32)
    with pytest.raises(ValueError, match="tokens must be int32 or uint16"):
        expand(arrays)


def test_a_span_chain_compares_as_the_chain_it_holds():
    chain = span_chain(np.random.default_rng(4), 8, 2, 4, 3)
    assert wire._same(chain, plain(chain)) and wire._same(plain(chain), chain)
    other = plain(span_chain(np.random.default_rng(5), 8, 2, 4, 3))
    assert not wire._same(chain, other)
