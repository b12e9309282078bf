"""What a `wire.Ready` carries to the trainer: its typed record and its compact arrays.

The record (`ReadyRecord`) is the step's `SchedulerRecord` with what packing and admission
add, a msgspec struct decoded strictly (a missing, mistyped or unknown field is refused).
The trainer reads its attributes; `ReadyRecord.scheduler_record(waited)` is the
`SchedulerRecord` the trainer logs.

The arrays are a segment table over the packed step's non-padding tokens, no bigger than the
results they pack (`compact`); `expand` gives back the `[rows, width]` arrays of the
`PackedBatch` (`pipeline.packing`), equal value for value. A segment is one chain placed in
a row; segments are listed row by row, in column order, so a segment's position in its row
(1, 2, ...) is its segment id and each row's tokens start at column 0.

| array | shape, dtype | what |
|---|---|---|
| `shape` | `[2]` int64 | rows, width |
| `seg_rows` | `[S]` int32 | the row of each segment (non-decreasing) |
| `seg_lengths` | `[S]` int32 | its tokens (>= 1) |
| `seg_rollout` | `[S]` int32 | its rollout: an index into the `rollout_*` arrays |
| `seg_chain` | `[S]` int32 | its chain's index within the rollout |
| `tokens` | `[T]` uint16 or int32 | the non-padding tokens, segment after segment: uint16 when every id is below 65,536 (most vocabularies), which makes a 1k-token rollout's share of the `Ready` about 2 KB smaller |
| `completion` | `[ceil(T / 8)]` uint8 | completion tokens, one bit each (`np.packbits`, little bit order) |
| `logprobs` | `[C]` float32 | behaviour log-prob of each completion token |
| `versions`, `version_runs` | `[V]` int32 | served versions of the completion tokens, run-length encoded |
| `support` | `[C, k]` int32 | sampling support of each completion token (only with a capacity) |
| `rollout_group`, `rollout_sample`, `rollout_reward`, `rollout_advantage`, `rollout_trained` | `[R]` | per packed rollout (`PackedBatch`) |

So the loss mask is a rollout's completion tokens when it trains (`rollout_trained`), its
advantage (`rollout_advantage`, as float32) on them; positions restart at 0 per segment;
off the completion tokens log-probs are 0, versions -1 and support -1, as in a `Result`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import msgspec
import numpy as np

from pipeline.chains import NO_VERSION
from pipeline.packing import PackedBatch, _Layout
from pipeline.scheduler import SchedulerRecord
from pipeline.sessions import LOGPROB_DTYPE, TOKEN_DTYPE


class ReadyRecord(SchedulerRecord, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A step's `SchedulerRecord` with what packing and admission add: `refused` groups
    that can never fit the step's rows, `surplus` groups cut when their batch reached
    `admit`, `overlong` admitted rollouts cut to the row width; and which tasks ended how:
    `admitted` (group, batch, task id; trained unless cut or refused at packing), `packed`
    group ids, `refused_groups` (group, reason), `dropped` (group, batch, task id, cause:
    abandoned after max_attempts with the last failure's cause, or `surplus`)."""

    refused: int = 0
    surplus: int = 0
    overlong: int = 0
    admitted: tuple[tuple[int, int, str], ...] = ()
    packed: tuple[int, ...] = ()
    refused_groups: tuple[tuple[int, str], ...] = ()
    dropped: tuple[tuple[int, int, str, str], ...] = ()

    def scheduler_record(self, waited: float | None = None) -> SchedulerRecord:
        """The `SchedulerRecord` part (with `waited` replaced, when given)."""
        fields = self.fields()
        if waited is not None:
            fields["waited"] = waited
        return SchedulerRecord(**fields)

    @property
    def extra(self) -> dict[str, int]:
        """What the record adds to the SchedulerRecord's counts."""
        return {"refused": self.refused, "surplus": self.surplus, "overlong": self.overlong}


def decode_record(value: object) -> ReadyRecord:
    """A `ReadyRecord` from its msgpack-native form, strictly; ValueError naming the field."""
    try:
        record = msgspec.convert(value, ReadyRecord, strict=True)
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from None
    for name, v in (("waited", record.waited), *((f"metrics.{k}", x) for k, x in record.metrics.items())):
        if not math.isfinite(v):
            raise ValueError(f"must be finite, got {v} - at `$.{name}`")
    return record


def record_builtins(record: ReadyRecord) -> dict:
    """The msgpack-native form of `record` (what `decode_record` reads)."""
    return msgspec.to_builtins(record)


# ---------------------------------------------------------------------------- arrays

_ROLLOUT = ("rollout_group", "rollout_sample", "rollout_reward", "rollout_advantage", "rollout_trained")


