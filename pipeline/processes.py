"""Child processes of the local tools (`rollstream.local.LocalRun`, `rollstream chaos`,
`rollstream bench schedule`, the tests): `Process` runs one with its output in a log file,
in a session of its own (so `kill` reaches a launcher and its workers); `free_port` picks a
port below the kernel's ephemeral range. Standard library only.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port(low: int = 20000, high: int = 32000) -> int:
    """A free TCP port below the kernel's ephemeral range (32768 and up by default), so
    the processes binding port 0 meanwhile (metrics endpoints) cannot take it first."""
    for port in random.sample(range(low, high), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}..{high}")


def child_env(env: Mapping[str, str] | None = None, *, inherit_env: bool = True) -> dict[str, str]:
    """A child's environment: this process's with `env` over it, or `env` alone with
    `inherit_env=False`; PYTHONPATH leads with the repository, so the child runs this tree."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**(os.environ if inherit_env else {}), "PYTHONPATH": path, **(env or {})}


class Process:
    """One child process; stdout and stderr go to `log`. Its environment is this process's
    with `env` over it, or `env` alone with `inherit_env=False` (PYTHONPATH always leads with
    the repository, so the child runs this tree's code); it runs in `cwd` (the repository by
    default)."""

    def __init__(self, role: str, args: list[str], log: Path, env: Mapping[str, str] | None = None, *,
                 cwd: Path | None = None, inherit_env: bool = True) -> None:
        self.role, self.args, self.log = role, args, log
        self._out = open(log, "ab")  # noqa: SIM115 (held for the process lifetime, closed in wait)
        self.popen = subprocess.Popen(args, cwd=cwd or ROOT, stdout=self._out, stderr=subprocess.STDOUT,
                                      env=child_env(env, inherit_env=inherit_env), start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            os.kill(self.pid, sig)

    def kill(self) -> int:
        """kill -9 (the whole process group: a launcher and its workers), and reap."""
        if self.alive:
            os.killpg(self.pid, signal.SIGKILL)
        return self.wait(10.0)

    def wait(self, timeout_s: float) -> int:
        code = self.popen.wait(timeout=timeout_s)
        self._out.close()
        return code

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM; kill -9 after `timeout_s`. Returns the exit code."""
        self.signal(signal.SIGTERM)
        try:
            return self.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return self.kill()

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""
