"""Sessions to chains: a session's policy calls merged into the token sequences a trainer runs.

An agent session makes calls whose prompts usually repeat the whole conversation so far:
the previous call's prompt, its completion, then new tokens (a tool result, an
observation, the next user turn). Training each call as its own sequence would run the
shared prefix again and again. `merge_calls` folds such calls into one chain:

- a call whose prompt starts with the previous call's prompt + completion (token by token)
  *continues* the previous call's chain; the prompt tokens beyond that prefix (the tool
  output) are appended as non-loss tokens, then the call's completion as loss tokens;
- any other call (the harness summarised, truncated or rewrote the context) *opens* a new
  chain.

Each `Chain` holds flat per-token numpy arrays: `tokens` (int32), `loss_mask` (bool, True
on completion tokens), `logprobs` (float32, the behaviour log-prob on completion tokens, 0
elsewhere), `versions` (int32, the weight version that served each completion token, -1 on
prompt tokens) and, for filtered sampling, `support` (`[n_tokens, k]` int32 token ids, -1
padded; prompt tokens have an all -1 row). `chains_to_arrays` / `chains_from_arrays` turn a
list of chains into a handful of flat little-endian arrays and back, which is the form they
travel in on the wire.

The merge ratio (`merge_ratio`) is the share of call tokens the merge saves:
``1 - (tokens in chains) / (sum over calls of len(prompt) + len(completion))``. It is 0
when no call continues another, and approaches 1 for long multi-turn sessions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import ClassVar, NamedTuple

import numpy as np

from pipeline.sessions import LOGPROB_DTYPE, TOKEN_DTYPE, Call

VERSION_DTYPE = np.dtype("<i4")
NO_VERSION = -1
"""Version of a token the policy did not sample (prompt, tool output, padding)."""
_new = object.__new__
_MIN = np.minimum.reduce  # an array's min, without `ndarray.min`'s Python layer


@dataclass(frozen=True)
class Chain:
    """One token sequence a trainer runs: merged calls, with per-token training data.

    `calls` counts the calls merged into it; `call_tokens` is what those calls would cost
    trained one by one (sum of prompt + completion lengths), so that the merge ratio can be
    computed from chains alone.
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    support: np.ndarray | None = None
    calls: int = 1
    call_tokens: int = -1

    def __post_init__(self) -> None:
        n = len(self.tokens)
        for name in ("loss_mask", "logprobs", "versions"):
            arr = getattr(self, name)
            if arr.ndim != 1 or len(arr) != n:
                raise ValueError(f"Chain.{name} has shape {arr.shape}, expected ({n},)")
        if self.support is not None and (self.support.ndim != 2 or len(self.support) != n):
            raise ValueError(f"Chain.support has shape {self.support.shape}, expected ({n}, k)")
        if self.call_tokens < 0:
            object.__setattr__(self, "call_tokens", n)

    @classmethod
    def trusted(cls, tokens: np.ndarray, loss_mask: np.ndarray, logprobs: np.ndarray,
                versions: np.ndarray, support: np.ndarray | None, calls: int, call_tokens: int,
                served: Sequence[int] | None = None) -> Chain:
        """The chain of these fields without `__post_init__`'s checks: only for arrays whose
        shapes the caller has checked itself (the wire decoder's: every per-token array one
        dimension of `len(tokens)` entries, `support` `[len(tokens), k]`) and a `call_tokens`
        of at least `len(tokens)`. About a quarter of the checked constructor's time.
        `served`: the versions that served the loss tokens, when the caller has them (the
        decoder's runs), which gives `oldest_version` without reading the arrays."""
        chain = _new(cls)
        fields = {"tokens": tokens, "loss_mask": loss_mask, "logprobs": logprobs, "versions": versions,
                  "support": support, "calls": calls, "call_tokens": call_tokens}
        if served is not None:
            fields["oldest_version"] = min(served, default=None)
        object.__setattr__(chain, "__dict__", fields)  # one dict, set at once
        return chain

    # (first, n, version) when the loss tokens are the one span `[first, first + n)`, all served
    # by `version`, and the chain says so (a `SpanChain`); None: read the arrays
    span: ClassVar[tuple[int, int, int] | None] = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def loss_tokens(self) -> int:
        """Number of completion (loss) tokens."""
        return int(np.count_nonzero(self.loss_mask))

    @cached_property
    def oldest_version(self) -> int | None:
        """The weight version that served the chain's oldest loss token (None without any),
        read once (the arrays are not to be changed in place)."""
        served = self.versions[self.loss_mask]
        return int(_MIN(served, axis=None)) if served.size else None

    @property
    def support_width(self) -> int:
        """k of the support array, 0 without support."""
        return 0 if self.support is None else int(self.support.shape[1])

    def head(self, n: int) -> Chain:
        """The chain's first `n` tokens (itself when it has no more)."""
        if len(self) <= n:
            return self
        support = None if self.support is None else self.support[:n]
        return Chain(self.tokens[:n], self.loss_mask[:n], self.logprobs[:n], self.versions[:n],
                     support, self.calls, self.call_tokens)


