"""Every Prometheus metric of the pipeline, in one place, and the `/metrics` server.

`Metrics(registry)` holds the metric objects of one process on its own `CollectorRegistry`
(nothing is registered on prometheus_client's global default registry, so tests can build
as many as they like). Names carry the `rollstream_` prefix and base units; counters end in
`_total`; distributions that several replicas report are histograms, so they aggregate
across pods with `sum by (le) (rate(..._bucket[5m]))`.

Which process feeds what (each series has exactly one owner process, so no query
counts a step twice; the rest stay empty in a process's scrape):

- admission consumer (label `shard`): `observe_event` per scheduler event,
  `observe_actions` per list of actions, `observe_finished` per result read,
  `set_in_flight` after each transition, `observe_record` per packed step (the scheduler's
  side of the step: groups, resubmissions, lag, the session metrics), `observe_stream` per
  stream and group when it trims, `dead_letter`, `served_version`;
- rollout consumer (label `consumer`): `set_slots`, `dead_letter`;
- trainer (label `shard`: the shard the rank trains): `observe_train` per optimizer step
  (steps, updates, its own wait, step seconds, tokens per second, mean reward, the loss
  metrics), `observe_push` per weight push (the publishing rank);
- `rollstream engine` (no labels): the version it serves, whether it follows the run's
  weights and its failed attempts (`consumers.cpu_engine`, served on its own `/metrics`).

`serve(metrics, "host:port", health=..., ready=...)` runs the HTTP endpoint: `/metrics`
(Prometheus text, or OpenMetrics when the scraper asks for it), `/healthz` and `/readyz`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import platform
import socket
import threading
from bisect import bisect_left
from collections import Counter as Counts
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import metadata
from itertools import accumulate
from pathlib import Path
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.utils import floatToGoString

from pipeline.config import metrics_address
from pipeline.errors import CommandError
from pipeline.files import write_whole
from pipeline.scheduler import Cancel, Discard, SchedulerRecord, Submit
from pipeline.sessions import Status

log = logging.getLogger(__name__)

PREFIX = "rollstream_"

LAG_BUCKETS = tuple(float(b) for b in range(17))
"""Lag of admitted rollouts, in trainer updates: one bucket per update from 0 to 16."""

SESSION_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 150.0, 300.0,
    600.0, 1200.0, 1800.0, 3600.0, 7200.0, 14400.0,
)
"""Session durations: roughly log-spaced from 10 ms to 4 h."""

WAIT_BUCKETS = (
    0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
    300.0, 600.0, 1800.0, 3600.0,
)
"""Trainer waits, weight pushes: 1 ms to 1 h."""

STEP_BUCKETS = (
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
    1200.0, 3600.0,
)
"""Optimizer step durations: 50 ms to 1 h."""

TRAIN_GAUGES = {
    "loss": "trainer_loss",
    "importance_mean": "importance_weight_mean",
    "importance_max": "importance_weight_max",
    "mismatch_kl": "trainer_engine_mismatch_kl",
    "mismatch_abs": "trainer_engine_mismatch_abs",
    "mismatch_over": "trainer_engine_mismatch_over",
}
"""Keys of the trainer's loss metrics (`GRPOObjective.loss`) that have a dedicated gauge.
Every finite key of those, and of `SchedulerRecord.metrics` on the admission side, is also
exported as `rollstream_step_metric{name=...}` (the two key sets are disjoint)."""


def _version() -> str:
    try:
        return metadata.version("rollstream")
    except metadata.PackageNotFoundError:
        return "unknown"


UNLABELLED_OWNER = {
    "weights_served_version": "admission",
    "weights_published_version": "trainer",
    "weights_push_seconds": "trainer",
    "engine_weights_following": "engine",
    "engine_weights_version": "engine",
    "engine_weights_failures_total": "engine",
}
"""The process that exports each family without labels. A labelled family only shows the
series a process sets, but an unlabelled one is exported (as 0) as soon as it is
registered, so it is registered only in its owner's process."""


