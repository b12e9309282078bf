"""The wire schema: one frozen dataclass per message kind, msgpack on the wire, strict decoding.

Every message is a msgpack map carrying `"v": SCHEMA_VERSION`, `"k": <kind>` and exactly the
fields of its class. Token ids and log-probabilities travel as packed little-endian bytes
(`<i4`, `<f4`), the arrays of a packed step as `{"dtype", "shape", "data"}` with a whitelist of
numeric dtypes; nothing is ever pickled.

A `Result` carries its session's calls already merged into chains by the rollout consumer
(`pipeline.chains`), as flat arrays (`chains.tokens`, `chains.lengths`, ...; log-probs,
versions and support only for completion tokens), so a prompt that repeats the conversation
so far never crosses the network twice. Schema version 2 introduced that; version 1 results
(which carried the calls) are refused, and dead-lettered, like any other unsupported version.

`decode` refuses anything malformed with a `SchemaError` naming the field (`chains.logprobs`),
never another exception. Well-formed messages decode through msgspec structs derived from
each kind's checkers (`_compile`), in C; only what those refuse is parsed again in Python,
for the field and the reason. `encode` runs the same checks on what it is about to send, so what
one process encodes every other process decodes. On a Redis stream an entry carries one field,
`m`, holding the encoded bytes (`to_fields` / `from_fields`); entries that fail to decode go to
the dead-letter stream (`dead_letter_fields`).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from operator import itemgetter
from typing import Annotated, Any, ClassVar, Literal, Optional, TypeVar, Union

import msgpack
import msgspec
import numpy as np

from pipeline.chains import (
    NO_VERSION, VERSION_DTYPE, Chain, Merged, SpanChain, chains_to_arrays, merged_calls, uniform_support)
from pipeline.config import MAX_MESSAGE_BYTES
from pipeline.packing import Rollout
from pipeline.ready import ReadyRecord, decode_record, record_builtins
from pipeline.scheduler import CAUSES  # of a resubmission
from pipeline.sessions import LOGPROB_DTYPE, TOKEN_DTYPE, Call, Session, Status, Task, finite_logprobs

SCHEMA_VERSION = 2
FIELD = b"m"  # the one field of a stream entry: the encoded message
DEAD_LETTER_BYTES = 64 * 1024  # how much of an undecodable entry a dead letter keeps
# the dtypes a packed step's arrays may have: little-endian and numeric
ARRAY_DTYPES = frozenset(
    {"|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8"})
_MAX_DEPTH = 32  # nesting of the free-form maps (task payloads, a step's record)
_MAX_NDIM = 32
_INT64 = 1 << 63


class SchemaError(ValueError):
    """A message that violates the schema; `field` is the dotted path of the offender."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def _tn(v: object) -> str:
    return type(v).__name__


# ---------------------------------------------------------------- field checkers
# Each takes (wire value, dotted path) and returns the Python value, or raises SchemaError.
# A checker whose refusals a msgspec type expresses exactly carries that type in `_TYPES`
# (and so do `_opt` and `_map` of one): decoding checks those fields in C (`_compiled`).

_TYPES: dict[Callable[[Any, str], Any], Any] = {}
_MAX_FLOAT = sys.float_info.max


def _typed(check: Callable[[Any, str], Any], wire_type: Any) -> Callable[[Any, str], Any]:
    """`check`, registered as accepting exactly what msgspec's `wire_type` accepts."""
    _TYPES[check] = wire_type
    return check


def _int(v: Any, path: str, nonneg: bool = True) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise SchemaError(path, f"expected an int, got {_tn(v)}")
    if nonneg and v < 0:
        raise SchemaError(path, f"must be >= 0, got {v}")
    if not -_INT64 <= v < _INT64:
        raise SchemaError(path, f"{v} is out of the int64 range")
    return int(v)


