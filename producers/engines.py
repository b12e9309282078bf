"""Publishers for external inference engines: write the version to a shared volume, then
tell every engine to load it over HTTP.

    publisher = SGLangPublisher(["http://sglang-0:30000", "http://sglang-1:30000"], "/shared/weights",
                                gateways=["http://gateway:8000"])
    publisher = VLLMPublisher(["http://vllm-0:8000"], "/shared/weights", layout="hf")
    RolloutScheduler(objective, None, publisher, redis=..., ...)   # a `Publisher`

`load(variables, version)` writes the weights (`layout="file"`: `<path>/v<version>.safetensors`
with a sha256 sidecar, as `DirectoryPublisher` does; `layout="hf"`: a Hugging Face
checkpoint directory `<path>/v<version>/` through the model's `save_pretrained`, which is
what SGLang and vLLM load), then POSTs to each engine in turn:

| publisher | endpoint | body |
|---|---|---|
| `SGLangPublisher` | `/update_weights_from_disk` | `{"model_path": PATH, "weight_version": "V"}`; the answer must say `"success": true` |
| `VLLMPublisher` | `/collective_rpc` (vLLM's dev-mode server, `VLLM_SERVER_DEV_MODE=1`) | `{"method": "reload_weights", "kwargs": {"weights_path": PATH, "weight_version": "V"}}` (`method` and extra `kwargs` are configurable: vLLM's reload arguments vary by version) |

`rollstream engine` serves both endpoints, so either publisher can drive it. A connection
error, a timeout (`timeout_s` per request) or a 5xx is retried `retries` times with
exponential backoff from `backoff_s`; a 4xx, a refused load, or the last failure raises
`EnginePushError` naming the engine (the trainer's push fails, on every rank, as a failed
publish must). After all engines loaded the version, each gateway in `gateways` is told
(`POST /weight_version`) so that the calls of engines that do not stamp versions in their
answers (vLLM) are credited with it. `load` returns `Published(location, digest, size)`
for the weights announcement.
"""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
from torch import nn

from producers.publishers import DirectoryPublisher, Published

log = logging.getLogger(__name__)


class EnginePushError(RuntimeError):
    """An engine did not load a published version."""