class BatchHistogram:
    """A labelled histogram observed a batch of values at a time, for a series fed once per
    result: prometheus_client's `Histogram` takes a lock and walks its buckets for each value
    (about 1.6 us), and has no call for several. Here a batch is bucketed with `bisect` and
    added under one lock. It is a collector on `registry` (None: on none), exposed as a
    histogram family like `Histogram`'s (`_bucket` with `le`, `_count`, `_sum`; no `_created`)."""

    def __init__(self, name: str, doc: str, labelnames: Sequence[str], buckets: Sequence[float],
                 registry: CollectorRegistry | None) -> None:
        self.name, self.doc, self.labelnames = name, doc, tuple(labelnames)
        self._bounds = [float(b) for b in buckets]
        if self._bounds != sorted(set(self._bounds)) or not all(map(math.isfinite, self._bounds)):
            raise ValueError(f"{name}: buckets must be finite and increasing, got {list(buckets)}")
        self._bounds.append(math.inf)
        self._bucket = partial(bisect_left, self._bounds)  # the first bound >= a value
        self._counts: dict[tuple[str, ...], list[int]] = {}  # by labels: each bucket's own count
        self._sums: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()
        if registry is not None:
            registry.register(self)

    def observe_many(self, labels: tuple[str, ...], values: Iterable[float | None]) -> None:
        """Observe each finite value >= 0 of `values` (None, NaN, infinities and negative
        values are left out) in the series of `labels` (one value per label name)."""
        if len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name}: labels {labels} for label names {self.labelnames}")
        kept = [v for v in values if v is not None and 0 <= v < math.inf]
        if not kept:
            return
        counts = Counts(map(self._bucket, kept))
        total = sum(kept)
        with self._lock:
            buckets = self._counts.get(labels)
            if buckets is None:
                buckets = self._counts[labels] = [0] * len(self._bounds)
            for i, n in counts.items():
                buckets[i] += n
            self._sums[labels] = self._sums.get(labels, 0.0) + total

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        with self._lock:
            series = [(labels, list(counts), self._sums[labels]) for labels, counts in self._counts.items()]
        les = [floatToGoString(b) for b in self._bounds]
        for labels, counts, total in series:
            family.add_metric(list(labels), list(zip(les, accumulate(counts))), total)
        yield family


