"""Publishers for external inference engines: write the version to a shared volume, then
have every engine load it over HTTP.

    publisher = VLLMPublisher(["http://vllm-0:8000"], "/shared/weights", gateways=["http://gateway:8000"])
    publisher = SGLangPublisher(["http://sglang-0:30000"], "/shared/weights", layout="hf")
    publisher.preflight()                       # at start: the engines are set up as a run needs
    RolloutScheduler(objective, None, publisher, redis=..., ...)   # a `Publisher`

`load(variables, version)` writes the weights, then pushes them to each engine in turn, and
returns `Published(location, digest, size)` for the weights announcement. Each gateway in
`gateways` (`consumers.gateway`) holds new calls to an engine during its push (`POST
/engines/hold`) and is told the version the engine then serves (`POST /weight_version`, or
`POST /engines/release` when the push failed), so the calls of engines that stamp no version
on their answers (vLLM) are credited with the weights that served them.

Layouts: `layout="hf"` writes a Hugging Face checkpoint directory `<path>/v<version>/`:
safetensors under the model's own parameter names, every name of its state dict (a tied
weight under each of its names: `save_pretrained` drops a tied `lm_head.weight`, and vLLM
0.32's in-place reload then keeps its old output head), sharded past `max_shard_bytes` with a
`model.safetensors.index.json`, and the model's `config.json` (from the module's config, or
copied with the tokenizer files from `base`, a model directory, when `variables` is a state
dict: what a ZeRO-3 push hands over). `layout="file"` writes `<path>/v<version>.safetensors`
with a sha256 sidecar, as `DirectoryPublisher` does; `rollstream engine` and SGLang load
either, vLLM only a directory (`VLLMPublisher` refuses `file`).

| publisher | a push, per engine |
|---|---|
| `VLLMPublisher` | `POST /pause?mode=wait` (requests in flight finish under the old weights; new ones queue), `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`, `POST /reset_prefix_cache` (no KV computed with the old weights is reused), `POST /update_weight_version {"new_version": "V"}`, `POST /resume` (also after a failed reload) |
| `SGLangPublisher` | `POST /update_weights_from_disk {"model_path": PATH, "weight_version": "V"}`: SGLang holds new requests, waits for those in flight, loads, flushes its cache and stamps the version itself; the answer must say `"success": true` |

vLLM's server exposes those routes with `VLLM_SERVER_DEV_MODE=1` (checked on vLLM 0.32);
`preflight()` refuses a server without them, or one whose `--logprobs-mode` is not
`processed_logprobs` (its log-probs would ignore the sampling temperature). A server without
`/pause` (older vLLM) gets the reload and the cache reset alone, with a warning; its
`/version` is logged at the first push.

Failures: a connection error, a timeout (`timeout_s` per request) or a 502/503/504 is
retried `retries` times with exponential backoff from `backoff_s`; any other answer of 400
or more (a 500 is vLLM's answer to a reload that raised: a missing directory, unknown
arguments) is a refusal, raised at once as `EnginePushError` naming the engine and the
engine's message, as is the last failure (the trainer's push fails on every rank).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import save_file

from pipeline.errors import CommandError
from producers.publishers import DirectoryPublisher, Published, state_dict

log = logging.getLogger(__name__)

RETRIED = (502, 503, 504)
SHARD_BYTES = 5 << 30
INDEX = "model.safetensors.index.json"
CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt")


class EnginePushError(CommandError):
    """An engine did not load a published version, or is not set up for a run (`status`: the
    HTTP status that refused it); the trainer stops with it in one line."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


# ----------------------------------------------------------------------------- checkpoint directories


