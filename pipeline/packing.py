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
- The fill is vectorised: one `np.repeat`/scatter over all placed tokens, no Python loop
  per token.

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

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.advantages import GroupScores, check_policy, group_advantages
from pipeline.chains import NO_VERSION, Chain, merge_calls
from pipeline.sessions import LOGPROB_DTYPE, TOKEN_DTYPE, Session, Status


@dataclass(frozen=True)
class Rollout:
    """One admitted sample of a group: what `pack` needs of a session."""

    sample: int
    status: Status
    chains: tuple[Chain, ...]
    reward: float | None = None
    components: Mapping[str, float] = field(default_factory=dict)
    truncation: str | None = None
    timings: Mapping[str, float] = field(default_factory=dict)

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
        return cls(group, tuple(sorted(rollouts, key=lambda r: r.sample)))

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.rollouts)


@dataclass(frozen=True)
class Refusal:
    """A group `pack` can never place, and why."""

    group: int
    reason: str


@dataclass(frozen=True)
class PackedBatch:
    """One step's packed rows (see the module docstring for the arrays).

    Per packed rollout, in packing order: `rollout_group`, `rollout_sample`,
    `rollout_reward` (the reward trained on; NaN for a masked rollout without reward),
    `rollout_advantage` and `rollout_trained`.
    """

    tokens: np.ndarray
    positions: np.ndarray
    segments: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    support: np.ndarray | None
    segment_group: np.ndarray
    segment_sample: np.ndarray
    segment_chain: np.ndarray
    rollout_group: np.ndarray
    rollout_sample: np.ndarray
    rollout_reward: np.ndarray
    rollout_advantage: np.ndarray
    rollout_trained: np.ndarray
    groups: tuple[int, ...]
    cut_groups: tuple[int, ...]
    refused: tuple[Refusal, ...]
    non_pad_share: float
    # the non-padding cells of some `[rows, width]` arrays, row after row, and the tokens of
    # each row, as `pack` had them before laying them out (`cells`, `row_tokens`)
    _cells: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def row_tokens(self) -> list[int]:
        """The non-padding tokens of each row (its chains fill it from column 0)."""
        used = self._cells.get("row_tokens")
        return list(used) if used is not None else np.count_nonzero(self.segments, axis=1).tolist()

    def cells(self, name: str) -> np.ndarray:
        """The non-padding cells of the `[rows, width, ...]` array `name`, row after row."""
        cached = self._cells.get(name)
        if cached is not None:
            return cached
        return _Layout(self.row_tokens, self.width).flat(getattr(self, name))

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def cut(self) -> int:
        """Complete groups left out because they did not fit beside the groups before them."""
        return len(self.cut_groups)

    @property
    def loss_tokens(self) -> int:
        return int(np.count_nonzero(self.loss_mask))


def check_support(source_is_filtered: bool, support_capacity: int | None) -> None:
    """Refuse, at construction, a filtered-sampling source without `support_capacity`."""
    if support_capacity is not None and support_capacity < 1:
        raise ValueError(f"support_capacity must be >= 1 or None, got {support_capacity}")
    if source_is_filtered and support_capacity is None:
        raise ValueError(
            "the source samples with a filtered support (top-k/top-p): set support_capacity "
            "so that the trainer can renormalise over the same support"
        )


@dataclass
class _Placement:
    """Where one chain went: row, start column, segment id, and whose chain it is."""

    row: int
    offset: int
    segment: int
    group_pos: int
    rollout_pos: int
    chain_pos: int


class _Rows:
    """Free room per row, with best-fit placement and per-group rollback."""

    def __init__(self, rows: int, width: int) -> None:
        self.free = np.full(rows, width, dtype=np.int64)
        self.count = np.zeros(rows, dtype=np.int64)
        self.width = width
        self._big = np.int64(width + 1)

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        return self.free.copy(), self.count.copy()

    def restore(self, snap: tuple[np.ndarray, np.ndarray]) -> None:
        self.free, self.count = snap

    def place(self, length: int) -> tuple[int, int, int] | None:
        """Best fit: the row with the least room >= length. Returns (row, offset, segment)."""
        room = np.where(self.free >= length, self.free, self._big)
        row = int(room.argmin())
        if room[row] == self._big:
            return None
        offset = self.width - int(self.free[row])
        self.free[row] -= length
        self.count[row] += 1
        return row, offset, int(self.count[row])


def _place_group(rows: _Rows, group: Group, group_pos: int) -> list[_Placement] | None:
    """Place the group's non-empty chains, longest first; None (rows untouched) if any fails."""
    items = [
        (len(c), ri, ci) for ri, r in enumerate(group.rollouts) for ci, c in enumerate(r.chains) if len(c)
    ]
    items.sort(key=lambda it: -it[0])
    snap = rows.snapshot()
    placed = []
    for length, ri, ci in items:
        spot = rows.place(length)
        if spot is None:
            rows.restore(snap)
            return None
        placed.append(_Placement(spot[0], spot[1], spot[2], group_pos, ri, ci))
    return placed


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


