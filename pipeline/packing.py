"""Packing: admitted groups into fixed `[rows, width]` training rows, with advantages.

`pack(groups, rows=, width=, estimator=, truncation=)` takes the admitted groups in order
(each a `Group`: a group id and its `Rollout`s, each rollout a sample index, a status, a
reward and its chains) and returns a `PackedBatch`.

Rules:

- Groups are packed whole and in order. A group whose chains do not all fit in the room
  the groups before it left is *cut*: it is left out (counted in `cut`, listed in
  `cut_groups`) and the next group is tried, so a smaller later group can still use the
  room. A group is never split across steps.
- A group that can never be packed is *refused* (`refused`, with the reason): a chain
  longer than `width`, filtered-sampling support while `support_capacity` is None, support
  wider than `support_capacity`, or chains that do not fit even an empty batch.
- Chains never cross a row; a row holds chains of any number of groups. Within a group,
  chains are placed longest first, each into the row with the least room that still fits
  it (best-fit decreasing), which packs realistic length mixes to >= 95% non-pad tokens
  when there is enough data to fill the rows (`rollstream.bench_pack`).
- `pack` keeps the packed chains and their segment table (`PackedBatch.segment_table`:
  row, segment id, length, rollout and chain index of each placed chain, row by row);
  every array below is computed from them on first access, vectorised over all placed
  tokens with no Python loop per token, and then kept. The admission reads only the
  segment table and the non-padding cells of a few arrays (`PackedBatch.cells`,
  `pipeline.ready.compact`), so it never lays out the `[rows, width]` arrays.

Packed arrays (`PackedBatch`), all `[rows, width]` unless noted; padding is at the end of
each row:

- `tokens` int32 (0 on padding), `positions` int32 (restart at 0 for each chain),
- `segments` int32: 0 = padding, 1, 2, ... = the row's chains in order,
- `loss_mask` bool: completion tokens of rollouts that train,
- `advantages` float32: the rollout's advantage on its loss tokens, 0 elsewhere,
- `logprobs` float32: behaviour log-prob on completion tokens, 0 elsewhere,
- `versions` int32: served weight version on completion tokens, -1 elsewhere,
- `support` `[rows, width, support_capacity]` int32, -1 padded (only with a capacity),
- `segment_group`, `segment_sample`, `segment_chain` `[rows, max_segments + 1]`: the group
  id, sample index and chain index (within the rollout) of segment s of row r at `[r, s]`;
  column 0 (padding) and unused columns are -1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from bisect import bisect_left, insort
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from operator import attrgetter, itemgetter
from typing import Any, NamedTuple

import numpy as np

from pipeline.advantages import check_policy, scores_of, stacked_advantages, training_rewards
from pipeline.chains import NO_VERSION, Chain, merge_calls
from pipeline.sessions import LOGPROB_DTYPE, TOKEN_DTYPE, Session, Status


_FRESH: Mapping[str, float] = MappingProxyType({})  # a default of Rollout's: a new empty dict


@dataclass(frozen=True, init=False)
class Rollout:
    """One admitted sample of a group: what `pack` needs of a session. (Its fields are set
    directly: the admission makes one for every result, and a frozen dataclass's own
    `__init__` sets each through `object.__setattr__`.)"""

    sample: int
    status: Status
    chains: tuple[Chain, ...]
    reward: float | None = None
    components: Mapping[str, float] = field(default_factory=dict)
    truncation: str | None = None
    timings: Mapping[str, float] = field(default_factory=dict)

    def __init__(self, sample: int, status: Status, chains: tuple[Chain, ...], reward: float | None = None,
                 components: Mapping[str, float] = _FRESH, truncation: str | None = None,
                 timings: Mapping[str, float] = _FRESH) -> None:
        self.__dict__.update(sample=sample, status=status, chains=chains, reward=reward,
                             components={} if components is _FRESH else components,
                             truncation=truncation, timings={} if timings is _FRESH else timings)

    @classmethod
    def from_session(cls, sample: int, session: Session) -> Rollout:
        """Merge the session's calls into chains and keep what packing and metrics use."""
        return cls(
            sample=sample,
            status=session.status,
            chains=tuple(merge_calls(session.calls)),
            reward=session.reward,
            components=dict(session.components),
            truncation=session.truncation,
            timings=dict(session.timings),
        )

    @property
    def tokens(self) -> int:
        return sum(len(c) for c in self.chains)