class SpanChain(Chain):
    """A chain whose loss tokens are one span, `[first, first + n)` with n >= 1, all served by
    one weight version (a single call's chain: the usual result), kept as the wire carries it:
    its tokens, the span, the version and the span's log-probs. The per-token `loss_mask`,
    `logprobs` and `versions` are made on first access (then kept), so code that reads them
    sees a `Chain` like any other; packing and the `Ready` read the span instead
    (`Chain.span`) and never make them. Made by `SpanChain.of` only, from values the caller
    checked (the wire decoder's)."""

    span_logprobs: np.ndarray  # the behaviour log-probs of the span's tokens, set by `of`

    @classmethod
    def of(cls, tokens: np.ndarray, first: int, logprobs: np.ndarray, version: int, calls: int,
           call_tokens: int) -> SpanChain:
        """The chain of `tokens` whose loss tokens are `tokens[first:first + len(logprobs)]`
        (at least one), with those `logprobs` (float32), served by `version`; unchecked: the
        span lies within the tokens and `call_tokens >= len(tokens)`."""
        chain = _new(cls)
        object.__setattr__(chain, "__dict__", {
            "tokens": tokens, "support": None, "calls": calls, "call_tokens": call_tokens,
            "oldest_version": version, "span": (first, len(logprobs), version), "span_logprobs": logprobs})
        return chain

    @cached_property
    def loss_mask(self) -> np.ndarray:
        first, n, _ = self._span
        mask = np.zeros(len(self.tokens), bool)
        mask[first:first + n] = True
        return mask

    @cached_property
    def logprobs(self) -> np.ndarray:
        first, n, _ = self._span
        full = np.zeros(len(self.tokens), LOGPROB_DTYPE)
        full[first:first + n] = self.span_logprobs
        return full

    @cached_property
    def versions(self) -> np.ndarray:
        first, n, version = self._span
        full = np.full(len(self.tokens), NO_VERSION, VERSION_DTYPE)
        full[first:first + n] = version
        return full

    @property
    def loss_tokens(self) -> int:
        return self._span[1]

    @property
    def _span(self) -> tuple[int, int, int]:
        span = self.span
        assert span is not None  # `of` sets it
        return span


