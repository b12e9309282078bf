"""Stream trimming that never removes an entry some consumer group still needs.

A stream read through consumer groups is trimmed with `XTRIM MINID` to the lowest id any of
its groups may still need: the oldest entry pending in the group (delivered, not yet
acknowledged) or, if earlier, the first entry not yet delivered to it. Every entry below
that bound was delivered to every group and acknowledged, so nothing in flight is lost.
A stream without any group is left alone: whoever will read it has not started yet.
"""

from __future__ import annotations

import logging

import redis

from pipeline.redis_io import next_id, parse_id, text

log = logging.getLogger(__name__)


def _groups(r: redis.Redis, stream: str) -> list[dict]:
    try:
        return r.xinfo_groups(stream)
    except redis.exceptions.ResponseError as exc:
        if "no such key" in str(exc).lower():
            return []
        raise


def safe_minid(r: redis.Redis, stream: str) -> str | None:
    """The lowest id any group of `stream` still needs, or None (no group: do not trim)."""
    bounds = []
    for info in _groups(r, stream):
        name = text(info["name"])
        bound = next_id(info["last-delivered-id"])
        if int(info["pending"]):
            oldest = r.xpending(stream, name)["min"]
            if oldest is not None:  # None: acknowledged since XINFO
                bound = min(bound, text(oldest), key=parse_id)
        bounds.append(bound)
    return min(bounds, key=parse_id) if bounds else None


def trim_acknowledged(r: redis.Redis, stream: str, *, keep_last: bool = False,
                      keep_from: str | None = None) -> int:
    """Trim `stream` below `safe_minid`; with `keep_last`, never its newest entry (a reader
    joining later learns the current value from it); with `keep_from`, no entry from that id
    on (entries acknowledged but still referred to). Returns the entries removed."""
    bound = safe_minid(r, stream)
    if bound is None:
        return 0
    if keep_from is not None:
        bound = min(bound, keep_from, key=parse_id)
    if keep_last:
        last = r.xrevrange(stream, count=1)
        if last:
            bound = min(bound, text(last[0][0]), key=parse_id)
    removed = r.xtrim(stream, minid=bound, approximate=False)
    if removed:
        log.debug("trimmed %d entries of %s below %s", removed, stream, bound)
    return removed


def trim_by_age(r: redis.Redis, stream: str, retention_s: float) -> int:
    """Trim entries older than `retention_s` before the stream's newest entry (ids are the
    server's clock, so no client clock enters the bound)."""
    last = r.xrevrange(stream, count=1)
    if not last:
        return 0
    ms, _ = parse_id(last[0][0])
    return r.xtrim(stream, minid=f"{max(0, ms - int(retention_s * 1000))}-0", approximate=False)


def trim_length(r: redis.Redis, stream: str, maxlen: int) -> int:
    """Keep about the newest `maxlen` entries (for streams nobody acknowledges)."""
    return r.xtrim(stream, maxlen=maxlen, approximate=True)