_SAMPLE = attrgetter("sample")


@dataclass(frozen=True)
class Group:
    """An admitted group: the scheduler's group id and its rollouts."""

    group: int
    rollouts: tuple[Rollout, ...]

    @classmethod
    def from_sessions(
        cls, group: int, sessions: Mapping[int, Session] | Iterable[tuple[int, Session]]
    ) -> Group:
        """A group from `{sample: session}` (or `(sample, session)` pairs), in sample order."""
        pairs = sessions.items() if isinstance(sessions, Mapping) else sessions
        return cls.from_rollouts(group, (Rollout.from_session(s, sess) for s, sess in pairs))

    @classmethod
    def from_rollouts(cls, group: int, rollouts: Iterable[Rollout]) -> Group:
        """A group of `rollouts` (already chains, e.g. `wire.Result.rollout()`), in sample order."""
        return cls(group, tuple(sorted(rollouts, key=_SAMPLE)))

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.rollouts)


@dataclass(frozen=True)
class Refusal:
    """A group `pack` can never place, and why."""

    group: int
    reason: str


@dataclass(frozen=True)
class SegmentTable:
    """The packed chains, one segment each, row by row in column order (so each row's
    chains fill it from column 0): `row`, `segment` (its id in the row: 1, 2, ...),
    `length` (>= 1), `rollout` (an index into the batch's `rollout_*` arrays) and `chain`
    (the chain's index within its rollout), each `[S]` int32."""

    row: np.ndarray
    segment: np.ndarray
    length: np.ndarray
    rollout: np.ndarray
    chain: np.ndarray


def _dense(name: str) -> cached_property[np.ndarray]:
    """The `[rows, width]` array `name` of a `PackedBatch`, laid out on first access."""
    def rows(self: PackedBatch) -> np.ndarray:
        return self._rows(name)
    rows.__doc__ = f"`[rows, width]` {name}, padded (laid out on first access)."
    return cached_property(rows)


class Spans(NamedTuple):
    """The packed chains' loss tokens, segment by segment, when each chain keeps them as one
    span served by one version (`Chain.span`): where the span starts in its segment, its
    tokens and its version (`[S]` int64 each), and the spans' log-probs end to end (float32)."""

    first: np.ndarray
    n: np.ndarray
    version: np.ndarray
    logprobs: np.ndarray