def _float(v: Any, path: str, nonneg: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise SchemaError(path, f"expected a float, got {_tn(v)}")
    try:
        v = float(v)
    except OverflowError:
        raise SchemaError(path, "too large for a float") from None
    if not math.isfinite(v):
        raise SchemaError(path, f"must be finite, got {v}")
    if nonneg and v < 0:
        raise SchemaError(path, f"must be >= 0, got {v}")
    return v


def _str(v: Any, path: str, nonempty: bool = False) -> str:
    if not isinstance(v, str):
        raise SchemaError(path, f"expected a str, got {_tn(v)}")
    if nonempty and not v:
        raise SchemaError(path, "must not be empty")
    return str(v)


def _opt(check: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    opt = lambda v, path: None if v is None else check(v, path)  # noqa: E731
    return _typed(opt, Optional[_TYPES[check]]) if check in _TYPES else opt


def _choice(values: tuple[str, ...], convert: Callable[[str], Any] = str) -> Callable[[Any, str], Any]:
    def check(v: Any, path: str) -> Any:
        if not isinstance(v, str) or v not in values:
            raise SchemaError(path, f"must be one of {', '.join(values)}, got {v!r}")
        return convert(v)
    enum_type = isinstance(convert, type) and issubclass(convert, enum.Enum)
    if enum_type and {e.value for e in convert} != set(values):  # type: ignore[attr-defined]
        raise TypeError(f"{convert.__name__} is not the choice of {values}")
    return _typed(check, convert if enum_type else Literal[values])


def _map(check: Callable[[Any, str], Any]) -> Callable[[Any, str], dict]:
    """A map with str keys and values passing `check`."""
    def check_map(v: Any, path: str) -> dict:
        if not isinstance(v, dict):
            raise SchemaError(path, f"expected a map, got {_tn(v)}")
        if not all(isinstance(key, str) for key in v):
            raise SchemaError(path, "map keys must be str")
        return {key: check(value, f"{path}.{key}") for key, value in v.items()}
    return _typed(check_map, dict[str, _TYPES[check]]) if check in _TYPES else check_map  # type: ignore[valid-type]


def _seq(check: Callable[[Any, str], Any]) -> Callable[[Any, str], tuple]:
    def check_seq(v: Any, path: str) -> tuple:
        if not isinstance(v, list):
            raise SchemaError(path, f"expected an array, got {_tn(v)}")
        return tuple(check(x, f"{path}.{i}") for i, x in enumerate(v))
    return check_seq


def _struct(v: Any, path: str, names: tuple[str, ...]) -> dict:
    """A nested map with exactly the keys `names`."""
    if not isinstance(v, dict):
        raise SchemaError(path, f"expected a map of {', '.join(names)}, got {_tn(v)}")
    for key in (*names, *v):
        if key not in v or key not in names:
            raise SchemaError(f"{path}.{key}", "missing" if key not in v else "unknown field")
    return v


def _native(v: Any, path: str, depth: int = 0) -> Any:
    """Free-form data (task payloads, a step's record): nil, bool, int, float, str, bin, and
    arrays and str-keyed maps of them."""
    if v is None or isinstance(v, (bool, float, str, bytes)):
        return v
    if isinstance(v, int):
        if not -_INT64 <= v < 2 * _INT64:
            raise SchemaError(path, f"{v} does not fit msgpack's integers")
        return v
    if depth >= _MAX_DEPTH and isinstance(v, (list, dict)):
        raise SchemaError(path, f"nested deeper than {_MAX_DEPTH}")
    if isinstance(v, list):
        return [_native(x, f"{path}.{i}", depth + 1) for i, x in enumerate(v)]
    if isinstance(v, dict):
        return _map(partial(_native, depth=depth + 1))(v, path)
    raise SchemaError(path, f"{_tn(v)} is not a msgpack-native value")


def _task(v: Any, path: str) -> Task:
    if type(v) is dict and len(v) == 2 and type(task_id := v.get("id")) is str and task_id \
            and type(payload := v.get("payload")) is dict:  # the usual map, as checked below
        task = _new(Task)
        object.__setattr__(task, "__dict__", {"id": task_id, "payload": _payload(payload, f"{path}.payload")
                                              if payload else {}})
        return task
    d = _struct(v, path, ("id", "payload"))
    payload = _payload(d["payload"], f"{path}.payload")
    return Task(_str(d["id"], f"{path}.id", nonempty=True), payload)


_payload = _map(_native)  # a task's payload


def _shaped(v: Any, path: str, dtype: np.dtype, shape: Any = None, copy: bool = True) -> np.ndarray:
    """Packed little-endian bytes `v`, of `shape` (a msgpack array) or one-dimensional: an
    array of its own (`copy`), else a read-only view of `v` (for checks only)."""
    if not isinstance(v, (bytes, memoryview)):  # (a view: a `Ready`'s wire form, checked before packing)
        raise SchemaError(path, f"expected bytes (msgpack bin), got {_tn(v)}")
    if shape is None:
        if len(v) % dtype.itemsize:
            raise SchemaError(path, f"{len(v)} bytes is not a multiple of {dtype.itemsize} ({dtype.str})")
        shape = (len(v) // dtype.itemsize,)
    elif len(v) != math.prod(shape) * dtype.itemsize:
        raise SchemaError(path, f"{len(v)} bytes for shape {list(shape)} of {dtype.str}")
    elif _too_large(shape, dtype.itemsize):
        raise SchemaError(path, f"shape {list(shape)} of {dtype.str} is too large")
    arr = np.frombuffer(v, dtype).reshape(shape)
    return arr.copy() if copy else arr


def _too_large(shape: Any, itemsize: int) -> bool:
    """Whether an array of `shape` is over the message limit (an empty array's other sides too)."""
    return math.prod(d for d in shape if d) * itemsize > MAX_MESSAGE_BYTES


_MIN = np.minimum.reduce  # an array's min, without `ndarray.min`'s Python layer
_MAX = np.maximum.reduce


def _bad_values(arr: np.ndarray) -> str | None:
    """Why a step's array may not hold its values (booleans other than 0 or 1, floats not
    finite), or None."""
    kind = arr.dtype.kind
    if kind == "b" and arr.size and _MAX(arr.view(np.uint8), None) > 1:
        return "booleans must be bytes 0 or 1"
    if kind == "f" and not np.isfinite(arr).all():
        return "must be finite"
    return None


def _ids(ids: np.ndarray, path: str, low: int = 0) -> np.ndarray:
    if ids.size and _MIN(ids, axis=None) < low:
        raise SchemaError(path, f"token ids must be >= {low}, got {ids.min()}")
    return ids


# A Result's chains, one packed little-endian array per field: per chain `lengths`, `calls`,
# `call_tokens`; per token `tokens` and `loss_mask` (one bit each, `np.packbits`, little bit
# order, the last byte zero-padded); per loss (completion) token only `logprobs`
# and `support` (nil or [loss tokens, k]); the loss tokens' versions run-length encoded
# (`versions[i]` for the next `version_runs[i]` loss tokens; a version changes once per call
# at most). Off the loss tokens log-probs, versions and support are 0, -1 and all -1 by
# definition. So a prompt token costs 4 bytes and a bit, a completion token 8 bytes and a bit
# (plus its support row): a single call costs about what it did as a call (2-7% more), and
# every call that continues a chain saves its repeated prompt.
_CHAIN_DTYPES: dict[str, np.dtype] = {"lengths": np.dtype("<i4"), "calls": np.dtype("<i4"), "call_tokens": np.dtype("<i8"),
                 "tokens": TOKEN_DTYPE, "loss_mask": np.dtype("|u1"), "logprobs": LOGPROB_DTYPE,
                 "versions": VERSION_DTYPE, "version_runs": np.dtype("<i4")}
_CHAIN_FIELDS = (*_CHAIN_DTYPES, "support")
_CHAIN_KEYS = frozenset(_CHAIN_FIELDS)
_CHAIN_VIEWS = tuple(_CHAIN_DTYPES.items())
_CHAIN_GET = itemgetter(*_CHAIN_DTYPES)  # a chains map's arrays, in `_CHAIN_DTYPES` order


def _chains(v: Any, path: str) -> tuple[Chain, ...]:
    """Chains from their wire arrays (above), every length and value checked (`_chain_parts`)."""
    return _expand_chains(*_chain_parts(v, path))


def _chain_parts(v: Any, path: str) -> tuple:
    """The checked pieces of chains' wire arrays (what `encode` checks, expanding nothing).

    The per-chain arrays (a handful of entries) are checked as Python lists, the per-token
    ones with one numpy reduction per check: a result decodes in about a dozen numpy calls
    whatever its chain count (the admission consumer decodes every result once, on input).
    The checks run in a fixed order, so that a message with several faults is refused for
    the first of them, whichever path decodes it."""
    d = v if type(v) is dict and v.keys() == _CHAIN_KEYS else _struct(v, path, _CHAIN_FIELDS)
    # well-formed bytes are viewed here, anything else refused by `_flat`
    lengths, calls, call_tokens, tokens, bits, logprobs, versions, runs = [
        np.frombuffer(data, dtype) if type(data) is bytes and not len(data) % dtype.itemsize
        else _flat(data, f"{path}.{name}", dtype) for (name, dtype), data in zip(_CHAIN_VIEWS, _CHAIN_GET(d))]
    lengths, calls, call_tokens = lengths.tolist(), calls.tolist(), call_tokens.tolist()
    n = len(lengths)
    if len(calls) != n:
        raise SchemaError(f"{path}.calls", f"{len(calls)} entries for {n} chains")
    if len(call_tokens) != n:
        raise SchemaError(f"{path}.call_tokens", f"{len(call_tokens)} entries for {n} chains")
    if n and min(lengths) < 0:
        raise SchemaError(f"{path}.lengths", f"must be >= 0, got {min(lengths)}")
    if n and min(calls) < 1:
        raise SchemaError(f"{path}.calls", f"must be >= 1, got {min(calls)}")
    if any(t < length for t, length in zip(call_tokens, lengths)):
        raise SchemaError(f"{path}.call_tokens", "must be >= the chain's length")
    total = sum(lengths)
    if len(tokens) != total:
        raise SchemaError(f"{path}.tokens", f"{len(tokens)} entries, the lengths sum to {total}")
    if total and _MIN(tokens, axis=None) < 0:
        _ids(tokens, f"{path}.tokens")
    if len(bits) != (total + 7) >> 3:
        raise SchemaError(f"{path}.loss_mask", f"{len(bits)} bytes for {total} bits")
    if total & 7 and int(bits[-1]) >> (total & 7):
        raise SchemaError(f"{path}.loss_mask", "the padding bits of the last byte must be 0")
    loss = np.unpackbits(bits, None, total, "little").view(bool)  # axis, count, bitorder (by position: 0.3 us less)
    n_loss = int(np.count_nonzero(loss))
    if len(logprobs) != n_loss:
        raise SchemaError(f"{path}.logprobs", f"{len(logprobs)} entries for {n_loss} loss tokens")
    if n_loss and not finite_logprobs(logprobs):
        raise SchemaError(f"{path}.logprobs", "must be finite and <= 0")
    versions, runs = versions.tolist(), runs.tolist()
    if len(runs) != len(versions):
        raise SchemaError(f"{path}.version_runs", f"{len(runs)} runs for {len(versions)} versions")
    if versions and min(versions) < 0:
        raise SchemaError(f"{path}.versions", f"must be >= 0, got {min(versions)}")
    if runs and min(runs) < 1:
        raise SchemaError(f"{path}.version_runs", f"must be >= 1, got {min(runs)}")
    if sum(runs) != n_loss:
        raise SchemaError(f"{path}.version_runs", f"the runs cover {sum(runs)} tokens, "
                          f"not the {n_loss} loss tokens")
    support = d["support"]
    if support is not None:
        support = _support(support, f"{path}.support", total, n_loss)
    return tokens, lengths, calls, call_tokens, loss, logprobs, versions, runs, support


def _support(v: Any, where: str, total: int, n_loss: int) -> np.ndarray:
    """The checked support rows of a result's loss tokens (`[n_loss, k]`)."""
    support = _ids(_array(v, where, TOKEN_DTYPE), where, -1)
    if support.ndim != 2 or support.shape[0] != n_loss:
        raise SchemaError(f"{where}.shape", f"must be [{n_loss}, k] (a row per loss token), got "
                          f"{list(support.shape)}")
    if total * support.shape[1] > MAX_MESSAGE_BYTES:  # expanded to every token
        raise SchemaError(f"{where}.shape", f"[{total}, {support.shape[1]}] once expanded to every "
                          f"token is more than {MAX_MESSAGE_BYTES} entries")
    return support


def _expand_chains(tokens: np.ndarray, lengths: list[int], calls: list[int], call_tokens: list[int],
                   loss: np.ndarray, logprobs: np.ndarray, versions: list[int], runs: list[int],
                   support: np.ndarray | None) -> tuple[Chain, ...]:
    """Chains from their checked wire pieces: log-probs, versions and support put back on
    every token (0, -1 and -1 off the loss tokens). The shapes `Chain` checks hold by
    construction (every array cut at the same bounds, `call_tokens` checked against the
    lengths): the chains are built without checking them again (`Chain.trusted`)."""
    total = len(tokens)
    full_logprobs = np.zeros(total, LOGPROB_DTYPE)
    full_versions = np.empty(total, VERSION_DTYPE)
    full_versions.fill(NO_VERSION)
    if len(logprobs):
        full_logprobs[loss] = logprobs
        # one version served every loss token (a single call, usually), or one per run
        full_versions[loss] = versions[0] if len(versions) == 1 else np.repeat(np.asarray(versions, VERSION_DTYPE), runs)
    full_support = None
    if support is not None:
        full_support = np.full((total, support.shape[1]), -1, TOKEN_DTYPE)
        full_support[loss] = support
    tokens = tokens.copy()  # not a view of the message's bytes
    return _cut_chains((tokens, loss, full_logprobs, full_versions, full_support), lengths, calls, call_tokens,
                       versions)


def _cut_chains(arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None],
                lengths: Sequence[int], calls: Sequence[int], call_tokens: Sequence[int],
                served: Sequence[int]) -> tuple[Chain, ...]:
    """The chains of one result's per-token arrays (tokens, loss mask, log-probs, versions,
    support), cut at `lengths`; `served`: the versions of its loss tokens."""
    tokens, loss, logprobs, versions, support = arrays
    if len(lengths) == 1:  # one chain (usually): the arrays as they are
        return (Chain.trusted(tokens, loss, logprobs, versions, support, calls[0], call_tokens[0], served),)
    out = []
    start = 0
    for i, length in enumerate(lengths):
        end = start + length
        out.append(Chain.trusted(tokens[start:end], loss[start:end], logprobs[start:end], versions[start:end],
                                 None if support is None else support[start:end], calls[i], call_tokens[i]))
        start = end
    return tuple(out)


def _flat(v: Any, path: str, dtype: np.dtype) -> np.ndarray:
    """Packed little-endian bytes `v` as a one-dimensional read-only view (no copy)."""
    if not isinstance(v, bytes):
        raise SchemaError(path, f"expected bytes (msgpack bin), got {_tn(v)}")
    if len(v) % dtype.itemsize:
        raise SchemaError(path, f"{len(v)} bytes is not a multiple of {dtype.itemsize} ({dtype.str})")
    return np.frombuffer(v, dtype)


def _chains_wire(chains: Any) -> Any:
    """The wire form `_chains` reads (anything but chains is left for the checks to refuse).
    Chains `Result.from_session` merged (`_CHECKED`) hold what decoding puts back off the
    loss tokens by construction: that is not compared again."""
    if not isinstance(chains, (list, tuple)) or not all(isinstance(c, Chain) for c in chains):
        return _wire(chains)
    arrays = chains_to_arrays(chains)
    loss = arrays["loss_mask"]
    if not _merged_checked(chains):
        off_loss = ~loss
        off = {"logprobs": 0, "versions": NO_VERSION, "support": -1}
        for name, value in off.items():  # what the wire leaves out must be what decoding puts back
            if name in arrays and (arrays[name][off_loss] != value).any():
                raise SchemaError(f"chains.{name}", f"must be {value} off loss tokens")
    versions = arrays["versions"][loss]
    if versions.size and versions[0] == versions[-1] and (versions == versions[0]).all():
        runs = np.array([len(versions)])  # one version served every loss token (usually)
        versions = versions[:1]
    else:
        change = np.ones(len(versions), dtype=bool)  # where a run of one version begins
        change[1:] = versions[1:] != versions[:-1]
        starts = np.flatnonzero(change)
        runs = np.diff(starts, append=len(versions))
        versions = versions[starts]
    arrays = {**arrays, "loss_mask": np.packbits(loss, bitorder="little"),
              "logprobs": arrays["logprobs"][loss], "versions": versions, "version_runs": runs}
    out: dict[str, Any] = {name: np.ascontiguousarray(arrays[name], dtype).tobytes()
                           for name, dtype in _CHAIN_DTYPES.items()}
    support = arrays.get("support")
    if support is not None:
        support = np.ascontiguousarray(support[loss], TOKEN_DTYPE)
    out["support"] = None if support is None else {"shape": list(support.shape), "data": support.tobytes()}
    return out


def _made_wire(result: Result, merged: Merged) -> None:
    """Refuse what decoding refuses of a session's merged chains (`merged`, whose chains are
    `result.chains`), with the field and reason decoding gives; then mark those chains
    checked and keep their wire form with `result` (`_MADE`), for `encode`. The calls were
    checked when made, but a source may change them after: their values are checked here
    once more, on the session's flat arrays (the loss mask and lengths hold by construction)."""
    tokens = merged.tokens
    if tokens.size:
        low = int(_MIN(tokens))
        if low < 0:
            raise SchemaError("chains.tokens", f"token ids must be >= 0, got {low}")
        if not finite_logprobs(merged.logprobs):  # 0 off the loss tokens by construction
            raise SchemaError("chains.logprobs", "must be finite and <= 0")
    versions, runs = _version_runs(merged)
    if versions and min(versions) < 0:
        raise SchemaError("chains.versions", f"must be >= 0, got {min(versions)}")
    for c in result.chains:
        object.__setattr__(c, _CHECKED, True)
    object.__setattr__(result, _MADE, {"chains": (result.chains, _merged_wire(merged, versions, runs))})


def _version_runs(merged: Merged) -> tuple[list[int], list[int]]:
    """The loss tokens' versions, run-length encoded as the wire carries them (`versions`,
    `version_runs`): one version per call, a run per call at most."""
    versions: list[int] = []
    runs: list[int] = []
    for start, end in merged.spans:
        if end > start:
            version = int(merged.versions[start])
            if versions and versions[-1] == version:
                runs[-1] += end - start
            else:
                versions.append(version)
                runs.append(end - start)
    return versions, runs


def _merged_wire(merged: Merged, versions: list[int], runs: list[int]) -> dict[str, Any]:
    """The wire form `_chains_wire` makes of `merged.chains`, byte for byte, straight from the
    session's flat arrays and completion spans: the tokens' bytes at once, the loss mask's
    bits as one int, the loss tokens' log-probs as the bytes of each span, the per-chain
    numbers packed from lists (no chain arrays concatenated, indexed or bit-packed again)."""
    chains, spans, total = merged.chains, merged.spans, len(merged.tokens)
    bits = 0
    for start, end in spans:
        bits |= ((1 << (end - start)) - 1) << start
    logprobs = merged.logprobs
    return {"lengths": _packed("lengths", [len(c) for c in chains]),
            "calls": _packed("calls", [c.calls for c in chains]),
            "call_tokens": _packed("call_tokens", [c.call_tokens for c in chains]),
            "tokens": merged.tokens.tobytes(),
            "loss_mask": bits.to_bytes((total + 7) // 8, "little"),  # np.packbits, little bit order
            "logprobs": b"".join([logprobs[start:end].tobytes() for start, end in spans]),
            "versions": _packed("versions", versions),
            "version_runs": _packed("version_runs", runs),
            "support": None}


_INT_CODES = {4: "i", 8: "q"}  # `struct` codes of the little-endian ints of `_CHAIN_DTYPES`


def _packed(name: str, values: list[int]) -> bytes:
    """`values` as the packed little-endian ints of chain field `name` (as numpy's `tobytes`)."""
    packer = _PACKERS.get((name, len(values)))
    if packer is None:
        packer = struct.Struct(f"<{len(values)}{_INT_CODES[_CHAIN_DTYPES[name].itemsize]}")
        if len(values) <= 4:  # the usual counts of chains and version runs, kept
            _PACKERS[name, len(values)] = packer
    return packer.pack(*values)


_PACKERS: dict[tuple[str, int], struct.Struct] = {}


def _array(v: Any, path: str, dtype: np.dtype | None = None, copy: bool = True) -> np.ndarray:
    """`{"dtype", "shape", "data"}` (a step's arrays) or, with `dtype`, `{"shape", "data"}`;
    `copy=False`: a read-only view of the data, for checks only."""
    d = _struct(v, path, ("shape", "data") if dtype is not None else ("dtype", "shape", "data"))
    if dtype is None:
        if not isinstance(d["dtype"], str) or d["dtype"] not in ARRAY_DTYPES:
            raise SchemaError(f"{path}.dtype", f"must be one of {sorted(ARRAY_DTYPES)}, got {d['dtype']!r}")
        dtype = np.dtype(d["dtype"])
    shape = _seq(_int)(d["shape"], f"{path}.shape")
    if len(shape) > _MAX_NDIM:
        raise SchemaError(f"{path}.shape", f"more than {_MAX_NDIM} dimensions")
    arr = _shaped(d["data"], f"{path}.data", dtype, shape, copy)
    bad = _bad_values(arr)
    if bad is not None:
        raise SchemaError(f"{path}.data", bad)
    return arr


_nonneg_float = partial(_float, nonneg=True)
_nonempty_str = partial(_str, nonempty=True)
_typed(_int, Annotated[int, msgspec.Meta(ge=0, le=_INT64 - 1)])
_typed(_float, Annotated[float, msgspec.Meta(ge=-_MAX_FLOAT, le=_MAX_FLOAT)])  # refuses NaN too
_typed(_nonneg_float, Annotated[float, msgspec.Meta(ge=0, le=_MAX_FLOAT)])
_typed(_str, str)
_typed(_nonempty_str, Annotated[str, msgspec.Meta(min_length=1)])
_STATUSES = tuple(s.value for s in Status)

# ---------------------------------------------------------------- messages


def _compared_as(v: Any) -> type:
    """The type a value compares as: a chain's is `Chain`, whatever form holds its arrays."""
    return Chain if isinstance(v, Chain) else type(v)


def _same(a: Any, b: Any) -> bool:
    """Equality that also holds for numpy arrays (by dtype, shape and values) inside values."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and bool(np.array_equal(a, b)))
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return _compared_as(a) is _compared_as(b) and all(
            _same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True  # a NaN in free-form data (a record) round-trips as NaN
    return bool(a == b)


class Message:
    """Base of every message kind; `KIND` is its `"k"` tag on the wire. Messages compare
    equal field by field, numpy arrays (token ids, a step's arrays) included."""

    KIND: ClassVar[str]
    SPEC: ClassVar[dict[str, Callable[[Any, str], Any]]]
    WIRE: ClassVar[dict[str, Callable[[Any], Any]]] = {}  # fields with their own wire form
    # fields added within a schema version: a message from a writer that predates them may
    # leave them out, and they decode to their default; every other field is required
    ADDED: ClassVar[frozenset[str]] = frozenset()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Message):
            return NotImplemented
        return _same(self, other)


_KINDS: dict[str, type[Message]] = {}


def _message(kind: str, **spec: Callable[[Any, str], Any]):
    """Register a message dataclass under `kind`, checked by `spec` (a checker per field, in order)."""
    def register(cls: Any) -> Any:
        names = [f.name for f in dataclasses.fields(cls)]
        if names != list(spec):
            raise TypeError(f"{cls.__name__}: spec {list(spec)} != fields {names}")
        cls.KIND, cls.SPEC = kind, spec
        _KINDS[kind] = cls
        return cls
    return register


@dataclass(frozen=True, eq=False)
class _ShardMessage(Message):
    shard: int
    epoch: int


@dataclass(frozen=True, eq=False)
class _SampleMessage(_ShardMessage):
    group: int
    sample: int
    attempt: int


_SHARD = {"shard": _int, "epoch": _int}
_SAMPLE = {**_SHARD, "group": _int, "sample": _int, "attempt": _int}


@_message("open", **_SHARD, scheduler=_opt(_map(_native)))
@dataclass(frozen=True, eq=False)
class Open(_ShardMessage):
    """The trainer (re)opened its task stream: epoch `epoch` starts. `scheduler` is the
    trainer's scheduler config (`SchedulerConfig`, JSON-native): the run's, which the
    admission consumer must equal before it applies the epoch."""
    scheduler: dict[str, Any] | None = None

    ADDED: ClassVar[frozenset[str]] = frozenset({"scheduler"})


@_message("registration", **_SHARD, batch=_int, tasks=_seq(_task))
@dataclass(frozen=True, eq=False)
class Registration(_ShardMessage):
    """Task batch `batch`, as the trainer's prefetch read it."""
    batch: int
    tasks: tuple[Task, ...]


@_message("handover", **_SHARD, step=_int, updates=_int, published=_opt(_int), steps_left=_opt(_int))
@dataclass(frozen=True, eq=False)
class Handover(_ShardMessage):
    """The trainer calls for step `step` after `updates` updates (`published`: its pushed
    version; `steps_left`: the steps it will call for after this one, when it knows)."""
    step: int
    updates: int
    published: int | None = None
    steps_left: int | None = None

    ADDED: ClassVar[frozenset[str]] = frozenset({"steps_left"})


@_message("work", **_SAMPLE, task=_task, submitted_version=_int, deadline=_opt(_nonneg_float),
          cause=_opt(_choice(CAUSES)))
@dataclass(frozen=True, eq=False)
class Work(_SampleMessage):
    """One attempt of one sample to run; `deadline` is wall-clock seconds since the epoch."""
    task: Task
    submitted_version: int
    deadline: float | None = None
    cause: str | None = None

    def __init__(self, shard: int, epoch: int, group: int, sample: int, attempt: int, task: Task,
                 submitted_version: int, deadline: float | None = None, cause: str | None = None) -> None:
        # the dataclass's own fields, set at once (its generated __init__ sets each through
        # object.__setattr__; the admission makes one for every submission)
        object.__setattr__(self, "__dict__", {
            "shard": shard, "epoch": epoch, "group": group, "sample": sample, "attempt": attempt, "task": task,
            "submitted_version": submitted_version, "deadline": deadline, "cause": cause})


@_message("cancel", **_SAMPLE, reason=_nonempty_str)
@dataclass(frozen=True, eq=False)
class Cancel(_SampleMessage):
    """Stop running this attempt (broadcast on the control stream)."""
    reason: str


@_message("result", **_SAMPLE, consumer=_nonempty_str, status=_choice(_STATUSES, Status),
          reward=_opt(_float), components=_map(_float), chains=_chains, truncation=_opt(_str),
          timings=_map(_nonneg_float), error=_opt(_str))
@dataclass(frozen=True, eq=False)
class Result(_SampleMessage):
    """What one attempt produced: its session with the calls merged into `chains` (the
    consumer merges, `from_session`); `error` holds the traceback when the source raised.
    When any chain has sampling support, every chain carries one of the same width
    (`pipeline.chains.uniform_support`)."""
    consumer: str
    status: Status
    reward: float | None = None
    components: dict[str, float] = field(default_factory=dict)
    chains: tuple[Chain, ...] = ()
    truncation: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    WIRE: ClassVar[dict[str, Callable[[Any], Any]]] = {"chains": _chains_wire}

    def __post_init__(self) -> None:
        if isinstance(self.chains, (list, tuple)) and all(isinstance(c, Chain) for c in self.chains):
            object.__setattr__(self, "chains", uniform_support(self.chains))

    @classmethod
    def from_session(cls, shard: int, epoch: int, group: int, sample: int, attempt: int,
                     session: Session, consumer: str, error: str | None = None) -> Result:
        """The result of a session: its calls merged into chains (`merge_calls`). The calls
        were checked when made, but a source may change them after: the merged chains' values
        are checked here, once, for what decoding refuses of them (a SchemaError naming the
        field, as `encode` would raise), and their wire form made from the session's flat
        arrays (`_made_wire`), so that `encode` neither checks nor converts them again (their
        arrays are not to be changed in place after this)."""
        merged = merged_calls(session.calls)
        result = cls(shard, epoch, group, sample, attempt, consumer, session.status, session.reward,
                     dict(session.components), merged.chains, session.truncation,
                     dict(session.timings), error)
        if not merged.supported:  # sampling support: `encode` checks the chains (rare)
            _made_wire(result, merged)
        return result

    @property
    def oldest_version(self) -> int | None:
        """The weight version of the oldest completion token (None without any): the
        rollout's staleness. A call that completed no token carries no version here."""
        chains = self.chains
        if len(chains) == 1:  # one chain (usually)
            return chains[0].oldest_version
        return min((v for c in chains if (v := c.oldest_version) is not None), default=None)

    def rollout(self) -> Rollout:
        """What packing needs of this result (the chains as they are, no merge; the
        components and timings maps shared, not copied: a message's maps are never changed)."""
        return Rollout(self.sample, self.status, self.chains, self.reward, self.components, self.truncation,
                       self.timings)


@_message("weights", version=_int, location=_nonempty_str, digest=_str, size=_int)
@dataclass(frozen=True, eq=False)
class Weights(Message):
    """Weight version `version` is published at `location` (`size` bytes, `digest`)."""
    version: int
    location: str
    digest: str
    size: int


def _ready_record(v: Any, path: str) -> ReadyRecord:
    if not isinstance(v, dict):
        raise SchemaError(path, f"expected a map, got {_tn(v)}")
    try:
        return decode_record(v)
    except ValueError as exc:
        raise SchemaError(path, str(exc)) from None


def _array_wire(v: np.ndarray, data: Callable[[np.ndarray], Any]) -> dict[str, Any]:
    """An array's wire form, its little-endian data given by `data` (its bytes, or a view)."""
    if v.dtype.kind not in "biuf":  # refused by the checks, and never turned into bytes
        return {"dtype": v.dtype.str, "shape": list(v.shape), "data": b""}
    dt = v.dtype.newbyteorder("<")
    return {"dtype": dt.str, "shape": list(v.shape), "data": data(np.ascontiguousarray(v, dt))}


def _byte_view(v: np.ndarray) -> memoryview:
    return v.reshape(-1).data.cast("B")


def _step_arrays_wire(arrays: Any) -> Any:
    """A `Ready`'s arrays, each's data a view of the array (packed without a copy of its own:
    a step's arrays are the largest thing the admission writes)."""
    if type(arrays) is not dict:
        return _wire(arrays)
    return {name: _array_wire(v, _byte_view) if isinstance(v, np.ndarray) else _wire(v, 1)
            for name, v in arrays.items()}


def _ready_record_wire(v: Any) -> Any:
    return record_builtins(v) if isinstance(v, ReadyRecord) else _wire(v)


_step_arrays = _map(_array)  # a Ready's
_FINE_DTYPES = frozenset(np.dtype(s) for s in ARRAY_DTYPES)


def _arrays_fine(arrays: Any) -> bool:
    """Whether a `Ready`'s arrays, given as numpy arrays, are ones the check of their wire form
    (`_array` of each) accepts, tested on the arrays themselves: a dtype of `ARRAY_DTYPES` as
    it is, at most `_MAX_NDIM` sides, not over the size limit, booleans 0 or 1, floats finite.
    A sufficient test: False leaves the arrays to that check, which says what it refuses."""
    if type(arrays) is not dict:
        return False
    return all(type(name) is str and type(v) is np.ndarray and v.dtype in _FINE_DTYPES
               and v.ndim <= _MAX_NDIM and not _too_large(v.shape, v.itemsize) and _bad_values(v) is None
               for name, v in arrays.items())


@_message("ready", **_SHARD, step=_int, updates=_int, arrays=_step_arrays, record=_opt(_ready_record),
          error=_opt(_str))
@dataclass(frozen=True, eq=False)
class Ready(_ShardMessage):
    """A packed step for the trainer: its compact arrays (a segment table,
    `pipeline.ready.compact`; the trainer expands them) and the step's typed record
    (`pipeline.ready.ReadyRecord`, decoded strictly); a step that failed carries no record,
    no arrays and its `error` (a traceback)."""
    step: int
    updates: int
    arrays: dict[str, np.ndarray]
    record: ReadyRecord | None = None
    error: str | None = None

    WIRE: ClassVar[dict[str, Callable[[Any], Any]]] = {"record": _ready_record_wire,
                                                       "arrays": _step_arrays_wire}
    ADDED: ClassVar[frozenset[str]] = frozenset({"error"})


@_message("record", **_SHARD, step=_int, updates=_int, version=_int, lag=_int, groups=_int,
          resubmitted=_map(_int), cancelled=_int, abandoned=_int, cut=_int,
          waited=_nonneg_float, metrics=_map(_float), refused=_int, surplus=_int, overlong=_int,
          backups=_int)
@dataclass(frozen=True, eq=False)
class Record(_ShardMessage):
    """The SchedulerRecord of one trainer call, with what packing and admission add:
    `refused` groups that can never fit the step's rows, `surplus` groups cut when their
    batch reached `admit`, `overlong` admitted rollouts cut to the row width."""
    step: int
    updates: int
    version: int
    lag: int
    groups: int
    resubmitted: dict[str, int]
    cancelled: int
    abandoned: int
    cut: int
    waited: float
    metrics: dict[str, float] = field(default_factory=dict)
    refused: int = 0
    surplus: int = 0
    overlong: int = 0
    backups: int = 0

    ADDED: ClassVar[frozenset[str]] = frozenset({"refused", "surplus", "overlong"})

    @classmethod
    def of(cls, shard: int, epoch: int, step: int, record: ReadyRecord) -> Record:
        """The records-stream entry of step `step`: its Ready's record, field for field."""
        return cls(shard, epoch, step, **{name: getattr(record, name) for name in cls.SPEC
                                          if name not in ("shard", "epoch", "step")})


# ---------------------------------------------------------------- the compiled schema
# One msgspec struct per kind, derived from its SPEC (there is no second list of fields):
# a field whose checker has a type (`_TYPES`) is checked in C as the message decodes; the
# others (chains, a step's arrays and record, tasks, free-form maps) decode as plain values
# and then go through their checker. Whatever the structs refuse is parsed again by
# `_parse`, which names the field and the reason; so the compiled path only ever accepts
# what `_parse` accepts, with the same values (tests/unit/test_wire_compiled.py compares
# the two on valid and damaged messages), and every refusal reads as it always did.


def _compile(cls: type[Message], **wire_types: Any) -> type[msgspec.Struct]:
    """The struct of kind `cls`; `wire_types`: types of fields in place of their checker's."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    fields: list[tuple] = [("v", Literal[SCHEMA_VERSION])]
    for name, check in cls.SPEC.items():
        wire_type = wire_types.get(name, _TYPES.get(check, Any))
        if name not in cls.ADDED:
            fields.append((name, wire_type))
        elif defaults[name] is dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{name}: a field added within a version needs a default")
        else:
            fields.append((name, wire_type, defaults[name]))
    return msgspec.defstruct(f"{cls.__name__}Wire", fields, kw_only=True, tag_field="k", tag=cls.KIND,
                             forbid_unknown_fields=True)


_COMPILED = {_compile(cls): cls for cls in _KINDS.values()}
_UNCOMPILED = {cls: tuple((name, check) for name, check in cls.SPEC.items() if check not in _TYPES)
               for cls in _KINDS.values()}
_ANY_KIND: Any = Union[tuple(_COMPILED)]  # tagged by "k"
_DECODER = msgspec.msgpack.Decoder(_ANY_KIND)
_REFUSED = (msgspec.DecodeError, SchemaError, RecursionError)  # by the structs or a checker
# The kinds whose decoded messages get their checked values set directly, without the
# dataclass's __init__ (a frozen dataclass sets each field through object.__setattr__, 13 for
# a Result): Result, the message the admission consumer decodes for every rollout, whose
# __post_init__ gives the chains one support width, which decoded chains have by
# construction (`_expand_chains`); and Work, which a rollout consumer decodes for every
# session (no __post_init__). Every other kind is built through its constructor.
_DIRECT = frozenset({Result, Work})
_new = object.__new__
_M = TypeVar("_M")


def _direct(cls: type[_M], values: dict[str, Any]) -> _M:
    """A message of a `_DIRECT` kind made from its checked fields, without its constructor."""
    msg = _new(cls)
    object.__setattr__(msg, "__dict__", values)
    return msg


def _compiled(struct: msgspec.Struct) -> Message:
    """The message of a struct `_DECODER` accepted, its remaining fields checked."""
    cls = _COMPILED[type(struct)]
    values = msgspec.structs.asdict(struct)  # "v", then the fields in their order
    del values["v"]
    for name, check in _UNCOMPILED[cls]:
        values[name] = check(values[name], name)
    if cls not in _DIRECT:
        return cls(**values)
    return _direct(cls, values)


# ---------------------------------------------------------------- codec


def _wire(v: Any, depth: int = 0) -> Any:
    """Python value -> msgpack-ready value (the checkers then validate it)."""
    if depth > 2 * _MAX_DEPTH:
        raise SchemaError("message", "nested too deeply")
    if v is None or type(v) in _SCALARS:
        return v
    if isinstance(v, Message):
        out = {"v": SCHEMA_VERSION, "k": v.KIND}
        special = v.WIRE
        made = v.__dict__.get(_MADE, _NONE_MADE)
        for name in v.SPEC:  # the fields, in order
            value = getattr(v, name)
            if value is None or type(value) in _SCALARS:  # (which every special form leaves as is)
                out[name] = value
            elif name in made and made[name][0] is value:
                out[name] = made[name][1]
            elif name in special:
                out[name] = special[name](value)
            elif type(value) is Status:
                out[name] = value.value
            elif type(value) is dict and all(x is None or type(x) in _SCALARS for x in value.values()):
                out[name] = value  # what the walk below would copy (only packed, never changed)
            else:
                out[name] = _wire(value, depth + 1)
        return out
    if isinstance(v, Status):
        return v.value
    if isinstance(v, Task):
        return {"id": v.id, "payload": _wire(v.payload, depth + 1)}
    if isinstance(v, np.ndarray):
        return _array_wire(v, np.ndarray.tobytes)
    if isinstance(v, Mapping):
        return {k: _wire(x, depth + 1) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_wire(x, depth + 1) for x in v]
    if isinstance(v, np.generic):
        return v.item()
    return v


_SCALARS = frozenset({int, float, str, bytes, bool})  # wire values as they are
_MERGED = frozenset({"chains"})  # a Result's fields `from_session` checked
_ARRAYS = frozenset({"arrays"})  # a Ready's, when `_arrays_fine` passes them
_CHECKED = "_checked_by_from_session"  # the attribute that marks a Chain `from_session` checked
_MADE = "_wire_made"  # a message's attribute: wire forms made with it, {field: (its value, wire form)}
_NONE_MADE: dict[str, tuple[Any, Any]] = {}
_TRUSTED = (Work, Cancel)


def _merged_checked(chains: Any) -> bool:
    """Whether `chains` are all chains `Result.from_session` merged and checked."""
    return isinstance(chains, (list, tuple)) and all(
        isinstance(c, Chain) and c.__dict__.get(_CHECKED) for c in chains)


def _parse(d: Any, expect: type | tuple[type, ...] | None = None) -> Message:
    if not isinstance(d, dict):
        raise SchemaError("message", f"expected a map, got {_tn(d)}")
    if "v" not in d:
        raise SchemaError("v", "missing")
    if type(d["v"]) is not int or d["v"] != SCHEMA_VERSION:
        raise SchemaError("v", f"schema version {d['v']!r} is not supported (this is {SCHEMA_VERSION})")
    kind = d.get("k")
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise SchemaError("k", f"unknown kind {kind!r}")
    if expect is not None and not issubclass(cls, expect):
        names = [getattr(t, "KIND", t.__name__) for t in (expect if isinstance(expect, tuple) else (expect,))]
        raise SchemaError("k", f"expected {' or '.join(names)}, got {kind!r}")
    for key in d:
        if key not in cls.SPEC and key not in ("v", "k"):
            raise SchemaError(str(key) or "message", "unknown field" if key else "unknown field ''")
    values = {}
    for name, check in cls.SPEC.items():
        if name in d:
            values[name] = check(d[name], name)
        elif name not in cls.ADDED:
            raise SchemaError(name, "missing")
    return cls(**values)


# what `_check` runs in place of a checker that builds
_CHECK_ONLY = {_chains: _chain_parts, _step_arrays: _map(partial(_array, copy=False))}
_STRUCTS = {cls: struct for struct, cls in _COMPILED.items()}  # converting to one kind's is ~10x faster


def _check(wire: dict, cls: type[Message], checked: frozenset[str] = frozenset()) -> None:
    """Refuse what `decode` would refuse of `wire`, the wire form of a `cls` message (so
    built from valid values: only the checks of its fields are run, not the message's own),
    but for the fields named in `checked`."""
    try:
        struct = msgspec.convert(wire, _STRUCTS.get(cls, _ANY_KIND), strict=True)
        for name, check in _UNCOMPILED[_COMPILED[type(struct)]]:
            if name not in checked:
                _CHECK_ONLY.get(check, check)(getattr(struct, name), name)
    except _REFUSED:
        _parse(wire)  # raises the SchemaError naming the field


def _checked_before(msg: Message) -> frozenset[str]:
    """The fields of `msg` already known to pass their checks, which `encode` skips: a
    `Result`'s chains merged and checked by `from_session`, a `Ready`'s arrays that
    `_arrays_fine` passes."""
    if isinstance(msg, Result) and _merged_checked(msg.chains):
        return _MERGED
    if isinstance(msg, Ready) and _arrays_fine(msg.arrays):
        return _ARRAYS
    return frozenset()


def encode(msg: Message, *, max_bytes: int = MAX_MESSAGE_BYTES, trusted: bool = False) -> bytes:
    """The msgpack bytes of `msg`, after the checks `decode` will make (SchemaError if not).

    `trusted=True` skips those checks (not the size limit): only for a `Work` or `Cancel`
    that a process builds from values it decoded and checked itself (the admission consumer's
    submissions and cancels, whose task came from a checked `Registration` and whose numbers
    come from the scheduler). Input from other processes is always decoded strictly."""
    if not isinstance(msg, Message):
        raise TypeError(f"not a message: {_tn(msg)}")
    if trusted and type(msg) is Work:
        data = _work_bytes(msg)  # None: not of the usual shape, or refused (the general path says why)
        if data is not None and len(data) <= max_bytes:
            return data
    if trusted and not isinstance(msg, _TRUSTED):
        raise TypeError(f"only {', '.join(t.KIND for t in _TRUSTED)} may be encoded unchecked, "
                        f"not {msg.KIND}")
    wire = _wire(msg)
    if not trusted:
        _check(wire, type(msg), _checked_before(msg))
    try:
        # a checked `Ready` holds plain values only, which msgspec packs to msgpack's bytes, at
        # about half the cost for a step's arrays (msgpack grows its buffer by copies)
        data = _ENCODER.encode(wire) if type(msg) is Ready else msgpack.packb(wire, use_bin_type=True)
    except Exception as exc:  # noqa: BLE001 (a str that is not UTF-8, and the like)
        raise SchemaError("message", f"cannot pack: {exc}") from None
    if len(data) > max_bytes:
        raise SchemaError("message", f"{len(data)} bytes exceeds the limit of {max_bytes}")
    return data


def work_bytes(shard: int, epoch: int, group: int, sample: int, attempt: int, task: Task,
               submitted_version: int, deadline: float | None = None, cause: str | None = None, *,
               max_bytes: int = MAX_MESSAGE_BYTES) -> bytes:
    """`encode(Work(...), trusted=True, max_bytes=max_bytes)`'s bytes, without making the
    `Work` when its fields are of the usual shape (`_work_bytes`): the admission consumer's
    submissions, one per attempt."""
    data = _work_values_bytes(shard, epoch, group, sample, attempt, task, submitted_version, deadline, cause)
    if data is not None and len(data) <= max_bytes:
        return data
    return encode(Work(shard, epoch, group, sample, attempt, task, submitted_version, deadline, cause),
                  trusted=True, max_bytes=max_bytes)


def _work_bytes(work: Work) -> bytes | None:
    """`encode(work, trusted=True)`'s bytes, built straight from the fields when they are of
    the usual shape: ints, a `Task` with a str id and a payload of plain values (`_plain`), a
    float or None deadline, a str or None cause. None for anything else, and for what cannot
    be packed: the general path then encodes it, or refuses it, as it always did."""
    return _work_values_bytes(*_WORK_GET(work.__dict__))


def _work_values_bytes(shard: Any, epoch: Any, group: Any, sample: Any, attempt: Any, task: Any,
                       version: Any, deadline: Any, cause: Any) -> bytes | None:
    """`_work_bytes` of a Work's field values, in order."""
    if not (type(shard) is int and type(epoch) is int and type(group) is int and type(sample) is int
            and type(attempt) is int and type(version) is int and type(task) is Task
            and (deadline is None or type(deadline) is float) and (cause is None or type(cause) is str)):
        return None
    task_id, payload = task.id, task.payload
    if type(task_id) is not str or type(payload) is not dict or (payload and not _plain(payload, 0)):
        return None
    try:  # msgpack.packb's bytes, of these plain values, in `_wire`'s order
        return _ENCODER.encode(_WorkOut(SCHEMA_VERSION, Work.KIND, shard, epoch, group, sample, attempt,
                                        _TaskOut(task_id, payload), version, deadline, cause))
    except (ValueError, TypeError, OverflowError, msgspec.EncodeError):  # a lone surrogate, an int too large
        return None


# a Work's map as `_wire` orders it, `v` and `k` first (a struct packs as the map of its fields
# in their order, and faster than a dict: its keys are packed once)
_WorkOut = msgspec.defstruct("WorkOut", [("v", int), ("k", str), *((name, Any) for name in Work.SPEC)], gc=False)
_TaskOut = msgspec.defstruct("TaskOut", [("id", str), ("payload", dict)], gc=False)
_WORK_GET = itemgetter("shard", "epoch", "group", "sample", "attempt", "task", "submitted_version",
                       "deadline", "cause")
_PLAIN_DEPTH = 8  # nesting `_plain` follows; deeper payloads take the general path
_KEYS = frozenset({str})


def _plain(v: dict | list | tuple, depth: int) -> bool:
    """Whether `v` (a dict, list or tuple) holds only what `_wire` leaves as it is (None and
    `_SCALARS`, str keys), or dicts, lists and tuples of them (which it copies, and msgpack
    packs alike), nested at most `_PLAIN_DEPTH` deep."""
    values = v.values() if type(v) is dict else v
    if type(v) is dict and not _KEYS.issuperset(map(type, v)):
        return False
    if _PLAIN.issuperset(map(type, values)):
        return True
    if depth >= _PLAIN_DEPTH:
        return False
    return all(x is None or type(x) in _SCALARS or (type(x) in _NESTED and _plain(x, depth + 1)) for x in values)


_NESTED = frozenset({dict, list, tuple})


def decode(data: bytes | bytearray | memoryview, expect: type | tuple[type, ...] | None = None, *,
           max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """The message in `data`; with `expect`, refuse other kinds. Raises only SchemaError."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SchemaError("message", f"expected bytes, got {_tn(data)}")
    if len(data) > max_bytes:
        raise SchemaError("message", f"{len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        msg = _compiled(_DECODER.decode(data))
        if expect is None or isinstance(msg, expect):
            return msg
    except _REFUSED:
        pass  # parsed again, for the field and reason of the refusal
    return _parsed(data, expect, max_bytes)


def _parsed(data: bytes | bytearray | memoryview, expect: type | tuple[type, ...] | None, max_bytes: int) -> Message:
    """`decode` field by field in Python: what names the field of a refusal."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, max_str_len=max_bytes,
                              max_bin_len=max_bytes, max_array_len=len(data),
                              max_map_len=len(data), max_ext_len=0)
    except Exception as exc:  # noqa: BLE001 (msgpack raises many kinds; none may leak)
        raise SchemaError("message", f"not msgpack ({_tn(exc)}: {exc})") from None
    return _parse(obj, expect)


def to_fields(msg: Message, *, trusted: bool = False, max_bytes: int = MAX_MESSAGE_BYTES) -> dict[bytes, bytes]:
    """The fields of the stream entry carrying `msg` (`trusted`: see `encode`)."""
    return {FIELD: encode(msg, trusted=trusted, max_bytes=max_bytes)}


def from_fields(fields: Mapping, expect: type | tuple[type, ...] | None = None, *,
                max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """The message of a stream entry's fields (as redis-py returns them)."""
    if type(fields) is dict or isinstance(fields, Mapping):  # redis-py's dict: no ABC check
        data = fields[FIELD] if FIELD in fields else fields.get("m")
    else:
        data = None
    if data is None:
        raise SchemaError("m", "missing")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SchemaError("m", f"expected bytes, got {_tn(data)}")
    return decode(data, expect, max_bytes=max_bytes)


def _b(v: Any) -> bytes:
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    return str(v).encode("utf-8", "backslashreplace")


def dead_letter_fields(stream: str, entry_id: bytes | str, reason: str, raw: Mapping) -> dict[bytes, bytes]:
    """The dead-letter entry for an entry of `stream` that could not be handled: where it came
    from, why, the names of its fields and its `m` bytes (the first DEAD_LETTER_BYTES)."""
    raw = raw if isinstance(raw, Mapping) else {}
    m = raw.get(FIELD, raw.get("m"))
    m = b"" if m is None else _b(m)
    return {b"stream": _b(stream), b"id": _b(entry_id), b"reason": _b(reason)[:DEAD_LETTER_BYTES],
            b"fields": b",".join(_b(k) for k in raw)[:1024], b"size": str(len(m)).encode(),
            b"m": m[:DEAD_LETTER_BYTES]}


def check_result(result: Result, *, vocab: int | None = None) -> None:
    """Refuse, with a SchemaError naming the field, a result that decodes but cannot train in
    this run: a token id at or past `vocab` (the model's vocabulary size), or a negative
    duration (`timings.finished` before `timings.started`). A chain longer than a packed row
    is not refused: `fit_width` cuts it."""
    for chain in result.chains:
        if vocab is None:
            continue
        if len(chain) and (top := int(_MAX(chain.tokens, axis=None))) >= vocab:
            raise SchemaError("chains.tokens", f"token id {top} is beyond the "
                              f"vocabulary of {vocab} (the config's vocab)")
        if chain.support is not None and chain.support.size and int(chain.support.max()) >= vocab:
            raise SchemaError("chains.support", f"token id {int(chain.support.max())} is beyond the "
                              f"vocabulary of {vocab} (the config's vocab)")
    if _negative_duration(result.timings):
        started, finished = result.timings["started"], result.timings["finished"]
        raise SchemaError("timings.finished", f"{finished} is before timings.started {started}: "
                          "a negative duration")


def _negative_duration(timings: Mapping[str, float]) -> bool:
    """Whether `timings.finished` is before `timings.started` (both given)."""
    started, finished = timings.get("started"), timings.get("finished")
    return started is not None and finished is not None and finished < started


# ---------------------------------------------------------------- results, a read batch at once
# The admission consumer decodes every result once, on input, a read batch at a time:
# `decode_results` takes each entry's bytes through a struct of the compiled schema's whose
# chains are typed too (packed bytes, no support: `_CHAINS_WIRE`), checks the chains' per-chain
# numbers in Python (`_result_piece`), then runs every per-token check (token ids,
# the vocabulary, log-probs) once over the batch's arrays joined, and expands the loss tokens'
# log-probs and versions once for the whole batch; each result gets its own copy of its
# span of those arrays (a held result keeps no other result's tokens alive), its chains
# cut from it as `_expand_chains` cuts them; a single call's result (one chain, one run of
# loss tokens) keeps its own decoded token and log-prob buffers instead (`_one_runs`).
# It takes only what `decode` + `check_result` accept, with the same values: anything either
# would refuse (or that it does not handle: another kind, sampling support) is left to them.

_OWN_BUFFERS = ("tokens", "logprobs")
# a Result whose chains are packed bytes without support, the fields checked in C as the
# compiled struct checks them: anything else is refused here and left to `decode`
# (the token ids and log-probs as a bytearray each: an array of the result's own, writable,
# made without a second copy)
_CHAINS_WIRE = msgspec.defstruct("ChainsWire", [
    *((name, bytearray if name in _OWN_BUFFERS else bytes) for name in _CHAIN_DTYPES), ("support", None)],
    forbid_unknown_fields=True)
_RESULTS_WIRE = _compile(Result, chains=_CHAINS_WIRE)
# tagged by "k", as `_DECODER` (one struct alone would take a message without its tag)
_RESULT_OR_ANY_KIND: Any = Union[tuple([_RESULTS_WIRE, *(s for s, cls in _COMPILED.items() if cls is not Result)])]
_RESULTS_DECODER = msgspec.msgpack.Decoder(_RESULT_OR_ANY_KIND)
_U1 = np.dtype("|u1")
# an entry's pieces: its fields but the chains, per chain lengths, calls and call tokens, the
# loss tokens' versions and their runs, the token, loss bit and log-prob bytes, its tokens, and
# the first loss token when the result is one chain whose loss tokens are one run served by one
# version (a single call: the usual result), -1 otherwise
_Piece = tuple[dict[str, Any], tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...],
               tuple[int, ...], bytes, bytes, bytes, int, int]


def decode_results(datas: Sequence[Any], *, vocab: int | None = None,
                   max_bytes: int = MAX_MESSAGE_BYTES) -> list[Result | None]:
    """`decode(data, Result)` of each of several entries' bytes, each passing
    `check_result(vocab=vocab)`, decoded and checked together (see above); None for an entry
    this does not take: `decode` and `check_result` of it alone give its message or refusal."""
    out: list[Result | None] = [None] * len(datas)
    taken = [(i, piece) for i, data in enumerate(datas) if (piece := _result_piece(data, max_bytes)) is not None]
    if not taken:
        return out
    pieces = [piece for _, piece in taken]
    tokens = np.frombuffer(b"".join([p[6] for p in pieces]), TOKEN_DTYPE)
    logprobs = np.frombuffer(b"".join([p[8] for p in pieces]), LOGPROB_DTYPE)
    bound = _TOKEN_BOUND if vocab is None else min(vocab, _TOKEN_BOUND)  # >= 0 and below the vocabulary
    if len(tokens) and int(_MAX(tokens.view(_U32), axis=None)) >= bound:
        return out  # one refuses: each decoded alone
    if len(logprobs) and not finite_logprobs(logprobs):
        return out
    if all(p[10] >= 0 for p in pieces):
        _one_runs(taken, out)
    else:
        _expanded(taken, tokens, logprobs, out)
    return out


def _one_runs(taken: list[tuple[int, _Piece]], out: list[Result | None]) -> None:
    """The results of `taken` (checked pieces, by their index in `out`), each one chain whose
    loss tokens are one run served by one version: a `SpanChain` whose tokens and loss tokens'
    log-probs are arrays over the entry's own buffers (the bytearrays its decode made, so
    writable and no other result's; the per-token arrays `_expand_chains` makes are made only
    if read)."""
    for i, (values, _, calls, call_tokens, served, _, token_bytes, _, logprob_bytes, _, first) in taken:
        values["chains"] = (SpanChain.of(np.frombuffer(token_bytes, TOKEN_DTYPE), first,
                                         np.frombuffer(logprob_bytes, LOGPROB_DTYPE), served[0], calls[0],
                                         call_tokens[0]),)
        out[i] = _direct(Result, values)


def _expanded(taken: list[tuple[int, _Piece]], tokens: np.ndarray, logprobs: np.ndarray,
              out: list[Result | None]) -> None:
    """The results of `taken` (checked pieces, by their index in `out`), of any chains: the
    loss tokens' log-probs and versions expanded once over the batch's arrays, and each
    result given its own copy of its span of them."""
    pieces = [piece for _, piece in taken]
    loss = _batch_loss(pieces, len(tokens))
    full_logprobs = np.zeros(len(tokens), LOGPROB_DTYPE)
    full_logprobs[loss] = logprobs
    full_versions = np.full(len(tokens), NO_VERSION, VERSION_DTYPE)
    versions = [v for p in pieces for v in p[4]]
    if len(set(versions)) == 1:  # one version served every loss token of the batch (usually)
        full_versions[loss] = versions[0]
    elif versions:
        full_versions[loss] = np.repeat(np.asarray(versions, VERSION_DTYPE), [r for p in pieces for r in p[5]])
    start = 0
    for i, (values, lengths, calls, call_tokens, served, *_, total, _) in taken:
        end = start + total
        # each result's own arrays: a held rollout keeps no other result's tokens alive
        arrays = (tokens[start:end].copy(), loss[start:end].copy(), full_logprobs[start:end].copy(),
                  full_versions[start:end].copy(), None)
        values["chains"] = _cut_chains(arrays, lengths, calls, call_tokens, served)
        start = end
        out[i] = _direct(Result, values)


def _batch_loss(pieces: list[_Piece], total: int) -> np.ndarray:
    """The loss masks of `pieces`, end to end: their bit bytes unpacked at once, each one's
    padding bits (past its tokens, to its last byte's end) left out."""
    bits = np.unpackbits(np.frombuffer(b"".join([p[7] for p in pieces]), _U1), None, None, "little")
    if not any(p[9] & 7 for p in pieces):
        return bits[:total].view(bool)
    shifts, shift = [], 0  # padding bits before each piece's first bit
    for p in pieces:
        shifts.append(shift)
        shift += -p[9] & 7
    at = np.arange(total) + np.repeat(np.asarray(shifts, np.intp), [p[9] for p in pieces])
    return bits[at].view(bool)


def _result_piece(data: Any, max_bytes: int) -> _Piece | None:
    """A result entry's pieces (`_Piece`), its fields checked by the struct and its chains' per
    chain numbers as `_chain_parts` checks them (the loss tokens counted from the mask's
    bits); None for anything else: another kind, sampling support, anything `decode` or
    `check_result` would refuse."""
    if type(data) is not bytes or len(data) > max_bytes:
        return None
    try:
        decoded = _RESULTS_DECODER.decode(data)
    except msgspec.DecodeError:
        return None  # refused: `decode` of it alone names the field
    if type(decoded) is not _RESULTS_WIRE:
        return None
    values = msgspec.structs.asdict(decoded)
    del values["v"]
    c = values["chains"]
    tokens, bits, logprobs = c.tokens, c.loss_mask, c.logprobs
    total = len(tokens) >> 2
    if len(tokens) & 3 or len(logprobs) & 3 or len(bits) != (total + 7) >> 3 or _negative_duration(values["timings"]):
        return None
    mask = int.from_bytes(bits, "little")
    n_loss = mask.bit_count()
    if mask >> total or len(logprobs) >> 2 != n_loss:  # padding bits set; not a log-prob per loss token
        return None
    if (len(c.lengths), len(c.calls), len(c.call_tokens), len(c.versions), len(c.version_runs)) == _ONE_CHAIN_SIZES:
        # one chain, one version run (a single call, usually): its numbers unpacked at once
        n, calls, call_tokens, served, runs = _ONE_CHAIN.unpack(
            b"".join((c.lengths, c.calls, c.call_tokens, c.versions, c.version_runs)))
        if not (n == total and calls >= 1 and call_tokens >= total and served >= 0 and runs == n_loss >= 1):
            return None
        first = (mask & -mask).bit_length() - 1  # of the loss tokens, which are one run if
        one_run = mask == ((1 << n_loss) - 1) << first
        return ((values, (n,), (calls,), (call_tokens,), (served,), (runs,), tokens, bits, logprobs, total,
                 first if one_run else -1))
    return _chains_piece(values, c, total, n_loss)


_ONE_CHAIN = struct.Struct("<iiqii")  # lengths, calls, call_tokens, versions, version_runs of one chain
_ONE_CHAIN_SIZES = (4, 4, 8, 4, 4)


def _chains_piece(values: dict[str, Any], c: Any, total: int, n_loss: int) -> _Piece | None:
    """`_result_piece` of a result of any chains and version runs (`c`: its chains' struct)."""
    lengths, calls, call_tokens = _ints(c.lengths, "i"), _ints(c.calls, "i"), _ints(c.call_tokens, "q")
    served, runs = _ints(c.versions, "i"), _ints(c.version_runs, "i")
    if (lengths is None or calls is None or call_tokens is None or served is None or runs is None
            or sum(lengths) != total or len(runs) != len(served)
            or sum(runs) != n_loss or (served and min(served) < 0) or (runs and min(runs) < 1)):
        return None
    if len(lengths) == 1:  # one chain
        ok = len(calls) == len(call_tokens) == 1 and calls[0] >= 1 and call_tokens[0] >= total
    else:
        ok = len(calls) == len(call_tokens) == len(lengths) and (not lengths or (
            min(lengths) >= 0 and min(calls) >= 1 and all(t >= n for t, n in zip(call_tokens, lengths))))
    return (values, lengths, calls, call_tokens, served, runs, c.tokens, c.loss_mask, c.logprobs, total, -1) if ok else None


def _ints(data: bytes, code: str) -> tuple[int, ...] | None:
    """Packed little-endian ints (`struct` code `code`), or None when not a whole number of them."""
    unpacker = _UNPACKERS.get((code, len(data)))
    if unpacker is None:
        size = _INT_SIZES[code]
        if len(data) % size:
            return None
        unpacker = struct.Struct(f"<{len(data) // size}{code}")
        if len(data) <= 4 * size:  # the usual counts of chains and version runs, kept
            _UNPACKERS[code, len(data)] = unpacker
    return unpacker.unpack(data)


_INT_SIZES = {"i": 4, "q": 8}
_UNPACKERS: dict[tuple[str, int], struct.Struct] = {}


def result_fields(shard: int, epoch: int, group: int, sample: int, attempt: int, session: Session,
                  consumer: str, error: str | None = None, *, vocab: int | None = None,
                  max_bytes: int = MAX_MESSAGE_BYTES) -> dict[bytes, bytes]:
    """`to_fields` of `Result.from_session(...)` once `check_result(vocab=vocab)` passed: the
    stream entry of a session's result, refused as those refuse it (ValueError; SchemaError
    naming the field). A session of one plain call (no sampling support, arrays as `Call`
    makes them: the common case) has its wire form built straight from that call, byte for
    byte the same, without a `Result`, its merged arrays or its chains; anything else, or
    anything such a session's checks would refuse, takes the general path (which then
    refuses it with its own field and reason)."""
    data = _one_call_result(shard, epoch, group, sample, attempt, session, consumer, error, vocab, max_bytes)
    if data is not None:
        return {FIELD: data}
    result = Result.from_session(shard, epoch, group, sample, attempt, session, consumer, error)
    check_result(result, vocab=vocab)
    return to_fields(result, max_bytes=max_bytes)


_TOKEN_BOUND = 1 << 31  # token ids are int32: >= 0 and below this
_U32 = np.dtype("<u4")  # token ids viewed unsigned: a negative one is >= 2**31, so one max checks both ends


def _one_call_result(shard: int, epoch: int, group: int, sample: int, attempt: int, session: Session,
                     consumer: str, error: str | None, vocab: int | None, max_bytes: int) -> bytes | None:
    """The bytes `result_fields` returns for a session of one plain call, or None for any
    other session and for one that a check of `from_session`, `check_result` or `encode`
    refuses (the general path then raises that refusal). Its checks are theirs on the same
    values: the call's token ids in [0, vocab) (one unsigned max of prompt and completion),
    its log-probs finite and <= 0 (the merged log-probs are these and zeros), one log-prob
    per completion token, its version a non-negative int32, the duration non-negative,
    then every other field as `encode` checks it, and the size limit."""
    form = _one_call_form(shard, epoch, group, sample, attempt, session, consumer, error)
    if form is None:
        return None
    out, prompt, completion, logprobs = form
    tokens = prompt.tobytes() + completion.tobytes()
    if not _valid_values(np.frombuffer(tokens, _U32), logprobs, vocab):
        return None
    return _one_call_bytes(out, tokens, logprobs.tobytes(), max_bytes)


_Form = tuple[dict[str, Any], np.ndarray, np.ndarray, np.ndarray]
"""A session of one plain call: its result's wire map (`_one_call_form`), the call's prompt
and completion ids and its log-probs."""


def _one_call_form(shard: int, epoch: int, group: int, sample: int, attempt: int, session: Session,
                   consumer: str, error: str | None) -> _Form | None:
    """The wire map of a session of one plain call, its chains' tokens and log-probs still to
    be set (`_one_call_bytes`), and that call's arrays: every check of `_one_call_result` made but
    those of the call's values (token ids, log-probs: `_valid_values`); None for any other
    session and for one those checks refuse."""
    calls = session.calls
    if type(calls) is not list or len(calls) != 1:
        return None
    call = calls[0]
    if type(call) is not Call or call.support is not None:
        return None
    prompt, completion, logprobs, version = call.prompt_ids, call.completion_ids, call.logprobs, call.version
    if not (type(prompt) is np.ndarray and type(completion) is np.ndarray and type(logprobs) is np.ndarray
            and prompt.dtype == TOKEN_DTYPE and completion.dtype == TOKEN_DTYPE
            and logprobs.dtype == LOGPROB_DTYPE and prompt.ndim == 1 and completion.ndim == 1
            and logprobs.ndim == 1):
        return None
    p, c = len(prompt), len(completion)
    if len(logprobs) != c or type(version) is not int or not 0 <= version < _TOKEN_BOUND:
        return None
    components, timings = dict(session.components), dict(session.timings)  # in `Result`'s order
    started, finished = timings.get("started"), timings.get("finished")
    if started is not None and finished is not None and finished < started:
        return None
    n = p + c
    chains = {"lengths": _I4.pack(n), "calls": _ONE_CALL, "call_tokens": _I8.pack(n), "tokens": None,
              "loss_mask": (((1 << c) - 1) << p).to_bytes((n + 7) // 8, "little"),  # np.packbits, little
              "logprobs": None, "versions": _I4.pack(version) if c else b"",
              "version_runs": _I4.pack(c) if c else b"", "support": None}
    status, reward, truncation = session.status, session.reward, session.truncation
    if not (type(shard) is int and type(epoch) is int and type(group) is int and type(sample) is int
            and type(attempt) is int and type(consumer) is str and type(status) is Status
            and (reward is None or type(reward) is float) and (truncation is None or type(truncation) is str)
            and (error is None or type(error) is str) and _PLAIN.issuperset(map(type, timings.values()))
            and _PLAIN.issuperset(map(type, components.values()))):
        return None  # values `_wire` converts: the general path
    return {"v": SCHEMA_VERSION, "k": Result.KIND, "shard": shard, "epoch": epoch, "group": group,
            "sample": sample, "attempt": attempt, "consumer": consumer, "status": status.value,
            "reward": reward, "components": components, "chains": chains, "truncation": truncation,
            "timings": timings, "error": error}, prompt, completion, logprobs


def _valid_values(tokens: np.ndarray, logprobs: np.ndarray, vocab: int | None) -> bool:
    """Whether token ids (viewed unsigned: a negative one is >= 2**31, so one max checks both
    ends) are all below `vocab` (and 2**31), and log-probs all finite and <= 0."""
    bound = _TOKEN_BOUND if vocab is None else min(vocab, _TOKEN_BOUND)
    if len(tokens) and int(_MAX(tokens)) >= bound:
        return False
    return not len(logprobs) or finite_logprobs(logprobs)


def _one_call_bytes(out: dict[str, Any], tokens: Any, logprobs: Any, max_bytes: int) -> bytes | None:
    """The bytes of a `_one_call_form` map with its chains' token and log-prob bytes (bytes
    or byte memoryviews, msgpack bin alike), once `encode`'s checks of its fields pass and
    within `max_bytes`; None if not."""
    chains = out["chains"]
    chains["tokens"], chains["logprobs"] = tokens, logprobs
    try:
        _check(out, Result, _MERGED)
        data = _ENCODER.encode(out)  # msgpack.packb's bytes, of these plain values
    except (ValueError, TypeError, OverflowError, msgspec.EncodeError):  # SchemaError is a ValueError
        return None  # refused: the general path raises it with its field and reason
    return data if len(data) <= max_bytes else None


def results_fields(items: Sequence[tuple[int, int, int, int, int, Session, str, str | None]], *,
                   vocab: int | None = None,
                   max_bytes: int = MAX_MESSAGE_BYTES) -> list[dict[bytes, bytes] | None]:
    """`result_fields(*item, vocab=vocab, max_bytes=max_bytes)` of several sessions at once,
    for those of one plain call (the common case): the per-token checks (token ids within
    the vocabulary, log-probs finite and <= 0) run once over those calls' arrays joined, and
    each result's token and log-prob bytes are its span of them. None for a session left to
    `result_fields` alone: any other kind of session, one whose other checks fail, and every
    session taken here when the joint check finds a value that one of them would refuse
    (`result_fields` of each then gives its fields, or refuses it with its field and reason)."""
    out: list[dict[bytes, bytes] | None] = [None] * len(items)
    forms = [(i, form) for i, item in enumerate(items) if (form := _one_call_form(*item)) is not None]
    if not forms:
        return out
    chunks: list[list[tuple[int, _Form]]] = [[]]
    size = 0
    for i, form in forms:
        n = len(form[1]) + len(form[2])
        if size + n > _JOINED_TOKENS and chunks[-1]:
            chunks.append([])
            size = 0
        chunks[-1].append((i, form))
        size += n
    for chunk in chunks:
        if not _joined_results(chunk, out, vocab, max_bytes):
            return [None] * len(items)  # one refuses: each alone
    return out


_JOINED_TOKENS = 1 << 14
_TOKEN_SIZE, _LOGPROB_SIZE = TOKEN_DTYPE.itemsize, LOGPROB_DTYPE.itemsize
"""Tokens of the results checked together, at most (but for one result alone): their
arrays joined (64 KB of token ids at most) stay in the processor's caches, and below the
size that an allocator maps afresh each time (128 KB for glibc's malloc): a read's 64
results of 1k tokens joined cost more than checking each alone."""


def _joined_results(forms: list[tuple[int, _Form]], out: list[dict[bytes, bytes] | None],
                    vocab: int | None, max_bytes: int) -> bool:
    """`results_fields` of `forms` (`_one_call_form`s, by their index in `out`): False,
    setting nothing, if the checks of their joined arrays refuse any value."""
    arrays = []
    for _, (_, prompt, completion, _) in forms:
        arrays.append(prompt)
        arrays.append(completion)
    tokens = np.concatenate(arrays)
    logprobs = np.concatenate([form[3] for _, form in forms])
    if not _valid_values(tokens.view(_U32), logprobs, vocab):
        return False
    token_bytes, logprob_bytes = tokens.data.cast("B"), logprobs.data.cast("B")
    t = lp = 0
    for i, (out_map, prompt, completion, call_logprobs) in forms:
        n = t + _TOKEN_SIZE * (len(prompt) + len(completion))
        c = lp + _LOGPROB_SIZE * len(call_logprobs)
        data = _one_call_bytes(out_map, token_bytes[t:n], logprob_bytes[lp:c], max_bytes)
        t, lp = n, c
        if data is not None:
            out[i] = {FIELD: data}
    return True


_I4, _I8 = struct.Struct("<i"), struct.Struct("<q")  # one int32 (lengths, versions, runs), one int64
_ONE_CALL = _I4.pack(1)
_PLAIN = frozenset({*_SCALARS, type(None)})  # the values `_wire` leaves as they are
_ENCODER = msgspec.msgpack.Encoder()


OVERLONG = "width"
"""The `truncation` cause of a rollout whose chains were cut to the packed row width."""


def fit_width(result: Result, width: int) -> Result | None:
    """`result` with every chain longer than `width` (a packed row) cut to its first `width`
    tokens, as a TRUNCATED rollout with truncation cause `OVERLONG`, so it trains under the
    run's truncation policy like any other truncation (masked, scored on its reward, or
    zero); None when every chain fits. A COMPLETED or AGENT_ERROR result keeps its reward;
    failures (INFRA_ERROR, CANCELLED) are returned cut but keep their status."""
    chains = result.chains
    if len(chains) == 1 and len(chains[0].tokens) <= width or all(len(chain) <= width for chain in chains):
        return None  # (one chain, usually, read without the generator)
    chains = tuple(chain.head(width) for chain in result.chains)
    trains = result.status in (Status.COMPLETED, Status.AGENT_ERROR, Status.TRUNCATED)
    status = Status.TRUNCATED if trains else result.status
    return dataclasses.replace(result, chains=chains, status=status,
                               truncation=OVERLONG if trains else result.truncation)


def named_attempt(fields: Mapping) -> tuple[int, int, int, int, int] | None:
    """`(shard, epoch, group, sample, attempt)` that an entry which failed to decode or to
    check still names (non-negative ints), or None: so that its attempt can be finished as
    an error instead of waiting for a result that will never come."""
    data = fields.get(FIELD, fields.get("m")) if isinstance(fields, Mapping) else None
    if not isinstance(data, (bytes, bytearray, memoryview)):
        return None
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=False, max_ext_len=0)
    except Exception:  # noqa: BLE001 (msgpack raises many kinds; this only looks)
        return None
    names = ("shard", "epoch", "group", "sample", "attempt")
    if not isinstance(d, dict) or not all(type(d.get(n)) is int and 0 <= d[n] < _INT64 for n in names):
        return None
    return tuple(d[n] for n in names)
