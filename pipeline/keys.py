"""Every Redis key, stream and consumer-group name of a run, in one place.

All keys of a run share the prefix `rs:{<namespace>}:`. The braces are a Redis Cluster hash
tag: every key of a run hashes to one slot, so a MULTI/EXEC over several of them (an
admission transition) also works on a cluster. `pattern` covers them all, for ACL rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

WORK_GROUP = "rollout"
"""Consumer group of the rollout consumers on the shared work stream."""
ADMISSION_GROUP = "admission"
"""Consumer group of the admission consumers on `tasks:{shard}`, `results:{shard}`, `weights`."""
TRAINER_GROUP = "trainer"
"""Consumer group of the trainer ranks on `ready:{shard}`."""


STATE_CONFIG = b"config"
"""Field of `Keys.state` holding the scheduler config the shard's state was built under
(JSON, sorted keys): the run's, which the trainer checks its own against at start."""


def admission_group(shard: int) -> str:
    """The group shard `shard`'s admission consumer reads its inputs through: the same name on
    `tasks:{shard}`, `results:{shard}` and the shared `weights` stream (one group per shard
    there, so every shard sees every published version), so one XREADGROUP reads all three."""
    return f"{ADMISSION_GROUP}:{_index('shard', shard)}"

_NAMESPACE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _index(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be an int >= 0, got {value!r}")
    return value


@dataclass(frozen=True)
class Keys:
    """The names of one run's keys: `Keys("exp1").results(0) == "rs:{exp1}:results:0"`."""

    namespace: str

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, str) or not _NAMESPACE.fullmatch(self.namespace):
            raise ValueError(
                f"namespace must be 1-64 characters of [A-Za-z0-9_.-], got {self.namespace!r}"
            )

    @property
    def prefix(self) -> str:
        return f"rs:{{{self.namespace}}}:"

    @property
    def pattern(self) -> str:
        """Glob of every key of the run (an ACL key pattern: `~rs:{ns}:*`)."""
        return self.prefix + "*"

    def _sharded(self, name: str, shard: int) -> str:
        return f"{self.prefix}{name}:{_index('shard', shard)}"

    # streams of one shard (one trainer rank and its admission consumer)
    def tasks(self, shard: int) -> str:
        """Registrations, handovers and epoch opens from the trainer."""
        return self._sharded("tasks", shard)

    def results(self, shard: int) -> str:
        """Finished rollouts from the rollout consumers."""
        return self._sharded("results", shard)

    def ready(self, shard: int) -> str:
        """Packed steps for the trainer."""
        return self._sharded("ready", shard)

    def records(self, shard: int) -> str:
        """One SchedulerRecord per trainer step."""
        return self._sharded("records", shard)

    def state(self, shard: int) -> str:
        """Hash: the admission consumer's persisted scheduler state (`snapshot`: the msgpack
        scheduler snapshot; `config`: the scheduler config it was built under)."""
        return self._sharded("state", shard)

    def fence(self, shard: int) -> str:
        """Counter: the fencing token of shard `shard`'s admission consumer. Each consumer that
        takes the shard over increments it; a transaction commits only while the token is
        still the one its consumer took (`consumers.fence`)."""
        return self._sharded("fence", shard)

    def lease(self, shard: int) -> str:
        """String with a TTL: who holds shard `shard`'s admission (renewed while it runs)."""
        return self._sharded("lease", shard)

    def epoch(self, shard: int) -> str:
        """Counter: the last epoch the trainer of `shard` opened (epochs only grow)."""
        return self._sharded("epoch", shard)

    def journal(self, shard: int) -> str:
        """Stream: the events the admission consumer applied since its last snapshot."""
        return self._sharded("journal", shard)

    def held(self, shard: int) -> str:
        """Hash: admitted result payloads awaiting their step, by `epoch:group:sample:attempt`."""
        return self._sharded("held", shard)

    def cancelled(self, shard: int) -> str:
        """Sorted set: attempts cancelled (`epoch:group:sample:attempt`, scored by the time of
        the cancel), checked by rollout consumers before they start work."""
        return self._sharded("cancelled", shard)

    # streams shared by the run
    @property
    def work(self) -> str:
        """The one work stream every rollout consumer reads (group `WORK_GROUP`)."""
        return self.prefix + "work"

    @property
    def control(self) -> str:
        """Cancel messages, broadcast to every rollout consumer."""
        return self.prefix + "control"

    @property
    def weights(self) -> str:
        """Published weight versions."""
        return self.prefix + "weights"

    @property
    def dead(self) -> str:
        """Dead letters: entries that could not be decoded, with the reason."""
        return self.prefix + "dead"

    # plain keys
    @property
    def served_version(self) -> str:
        """String: the weight version the engines serve now."""
        return self.prefix + "served_version"

    def weights_blob(self, version: int) -> str:
        """Key (and prefix of the chunk keys) of the bytes of weight `version`."""
        return f"{self.prefix}weights:{_index('version', version)}:blob"

    def consumer_heartbeat(self, name: str) -> str:
        """String with a TTL: a rollout consumer's liveness."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"consumer name must be a non-empty str, got {name!r}")
        return f"{self.prefix}consumer:{name}:heartbeat"

    def all_streams(self, shards: int) -> list[str]:
        """Every stream of a run with `shards` trainer ranks (for status and trimming)."""
        per_shard = [
            key(shard)
            for shard in range(_index("shards", shards))
            for key in (self.tasks, self.results, self.ready, self.records)
        ]
        return [self.work, self.control, self.weights, self.dead, *per_shard]
