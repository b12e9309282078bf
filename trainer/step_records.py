"""The trainer's step records (`record` of `RunConfig`): a JSON-lines file, one row a step,
appended by every trainer run in turn.

A row is one `write` of its line, but a line that crosses a page of the file is not written
at once: a reader can see its first page before the rest, and a trainer killed (`kill -9`)
between the two leaves the first part for good. So a reader takes complete lines only
(`read_rows`), and a trainer opening the file drops a torn last line before it appends
(`open_for_append`): otherwise the next run's first row would be glued onto it. The torn row
is never the only record of its step: the step's checkpoint is saved after its row is
written, so the next run resumes at that step or before it and records it again.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger(__name__)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Every complete row of `path` in file order (none when it does not exist yet); a last
    line without its newline is still being written, or was torn, and is left out."""
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")[:-1]  # what follows the last newline is not a row
    return [json.loads(line) for line in lines if line.strip()]


def count_rows(path: Path) -> int:
    """How many complete rows `path` holds (`read_rows`, without decoding them)."""
    if not path.exists():
        return 0
    with path.open("rb") as f:
        return sum(1 for line in f if line.endswith(b"\n") and line.strip())


def open_for_append(path: Path) -> TextIO:
    """`path` opened to append rows, a torn last line (one without its newline, left by a
    trainer killed while writing it) cut off first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab+") as f:
        size = f.seek(0, os.SEEK_END)
        kept = _complete_length(f, size)
        if kept < size:
            log.warning("%s: dropping a torn last row (%d bytes without a newline) left by a "
                        "trainer that was killed while writing it", path, size - kept)
            f.truncate(kept)
    return path.open("a", encoding="utf-8")


def _complete_length(f: Any, size: int, chunk: int = 1 << 16) -> int:
    """The length of `f`'s complete lines: up to and including its last newline."""
    end = size
    while end > 0:
        start = max(0, end - chunk)
        f.seek(start)
        block = f.read(end - start)
        newline = block.rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        end = start
    return 0