class Metrics:
    """The pipeline's metrics on `registry` (a fresh `CollectorRegistry` when omitted).

    `process=True` also registers the process and platform collectors (CPU, memory, open
    file descriptors, Python version) on the same registry, as the servers want.
    `component` (admission, consumer, trainer, engine) leaves the unlabelled families other
    processes own off the registry (`UNLABELLED_OWNER`); their objects still take calls.
    None registers every family."""

    def __init__(self, registry: CollectorRegistry | None = None, *, process: bool = False,
                 component: str | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}  # `_child`'s
        r = self.registry
        if process:
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)

        def own(name: str) -> CollectorRegistry | None:
            owner = UNLABELLED_OWNER.get(name)
            return r if component is None or owner is None or owner == component else None

        def counter(name: str, doc: str, labels: Iterable[str] = ()) -> Counter:
            return Counter(PREFIX + name, doc, tuple(labels), registry=own(name))

        def gauge(name: str, doc: str, labels: Iterable[str] = ()) -> Gauge:
            return Gauge(PREFIX + name, doc, tuple(labels), registry=own(name))

        def histogram(name: str, doc: str, labels: Iterable[str], buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, tuple(labels), buckets=buckets, registry=own(name))

        # -- scheduler (admission consumer, label shard)
        self.scheduler_events = counter(
            "scheduler_events_total", "Events handled by the scheduling state machine, by kind "
            "(open, register, handover, finish, publish, tick, close).", ("shard", "kind"))
        self.samples_in_flight = gauge(
            "samples_in_flight", "Samples submitted and not yet ended.", ("shard",))
        self.samples_submitted = counter(
            "samples_submitted_total", "Work entries submitted (first attempts and "
            "resubmissions).", ("shard",))
        self.samples_resubmitted = counter(
            "samples_resubmitted_total", "Resubmissions by cause (infra_error, cancelled, "
            "stale, timeout, unscored), from the SchedulerRecords.", ("shard", "cause"))
        self.samples_finished = counter(
            "samples_finished_total", "Results read, by session status (completed, "
            "agent_error, truncated, infra_error, cancelled).", ("shard", "status"))
        self.samples_cancelled = counter(
            "samples_cancelled_total", "Cancels sent, by reason (surplus, stale, abandoned, "
            "timeout, epoch, closed, broken).", ("shard", "reason"))
        self.samples_discarded = counter(
            "samples_discarded_total", "Results dropped without training, by reason "
            "(superseded, stale, or the failure cause).", ("shard", "reason"))
        self.groups_admitted = counter(
            "groups_admitted_total", "Complete groups handed to the trainer.", ("shard",))
        self.groups_abandoned = counter(
            "groups_abandoned_total", "Groups given up after max_attempts failures of a "
            "sample.", ("shard",))
        self.groups_cut = counter(
            "groups_cut_total", "Complete groups left out because their chains did not fit "
            "the step's packed rows.", ("shard",))
        self.groups_refused = counter(
            "groups_refused_total", "Complete groups that can never be packed (more tokens "
            "than rows x width), left out of their step.", ("shard",))
        self.groups_surplus = counter(
            "groups_surplus_total", "Groups cut untrained when their batch reached `admit` "
            "(batch admission).", ("shard",))
        self.samples_backed_up = counter(
            "samples_backed_up_total", "Extra rollouts queued as backups of a group's "
            "stragglers (stream admission, oversample_start=straggler; capped by "
            "backup_limit), as replacements of its members about to go stale "
            "(oversample_start=replace), or as backups of every straggler in the run's last "
            "steps (end_backups), from the SchedulerRecords.", ("shard",))
        self.rollouts_overlong = counter(
            "rollouts_overlong_total", "Results with a chain longer than a packed row, cut "
            "to the row width and admitted as TRUNCATED (they train under the truncation "
            "policy).", ("shard",))
        self.admitted_lag = histogram(
            "admitted_lag_updates", "Lag of each step's admitted rollouts: trainer updates "
            "minus the weight version of the oldest admitted call (the step's worst case).",
            ("shard",), LAG_BUCKETS)
        self.session_duration = BatchHistogram(  # one observation per result: in batches
            PREFIX + "session_duration_seconds", "Seconds each rollout session held a "
            "consumer's slot (its start there to its end; a cancelled one's to its cancel), by "
            "session status: the _sum of every status is the busy slot-seconds.",
            ("shard", "status"), SESSION_BUCKETS, r)
        self.trained_session = BatchHistogram(
            PREFIX + "trained_session_seconds", "Slot seconds (as in session_duration_seconds) "
            "of each rollout a step trained (its group packed into the step's rows): against "
            "session_duration_seconds, the waste share and the trained sessions' length bias.",
            ("shard",), SESSION_BUCKETS, r)
        self.held_session = gauge(
            "held_session_seconds", "Slot seconds of the results the admission consumer holds "
            "for groups not yet trained (read, so in session_duration_seconds, and neither "
            "trained nor discarded yet): busy minus trained minus its change is the waste.",
            ("shard",))
        self.step_metric = gauge(
            "step_metric", "Every finite value of the latest SchedulerRecord.metrics, by key "
            "(merge_ratio, non_pad_share, latency_s_p90, token_lag_mean, ...).",
            ("shard", "name"))

        # -- trainer (label shard = rank)
        self.trainer_steps = counter(
            "trainer_steps_total", "Optimizer steps the trainer rank took.", ("shard",))
        self.trainer_updates = gauge(
            "trainer_updates", "Optimizer updates applied so far (the weight version the "
            "trainer holds).", ("shard",))
        self.trainer_waited = histogram(
            "trainer_waited_seconds", "Seconds each trainer call waited for its step's "
            "packed rows (hand-over to rows, as the trainer measures it).",
            ("shard",), WAIT_BUCKETS)
        self.trainer_step = histogram(
            "trainer_step_seconds", "Seconds of each optimizer step (rescore, loss, "
            "backward, step).", ("shard",), STEP_BUCKETS)
        self.trainer_tokens_per_second = gauge(
            "trainer_tokens_per_second", "Trained tokens per second of the latest step.",
            ("shard",))
        self.trainer_loss = gauge("trainer_loss", "Loss of the latest step.", ("shard",))
        self.reward_mean = gauge(
            "reward_mean", "Mean verifier reward of the rollouts the latest step trained.",
            ("shard",))
        self.importance_weight_mean = gauge(
            "importance_weight_mean", "Mean behaviour importance weight (proximal / "
            "behaviour) over the latest step's loss tokens.", ("shard",))
        self.importance_weight_max = gauge(
            "importance_weight_max", "Largest behaviour importance weight of the latest "
            "step, before any cap.", ("shard",))
        self.trainer_engine_mismatch_kl = gauge(
            "trainer_engine_mismatch_kl", "Trainer-engine mismatch of the latest step: k3 "
            "estimate of KL(behaviour || trainer) on tokens sampled by the trainer's "
            "version.", ("shard",))
        self.trainer_engine_mismatch_abs = gauge(
            "trainer_engine_mismatch_abs", "Training-inference mismatch of the latest step: mean "
            "|trainer log-prob - engine log-prob| over the tokens sampled by the trainer's version.",
            ("shard",))
        self.trainer_engine_mismatch_over = gauge(
            "trainer_engine_mismatch_over", "Share of the latest step's tokens sampled by the "
            "trainer's version whose trainer and engine log-probs differ by more than 0.1.",
            ("shard",))

        # -- rollout consumers (label consumer)
        self.consumer_slots_busy = gauge(
            "consumer_slots_busy", "Session slots running a rollout now.", ("consumer",))
        self.consumer_slots = gauge(
            "consumer_slots", "Session slots of the consumer (its capacity).", ("consumer",))

        # -- streams
        self.stream_length = gauge(
            "stream_length", "Entries in the stream (XLEN).", ("stream",))
        self.stream_group_lag = gauge(
            "stream_group_lag", "Entries of the stream not yet delivered to the consumer "
            "group (XINFO GROUPS lag).", ("stream", "group"))
        self.stream_group_pending = gauge(
            "stream_group_pending", "Entries delivered to the consumer group and not yet "
            "acknowledged (XPENDING).", ("stream", "group"))
        self.dead_letters = counter(
            "dead_letters_total", "Entries moved to the dead-letter stream, by the stream "
            "they came from and the reason.", ("stream", "reason"))

        # -- weights
        self.served_version = gauge(
            "weights_served_version", "Weight version the inference engines serve now.")
        self.published_version = gauge(
            "weights_published_version", "Latest weight version the trainer published.")
        self.weights_push = histogram(
            "weights_push_seconds", "Seconds of each weight push, agreement to publication.",
            (), WAIT_BUCKETS)

        # -- rollstream engine (the CPU inference server; no labels: one model per process)
        self.engine_weights_following = gauge(
            "engine_weights_following", "1 unless the engine fails to follow the run's weights "
            "(its last read of them failed), 0 while it cannot (Redis unreachable or refusing it): it then "
            "serves its last version and /health answers 503.")
        self.engine_weights_version = gauge(
            "engine_weights_version", "Weight version the engine serves now.")
        self.engine_weights_failures = counter(
            "engine_weights_failures_total", "Failed attempts of the engine to read or load the "
            "run's weights (each is retried).")

        self.build = Info(PREFIX + "build", "The running rollstream build.", registry=r)

    # ---------------------------------------------------------------------- helpers

    def set_build(self, *, component: str, run: str) -> None:
        """Label `rollstream_build_info` with the version, the process role and the run
        namespace (so one Prometheus can tell several runs apart)."""
        self.build.info({
            "version": _version(),
            "python": platform.python_version(),
            "component": component,
            "run": run,
        })

    def _child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, looked up once: prometheus_client's lookup checks every
        label and takes a lock, and the admission consumer observes several series per result
        (no series of these is ever removed, so a kept child stays the registry's)."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def observe_event(self, shard: int, event: object) -> None:
        """Count one scheduler event by kind (its class name, lowercased)."""
        self.observe_events(shard, [type(event)])

    def observe_events(self, shard: int, kinds: Iterable[type]) -> None:
        """Count scheduler events by kind: `kinds`, the class of each event (`observe_event`
        of each, counted together)."""
        s = str(shard)
        for kind, n in Counts(kinds).items():
            self._child(self.scheduler_events, s, kind.__name__.lower()).inc(n)

    def observe_actions(self, shard: int, actions: Iterable[object]) -> None:
        """Count submissions, cancels by reason and discards by reason.

        Resubmissions, abandoned groups and admitted groups come from `observe_record`
        (the SchedulerRecord carries them), so this counts none of them."""
        s = str(shard)
        submitted, cancelled, discarded = 0, Counts[str](), Counts[str]()
        for action in actions:
            if isinstance(action, Submit):
                submitted += 1
            elif isinstance(action, Cancel):
                cancelled[action.reason] += 1
            elif isinstance(action, Discard):
                discarded[action.reason] += 1
        if submitted:
            self._child(self.samples_submitted, s).inc(submitted)
        for metric, reasons in ((self.samples_cancelled, cancelled), (self.samples_discarded, discarded)):
            for reason, n in reasons.items():
                self._child(metric, s, reason).inc(n)

    def observe_finished(self, shard: int, status: Status | str, duration_s: float | None) -> None:
        """One result read: its status, and its session's duration when known."""
        self.observe_finished_many(shard, [status], [duration_s])

    def observe_finished_many(self, shard: int, statuses: Iterable[Status | str],
                              durations: Iterable[float | None]) -> None:
        """Results read (`observe_finished` of each, counted together): their statuses, and
        their sessions' durations where known."""
        s = str(shard)
        by_status: dict[str, list[float | None]] = {}
        for status, duration in zip(statuses, durations, strict=True):
            by_status.setdefault(status.value if isinstance(status, Status) else status, []).append(duration)
        for name, of_status in by_status.items():
            self._child(self.samples_finished, s, name).inc(len(of_status))
            self.session_duration.observe_many((s, name), of_status)

    def observe_trained(self, shard: int, durations: Iterable[float | None]) -> None:
        """The slot seconds of the rollouts one step trained (None where unknown)."""
        self.trained_session.observe_many((str(shard),), durations)

    def start_shard(self, shard: int) -> None:
        """Make the counters a shard may leave at zero for a long time exist at 0 (a series
        that appears only at its first increment hides that first increment from rate())."""
        s = str(shard)
        for counter in (self.rollouts_overlong, self.groups_refused, self.groups_surplus,
                        self.samples_backed_up):
            counter.labels(s)

    def set_in_flight(self, shard: int, samples: int) -> None:
        self._child(self.samples_in_flight, str(shard)).set(samples)

    def set_held_seconds(self, shard: int, seconds: float) -> None:
        self._child(self.held_session, str(shard)).set(seconds)

    def observe_record(self, record: SchedulerRecord, *, shard: int, refused: int = 0,
                       surplus: int = 0, overlong: int = 0) -> None:
        """The scheduler's side of one packed step of `shard` (the admission consumer).

        Counters: admitted/abandoned/cut/refused/surplus groups, resubmissions by cause,
        straggler backups and replacements queued. Histogram: the
        step's lag. Gauges: every finite key of `record.metrics` in `rollstream_step_metric`.
        `record.cancelled` is not re-counted: the cancels are counted with their reasons as
        they happen (`observe_actions`). The trainer's side of the same step (steps,
        updates, its wait, the mean reward) is `observe_train`'s, in the trainer process."""
        s = str(shard)
        self._child(self.admitted_lag, s).observe(record.lag)
        self._child(self.groups_admitted, s).inc(record.groups)
        self._child(self.groups_abandoned, s).inc(record.abandoned)
        self._child(self.groups_cut, s).inc(record.cut)
        self._child(self.groups_refused, s).inc(refused)
        self._child(self.groups_surplus, s).inc(surplus)
        self._child(self.samples_backed_up, s).inc(record.backups)
        for cause, n in record.resubmitted.items():
            if n:
                self._child(self.samples_resubmitted, s, cause).inc(n)
        self._observe_values(s, record.metrics)

    def observe_train(self, shard: int, *, step_s: float, tokens: int,
                      metrics: Mapping[str, float], record: SchedulerRecord | None = None) -> None:
        """One optimizer step of a trainer rank training `shard`: the step count, its
        duration, throughput and loss metrics (`GRPOObjective.loss` returns them: loss,
        importance_mean/max, mismatch_kl, ...), and, given the step's `SchedulerRecord`
        as the trainer received it, the updates after the step, the trainer's own wait
        for the batch and the batch's mean reward."""
        s = str(shard)
        self.trainer_steps.labels(s).inc()
        self.trainer_step.labels(s).observe(step_s)
        if step_s > 0:
            self.trainer_tokens_per_second.labels(s).set(tokens / step_s)
        self._observe_values(s, metrics, TRAIN_GAUGES)
        if record is not None:
            self.trainer_updates.labels(s).set(record.updates + 1)
            self.trainer_waited.labels(s).observe(max(0.0, float(record.waited)))
            reward = float(record.metrics.get("reward_mean", math.nan))
            if math.isfinite(reward):
                self.reward_mean.labels(s).set(reward)

    def _observe_values(self, shard: str, values: Mapping[str, float],
                        gauges: Mapping[str, str] | None = None) -> None:
        for key, value in values.items():
            value = float(value)
            if not math.isfinite(value):
                continue
            self._child(self.step_metric, shard, key).set(value)
            attr = (gauges or {}).get(key)
            if attr is not None:
                getattr(self, attr).labels(shard).set(value)

    def set_slots(self, consumer: str, *, busy: int, total: int) -> None:
        self.consumer_slots_busy.labels(consumer).set(busy)
        self.consumer_slots.labels(consumer).set(total)

    def observe_stream(self, stream: str, length: int,
                       groups: Mapping[str, tuple[int | None, int]] | None = None) -> None:
        """`length` of `stream`, and `(lag, pending)` of each of its consumer groups (lag
        None: the server cannot tell, as Redis < 7 and after some deletions)."""
        self.stream_length.labels(stream).set(length)
        for group, (lag, pending) in (groups or {}).items():
            if lag is not None:
                self.stream_group_lag.labels(stream, group).set(lag)
            self.stream_group_pending.labels(stream, group).set(pending)

    def dead_letter(self, stream: str, reason: str) -> None:
        self.dead_letters.labels(stream, reason).inc()

    def observe_push(self, version: int, seconds: float) -> None:
        """The trainer published weight `version` in `seconds`."""
        self.published_version.set(version)
        self.weights_push.observe(seconds)


def families(metrics: Metrics) -> dict[str, str]:
    """`{family name: type}` of every metric defined on `metrics.registry` (the family
    name as prometheus_client reports it: counters without `_total`, info without
    `_info`)."""
    return {f.name: f.type for f in metrics.registry.collect()}


def sample_names(metrics: Metrics) -> set[str]:
    """Every series name `metrics` can expose (`_total`, `_bucket`, `_sum`, `_count`,
    `_info` included), for checking PromQL against the registry."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("", "_sum", "_count", "_created"),
        "info": ("_info",),
    }
    return {name + suffix for name, kind in families(metrics).items()
            for suffix in suffixes.get(kind, ("",))}


# ------------------------------------------------------------------------------ server


def parse_addr(addr: str) -> tuple[str, int]:
    """`"host:port"` (or `"[v6]:port"`, or `":port"` for 127.0.0.1) to `(host, port)`."""
    try:
        return metrics_address(addr)
    except ValueError as exc:
        raise ValueError(f"metrics address {exc}") from None


@dataclass
class MetricsServer:
    """A running `/metrics` endpoint; `stop()` shuts it down and closes the socket."""

    host: str
    port: int
    _server: ThreadingHTTPServer
    _thread: threading.Thread

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def _check(probe: Callable[[], bool]) -> tuple[bool, str]:
    """A probe's verdict; a probe that raises says not-ok with the error (the server
    must keep answering, so it is not re-raised)."""
    try:
        return bool(probe()), ""
    except Exception as exc:  # noqa: BLE001 -- a failing probe is a 503, never a dead server
        return False, f"{type(exc).__name__}: {exc}"


def _handler(registry: CollectorRegistry, health: Callable[[], bool],
             ready: Callable[[], bool]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "rollstream-metrics"

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                self._send(200, encoder(registry), content_type)
            elif path in ("/healthz", "/readyz"):
                ok, why = _check(health if path == "/healthz" else ready)
                body = b"ok\n" if ok else f"unavailable {why}".strip().encode() + b"\n"
                self._send(200 if ok else 503, body, "text/plain; charset=utf-8")
            else:
                self._send(404, b"not found: try /metrics, /healthz, /readyz\n",
                           "text/plain; charset=utf-8")

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("metrics %s - " + format, self.address_string(), *args)

    return Handler


def serve(metrics: Metrics, addr: str = "127.0.0.1:0", *,
          health: Callable[[], bool] = lambda: True,
          ready: Callable[[], bool] | None = None) -> MetricsServer:
    """Serve `/metrics`, `/healthz` (200 while `health()` is true, else 503) and
    `/readyz` (the same with `ready`, which defaults to `health`) on `addr` from a daemon
    thread. Port 0 binds a free port; the returned server's `port` is the bound one."""
    host, port = parse_addr(addr)

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    server = Server((host, port), _handler(metrics.registry, health, ready or health))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                              name=f"metrics:{addr}", daemon=True)
    thread.start()
    bound = server.server_address[1]
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return MetricsServer(host, bound, server, thread)