class _ChainBuilder:
    """Lays out the chains of a session end to end, then fills each of the session's arrays
    once (one concatenation of the token pieces; the loss mask, log-probs and versions
    written in place) and makes every chain a slice of them."""

    def __init__(self) -> None:
        self.tokens: list[np.ndarray] = []
        self.calls_at: list[tuple[int, Call]] = []  # each completion's first token, its call
        self.opened: list[tuple[int, int]] = []  # each chain's first token and first call (in calls_at)
        self.call_tokens: list[int] = []  # per chain
        self.length = 0

    def open(self) -> None:
        self.opened.append((self.length, len(self.calls_at)))
        self.call_tokens.append(0)

    def add_prompt(self, ids: np.ndarray) -> None:
        self.tokens.append(ids)
        self.length += len(ids)

    def add_completion(self, call: Call) -> None:
        self.calls_at.append((self.length, call))
        self.add_prompt(np.asarray(call.completion_ids))
        self.call_tokens[-1] += len(call.prompt_ids) + len(call.completion_ids)

    def build(self) -> Merged:
        bounds = [*self.opened, (self.length, len(self.calls_at))]
        for (first, first_call), (end, end_call) in zip(bounds, bounds[1:]):
            self._check_logprobs(end - first, self.calls_at[first_call:end_call])
        n = self.length
        tokens = (np.concatenate(self.tokens) if self.tokens else np.zeros(0, TOKEN_DTYPE)).astype(
            TOKEN_DTYPE, copy=False)
        loss_mask = np.zeros(n, dtype=bool)
        logprobs = np.zeros(n, dtype=LOGPROB_DTYPE)
        versions = np.empty(n, dtype=VERSION_DTYPE)
        versions.fill(NO_VERSION)  # np.full's Python layer costs more than the fill
        spans = []
        supported = False
        for start, call in self.calls_at:
            end = start + len(call.completion_ids)
            loss_mask[start:end] = True
            logprobs[start:end] = call.logprobs
            versions[start:end] = call.version
            spans.append((start, end))
            supported = supported or call.support is not None
        chains = []
        for (first, first_call), (end, end_call), call_tokens in zip(bounds, bounds[1:], self.call_tokens):
            whole = len(bounds) == 2  # one chain: the session's arrays themselves, not views
            part = slice(first, end)
            support = self._support(first, end, self.calls_at[first_call:end_call]) if supported else None
            chains.append(Chain(tokens if whole else tokens[part], loss_mask if whole else loss_mask[part],
                                logprobs if whole else logprobs[part], versions if whole else versions[part],
                                support, end_call - first_call, call_tokens))
        return Merged(tuple(chains), tokens, loss_mask, logprobs, versions, tuple(spans), supported)

    @staticmethod
    def _check_logprobs(n: int, calls_at: list[tuple[int, Call]]) -> None:
        """A chain of `n` tokens must get a log-prob for each (a call changed after it was made)."""
        logprobs_n = n - sum(len(call.completion_ids) - len(call.logprobs) for _, call in calls_at)
        if logprobs_n != n:
            raise ValueError(f"Chain.logprobs has shape ({logprobs_n},), expected ({n},)")

    @staticmethod
    def _support(first: int, end: int, calls_at: list[tuple[int, Call]]) -> np.ndarray | None:
        """The support of the chain of tokens [first, end), None when none of its calls has any."""
        widths = [call.support.shape[1] for _, call in calls_at if call.support is not None]
        if not widths:
            return None
        support = np.full((end - first, max(widths)), -1, dtype=TOKEN_DTYPE)
        for start, call in calls_at:
            if call.support is not None:
                at = start - first
                support[at:at + len(call.completion_ids), : call.support.shape[1]] = call.support
        return support


def _extends(call: Call, prev: Call) -> bool:
    """True when `call.prompt_ids` starts with `prev.prompt_ids + prev.completion_ids`."""
    p, c = len(prev.prompt_ids), len(prev.completion_ids)
    if len(call.prompt_ids) < p + c:
        return False
    head = call.prompt_ids
    return bool(
        np.array_equal(head[:p], prev.prompt_ids) and np.array_equal(head[p : p + c], prev.completion_ids)
    )


class Merged(NamedTuple):
    """A session's calls merged into chains, laid end to end: each chain's arrays are a slice
    of the session's flat `tokens`, `loss_mask`, `logprobs` and `versions` (one array each),
    and `spans` holds each call's completion as (first token, past its last token) in those
    arrays, in call order (the loss tokens, in the order the wire carries them). An encoder
    reads these instead of concatenating the chains' arrays again. `supported`: some call
    has sampling support (the chains then carry it; the flat arrays hold none)."""

    chains: tuple[Chain, ...]
    tokens: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    spans: tuple[tuple[int, int], ...]
    supported: bool


def merge_calls(calls: Sequence[Call]) -> list[Chain]:
    """Merge a session's calls, in order, into chains (see the module docstring)."""
    return list(merged_calls(calls).chains)


def merged_calls(calls: Sequence[Call]) -> Merged:
    """`merge_calls`, with the session's flat arrays the chains are slices of."""
    builder = _ChainBuilder()
    prev: Call | None = None
    for call in calls:
        if prev is not None and _extends(call, prev):
            start = len(prev.prompt_ids) + len(prev.completion_ids)
            builder.add_prompt(np.asarray(call.prompt_ids)[start:])
        else:
            builder.open()
            builder.add_prompt(np.asarray(call.prompt_ids))
        builder.add_completion(call)
        prev = call
    return builder.build()


def merge_ratio(chains: Sequence[Chain]) -> float:
    """Share of call tokens saved by merging: ``1 - sum(len(chain)) / sum(call_tokens)``.

    0.0 for no chains (nothing to save).
    """
    call_tokens = sum(c.call_tokens for c in chains)
    if call_tokens == 0:
        return 0.0
    return 1.0 - sum(len(c) for c in chains) / call_tokens


