"""`rollstream status`: what a live pipeline is doing, read from Redis alone.

For every stream of the run: its length and, per consumer group, the entries pending, the
lag (entries not yet delivered: Redis 7 reports it, on 6.2 it is counted) and each consumer's
pending count and idle time. Then the samples in flight (work entries not yet
acknowledged), the rollout consumers alive (by heartbeat), the newest published weight
version and the dead-lettered entries. Credentials never appear: the URL is shown without
them.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis

from pipeline import streams, wire
from pipeline.keys import Keys
from pipeline.redis_io import text


def redact(url: str) -> str:
    """`url` without its user name and password."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, parts.query, ""))


LAG_SCAN = 100_000
"""Redis 6.2 reports no group lag: it is counted with XRANGE, up to this many entries."""


def _lag(r: redis.Redis, stream: str, group: dict) -> int:
    if group.get("lag") is not None:
        return group["lag"]
    last = text(group["last-delivered-id"])
    return len(streams.entries(r, stream, f"({last}", count=LAG_SCAN))


def _groups(r: redis.Redis, stream: str) -> list[dict[str, Any]]:
    out = []
    for g in r.xinfo_groups(stream):
        name = text(g["name"])
        consumers = [
            {"name": text(c["name"]), "pending": c["pending"], "idle_ms": c["idle"]}
            for c in r.xinfo_consumers(stream, name)
        ]
        out.append({"group": name, "pending": g["pending"], "lag": _lag(r, stream, g),
                    "consumers": consumers})
    return out


def _published(r: redis.Redis, keys: Keys) -> int | None:
    last = streams.newest(r, keys.weights)
    if last is not None:
        try:
            return wire.from_fields(last[1], wire.Weights).version
        except wire.SchemaError:
            return None
    return None


def _alive(r: redis.Redis, keys: Keys) -> list[str]:
    prefix = keys.prefix + "consumer:"
    names = []
    for key in r.scan_iter(match=prefix.replace("{", "\\{").replace("}", "\\}") + "*:heartbeat",
                           count=500):
        names.append(text(key)[len(prefix): -len(":heartbeat")])
    return sorted(names)


def collect(r: redis.Redis, keys: Keys, shards: int = 1) -> dict[str, Any]:
    """The status of the run under `keys`, as a JSON-ready dict."""
    streams = {}
    for stream in keys.all_streams(shards):
        if not r.exists(stream):
            continue
        streams[stream] = {"length": r.xlen(stream), "groups": _groups(r, stream)}
    work = streams.get(keys.work, {"groups": []})
    in_flight = sum(g["pending"] + g["lag"] for g in work["groups"])
    return {
        "namespace": keys.namespace,
        "streams": streams,
        "in_flight": in_flight,
        "consumers_alive": _alive(r, keys),
        "published_version": _published(r, keys),
        "dead_lettered": r.xlen(keys.dead),
    }


def render(status: dict[str, Any], url: str) -> str:
    """A human-readable page of `status`."""
    lines = [f"run {status['namespace']} at {redact(url)}",
             f"samples in flight: {status['in_flight']}    "
             f"published weights: {status['published_version']}    "
             f"dead-lettered: {status['dead_lettered']}",
             f"rollout consumers alive: {len(status['consumers_alive'])} "
             f"{' '.join(status['consumers_alive'])}", ""]
    lines.append(f"{'stream':44s} {'length':>8s}  group: pending/lag  consumers (pending)")
    for name, s in status["streams"].items():
        groups = "  ".join(
            f"{g['group']}: {g['pending']}/{g['lag']} "
            + " ".join(f"{c['name']}({c['pending']})" for c in g["consumers"])
            for g in s["groups"]) or "-"
        lines.append(f"{name:44s} {s['length']:8d}  {groups}")
    return "\n".join(lines)


def main(r: redis.Redis, keys: Keys, url: str, *, shards: int, as_json: bool) -> int:
    """Print the status (the caller checked the connection and credentials: `redis_io.check`)."""
    status = collect(r, keys, shards)
    print(json.dumps(status) if as_json else render(status, url))
    return 0
