"""Files written whole: `write_whole(path, data)` writes a hidden file beside `path` and
renames it into place, so a reader (a resuming rank, Prometheus's file discovery) sees the
old content or the new, never half of it."""

from __future__ import annotations

import os
from pathlib import Path


def write_whole(path: Path, data: bytes) -> None:
    """`data` at `path`, renamed into place from `.<name>.<pid>` beside it (a name no
    `*.<suffix>` glob of the folder matches)."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_bytes(data)
    os.replace(partial, path)
