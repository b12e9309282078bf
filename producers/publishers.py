"""Weight publishers: where the trainer's weights go (`Publisher.load(variables, version)`).

    publisher = RedisPublisher(sched.r, sched.keys)           # or DirectoryPublisher("/ckpt/w")
    published = publisher.load(model, version)              # -> Published(location, digest, size)
    writer.announce_weights(version, *published)            # RolloutScheduler does this

Both serialise the model's state dict with safetensors (never pickle) and return where the
version lies (`location`), the sha256 of its bytes (`digest`) and their count (`size`), which
the trainer announces on the `weights` stream. Consumers fetch a version with
`consumers.weights.WeightsLoader`, which verifies the digest.

- `RedisPublisher` stores the bytes in chunks `<weights_blob(version)>:<i>` beside a manifest
  hash at `weights_blob(version)` (chunks, size, digest, format, dtypes), all in one
  MULTI/EXEC, and expires the versions older than the newest `keep`. Location:
  `redis:<manifest key>`. Suited to small and medium models (the whole version passes through
  one transaction); for large ones use a shared volume (`DirectoryPublisher`).
- `DirectoryPublisher` writes `<path>/v<version>.safetensors` atomically (temporary file,
  fsync, rename) with a `.sha256` sidecar (`<digest> <size>`), and deletes the versions
  older than the newest `keep`. Location: `file://<absolute path>`.

`variables` is a torch module (a DeepSpeed engine's `.module` is taken), or a state dict.
ZeRO-3 partitioned parameters must be gathered by the caller before `load`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import redis
import torch
from safetensors.torch import save as safetensors_save
from torch import nn

from pipeline.keys import Keys

log = logging.getLogger(__name__)

FORMAT = "safetensors"
CHUNK_BYTES = 4 << 20


class Published(NamedTuple):
    """Where a published version lies: what `announce_weights` carries."""

    location: str
    digest: str
    size: int


def state_dict(variables: Any) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors of `variables` (a module, an engine or a state dict).
    Tensors that share storage (tied weights) are copied apart, which safetensors requires."""
    module = getattr(variables, "module", None)
    if isinstance(module, nn.Module):
        variables = module
    if isinstance(variables, nn.Module):
        variables = variables.state_dict()
    if not isinstance(variables, Mapping):
        raise TypeError(f"expected a torch module or a state dict, got {type(variables).__name__}")
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, value in variables.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state dict entry {name!r} is {type(value).__name__}, not a tensor")
        t = value.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        if ptr is not None and ptr in seen:
            t = t.clone()
        elif ptr is not None:
            seen.add(ptr)
        out[name] = t
    return out


def serialise(variables: Any) -> tuple[bytes, dict[str, str]]:
    """The safetensors bytes of `variables` and each tensor's dtype."""
    tensors = state_dict(variables)
    return safetensors_save(tensors), {k: str(v.dtype).removeprefix("torch.") for k, v in tensors.items()}


def _check(version: int, keep: int) -> None:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be an int >= 0, got {version!r}")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")


class RedisPublisher:
    """Weights in Redis chunks under `keys.weights_blob(version)` (module docstring).

    Versions older than the newest `keep` get a TTL of `grace_s` seconds (0: deleted at
    once), so a consumer fetching one just as it is superseded still reads it whole."""

    def __init__(self, redis: redis.Redis, keys: Keys, *, chunk_bytes: int = CHUNK_BYTES,
                 keep: int = 2, grace_s: float = 60.0) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        _check(0, keep)
        if grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        self.r, self.keys = redis, keys
        self.chunk_bytes, self.keep, self.grace_s = chunk_bytes, keep, grace_s
        self._versions: set[int] | None = None  # live versions in Redis (found once by SCAN)

    def load(self, variables: Any, version: int) -> Published:
        """Store `variables` as weight `version`; return where it lies."""
        _check(version, self.keep)
        data, dtypes = serialise(variables)
        digest = hashlib.sha256(data).hexdigest()
        manifest_key = self.keys.weights_blob(version)
        chunks = [data[i:i + self.chunk_bytes] for i in range(0, len(data), self.chunk_bytes)] or [b""]
        live = self._live() | {version}
        stale = sorted(live)[:-self.keep]
        previous = int(self.r.hget(manifest_key, "chunks") or 0)  # a version published again
        with self.r.pipeline(transaction=True) as pipe:
            pipe.delete(manifest_key, *(f"{manifest_key}:{i}" for i in range(max(previous, len(chunks)))))
            for i, chunk in enumerate(chunks):
                pipe.set(f"{manifest_key}:{i}", chunk)
            pipe.hset(manifest_key, mapping={
                "version": version, "chunks": len(chunks), "size": len(data), "digest": digest,
                "format": FORMAT, "dtypes": json.dumps(dtypes, sort_keys=True)})
            for old in stale:
                self._expire(pipe, old)
            pipe.execute()
        self._versions = live - set(stale)
        log.info("published weights version %d to Redis (%d bytes, %d chunks)", version, len(data), len(chunks))
        return Published(f"redis:{manifest_key}", digest, len(data))

    def _live(self) -> set[int]:
        if self._versions is None:
            pattern = re.compile(re.escape(self.keys.prefix) + r"weights:(\d+):blob")
            found = set()
            for key in self.r.scan_iter(match=self.keys.prefix + "weights:*:blob", count=500):
                m = pattern.fullmatch(key.decode() if isinstance(key, bytes) else key)
                if m:
                    found.add(int(m.group(1)))
            self._versions = found
        return set(self._versions)

    def _expire(self, pipe: Any, version: int) -> None:
        manifest_key = self.keys.weights_blob(version)
        count = self.r.hget(manifest_key, "chunks")
        names = [manifest_key, *(f"{manifest_key}:{i}" for i in range(int(count or 0)))]
        if self.grace_s == 0:
            pipe.delete(*names)
        else:
            for name in names:
                pipe.pexpire(name, max(1, int(self.grace_s * 1000)))


class DirectoryPublisher:
    """Weights as `<path>/v<version>.safetensors` with a sha256 sidecar (module docstring)."""

    def __init__(self, path: str | os.PathLike[str], *, keep: int = 2) -> None:
        _check(0, keep)
        self.path, self.keep = Path(path).resolve(), keep

    def file(self, version: int) -> Path:
        return self.path / f"v{version}.safetensors"

    def load(self, variables: Any, version: int) -> Published:
        """Write `variables` as weight `version`; return where it lies."""
        _check(version, self.keep)
        data, _ = serialise(variables)
        digest = hashlib.sha256(data).hexdigest()
        self.path.mkdir(parents=True, exist_ok=True)
        target = self.file(version)
        _atomic_write(Path(f"{target}.sha256"), f"{digest} {len(data)}\n".encode())
        _atomic_write(target, data)
        self._prune()
        log.info("published weights version %d to %s (%d bytes)", version, target, len(data))
        return Published(f"file://{target}", digest, len(data))

    def _prune(self) -> None:
        versions = sorted(int(m.group(1)) for p in self.path.iterdir()
                          if (m := re.fullmatch(r"v(\d+)\.safetensors", p.name)))
        for old in versions[:-self.keep]:
            for p in (self.file(old), Path(f"{self.file(old)}.sha256")):
                p.unlink(missing_ok=True)


def _atomic_write(target: Path, data: bytes) -> None:
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