class EnginePublisher:
    """Write a version to `path`, then POST `endpoint` to each of `engines` (module docstring)."""

    endpoint = ""

    def __init__(self, engines: Sequence[str], path: str | Path, *, layout: str = "file", keep: int = 2,
                 timeout_s: float = 300.0, retries: int = 3, backoff_s: float = 0.5,
                 gateways: Sequence[str] = ()) -> None:
        if isinstance(engines, str) or not engines:
            raise ValueError("engines: give a list of at least one engine URL")
        if layout not in ("file", "hf"):
            raise ValueError(f"layout must be file or hf, got {layout!r}")
        if retries < 0 or backoff_s < 0 or timeout_s <= 0:
            raise ValueError("need retries >= 0, backoff_s >= 0 and timeout_s > 0")
        self.engines = [e.rstrip("/") for e in engines]
        self.gateways = [g.rstrip("/") for g in gateways]
        self.path, self.layout, self.keep = Path(path).resolve(), layout, keep
        self.files = DirectoryPublisher(self.path, keep=keep)
        self.retries, self.backoff_s = retries, backoff_s
        self.http = httpx.Client(timeout=timeout_s)
        self.pushes = 0

    def body(self, path: str, version: int) -> dict[str, Any]:
        raise NotImplementedError

    def check(self, engine: str, answer: Any) -> None:
        """Raise `EnginePushError` when a 2xx answer still says the load failed."""

    # ------------------------------------------------------------------ Publisher

    def load(self, variables: Any, version: int) -> Published:
        published, path = self._write(variables, version)
        for engine in self.engines:
            self._push(engine, path, version)
        for gateway in self.gateways:
            for engine in self.engines:
                self._post(gateway, "/weight_version", {"engine": engine, "version": version})
        self.pushes += 1
        log.info("weights version %d loaded by %d engine(s) from %s", version, len(self.engines), path)
        return published

    def _write(self, variables: Any, version: int) -> tuple[Published, str]:
        if self.layout == "file":
            published = self.files.load(variables, version)
            return published, str(self.files.file(version))
        module = getattr(variables, "module", variables)
        if not isinstance(module, nn.Module) or not callable(getattr(module, "save_pretrained", None)):
            raise TypeError("layout='hf' needs a Hugging Face model (with save_pretrained)")
        target = self.path / f"v{version}"
        tmp = self.path / f".v{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        module.save_pretrained(tmp, safe_serialization=True)
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        data = b"".join(p.read_bytes() for p in sorted(target.glob("*.safetensors")))
        self._prune()
        return Published(f"file://{target}", hashlib.sha256(data).hexdigest(), len(data)), str(target)

    def _prune(self) -> None:
        versions = sorted(int(m.group(1)) for p in self.path.iterdir()
                          if p.is_dir() and (m := re.fullmatch(r"v(\d+)", p.name)))
        for old in versions[:-self.keep]:
            shutil.rmtree(self.path / f"v{old}", ignore_errors=True)

    def _push(self, engine: str, path: str, version: int) -> None:
        answer = self._post(engine, self.endpoint, self.body(path, version))
        self.check(engine, answer)

    def _post(self, base: str, endpoint: str, body: Mapping[str, Any]) -> Any:
        """POST with retries on connection errors, timeouts and 5xx; the JSON answer."""
        url = f"{base}{endpoint}"
        for attempt in range(self.retries + 1):
            try:
                resp = self.http.post(url, json=dict(body))
            except httpx.TransportError as exc:
                failure = f"{type(exc).__name__}: {exc}"
            else:
                if resp.status_code < 400:
                    return resp.json() if resp.content else None
                if resp.status_code < 500:
                    raise EnginePushError(f"{url} refused the weights ({resp.status_code}): {resp.text[:1000]}")
                failure = f"{resp.status_code}: {resp.text[:500]}"
            if attempt == self.retries:
                raise EnginePushError(f"{url} failed {self.retries + 1} time(s); last: {failure}")
            delay = self.backoff_s * 2 ** attempt
            log.warning("%s failed (%s); retry %d/%d in %.2fs", url, failure, attempt + 1, self.retries, delay)
            time.sleep(delay)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.http.close()


class SGLangPublisher(EnginePublisher):
    """SGLang's `/update_weights_from_disk` (module docstring)."""

    endpoint = "/update_weights_from_disk"

    def __init__(self, engines: Sequence[str], path: str | Path, *, load_format: str | None = None,
                 **options: Any) -> None:
        super().__init__(engines, path, **options)
        self.load_format = load_format

    def body(self, path: str, version: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model_path": path, "weight_version": str(version)}
        if self.load_format is not None:
            body["load_format"] = self.load_format
        return body

    def check(self, engine: str, answer: Any) -> None:
        if not isinstance(answer, Mapping) or answer.get("success") is not True:
            raise EnginePushError(f"{engine}{self.endpoint} did not load the weights: {answer!r}")


class VLLMPublisher(EnginePublisher):
    """vLLM's dev-mode `/collective_rpc` with `reload_weights` (module docstring)."""

    endpoint = "/collective_rpc"

    def __init__(self, engines: Sequence[str], path: str | Path, *, method: str = "reload_weights",
                 kwargs: Mapping[str, Any] | None = None, **options: Any) -> None:
        super().__init__(engines, path, **options)
        self.method, self.kwargs = method, dict(kwargs or {})

    def body(self, path: str, version: int) -> dict[str, Any]:
        return {"method": self.method,
                "kwargs": {**self.kwargs, "weights_path": path, "weight_version": str(version)}}
