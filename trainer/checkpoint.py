"""Checkpoints: the DeepSpeed checkpoint plus the data position and the scheduler's counters.

    position = checkpoint.load(engine, "/ckpt")         # None: nothing to resume from
    ...
    checkpoint.save(engine, "/ckpt", Position(step=120, updates=120, epoch=3), keep=2)

A checkpoint is a DeepSpeed tag directory `step{NNNNNNNN}` (model, optimizer and ZeRO
shards of every rank; `engine.save_checkpoint` is collective) whose client state holds a
`Position` under `rollstream`: `step`, the steps trained, which is also the data position
(the trainer's task stream is a pure function of the step: `trainer.main.batches`);
`updates`, the trainer's version counter; `epoch`, the scheduler epoch it was taken in.
Each rank also writes its task stream's position beside it (`rollstream-rank{R}.msgpack`,
msgpack of `RolloutScheduler.position()`): the tasks outstanding before the data position
and those already ended after it. In batch admission both are empty (step i trains batch
i); in stream admission a step trains groups of any registered batch, and this is what
lets a resumed run train every task exactly once.
The newest complete tag is named in `latest`, written by rank 0 after every rank saved
(atomically: a temporary file renamed over it, so a process killed mid-checkpoint leaves
the previous one named, never a torn name). A resumed run opens a new epoch (epochs
only grow: `load` checks it), which cancels everything the old run left in flight, and
re-registers the batches from `step` on, so the tasks the old run had in flight are
resubmitted and none is trained twice in the resumed model's history.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import torch.distributed as dist

from pipeline.files import write_whole

log = logging.getLogger(__name__)

_PREFIX = "step"


@dataclass(frozen=True)
class Position:
    step: int  # steps trained; the next step reads batch `step` of the task stream
    updates: int  # the trainer's version counter (`RolloutScheduler.updates`)
    epoch: int  # the scheduler epoch the checkpoint was taken in
    # this rank's task stream beside the data position (`trainer.task_stream.Resume.to_data`);
    # None: a checkpoint from before it was kept
    data: dict[str, Any] | None = field(default=None, compare=False)

    def client_state(self) -> dict[str, int]:
        return {"step": self.step, "updates": self.updates, "epoch": self.epoch}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _data_file(directory: str | Path, name: str, rank: int) -> Path:
    return Path(directory) / name / f"rollstream-rank{rank}.msgpack"


def tag(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def save(engine: Any, directory: str | Path, position: Position, *, keep: int = 2) -> str:
    """Write a checkpoint (every rank calls this) and drop all but the newest `keep`."""
    name = tag(position.step)
    engine.save_checkpoint(str(directory), tag=name, client_state={"rollstream": position.client_state()},
                           save_latest=False)
    if position.data is not None:
        write_whole(_data_file(directory, name, _rank()), msgpack.packb(position.data, use_bin_type=True))
    if dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_whole(Path(directory) / "latest", name.encode())
        for old in sorted(Path(directory).glob(f"{_PREFIX}*"))[:-keep]:
            if old.is_dir() and old.name != name:
                shutil.rmtree(old)
    if dist.is_initialized():
        dist.barrier()  # no rank resumes from, or prunes, what another has not finished
    log.info("checkpoint %s: %s", name, position)
    return name


def load(engine: Any, directory: str | Path) -> Position | None:
    """Load the newest checkpoint into `engine` (model, optimizer); None when there is none."""
    latest = Path(directory) / "latest"
    if not latest.is_file():
        return None
    name = latest.read_text().strip()
    path, state = engine.load_checkpoint(str(directory), tag=name)
    if path is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint under {directory} despite its 'latest' file")
    try:
        position = Position(**(state or {})["rollstream"])
    except (KeyError, TypeError) as exc:
        raise RuntimeError(f"checkpoint {path} holds no rollstream position: {exc}") from exc
    data_file = _data_file(directory, name, _rank())
    if data_file.is_file():
        data = msgpack.unpackb(data_file.read_bytes(), raw=False, strict_map_key=False)
        position = Position(position.step, position.updates, position.epoch, data)
    log.info("resumed from %s: %s", path, position)
    return position