def compact(packed: PackedBatch) -> dict[str, np.ndarray]:
    """The segment table of `packed` (module docstring). A masked rollout's NaN reward
    travels as 0 (`rollout_trained` says which rollouts train). ValueError when a chain
    carries a log-prob, version or support off its completion tokens (a `Result` cannot)."""
    table = packed.segment_table
    spans = packed.spans if packed.support_capacity is None else None
    if spans is not None:  # each chain's loss tokens one span of one version (decoded results)
        completion = _span_mask(table.length, spans.first, spans.n)
        logprobs, versions, counts = spans.logprobs, spans.version, spans.n
    else:
        versions = packed.cells("versions")
        completion = versions != NO_VERSION
        logprobs = packed.cells("logprobs")
        if logprobs[~completion].any():
            raise ValueError("a chain carries log-probs off its completion tokens")
        logprobs, versions, counts = logprobs[completion], versions[completion], None
    bounds = _run_bounds(versions)
    runs = bounds[1:] - bounds[:-1] if counts is None else np.add.reduceat(counts, bounds[:-1])
    out = {
        "shape": np.array([packed.rows, packed.width], np.int64),
        "seg_rows": table.row,
        "seg_lengths": table.length,
        "seg_rollout": table.rollout,
        "seg_chain": table.chain,
        "tokens": _narrow(packed.cells("tokens")),
        "completion": np.packbits(completion, bitorder="little"),
        "logprobs": logprobs,
        "versions": versions[bounds[:-1]].astype(np.int32),
        "version_runs": runs.astype(np.int32),
        **{name: getattr(packed, name) for name in _ROLLOUT},
    }
    if not np.isfinite(packed.rollout_reward).all():
        out["rollout_reward"] = np.nan_to_num(packed.rollout_reward, nan=0.0)
    if packed.support_capacity is not None:
        support = packed.cells("support")
        if (support[~completion] != -1).any():
            raise ValueError("a chain carries sampling support off its completion tokens")
        out["support"] = support[completion]
    return out


_NARROW = np.dtype("<u2")
_TOKEN_DTYPES = (TOKEN_DTYPE, _NARROW)


def _narrow(tokens: np.ndarray) -> np.ndarray:
    """The token ids as uint16 when every one fits (ids are never negative: a negative int32
    reads as an unsigned one above the range, so it keeps the ids as they are)."""
    if tokens.dtype == TOKEN_DTYPE and tokens.size \
            and int(np.maximum.reduce(tokens.view(np.uint32), axis=None)) < 1 << 16:
        return tokens.astype(_NARROW)
    return tokens


_OFF_ON_OFF = np.array([False, True, False])


def _span_mask(lengths: np.ndarray, first: np.ndarray, n: np.ndarray) -> np.ndarray:
    """The completion tokens of segments of `lengths` whose loss tokens are the spans
    `[first, first + n)` within each, end to end."""
    runs = np.empty((len(lengths), 3), np.int64)  # per segment: before, in and after its span
    runs[:, 0], runs[:, 1] = first, n
    runs[:, 2] = lengths - first - n
    return np.resize(_OFF_ON_OFF, runs.size).repeat(runs.ravel())


def _run_bounds(values: np.ndarray) -> np.ndarray:
    """Where the runs of equal values start, then `len(values)`."""
    n = len(values)
    edges = np.ones(n + 1, dtype=bool)
    np.not_equal(values[1:], values[:-1], out=edges[1:n])
    return np.flatnonzero(edges)


