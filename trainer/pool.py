"""`Pool`: how the processes of a multi-process trainer meet in a `RolloutScheduler` call.

    init_distributed("gloo")                  # build_engine does it (trainer.deepspeed_engine)
    pool = Pool(share=1)                      # every process of torch.distributed's world
    scheduler = RolloutScheduler(..., redis=url, shard=pool.shard, pool=pool)

Every process runs its own scheduler over its own shard (`shard = rank // share`): its
admission consumer, its task rows, its packed rows. The pool meets twice a call
(specification, "Every process of a multi-process trainer..."):

1. the weight push. Every process computes the same "is a push due" from the same counters;
   rank 0 alone publishes, and `agree` follows, so no process hands its step over before the
   push is known to have succeeded (or knows it failed).
2. after the wait on the ready stream, before the proximal rescoring. A process whose
   admission failed (a failed step, a timeout, a dead consumer) does not raise alone: it
   brings its error to `agree`, and every process raises `PoolFailed` there, naming the
   failed ranks and their errors, instead of the others waiting in the rescoring's
   collectives until the distributed timeout.

first_reader_batch (`share > 1`): ranks that read one batch share (a tensor- or
sequence-parallel axis across processes) form a share group of `share` consecutive ranks.
Its first reader (the lowest rank) alone registers, hands over and waits; `broadcast`
sends the rows it packed, and the step's record, to the others, so every device of the
share trains on the same rows (independent draws would differ).

Everything here runs on a separate gloo group, so it works beside an NCCL training group;
error texts and records travel as UTF-8 bytes in uint8 tensors (never pickled objects).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import fields
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from pipeline.ready import ReadyRecord
from trainer.objective import Rows

log = logging.getLogger(__name__)

ERROR_BYTES = 4096  # an error's text is cut to this many bytes at the agreement point
_DTYPES = (torch.long, torch.bool, torch.float32)
_MAX_DIMS = 3  # Rows fields are [rows, width] or [rows, width, k]
_FIELDS = tuple(f.name for f in fields(Rows))


class PoolFailed(RuntimeError):
    """Raised on every process when any process of the pool failed at an agreement point."""

    def __init__(self, point: str, errors: dict[int, str]) -> None:
        self.point, self.errors = point, dict(errors)
        detail = "; ".join(f"rank {rank}: {text}" for rank, text in sorted(errors.items()))
        super().__init__(f"the trainer pool failed at the {point} agreement: {detail}")


class Pool:
    """The agreement and first-reader broadcast of one trainer process (module docstring)."""

    def __init__(self, share: int = 1, *, timeout_s: float = 7200.0) -> None:
        if not dist.is_initialized():
            raise RuntimeError("Pool needs torch.distributed initialised (trainer.deepspeed_engine.init_distributed)")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if share < 1 or self.world % share:
            raise ValueError(f"share={share} must be >= 1 and divide the world size {self.world}")
        self.share = share
        self.shard = self.rank // share  # the batch share (and the admission shard) it reads
        self.shards = self.world // share
        self.first_reader = self.rank % share == 0
        self.publishes = self.rank == 0
        # collectives of every process, in the same order: the agreement group, then one
        # group per batch share (new_group must be called by every rank for every group)
        timeout = timedelta(seconds=timeout_s)
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self.share_group = None
        for s in range(self.shards):
            ranks = list(range(s * share, (s + 1) * share))
            group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout) if share > 1 else None
            if s == self.shard:
                self.share_group = group
        self.share_ranks = list(range(self.shard * share, (self.shard + 1) * share))

    # ------------------------------------------------------------------ agreement

    def agree(self, point: str, error: BaseException | str | None = None) -> None:
        """Every process calls this at `point`; all return, or all raise `PoolFailed`."""
        text = "" if error is None else (error if isinstance(error, str) else _describe(error))
        mine = _encode(text, ERROR_BYTES)
        gathered = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(gathered, mine, group=self.group)
        errors = {rank: _decode(t) for rank, t in enumerate(gathered) if int(t[0]) or int(t[1])}
        if errors:
            failed = PoolFailed(point, errors)
            if isinstance(error, BaseException):
                raise failed from error
            raise failed

    def any(self, flag: bool) -> bool:
        """Whether any process passed True (e.g. a stop request), agreed by all."""
        t = torch.tensor([1 if flag else 0], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    # ------------------------------------------------------------------ first_reader_batch

    def broadcast(self, rows: Rows | None, record: ReadyRecord | None) -> tuple[Rows, ReadyRecord]:
        """The share's first reader sends `rows` and `record` (msgpack, decoded strictly);
        the others pass None and receive them. With `share == 1` it returns its arguments."""
        if self.share == 1:
            assert rows is not None and record is not None
            return rows, record
        src = self.share_ranks[0]
        header = torch.zeros(len(_FIELDS) * (2 + _MAX_DIMS) + 1, dtype=torch.long)
        payload = b""
        if self.first_reader:
            assert rows is not None and record is not None
            payload = msgspec.msgpack.encode(record)
            header = _header(rows, len(payload))
        dist.broadcast(header, src=src, group=self.share_group)
        tensors = _receive_buffers(header) if not self.first_reader else _tensors(rows)
        for t in tensors.values():
            dist.broadcast(t, src=src, group=self.share_group)
        blob = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.first_reader \
            else torch.zeros(int(header[-1]), dtype=torch.uint8)
        if blob.numel():
            dist.broadcast(blob, src=src, group=self.share_group)
        if self.first_reader:
            return rows, record  # type: ignore[return-value]
        got = Rows(**{name: tensors.get(name) for name in _FIELDS})
        return got, msgspec.msgpack.decode(bytes(blob.tolist()), type=ReadyRecord, strict=True)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _encode(text: str, size: int) -> torch.Tensor:
    """[length hi, length lo, bytes...] in a uint8 tensor of `size` + 2."""
    data = text.encode("utf-8", errors="replace")[:size]
    out = torch.zeros(size + 2, dtype=torch.uint8)
    out[0], out[1] = len(data) >> 8, len(data) & 0xFF
    if data:
        out[2:2 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def _decode(t: torch.Tensor) -> str:
    n = (int(t[0]) << 8) | int(t[1])
    return bytes(t[2:2 + n].tolist()).decode("utf-8", errors="replace")


def _tensors(rows: Rows | None) -> dict[str, torch.Tensor]:
    assert rows is not None
    return {name: getattr(rows, name).contiguous().cpu() for name in _FIELDS
            if getattr(rows, name) is not None}


def _header(rows: Rows, record_bytes: int) -> torch.Tensor:
    """Per field: present, dtype index, up to three dims; then the record's length."""
    values: list[int] = []
    for name in _FIELDS:
        t = getattr(rows, name)
        if t is None:
            values += [0] * (2 + _MAX_DIMS)
            continue
        if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
            raise ValueError(f"rows.{name}: cannot broadcast a {t.dtype} of {t.dim()} dims")
        dims = list(t.shape) + [-1] * (_MAX_DIMS - t.dim())
        values += [1, _DTYPES.index(t.dtype), *dims]
    return torch.tensor(values + [record_bytes], dtype=torch.long)


def _receive_buffers(header: torch.Tensor) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    values: Sequence[int] = header.tolist()
    width = 2 + _MAX_DIMS
    for i, name in enumerate(_FIELDS):
        present, dtype, *dims = values[i * width:(i + 1) * width]
        if present:
            out[name] = torch.zeros([d for d in dims if d >= 0], dtype=_DTYPES[dtype])
    return out