def shards(tensors: Mapping[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """`tensors` in order, cut into groups of at most `max_bytes` (a bigger tensor alone)."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += nbytes
    return groups


def write_hf_dir(target: Path, variables: Any, *, base: str | Path | None = None,
                 max_shard_bytes: int = SHARD_BYTES) -> Published:
    """Write `variables` as a Hugging Face checkpoint directory at `target` (module
    docstring), atomically (a temporary directory renamed); returns where it lies and the
    sha256 of its weight files' bytes in name order."""
    config = getattr(getattr(variables, "module", variables), "config", None)
    if not callable(getattr(config, "save_pretrained", None)):
        config = None
        if base is None or not (Path(base) / "config.json").exists():
            raise TypeError("layout='hf' needs a Hugging Face model (with a config) or base=<model directory>")
    tensors = state_dict(variables)
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if base is not None:
        for name in CONFIG_FILES:
            if (Path(base) / name).exists():
                shutil.copy2(Path(base) / name, tmp / name)
    if config is not None:
        config.save_pretrained(tmp)
    groups = shards(tensors, max_shard_bytes)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    for name, group in zip(names, groups, strict=True):
        save_file(group, str(tmp / name), metadata={"format": "pt"})
    if len(groups) > 1:
        weight_map = {t: name for name, group in zip(names, groups, strict=True) for t in group}
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    digest, size = hashlib.sha256(), 0
    for name in names:
        data = (tmp / name).read_bytes()
        digest.update(data)
        size += len(data)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return Published(f"file://{target}", digest.hexdigest(), size)


# ----------------------------------------------------------------------------- publishers


class EnginePublisher:
    """Write a version to `path`, then push it to each of `engines` (module docstring)."""

    def __init__(self, engines: Sequence[str], path: str | Path, *, layout: str = "hf", keep: int = 2,
                 timeout_s: float = 300.0, retries: int = 3, backoff_s: float = 0.5,
                 gateways: Sequence[str] = (), base: str | Path | None = None,
                 max_shard_bytes: int = SHARD_BYTES) -> None:
        if isinstance(engines, str) or not engines:
            raise ValueError("engines: give a list of at least one engine URL")
        if layout not in ("file", "hf"):
            raise ValueError(f"layout must be file or hf, got {layout!r}")
        if retries < 0 or backoff_s < 0 or timeout_s <= 0 or max_shard_bytes < 1:
            raise ValueError("need retries >= 0, backoff_s >= 0, timeout_s > 0 and max_shard_bytes >= 1")
        self.engines = [e.rstrip("/") for e in engines]
        self.gateways = [g.rstrip("/") for g in gateways]
        self.path, self.layout, self.keep = Path(path).resolve(), layout, keep
        self.base, self.max_shard_bytes = base, max_shard_bytes
        self.files = DirectoryPublisher(self.path, keep=keep)
        self.retries, self.backoff_s = retries, backoff_s
        self.http = httpx.Client(timeout=timeout_s)
        self.pushes = 0
        self.seconds: list[float] = []  # the seconds of each push to every engine (not the write)

    def push(self, engine: str, path: str, version: int) -> None:
        """Make `engine` serve the weights at `path` as `version`."""
        raise NotImplementedError

    def preflight(self) -> None:
        """Check that each engine is set up as a run needs (raise `EnginePushError` if not)."""

    # ------------------------------------------------------------------ Publisher

    def load(self, variables: Any, version: int) -> Published:
        published, path = self._write(variables, version)
        start = time.monotonic()
        for engine in self.engines:
            self._tell("/engines/hold", {"engine": engine})
            try:
                self.push(engine, path, version)
            except BaseException:
                self._tell("/engines/release", {"engine": engine})
                raise
            self._tell("/weight_version", {"engine": engine, "version": version})
        self.seconds.append(time.monotonic() - start)
        self.pushes += 1
        log.info("weights version %d loaded by %d engine(s) from %s in %.2fs", version, len(self.engines),
                 path, self.seconds[-1])
        return published

    def _write(self, variables: Any, version: int) -> tuple[Published, str]:
        if self.layout == "file":
            published = self.files.load(variables, version)
            return published, str(self.files.file(version))
        self.path.mkdir(parents=True, exist_ok=True)
        target = self.path / f"v{version}"
        published = write_hf_dir(target, variables, base=self.base, max_shard_bytes=self.max_shard_bytes)
        self._prune()
        return published, str(target)

    def _prune(self) -> None:
        versions = sorted(int(m.group(1)) for p in self.path.iterdir()
                          if p.is_dir() and (m := re.fullmatch(r"v(\d+)", p.name)))
        for old in versions[:-self.keep]:
            shutil.rmtree(self.path / f"v{old}", ignore_errors=True)

    # ------------------------------------------------------------------ HTTP

    def _tell(self, endpoint: str, body: Mapping[str, Any]) -> None:
        for gateway in self.gateways:
            self.post(gateway, endpoint, body)

    def post(self, base: str, endpoint: str, body: Mapping[str, Any] | None = None,
             params: Mapping[str, str] | None = None) -> Any:
        """POST, retrying connection errors, timeouts and 502/503/504; the JSON answer (None
        when empty). Any other status >= 400 raises `EnginePushError` at once."""
        return self._send("POST", base, endpoint, body, params)

    def get(self, base: str, endpoint: str) -> Any:
        return self._send("GET", base, endpoint, None, None)

    def _send(self, method: str, base: str, endpoint: str, body: Mapping[str, Any] | None,
              params: Mapping[str, str] | None) -> Any:
        url = f"{base}{endpoint}"
        for attempt, delay in enumerate(self._delays()):
            try:
                resp = self.http.request(method, url, json=None if body is None else dict(body), params=params)
            except httpx.TransportError as exc:
                failure = f"{type(exc).__name__}: {exc}"
            else:
                if resp.status_code < 400:
                    return _json(resp)
                if resp.status_code not in RETRIED:
                    raise EnginePushError(f"{url} refused ({resp.status_code}): {_message(resp)}", resp.status_code)
                failure = f"{resp.status_code}: {resp.text[:500]}"
            if delay is None:
                raise EnginePushError(f"{url} failed {attempt + 1} time(s); last: {failure}")
            log.warning("%s failed (%s); retry %d/%d in %.2fs", url, failure, attempt + 1, self.retries, delay)
            time.sleep(delay)
        raise AssertionError("unreachable")

    def _delays(self) -> Iterator[float | None]:
        for attempt in range(self.retries):
            yield self.backoff_s * 2 ** attempt
        yield None

    def close(self) -> None:
        self.http.close()


def _json(resp: httpx.Response) -> Any:
    if not resp.content:
        return None
    try:
        return resp.json()
    except ValueError:
        return resp.text


def _message(resp: httpx.Response) -> str:
    """The engine's error message (vLLM and OpenAI `{"error": {"message"}}`, FastAPI
    `{"detail"}`, SGLang `{"message"}`), else the body's start."""
    body = _json(resp)
    if isinstance(body, Mapping):
        error = body.get("error")
        if isinstance(error, Mapping) and error.get("message"):
            return str(error["message"])
        for key in ("detail", "message", "error"):
            if body.get(key):
                return str(body[key])
    return resp.text[:1000]


class SGLangPublisher(EnginePublisher):
    """SGLang's `/update_weights_from_disk` (module docstring)."""

    def __init__(self, engines: Sequence[str], path: str | Path, *, load_format: str | None = None,
                 **options: Any) -> None:
        super().__init__(engines, path, **options)
        self.load_format = load_format

    def push(self, engine: str, path: str, version: int) -> None:
        body: dict[str, Any] = {"model_path": path, "weight_version": str(version)}
        if self.load_format is not None:
            body["load_format"] = self.load_format
        answer = self.post(engine, "/update_weights_from_disk", body)
        if not isinstance(answer, Mapping) or answer.get("success") is not True:
            raise EnginePushError(f"{engine}/update_weights_from_disk did not load the weights: {answer!r}")


PAUSE_MODES = ("wait", "keep", "abort")


class VLLMPublisher(EnginePublisher):
    """vLLM's pause, `reload_weights`, cache reset, version and resume (module docstring).

    `pause_mode`: `wait` (default: requests in flight finish under the old weights),
    `abort` (they are aborted: the gateway records them as failed calls), or `keep` (they
    are frozen and continue under the new weights with the KV of the old: a call then
    spans two versions and is credited with the older). `kwargs` are extra `reload_weights`
    arguments (`is_checkpoint_format`, ...)."""

    def __init__(self, engines: Sequence[str], path: str | Path, *, pause_mode: str = "wait",
                 kwargs: Mapping[str, Any] | None = None, **options: Any) -> None:
        if options.get("layout", "hf") != "hf":
            raise ValueError("vLLM reloads a Hugging Face directory: VLLMPublisher needs layout='hf'")
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        super().__init__(engines, path, **options)
        self.pause_mode, self.kwargs = pause_mode, dict(kwargs or {})
        self.pausable: dict[str, bool] = {}  # per engine, found at its first push

    def preflight(self) -> None:
        for engine in self.engines:
            try:
                info = self.get(engine, "/server_info?config_format=json")
            except EnginePushError as exc:
                if exc.status == 404:
                    raise EnginePushError(f"{engine} has no /server_info: start vLLM with VLLM_SERVER_DEV_MODE=1 "
                                          "(its weight-update routes need it too)") from exc
                raise
            mode = ((info or {}).get("vllm_config") or {}).get("model_config", {}).get("logprobs_mode")
            if mode != "processed_logprobs":
                raise EnginePushError(
                    f"{engine} runs with --logprobs-mode {mode}: its log-probs ignore the sampling temperature "
                    "(and top-k/top-p); start it with --logprobs-mode processed_logprobs")
            log.info("%s: vLLM %s", engine, (self.get(engine, "/version") or {}).get("version"))

    def push(self, engine: str, path: str, version: int) -> None:
        try:
            paused = self._pause(engine)
            self.post(engine, "/collective_rpc",
                      {"method": "reload_weights", "kwargs": {**self.kwargs, "weights_path": path}})
            answer = self.post(engine, "/reset_prefix_cache")
            if isinstance(answer, Mapping) and answer.get("success") is False:
                raise EnginePushError(f"{engine}/reset_prefix_cache did not reset the cache (blocks still held)")
            if paused:
                self.post(engine, "/update_weight_version", {"new_version": str(version)})
        finally:  # also after a failed reload, or a pause that timed out while draining
            if self.pausable.get(engine, True):
                self.post(engine, "/resume")

    def _pause(self, engine: str) -> bool:
        """Pause `engine`; False for a server without `/pause` (found at its first push)."""
        if self.pausable.get(engine) is False:
            return False
        try:
            self.post(engine, "/pause", params={"mode": self.pause_mode})
        except EnginePushError as exc:
            if exc.status != 404 or engine in self.pausable:
                raise
            version = (self.get(engine, "/version") or {}).get("version")
            log.warning("%s (vLLM %s) has no /pause: its pushes reload and reset the cache with requests "
                        "in flight (start it with VLLM_SERVER_DEV_MODE=1 on vLLM >= 0.32)", engine, version)
            self.pausable[engine] = False
            return False
        self.pausable[engine] = True
        return True