def chains_to_arrays(chains: Sequence[Chain]) -> dict[str, np.ndarray]:
    """Flatten chains into little-endian arrays: `lengths`, `calls`, `call_tokens` (one entry
    per chain) and `tokens`, `loss_mask`, `logprobs`, `versions` (all chains concatenated),
    plus `support` (`[total, k]`, -1 padded) when any chain has support (even of width 0).
    Of a single chain the arrays may be the chain's own: read them, do not write to them."""
    out: dict[str, np.ndarray] = {
        "lengths": np.array([len(c) for c in chains], dtype="<i4"),
        "calls": np.array([c.calls for c in chains], dtype="<i4"),
        "call_tokens": np.array([c.call_tokens for c in chains], dtype="<i8"),
    }
    out["tokens"] = _cat([c.tokens for c in chains], TOKEN_DTYPE)
    out["loss_mask"] = _cat([c.loss_mask for c in chains], np.dtype(bool))
    out["logprobs"] = _cat([c.logprobs for c in chains], LOGPROB_DTYPE)
    out["versions"] = _cat([c.versions for c in chains], VERSION_DTYPE)
    if any(c.support is not None for c in chains):
        k = _support_k(chains)
        out["support"] = np.concatenate([_padded_support(c, k) for c in chains])
    return out


def uniform_support(chains: Sequence[Chain]) -> tuple[Chain, ...]:
    """The chains with support all of one width, or all without: when any chain has support,
    every chain gets a `[n, k]` support (k the widest, -1 padded; all -1 where a chain had
    none). This is the form `chains_from_arrays` returns, so it survives the wire unchanged."""
    if all(c.support is None for c in chains):
        return tuple(chains)
    k = _support_k(chains)
    return tuple(c if c.support is not None and c.support_width == k
                 else replace(c, support=_padded_support(c, k)) for c in chains)


def _support_k(chains: Sequence[Chain]) -> int:
    return max(c.support_width for c in chains)


def _padded_support(chain: Chain, k: int) -> np.ndarray:
    block = np.full((len(chain), k), -1, dtype=TOKEN_DTYPE)
    if chain.support is not None:
        block[:, : chain.support_width] = chain.support
    return block


def chains_from_arrays(arrays: Mapping[str, np.ndarray]) -> list[Chain]:
    """Inverse of `chains_to_arrays`; validates that the lengths cover the flat arrays."""
    lengths = np.asarray(arrays["lengths"], dtype=np.int64)
    total = int(lengths.sum())
    flat = {
        "tokens": np.asarray(arrays["tokens"], dtype=TOKEN_DTYPE),
        "loss_mask": np.asarray(arrays["loss_mask"], dtype=bool),
        "logprobs": np.asarray(arrays["logprobs"], dtype=LOGPROB_DTYPE),
        "versions": np.asarray(arrays["versions"], dtype=VERSION_DTYPE),
    }
    support = arrays.get("support")
    for name, arr in flat.items():
        if arr.shape != (total,):
            raise ValueError(f"chain array {name!r} has shape {arr.shape}, lengths sum to {total}")
    if support is not None and (support.ndim != 2 or support.shape[0] != total):
        raise ValueError(f"chain array 'support' has shape {support.shape}, lengths sum to {total}")
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    calls, call_tokens = arrays["calls"], arrays["call_tokens"]
    chains = []
    for i in range(len(lengths)):
        a, b = int(bounds[i]), int(bounds[i + 1])
        chains.append(
            Chain(
                tokens=flat["tokens"][a:b],
                loss_mask=flat["loss_mask"][a:b],
                logprobs=flat["logprobs"][a:b],
                versions=flat["versions"][a:b],
                support=None if support is None else np.asarray(support[a:b], dtype=TOKEN_DTYPE),
                calls=int(calls[i]),
                call_tokens=int(call_tokens[i]),
            )
        )
    return chains


def _cat(parts: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    if not parts:
        return np.zeros(0, dtype=dtype)
    if len(parts) == 1:  # one chain: its own array (copied only to change its dtype or layout)
        return np.ascontiguousarray(parts[0], dtype=dtype)
    return np.ascontiguousarray(np.concatenate(parts).astype(dtype, copy=False))
