"""`LocalRun`: a whole run as local processes, from one `RunConfig`.

    run = LocalRun(config, Path("runs/x"), ranks=2, consumers=2)
    run.start()                  # admission per shard, rollout consumers, trainer ranks
    run.wait_trainer(600)        # the exit code of each trainer process
    run.stop()

The production layout on one machine, for tests, `rollstream chaos` and trying things out:
every process is `python -m rollstream.cli <role> --config FILE` with its config written
under the folder. Admission consumer *i* serves shard *i* with the run's `scheduler`
section; the rollout consumers run a `PolicySource` over the run's `data.env` with the
trainer's model config and the run's publisher as their weights source; the trainer ranks
are started with the launcher's environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
`MASTER_PORT`; one process per rank, as the chart's pods), or under `torchrun` with
`launcher="torchrun"`. Each process logs to
`<folder>/<role>.log`.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeline.config import AdmissionConfig, ConsumerConfig, build
from pipeline.processes import Process, free_port
from trainer.run_config import RunConfig

class LocalRun:
    """The processes of one run (module docstring)."""

    def __init__(self, config: RunConfig, folder: Path, *, ranks: int = 1, consumers: int = 2,
                 slots: int = 8, max_new_tokens: int = 1, launcher: str = "env",
                 admission: Mapping[str, Any] | None = None,
                 consumer: Mapping[str, Any] | None = None,
                 source: str = "consumers.sources.policy:PolicySource",
                 source_args: Mapping[str, Any] | None = None) -> None:
        if launcher not in ("env", "torchrun"):
            raise ValueError(f"launcher must be env or torchrun, got {launcher!r}")
        self.config, self.folder, self.ranks = config, Path(folder), ranks
        self.folder.mkdir(parents=True, exist_ok=True)
        self.launcher = launcher
        self.shards = ranks // config.share
        redis = config.redis.model_dump(mode="json")
        self.admission_file = self._write("admission", AdmissionConfig, {
            "redis": redis, "scheduler": config.scheduler.model_dump(mode="json"),
            "block_ms": 100, "lease_s": 10.0, "metrics_addr": "127.0.0.1:0", **(admission or {})})
        weights: dict[str, Any] = ({"directory": config.publisher.path}
                                   if config.publisher.kind == "directory" else {"redis": redis})
        model = config.trainer.model
        if model.kind == "tiny":
            model_config: Any = model.tiny.model_dump()
        elif model.path:
            model_config = model.path
        else:
            raise ValueError("LocalRun's PolicySource consumers run the tiny model or a model directory "
                             "(trainer.model.path)")
        args = {"env": config.data.env, "env_args": dict(config.data.env_args),
                "model_config": model_config, "temperature": config.objective.temperature,
                "max_new_tokens": max_new_tokens, "weights": weights, "seed": config.trainer.seed}
        self.consumer_file = self._write("consumer", ConsumerConfig, {
            "redis": redis, "slots": slots, "block_ms": 100, "lease_s": 10.0, "grace_s": 5.0,
            "metrics_addr": "127.0.0.1:0", "source": source,
            "source_args": dict(source_args) if source_args is not None else args, **(consumer or {})})
        self.trainer_file = self.folder / "trainer.json"
        self.trainer_file.write_text(json.dumps(config.model_dump(mode="json"), indent=1))
        self.n_consumers = consumers
        self.admissions: dict[int, Process] = {}
        self.consumers: dict[int, Process] = {}
        self.trainers: list[Process] = []
        self.restarts: dict[str, int] = {}

    def _write(self, name: str, model: Any, data: dict[str, Any]) -> Path:
        path = self.folder / f"{name}.json"
        path.write_text(json.dumps(build(model, data).model_dump(mode="json"), indent=1))
        return path

    def _cli(self, role: str, config: Path, *extra: str, log: str | None = None,
             env: Mapping[str, str] | None = None) -> Process:
        name = log or role
        n = self.restarts.get(name, 0)
        self.restarts[name] = n + 1
        return Process(role, [sys.executable, "-m", "rollstream.cli", "--log-level", "INFO", role,
                              "--config", str(config), *extra],
                       self.folder / f"{name}.log", env=env)

    # ------------------------------------------------------------------ roles

    def start_admission(self, shard: int) -> Process:
        self.admissions[shard] = self._cli("admission", self.admission_file, "--shard", str(shard),
                                           log=f"admission-{shard}")
        return self.admissions[shard]

    def start_consumer(self, i: int) -> Process:
        self.consumers[i] = self._cli("consumer", self.consumer_file, log=f"consumer-{i}")
        return self.consumers[i]

    def start_trainer(self, *extra: str) -> list[Process]:
        """The trainer ranks: one process per rank with the launcher's environment set
        (as the chart's StatefulSet does), or one `torchrun` starting them all."""
        env = {"OMP_NUM_THREADS": "1"}
        port = str(free_port())
        if self.launcher == "torchrun":
            args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                    "--nproc_per_node", str(self.ranks), "--master_addr", "127.0.0.1",
                    "--master_port", port, "-m", "rollstream.cli", "--log-level", "INFO",
                    "trainer", "--config", str(self.trainer_file), *extra]
            self.trainers = [Process("trainer", args, self.folder / "trainer.log", env=env)]
            return self.trainers
        if self.ranks == 1:
            self.trainers = [self._cli("trainer", self.trainer_file, *extra, env=env)]
            return self.trainers
        self.trainers = [
            self._cli("trainer", self.trainer_file, *extra, log=f"trainer-{rank}",
                      env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank),
                           "WORLD_SIZE": str(self.ranks), "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": port})
            for rank in range(self.ranks)]
        return self.trainers

    def start(self) -> None:
        for shard in range(self.shards):
            self.start_admission(shard)
        for i in range(self.n_consumers):
            self.start_consumer(i)
        self.start_trainer()

    def wait_trainer(self, timeout_s: float) -> list[int]:
        """The exit code of each trainer process (raises TimeoutExpired past `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        return [p.wait(max(0.1, deadline - time.monotonic())) for p in self.trainers]

    def processes(self) -> list[Process]:
        return [*self.admissions.values(), *self.consumers.values(), *self.trainers]

    def stop(self) -> dict[str, int]:
        """SIGTERM every process still running; their exit codes by log name."""
        codes = {}
        for p in self.processes():
            codes[p.log.stem] = p.stop() if p.alive else p.popen.returncode
        return codes

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"--- {p.log.name}\n{p.output()[-tail:]}" for p in self.processes())