@dataclass(frozen=True)
class PackedBatch:
    """One step's packed rows (see the module docstring for the arrays).

    `pack` keeps the packed chains and their `segment_table`; the `[rows, width]` arrays
    and their non-padding `cells` are computed from them on first access (the admission
    sends only the segment table and a few cells, `pipeline.ready.compact`).

    Per packed rollout, in packing order: `rollout_group`, `rollout_sample`,
    `rollout_reward` (the reward trained on; NaN for a masked rollout without reward),
    `rollout_advantage` and `rollout_trained`.
    """

    rows: int
    width: int
    segment_table: SegmentTable
    support_capacity: int | None
    rollout_group: np.ndarray
    rollout_sample: np.ndarray
    rollout_reward: np.ndarray
    rollout_advantage: np.ndarray
    rollout_trained: np.ndarray
    groups: tuple[int, ...]
    cut_groups: tuple[int, ...]
    refused: tuple[Refusal, ...]
    non_pad_share: float
    # the packed chains, one per segment of `segment_table`, and the cells computed so far
    _chains: tuple[Chain, ...] = field(default=(), repr=False, compare=False)
    _cells: dict[str, np.ndarray] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def row_tokens(self) -> list[int]:
        """The non-padding tokens of each row (its chains fill it from column 0)."""
        return list(self._layout.used)

    def cells(self, name: str) -> np.ndarray:
        """The non-padding cells of the `[rows, width, ...]` array `name`, row after row."""
        if name not in _CELLS or (name == "support" and self.support_capacity is None):
            raise KeyError(f"no cells named {name!r}")
        cached = self._cells.get(name)
        if cached is None:
            cached = self._cells[name] = _CELLS[name](self)
        return cached

    @cached_property
    def completion_cells(self) -> np.ndarray:
        """The packed chains' loss masks end to end, as `cells` lays them out: every
        completion token, whether its rollout trains or not (`cells("loss_mask")` has those
        that train)."""
        return _cat([c.loss_mask for c in self._chains], bool)

    @cached_property
    def spans(self) -> Spans | None:
        """The packed chains' loss spans (`Spans`) when every packed chain has one, else None
        (and None for an empty batch): what the `Ready` and the metrics read in place of the
        per-token cells, which then are never made."""
        spans = [c.span for c in self._chains]
        if not spans or any(span is None for span in spans):
            return None
        first, n, version = (np.array(column, np.int64) for column in zip(*spans))
        logprobs = _cat([c.span_logprobs for c in self._chains], LOGPROB_DTYPE)  # type: ignore[attr-defined]
        return Spans(first, n, version, logprobs)

    @cached_property
    def completion_tokens(self) -> int:
        """The packed chains' completion tokens (those of `completion_cells`)."""
        spans = self.spans
        return int(spans.n.sum()) if spans is not None else int(np.count_nonzero(self.completion_cells))

    @property
    def cut(self) -> int:
        """Complete groups left out because they did not fit beside the groups before them."""
        return len(self.cut_groups)

    @property
    def loss_tokens(self) -> int:
        return int(np.count_nonzero(self.cells("loss_mask")))

    # the `[rows, width]` arrays, each laid out from its cells on first access
    tokens = _dense("tokens")
    positions = _dense("positions")
    segments = _dense("segments")
    loss_mask = _dense("loss_mask")
    advantages = _dense("advantages")
    logprobs = _dense("logprobs")
    versions = _dense("versions")

    @cached_property
    def support(self) -> np.ndarray | None:
        return None if self.support_capacity is None else self._rows("support")

    @cached_property
    def segment_group(self) -> np.ndarray:
        return self._by_segment(self.rollout_group[self.segment_table.rollout])

    @cached_property
    def segment_sample(self) -> np.ndarray:
        return self._by_segment(self.rollout_sample[self.segment_table.rollout])

    @cached_property
    def segment_chain(self) -> np.ndarray:
        return self._by_segment(self.segment_table.chain)

    @cached_property
    def _layout(self) -> _Layout:
        table = self.segment_table
        used = np.bincount(table.row, weights=table.length, minlength=self.rows).astype(np.int64)
        return _Layout(used.tolist(), self.width)

    def _rows(self, name: str) -> np.ndarray:
        return self._layout.rows(self.cells(name), _PADDING[name])

    def _by_segment(self, values: np.ndarray) -> np.ndarray:
        """`[rows, max segment + 1]` int64: `values[i]` at segment i's (row, id), else -1."""
        table = self.segment_table
        out = np.full((self.rows, int(table.segment.max(initial=0)) + 1), -1, dtype=np.int64)
        out[table.row, table.segment] = values
        return out


def check_support(source_is_filtered: bool, support_capacity: int | None) -> None:
    """Refuse, at construction, a filtered-sampling source without `support_capacity`."""
    if support_capacity is not None and support_capacity < 1:
        raise ValueError(f"support_capacity must be >= 1 or None, got {support_capacity}")
    if source_is_filtered and support_capacity is None:
        raise ValueError(
            "the source samples with a filtered support (top-k/top-p): set support_capacity "
            "so that the trainer can renormalise over the same support"
        )


# one chain of a group: (length, rollout index in the group, chain index, the chain)
_Item = tuple[int, int, int, Chain]
# where one chain went: (row, start column, segment id, rollout index, chain index, length,
# the chain); the rollout index counts the packed groups' rollouts in packing order
_Placement = tuple[int, int, int, int, int, int, Chain]


