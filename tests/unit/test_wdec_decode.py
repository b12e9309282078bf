"""`wire.decode_results` on results of one chain whose loss tokens are one run served by one
version (a single call: the usual result), which it builds at each result's size from slices,
and on batches that mix them with results of several chains, runs or versions, which it
expands over the batch: every taken result is the one `decode` + `check_result` give alone
(values, dtypes, writable arrays, oldest version), nothing is taken that those refuse; and a
decoded result's `oldest_version` and `fit_width` of one chain as of several."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline import wire
from pipeline.chains import SpanChain
from tests.unit.test_adm_decode_results import check_batch, result
from tests.unit.test_fuzz_wire import FUZZ


def _first_loss(data: bytes) -> int:
    """The piece's first loss token (-1: not one chain of one run served by one version)."""
    piece = wire._result_piece(data, wire.MAX_MESSAGE_BYTES)
    assert piece is not None
    return piece[10]


def _tree(data: bytes) -> dict:
    return msgpack.unpackb(data, raw=False)


def _packed(tree: dict) -> bytes:
    return msgpack.packb(tree, use_bin_type=True)


def test_a_single_call_is_one_run_at_its_first_completion_token():
    assert _first_loss(result(0, [(5, 3, 0)])) == 5
    assert _first_loss(result(0, [(0, 4, 2)])) == 0  # no prompt
    assert _first_loss(result(0, [(8, 8, 1)])) == 8  # no padding bits


def test_results_of_several_runs_chains_or_versions_are_not_one_run():
    assert _first_loss(result(1, [(4, 3, 0), (10, 2, 0)])) == -1  # one chain, a tool output between
    assert _first_loss(result(1, [(4, 3, 0), (10, 2, 1)])) == -1  # two versions
    assert _first_loss(result(0, [(4, 3, 0), (10, 2, 0)])) == -1  # two chains
    assert _first_loss(result(0, [(3, 0, 0)])) == -1  # no loss token


def test_a_batch_of_single_calls_decodes_as_each_alone():
    datas = [result(s, [(s % 5, 1 + s % 11, s % 3)], seed=s) for s in range(24)]
    assert all(_first_loss(d) >= 0 for d in datas)
    assert all(got is not None for got in check_batch(datas, vocab=1000))


def test_a_mixed_batch_decodes_as_each_alone():
    datas = [result(0, [(6, 5, 1)]), result(1, [(4, 3, 0), (10, 2, 0)]), result(2, [(2, 2, 3)]),
             result(3, [(4, 3, 0), (10, 2, 1)]), result(4, [(3, 0, 0)]), result(5, [])]
    assert all(got is not None for got in check_batch(datas))


def test_single_call_arrays_are_made_only_when_read():
    got = wire.decode_results([result(s, [(7, 9, 2)], seed=s) for s in range(3)])
    for r in got:
        assert r is not None and type(r.chains[0]) is SpanChain
        assert not {"loss_mask", "logprobs", "versions"} & set(vars(r.chains[0]))


def test_single_call_arrays_are_each_results_own_and_writable():
    got = check_batch([result(s, [(7, 9, 2)], seed=s) for s in range(3)])
    for r in got:
        assert r is not None and len(r.chains) == 1
        chain = r.chains[0]
        assert type(chain) is SpanChain and chain.span == (7, 9, 2) and r.oldest_version == 2
        assert chain.span_logprobs.dtype == np.float32 and len(chain.span_logprobs) == 9
        for array in (chain.tokens, chain.span_logprobs):  # over a buffer of its own, no other result's
            assert array.flags.writeable and type(array.base.obj) is bytearray
            assert len(array.base.obj) == array.nbytes
        for name in ("tokens", "loss_mask", "logprobs", "versions"):
            array = getattr(chain, name)
            assert (array.base is None or name == "tokens") and array.flags.writeable and len(array) == 16
        tokens = chain.tokens.copy()
        got[0].chains[0].tokens[0] += 1  # another result's arrays do not change
        assert (chain.tokens == tokens).all() or r is got[0]
        assert chain.loss_mask.tolist() == [False] * 7 + [True] * 9
        assert chain.versions.tolist() == [-1] * 7 + [2] * 9
        assert (chain.logprobs[:7] == 0).all() and (chain.logprobs[7:] < 0).all()


@pytest.mark.parametrize("field, value", [
    ("lengths", (15).to_bytes(4, "little")), ("calls", (0).to_bytes(4, "little")),
    ("call_tokens", (15).to_bytes(8, "little")), ("versions", (-1).to_bytes(4, "little", signed=True)),
    ("version_runs", (8).to_bytes(4, "little")), ("version_runs", (0).to_bytes(4, "little")),
    ("loss_mask", b"\x80\x7f"), ("loss_mask", b"\x80\xff\x00"),  # 8 loss bits; a byte too many
    ("logprobs", b"\x00\x00\x80\x7f" * 9),  # inf
    ("logprobs", b"\x00\x00\x00\x00" * 8),  # a log-prob short
    ("tokens", b"\xff\xff\xff\xff" * 16),  # -1
])
def test_a_damaged_single_call_is_left_to_decoding_alone(field, value):
    good = result(0, [(7, 9, 2)])
    tree = _tree(good)
    tree["chains"][field] = value
    assert check_batch([good, _packed(tree), good])[1] is None


def test_padding_bits_set_leave_a_single_call_to_decoding_alone():
    good = result(0, [(7, 8, 2)])  # 15 tokens: one padding bit
    tree = _tree(good)
    tree["chains"]["loss_mask"] = tree["chains"]["loss_mask"][:-1] + bytes([tree["chains"]["loss_mask"][-1] | 0x80])
    assert check_batch([good, _packed(tree)]) == [_not_none, None]


class _NotNone:
    def __eq__(self, other: object) -> bool:
        return other is not None


_not_none = _NotNone()


@pytest.mark.parametrize("vocab, taken", [(None, True), (2**31, True), (2**40, True), (1000, True), (999, False),
                                          (0, False), (-5, False)])
def test_the_vocabulary_bounds_the_token_ids_as_check_result_does(vocab, taken):
    tree = _tree(result(0, [(3, 2, 0)]))
    tree["chains"]["tokens"] = np.array([0, 1, 998, 999, 5], "<i4").tobytes()
    got = check_batch([_packed(tree)], vocab=vocab)
    assert (got[0] is not None) is taken


@FUZZ
@given(calls=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(0, 3)), max_size=12),
       merged=st.lists(st.booleans(), max_size=12), vocab=st.sampled_from([None, 1000, 500]))
def test_generated_batches_decode_as_each_alone(calls, merged, vocab):
    datas = [result(i, [call, call] if i < len(merged) and merged[i] else [call], seed=i)
             for i, call in enumerate(calls)]
    check_batch(datas, vocab=vocab)


def test_oldest_version_and_fit_width_of_one_chain_and_of_several():
    one, several = check_batch([result(0, [(4, 6, 3)]), result(2, [(4, 3, 5), (9, 2, 1)])])
    assert one is not None and several is not None
    assert one.oldest_version == 3 and several.oldest_version == 1
    assert wire.fit_width(one, 10) is None and wire.fit_width(several, 11) is None
    cut = wire.fit_width(one, 9)
    assert cut is not None and [len(c) for c in cut.chains] == [9] and cut.truncation == wire.OVERLONG
    cut = wire.fit_width(several, 10)
    assert cut is not None and [len(c) for c in cut.chains] == [7, 10]