WILDCARDS = ("0.0.0.0", "::")  # a server bound here is reached by the machine's name


@contextlib.contextmanager
def listed(folder: str, component: str, run: str, server: MetricsServer) -> Iterator[Path]:
    """`server` listed for Prometheus's file-based discovery (`file_sd_configs`) while the
    block runs: `folder/<component>-<host>-<port>.json` names its address (the machine's
    name where it listens on every interface) with labels `component` and `release` (the
    run). The file is written whole (`write_whole`: a scan never reads half of it) and
    removed at exit; a process that dies leaves it, and its target then reads down.
    A folder that cannot be written is a `CommandError` naming `metrics_targets`."""
    host = socket.gethostname() if server.host in WILDCARDS else server.host
    address = f"[{host}]:{server.port}" if ":" in host else f"{host}:{server.port}"
    path = Path(folder) / f"{component}-{host.replace(':', '_')}-{server.port}.json"
    entry = [{"targets": [address], "labels": {"component": component, "release": run}}]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, json.dumps(entry).encode() + b"\n")
    except OSError as exc:
        raise CommandError(f"metrics_targets {folder}: cannot list this process's /metrics "
                           f"there: {exc.strerror or exc}") from exc
    log.info("listed %s for Prometheus in %s", address, path)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def serving(component: str, run: str, addr: str, *, health: Callable[[], bool],
            ready: Callable[[], bool] | None = None, offsets: Mapping[str, int] | None = None,
            targets: str | None = None) -> Iterator[Metrics]:
    """A process's `Metrics`, labelled with its role and run, served until exit on `addr`
    (a config's `metrics_addr`; `offsets` gives the values of its `+shard` or `+rank`), and
    listed in the folder `targets` (a config's `metrics_targets`; `listed`) when given. An
    address that cannot be bound is a `CommandError` naming `metrics_addr`."""
    offsets = dict(offsets or {})
    host, port = metrics_address(addr, tuple(offsets), **offsets)
    metrics = Metrics(process=True, component=component)
    metrics.set_build(component=component, run=run)
    try:
        server = serve(metrics, f"[{host}]:{port}" if ":" in host else f"{host}:{port}", health=health, ready=ready)
    except OSError as exc:
        resolved = "" if addr == f"{host}:{port}" else f" (port {port} here)"
        derive = "".join(f"+{name} adds the {name} to the port; " for name in offsets)
        raise CommandError(
            f"metrics_addr {addr}{resolved}: cannot serve /metrics there: {exc.strerror or exc}. "
            f"Give each process on this machine its own port ({derive}port 0 picks a free one)") from exc
    try:
        with listed(targets, component, run, server) if targets is not None else contextlib.nullcontext():
            yield metrics
    finally:
        server.stop()