def _scores(group: Group, estimator: str, truncation: str, eps: float) -> GroupScores:
    try:
        return group_advantages(
            [r.status for r in group.rollouts],
            [r.reward for r in group.rollouts],
            estimator=estimator,
            truncation=truncation,
            eps=eps,
        )
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
    packed: list[tuple[Group, GroupScores]] = []
    cut: list[int] = []
    refused: list[Refusal] = []
    for group in groups:
        reason = _refusal(group, width, support_capacity)
        if reason is not None:
            refused.append(Refusal(group.group, reason))
            continue
        scores = _scores(group, estimator, truncation, eps)
        placed = _place_group(free, group, len(packed))
        if placed is None:
            if _place_group(_Rows(rows, width), group, 0) is None:
                refused.append(
                    Refusal(
                        group.group, f"group of {group.tokens} tokens does not fit {rows} rows of {width}"
                    )
                )
            else:
                cut.append(group.group)
            continue
        placements.extend(placed)
        packed.append((group, scores))
    return _fill(packed, placements, rows, width, support_capacity, tuple(cut), tuple(refused))


def _fill(
    packed: list[tuple[Group, GroupScores]],
    placements: list[_Placement],
    rows: int,
    width: int,
    support_capacity: int | None,
    cut: tuple[int, ...],
    refused: tuple[Refusal, ...],
) -> PackedBatch:
    """Write the placed chains into the row arrays in one vectorised pass.

    Chains fill each row from column 0 with no gaps, so with the placements in (row, offset)
    order the concatenated chains are exactly the row-major non-padding cells.
    """
    placements = sorted(placements, key=lambda p: (p.row, p.offset))
    chains = [packed[p.group_pos][0].rollouts[p.rollout_pos].chains[p.chain_pos] for p in placements]
    lengths = np.array([len(c) for c in chains], dtype=np.int64)
    used = np.bincount([p.row for p in placements], weights=lengths, minlength=rows).astype(np.int64)
    total = int(lengths.sum())
    layout = _Layout(used.tolist(), width)
    positions = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)

    adv = np.array([_advantage(packed, p) for p in placements], dtype=np.float32)
    trains = np.array([packed[p.group_pos][1].trained[p.rollout_pos] for p in placements], dtype=bool)
    loss = _cat([c.loss_mask for c in chains], bool) & np.repeat(trains, lengths)
    values: dict[str, tuple[Any, Any, np.ndarray]] = {
        "tokens": (TOKEN_DTYPE, 0, _cat([c.tokens for c in chains], TOKEN_DTYPE)),
        "positions": (np.int32, 0, positions),
        "segments": (np.int32, 0, np.repeat(np.array([p.segment for p in placements], np.int32), lengths)),
        "loss_mask": (bool, False, loss),
        "advantages": (np.float32, 0, np.where(loss, np.repeat(adv, lengths), np.float32(0))),
        "logprobs": (LOGPROB_DTYPE, 0, _cat([c.logprobs for c in chains], LOGPROB_DTYPE)),
        "versions": (np.int32, NO_VERSION, _cat([c.versions for c in chains], np.int32)),
    }
    cells = {name: np.asarray(flat, dtype) for name, (dtype, pad, flat) in values.items()}
    out = {name: layout.rows(cells[name], pad) for name, (_, pad, _) in values.items()}
    support = None
    if support_capacity is not None:
        support = layout.rows(_support_blocks(chains, support_capacity), -1)
    return PackedBatch(
        **out,
        support=support,
        **_segment_index(packed, placements, rows),
        **_rollout_arrays(packed),
        groups=tuple(g.group for g, _ in packed),
        cut_groups=cut,
        refused=refused,
        non_pad_share=float(total / (rows * width)),
        _cells={**cells, "row_tokens": tuple(layout.used)},
    )


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


def _advantage(packed: list[tuple[Group, GroupScores]], p: _Placement) -> float:
    return float(packed[p.group_pos][1].advantages[p.rollout_pos])


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


def _segment_index(
    packed: list[tuple[Group, GroupScores]], placements: list[_Placement], rows: int
) -> dict[str, np.ndarray]:
    """`segment_group/sample/chain[r, s]` for segment s of row r; -1 where there is none."""
    n_seg = max((p.segment for p in placements), default=0) + 1
    group = np.full((rows, n_seg), -1, dtype=np.int64)
    sample = np.full((rows, n_seg), -1, dtype=np.int64)
    chain = np.full((rows, n_seg), -1, dtype=np.int64)
    if placements:
        r = np.array([p.row for p in placements])
        s = np.array([p.segment for p in placements])
        group[r, s] = [packed[p.group_pos][0].group for p in placements]
        sample[r, s] = [packed[p.group_pos][0].rollouts[p.rollout_pos].sample for p in placements]
        chain[r, s] = [p.chain_pos for p in placements]
    return {"segment_group": group, "segment_sample": sample, "segment_chain": chain}


def _rollout_arrays(packed: list[tuple[Group, GroupScores]]) -> dict[str, np.ndarray]:
    """Per packed rollout: group, sample, reward trained on, advantage, trained flag."""
    groups = [g for g, _ in packed]
    scores = [s for _, s in packed]
    return {
        "rollout_group": np.array([g.group for g in groups for _ in g.rollouts], dtype=np.int64),
        "rollout_sample": np.array([r.sample for g in groups for r in g.rollouts], dtype=np.int64),
        "rollout_reward": _cat([s.rewards for s in scores], np.float64),
        "rollout_advantage": _cat([s.advantages for s in scores], np.float64),
        "rollout_trained": _cat([s.trained for s in scores], bool),
    }