class _Rows:
    """Free room per row, with best-fit placement and rollback.

    The rows are kept sorted by room in `keys` (`room * rows + row`), so the row with the
    least room that fits a chain, the lowest-numbered among equals, is one bisection away."""

    def __init__(self, rows: int, width: int) -> None:
        self.n, self.width = rows, width
        self.free = [width] * rows
        self.count = [0] * rows
        self.keys = [width * rows + r for r in range(rows)]

    def place(self, length: int) -> tuple[int, int, int] | None:
        """Best fit: the row with the least room >= length. Returns (row, offset, segment)."""
        keys, n = self.keys, self.n
        i = bisect_left(keys, length * n)
        if i == len(keys):
            return None
        row = keys.pop(i) % n
        room = self.free[row] - length
        self.free[row] = room
        insort(keys, room * n + row)
        self.count[row] += 1
        return row, self.width - room - length, self.count[row]

    def place_all(self, items: list[_Item], first_rollout: int) -> list[_Placement] | None:
        """`place` of each non-empty chain of `items` (`_chain_items`), in order, as the
        placements of the rollouts from `first_rollout` on; None (rows untouched) if any fails."""
        placed: list[_Placement] = []
        place = self.place
        for length, ri, ci, c in items:
            if not length:
                break
            spot = place(length)
            if spot is None:
                for p in reversed(placed):
                    self.unplace(p[0], p[5])
                return None
            row, offset, segment = spot
            placed.append((row, offset, segment, first_rollout + ri, ci, length, c))
        return placed

    def unplace(self, row: int, length: int) -> None:
        """Undo the last placement in `row`, of `length` tokens."""
        del self.keys[bisect_left(self.keys, self.free[row] * self.n + row)]
        self._move(row, length)
        self.count[row] -= 1

    def _move(self, row: int, change: int) -> None:
        self.free[row] += change
        insort(self.keys, self.free[row] * self.n + row)


def _chain_items(group: Group) -> list[_Item]:
    """The group's chains as (length, rollout index in the group, chain index, chain),
    longest first (equal lengths in rollout then chain order)."""
    items = [(len(c.tokens), ri, ci, c) for ri, r in enumerate(group.rollouts) for ci, c in enumerate(r.chains)]
    items.sort(key=itemgetter(0), reverse=True)  # stable: equal lengths keep their order
    return items


def _refusal(group: Group, width: int, support_capacity: int | None) -> str | None:
    """Why the group can never be packed at this width/capacity, or None."""
    for r in group.rollouts:
        for c in r.chains:
            if len(c) > width:
                return f"chain of {len(c)} tokens (sample {r.sample}) exceeds width {width}"
            if c.support is None:
                continue
            if support_capacity is None:
                return (
                    f"sample {r.sample} carries sampling support but support_capacity is None: "
                    "a filtered-sampling source requires support_capacity"
                )
            if c.support_width > support_capacity:
                return (
                    f"sample {r.sample} has a support of {c.support_width} tokens, above "
                    f"support_capacity {support_capacity}"
                )
    return None


def _training_rewards(group: Group, truncation: str) -> list[float | None]:
    """What each rollout of the group trains on (`advantages.training_rewards`), or the
    ValueError that says which group cannot train as given."""
    try:
        return training_rewards([r.status for r in group.rollouts], [r.reward for r in group.rollouts],
                                truncation)
    except ValueError as exc:
        raise ValueError(f"group {group.group}: {exc}") from exc


