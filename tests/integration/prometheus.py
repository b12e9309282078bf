"""A real Prometheus server (Debian's `prometheus` package) for integration tests: it
scrapes the given targets every second and answers PromQL over its HTTP API."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """`with Prometheus(tmp_path, ["127.0.0.1:9400", ...]) as prom: prom.query("up")`."""

    BINARY = "prometheus"

    def __init__(self, directory: Path, targets: list[str]) -> None:
        self.dir = Path(directory)
        self.targets = targets
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @classmethod
    def available(cls) -> bool:
        return shutil.which(cls.BINARY) is not None

    def __enter__(self) -> Prometheus:
        config = self.dir / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "rollstream",
                                "static_configs": [{"targets": self.targets}]}],
        }))
        self.log = open(self.dir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [self.BINARY, f"--config.file={config}", f"--storage.tsdb.path={self.dir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self._wait(lambda: self._get("/-/ready") is not None, 30, "Prometheus to start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def _get(self, path: str) -> bytes | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.read()
        except OSError:
            return None

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(self.dir / 'prometheus.log').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s}s for {what}")
            time.sleep(0.2)

    def query(self, expr: str) -> list[dict]:
        """The instant-vector result of `expr` (empty when there is no data)."""
        body = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        if body is None:
            raise RuntimeError(f"query failed: {expr}")
        reply = json.loads(body)
        if reply.get("status") != "success":
            raise RuntimeError(f"query {expr!r}: {reply}")
        return reply["data"]["result"]

    def wait_scraped(self, timeout_s: float = 30) -> None:
        """Until every target has been scraped successfully at least once."""
        def all_up() -> bool:
            up = self.query('up{job="rollstream"}')
            return len(up) == len(self.targets) and all(s["value"][1] == "1" for s in up)
        self._wait(all_up, timeout_s, "every target to be scraped")
