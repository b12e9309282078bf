"""Consumer-side weight loading: fetch a published version, verify its digest, return tensors.

    loader = WeightsLoader(RedisWeights(redis, keys))        # or DirectoryWeights("/ckpt/w")
    state = loader.load(version)                             # dict[str, torch.Tensor]
    model.load_state_dict(state)

    state = load_weights("redis:rs:{exp1}:weights:3:blob", redis=client)   # by location
    state = load_weights("file:///ckpt/w/v3.safetensors")

The stores read what `producers.publishers` writes: a manifest hash plus chunks in Redis, or
a `v<version>.safetensors` file with a `.sha256` sidecar. A version whose bytes do not match
the published sha256 raises `WeightsCorrupt` naming the version; one that is not (or no
longer) stored raises `WeightsMissing`. `WeightsLoader` caches the last version it loaded,
so the sessions of one consumer that move to a new version fetch it once; it is thread-safe.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import redis
import torch
from safetensors.torch import load as safetensors_load

from pipeline.keys import Keys


class WeightsError(RuntimeError):
    """A weight version could not be loaded."""


class WeightsMissing(WeightsError):
    """The version is not (or no longer) stored."""


class WeightsCorrupt(WeightsError):
    """The version's bytes do not match its published digest."""


class WeightStore(Protocol):
    def fetch(self, version: int) -> tuple[bytes, str]:
        """The bytes of `version` and their published sha256 (hex)."""
        ...

    def location(self, version: int) -> str: ...


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisWeights:
    """Versions a `RedisPublisher` stored under `keys.weights_blob(version)`."""

    def __init__(self, redis: redis.Redis, keys: Keys) -> None:
        self.r, self.keys = redis, keys

    def location(self, version: int) -> str:
        return f"redis:{self.keys.weights_blob(version)}"

    def fetch(self, version: int) -> tuple[bytes, str]:
        return _fetch_redis(self.r, self.keys.weights_blob(version), version)


def _fetch_redis(r: redis.Redis, manifest_key: str, version: int) -> tuple[bytes, str]:
    manifest = {_text(k): _text(v) for k, v in r.hgetall(manifest_key).items()}
    if not manifest:
        raise WeightsMissing(f"weights version {version} is not stored at redis:{manifest_key}")
    count = int(manifest["chunks"])
    with r.pipeline(transaction=True) as pipe:  # every chunk as of one moment
        for i in range(count):
            pipe.get(f"{manifest_key}:{i}")
        chunks = pipe.execute()
    if any(c is None for c in chunks):
        raise WeightsMissing(f"weights version {version} at redis:{manifest_key} lost chunks "
                             "(superseded and expired while being read)")
    data = b"".join(chunks)
    if len(data) != int(manifest["size"]):
        raise WeightsCorrupt(f"weights version {version} at redis:{manifest_key}: {len(data)} bytes, "
                             f"published {manifest['size']}")
    return data, manifest["digest"]


class DirectoryWeights:
    """Versions a `DirectoryPublisher` wrote as `<path>/v<version>.safetensors`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).resolve()

    def location(self, version: int) -> str:
        return f"file://{self.path / f'v{version}.safetensors'}"

    def fetch(self, version: int) -> tuple[bytes, str]:
        return _fetch_file(self.path / f"v{version}.safetensors", version)


def _fetch_file(path: Path, version: int) -> tuple[bytes, str]:
    try:
        digest = Path(f"{path}.sha256").read_text().split()[0]
        data = path.read_bytes()
    except FileNotFoundError as exc:
        raise WeightsMissing(f"weights version {version} is not stored at {path}: {exc}") from exc
    return data, digest


def decode(data: bytes, digest: str, version: int, location: str) -> dict[str, torch.Tensor]:
    """The tensors of `data` once its sha256 matches `digest`."""
    got = hashlib.sha256(data).hexdigest()
    if got != digest:
        raise WeightsCorrupt(f"weights version {version} at {location} is corrupt: sha256 {got} "
                             f"does not match the published {digest}")
    return safetensors_load(data)


def load_weights(location: str, *, redis: redis.Redis | None = None) -> dict[str, torch.Tensor]:
    """The verified state dict at `location`: `redis:<manifest key>` (needs `redis`),
    `file://<path>` or a plain path."""
    if location.startswith("redis:"):
        if redis is None:
            raise ValueError(f"loading {location} needs a Redis client")
        key = location.removeprefix("redis:")
        m = re.search(r":weights:(\d+):blob$", key)
        version = int(m.group(1)) if m else -1
        data, digest = _fetch_redis(redis, key, version)
    else:
        path = Path(location.removeprefix("file://"))
        m = re.fullmatch(r"v(\d+)\.safetensors", path.name)
        version = int(m.group(1)) if m else -1
        data, digest = _fetch_file(path, version)
    return decode(data, digest, version, location)


class WeightsLoader:
    """Loads versions from `store`, verified, caching the last one (thread-safe: one fetch
    at a time; sessions waiting on the same version get the cached tensors)."""

    def __init__(self, store: WeightStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._cached: tuple[int, dict[str, torch.Tensor]] | None = None
        self.fetches = 0

    @property
    def version(self) -> int | None:
        """The version cached now (None before the first load)."""
        cached = self._cached
        return None if cached is None else cached[0]

    def load(self, version: int) -> dict[str, torch.Tensor]:
        """The state dict of `version`. Callers must not modify the tensors (shared)."""
        with self._lock:
            if self._cached is not None and self._cached[0] == version:
                return self._cached[1]
            data, digest = self.store.fetch(version)
            state = decode(data, digest, version, self.store.location(version))
            self.fetches += 1
            self._cached = (version, state)
            return state


def weights_loader(spec: Any) -> WeightsLoader | None:
    """A loader from a source's `weights` argument: None, a `WeightsLoader`, a store, a
    directory path, or a mapping `{"directory": path}` or `{"redis": {RedisConfig fields}}`
    (the form a consumer's JSON `source_args` can carry)."""
    if spec is None or isinstance(spec, WeightsLoader):
        return spec
    if isinstance(spec, (str, os.PathLike)):
        return WeightsLoader(DirectoryWeights(spec))
    if isinstance(spec, Mapping):
        if "directory" in spec:
            return WeightsLoader(DirectoryWeights(spec["directory"]))
        if "redis" in spec:
            from pipeline.config import RedisConfig, build
            from pipeline.redis_io import connect

            config = build(RedisConfig, dict(spec["redis"]))
            return WeightsLoader(RedisWeights(connect(config), Keys(config.namespace)))
        raise ValueError(f"weights mapping needs 'directory' or 'redis', got {sorted(spec)}")
    if callable(getattr(spec, "fetch", None)) and callable(getattr(spec, "location", None)):
        return WeightsLoader(spec)
    raise TypeError(f"cannot load weights from {type(spec).__name__}")