def pack(
    groups: Sequence[Group],
    *,
    rows: int,
    width: int,
    estimator: str = "group",
    truncation: str = "mask",
    support_capacity: int | None = None,
    eps: float = 1e-6,
) -> PackedBatch:
    """Pack admitted groups, in order, into `[rows, width]` (see the module docstring).

    Raises ValueError for an invalid shape or policy, and for a rollout that cannot train as
    given (a COMPLETED rollout without reward, an INFRA_ERROR or CANCELLED rollout).
    """
    if rows < 1 or width < 1:
        raise ValueError(f"rows and width must be >= 1, got rows={rows}, width={width}")
    check_policy(estimator, truncation)
    check_support(False, support_capacity)
    free = _Rows(rows, width)
    placements: list[_Placement] = []
    packed: list[tuple[Group, list[float | None]]] = []
    n_rollouts = 0
    cut: list[int] = []
    refused: list[Refusal] = []
    for group in groups:
        items = _chain_items(group)
        # a chain too long or with a support is why a group is refused, if any is (in order)
        if (items and items[0][0] > width) or any(it[3].support is not None for it in items):
            reason = _refusal(group, width, support_capacity)
            if reason is not None:
                refused.append(Refusal(group.group, reason))
                continue
        used = _training_rewards(group, truncation)
        placed = free.place_all(items, n_rollouts)
        if placed is None:
            if _Rows(rows, width).place_all(items, 0) is None:
                refused.append(
                    Refusal(
                        group.group, f"group of {group.tokens} tokens does not fit {rows} rows of {width}"
                    )
                )
            else:
                cut.append(group.group)
            continue
        placements.extend(placed)
        packed.append((group, used))
        n_rollouts += len(group.rollouts)
    placements.sort(key=lambda p: (p[0], p[1]))  # row-major: each row's chains in column order
    return PackedBatch(
        rows=rows,
        width=width,
        segment_table=_segment_table(placements),
        support_capacity=support_capacity,
        **_rollout_arrays(packed, estimator, eps),
        groups=tuple(g.group for g, _ in packed),
        cut_groups=tuple(cut),
        refused=tuple(refused),
        non_pad_share=float((width * rows - sum(free.free)) / (rows * width)),
        _chains=tuple(p[6] for p in placements),
    )


def _segment_table(placements: list[_Placement]) -> SegmentTable:
    """The segment table of the placements (already in row-major order)."""
    row, segment, rollout, chain, length = (
        np.array([p[i] for p in placements], dtype=np.int32) for i in (0, 2, 3, 4, 5)
    )
    return SegmentTable(row=row, segment=segment, length=length, rollout=rollout, chain=chain)


class _Layout:
    """Where the row-major non-padding cells are: row r holds the next `used[r]` values of
    the flat data from column 0, then padding. `rows(flat, pad)` lays the flat data out in
    one concatenation of slices (a boolean-mask scatter costs about ten times as much)."""

    def __init__(self, used: list[int], width: int) -> None:
        self.used, self.width = used, width
        self.starts = [0]
        for n in used[:-1]:
            self.starts.append(self.starts[-1] + n)

    def rows(self, flat: np.ndarray, pad: Any) -> np.ndarray:
        """`[rows, width, *flat.shape[1:]]`: the flat data, each row padded with `pad`."""
        padding = np.full((self.width, *flat.shape[1:]), pad, dtype=flat.dtype)
        parts = []
        for start, n in zip(self.starts, self.used):
            parts.append(flat[start:start + n])
            parts.append(padding[:self.width - n])
        return np.concatenate(parts).reshape(len(self.used), self.width, *flat.shape[1:])

    def flat(self, rows: np.ndarray) -> np.ndarray:
        """The inverse of `rows`: the non-padding cells of `[rows, width, ...]`, row after row."""
        if not self.used:
            return rows.reshape(0, *rows.shape[2:])
        return np.concatenate([row[:n] for row, n in zip(rows, self.used)])


def _cat(parts: list[np.ndarray], dtype: type | np.dtype) -> np.ndarray:
    if not parts:
        return np.zeros(0, dtype=dtype)
    return np.concatenate(parts).astype(dtype, copy=False)


def _support_blocks(chains: list[Chain], capacity: int) -> np.ndarray:
    """The chains' supports, concatenated and -1 padded to `capacity` columns."""
    blocks = []
    for c in chains:
        block = np.full((len(c), capacity), -1, dtype=TOKEN_DTYPE)
        if c.support is not None:
            block[:, : c.support_width] = c.support
        blocks.append(block)
    if not blocks:
        return np.zeros((0, capacity), dtype=TOKEN_DTYPE)
    return np.concatenate(blocks)