def expand(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The `[rows, width]` arrays of the packed step whose segment table is `arrays`
    (`compact`), as `PackedBatch` has them. ValueError naming the array when the table is
    inconsistent (a missing array, lengths that do not add up, a segment past its row)."""
    missing = [name for name in ("shape", "seg_rows", "seg_lengths", "seg_rollout", "seg_chain", "tokens",
                                 "completion", "logprobs", "versions", "version_runs", *_ROLLOUT)
               if name not in arrays]
    if missing:
        raise ValueError(f"ready arrays: missing {', '.join(missing)}")
    shape = arrays["shape"].tolist()
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"ready arrays: shape must be [rows, width] >= 1, got {shape}")
    rows, width = shape
    seg_rows = arrays["seg_rows"].astype(np.int64)
    lengths = arrays["seg_lengths"].astype(np.int64)
    seg_rollout = arrays["seg_rollout"].astype(np.int64)
    n_rollouts = len(arrays["rollout_group"])
    _same_length("seg_rows", seg_rows, ("seg_lengths", "seg_rollout", "seg_chain"), arrays)
    if seg_rows.size and (seg_rows.min() < 0 or seg_rows.max() >= rows or (np.diff(seg_rows) < 0).any()):
        raise ValueError(f"ready arrays: seg_rows must be non-decreasing rows of 0..{rows - 1}")
    if lengths.size and lengths.min() < 1:
        raise ValueError("ready arrays: seg_lengths must be >= 1")
    if seg_rollout.size and (seg_rollout.min() < 0 or seg_rollout.max() >= n_rollouts):
        raise ValueError(f"ready arrays: seg_rollout must index the {n_rollouts} rollouts")
    for name in _ROLLOUT:
        if len(arrays[name]) != n_rollouts:
            raise ValueError(f"ready arrays: {name} has {len(arrays[name])} entries for {n_rollouts} rollouts")
    used = np.bincount(seg_rows, weights=lengths, minlength=rows).astype(np.int64)
    if used.max(initial=0) > width:
        raise ValueError(f"ready arrays: a row holds {used.max()} tokens, more than the width {width}")
    total = int(lengths.sum())
    tokens = _tokens(arrays["tokens"], total)
    bits = arrays["completion"]
    if len(bits) != (total + 7) // 8:
        raise ValueError(f"ready arrays: completion has {len(bits)} bytes for {total} tokens")
    completion = np.unpackbits(bits, count=total, bitorder="little").view(bool)
    n_completion = int(np.count_nonzero(completion))
    runs = arrays["version_runs"].astype(np.int64)
    if len(arrays["logprobs"]) != n_completion or int(runs.sum()) != n_completion \
            or len(runs) != len(arrays["versions"]) or (runs.size and runs.min() < 1):
        raise ValueError(f"ready arrays: logprobs and version runs must cover the {n_completion} "
                         "completion tokens")
    seg_starts = np.cumsum(lengths) - lengths
    row_first = np.searchsorted(seg_rows, seg_rows)  # the first segment of each one's row
    seg_ids = (np.arange(len(seg_rows)) - row_first + 1).astype(np.int32)
    trained = arrays["rollout_trained"].astype(bool)[seg_rollout]
    advantage = arrays["rollout_advantage"].astype(np.float32)[seg_rollout]
    loss = completion & np.repeat(trained, lengths)
    logprobs = np.zeros(total, LOGPROB_DTYPE)
    logprobs[completion] = arrays["logprobs"]
    versions = np.full(total, NO_VERSION, np.int32)
    versions[completion] = np.repeat(arrays["versions"].astype(np.int32), runs)
    flat = {
        "tokens": (tokens, 0),
        "positions": ((np.arange(total, dtype=np.int64) - np.repeat(seg_starts, lengths)).astype(np.int32), 0),
        "segments": (np.repeat(seg_ids, lengths), 0),
        "loss_mask": (loss, False),
        "advantages": (np.where(loss, np.repeat(advantage, lengths), np.float32(0)), 0),
        "logprobs": (logprobs, 0),
        "versions": (versions, NO_VERSION),
    }
    layout = _Layout(used.tolist(), width)
    out = {name: layout.rows(values, pad) for name, (values, pad) in flat.items()}
    if "support" in arrays:
        support = arrays["support"]
        if support.ndim != 2 or len(support) != n_completion:
            raise ValueError(f"ready arrays: support must be [{n_completion}, k], got {list(support.shape)}")
        full = np.full((total, support.shape[1]), -1, TOKEN_DTYPE)
        full[completion] = support
        out["support"] = layout.rows(full, -1)
    n_seg = int(seg_ids.max(initial=0)) + 1
    for name, values in (("segment_group", arrays["rollout_group"][seg_rollout]),
                         ("segment_sample", arrays["rollout_sample"][seg_rollout]),
                         ("segment_chain", arrays["seg_chain"])):
        table = np.full((rows, n_seg), -1, np.int64)
        table[seg_rows, seg_ids] = values
        out[name] = table
    out.update({name: arrays[name] for name in _ROLLOUT})
    return out


def _tokens(tokens: np.ndarray, total: int) -> np.ndarray:
    """The `total` token ids of `tokens` (int32 or uint16) as int32."""
    if tokens.dtype not in _TOKEN_DTYPES:
        raise ValueError(f"ready arrays: tokens must be int32 or uint16, got {tokens.dtype}")
    if len(tokens) != total:
        raise ValueError(f"ready arrays: tokens has {len(tokens)} entries, the segments {total}")
    return np.asarray(tokens, TOKEN_DTYPE)


def _same_length(first: str, values: np.ndarray, others: tuple[str, ...], arrays: Mapping) -> None:
    for name in others:
        if len(arrays[name]) != len(values):
            raise ValueError(f"ready arrays: {name} has {len(arrays[name])} entries, {first} {len(values)}")


def nbytes(arrays: Mapping[str, np.ndarray]) -> int:
    """The bytes of the arrays' data."""
    return sum(a.nbytes for a in arrays.values())