def _rollout_arrays(packed: list[tuple[Group, list[float | None]]], estimator: str,
                    eps: float) -> dict[str, np.ndarray]:
    """Per packed rollout: group, sample, reward trained on, advantage, trained flag. Groups
    of one size whose rollouts all train (usually every group of a step) are scored at once."""
    groups = [g for g, _ in packed]
    out = {
        "rollout_group": np.array([g.group for g in groups for _ in g.rollouts], dtype=np.int64),
        "rollout_sample": np.array([r.sample for g in groups for r in g.rollouts], dtype=np.int64),
    }
    used = [u for _, u in packed]
    if len({len(u) for u in used}) == 1 and used[0] and not any(None in u for u in used):
        advantages = stacked_advantages(used, estimator=estimator, eps=eps)  # type: ignore[arg-type]
        return {**out, "rollout_reward": np.array(used, dtype=np.float64).ravel(),
                "rollout_advantage": advantages.ravel(), "rollout_trained": np.ones(advantages.size, bool)}
    scores = [scores_of(u, [r.reward for r in g.rollouts], estimator=estimator, eps=eps) for g, u in packed]
    return {
        **out,
        "rollout_reward": _cat([s.rewards for s in scores], np.float64),
        "rollout_advantage": _cat([s.advantages for s in scores], np.float64),
        "rollout_trained": _cat([s.trained for s in scores], bool),
    }


def _chain_cells(attr: str, dtype: type | np.dtype) -> Callable[[PackedBatch], np.ndarray]:
    """The cells that are the packed chains' `attr` arrays, concatenated."""
    return lambda batch: _cat([getattr(c, attr) for c in batch._chains], dtype)


def _loss_cells(batch: PackedBatch) -> np.ndarray:
    """The completion tokens of the rollouts that train: the chains' loss masks
    (`completion_cells`) when every rollout trains."""
    completion = batch.completion_cells
    if batch.rollout_trained.all():
        return completion
    table = batch.segment_table
    return completion & np.repeat(batch.rollout_trained[table.rollout], table.length)


def _advantage_cells(batch: PackedBatch) -> np.ndarray:
    """Each rollout's advantage on its loss tokens, 0 elsewhere."""
    table = batch.segment_table
    advantages = np.repeat(batch.rollout_advantage.astype(np.float32)[table.rollout], table.length)
    return np.where(batch.cells("loss_mask"), advantages, np.float32(0))


def _position_cells(batch: PackedBatch) -> np.ndarray:
    """Positions restarting at 0 for each segment."""
    lengths = batch.segment_table.length.astype(np.int64)
    starts = np.cumsum(lengths) - lengths
    return (np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)).astype(np.int32)


def _support_cells(batch: PackedBatch) -> np.ndarray:
    assert batch.support_capacity is not None  # `PackedBatch.cells` asks only with a capacity
    return _support_blocks(list(batch._chains), batch.support_capacity)


_CELLS: dict[str, Callable[[PackedBatch], np.ndarray]] = {
    "tokens": _chain_cells("tokens", TOKEN_DTYPE),
    "positions": _position_cells,
    "segments": lambda batch: np.repeat(batch.segment_table.segment, batch.segment_table.length),
    "loss_mask": _loss_cells,
    "advantages": _advantage_cells,
    "logprobs": _chain_cells("logprobs", LOGPROB_DTYPE),
    "versions": _chain_cells("versions", np.int32),
    "support": _support_cells,
}
"""How each `[rows, width, ...]` array's non-padding cells are computed (`PackedBatch.cells`)."""

_PADDING: dict[str, Any] = {
    "tokens": 0, "positions": 0, "segments": 0, "loss_mask": False, "advantages": 0, "logprobs": 0,
    "versions": NO_VERSION, "support": -1,
}
"""What each `[rows, width, ...]` array holds past its row's chains."""
