"""Validated configuration: one model per process, units in field names.

Every model refuses unknown fields and checks its cross-field rules at construction, so a
bad config fails at start with the offending field named (`ConfigError`).
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import unquote, urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline.advantages import Estimator, Truncation
from pipeline.errors import ConfigError

Admission = Literal["batch", "stream"]
ADMISSIONS = typing.get_args(Admission)
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # the default of every process's `max_message_bytes`, and the wire's


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, strict=True,
                              allow_inf_nan=False)


class SchedulerConfig(_Model):
    """The scheduling rules (the specification's `RolloutScheduler` arguments)."""

    groups: int = Field(4, ge=1, description="rollouts admitted per group (the group size)")
    oversample: int = Field(0, ge=0, description="extra rollouts run per group; first finishers win")
    admit: int | None = Field(None, ge=1, description="groups trained per step; None: the batch size")
    batch_size: int | None = Field(None, ge=1, description="tasks per registered batch, when known")
    max_lag: int = Field(1, ge=0, description="most updates an admitted rollout's oldest call may trail")
    ahead: int = Field(1, ge=0, description="task batches submitted before their step")
    sync_every: int = Field(1, ge=1, description="push weights once the served version is this far behind")
    max_attempts: int = Field(3, ge=1, description="failed attempts per sample before its group is abandoned")
    timeout_s: float | None = Field(None, gt=0, description="deadline of a rollout from its submission")
    estimator: Estimator = "group"  # pipeline.advantages.ESTIMATORS
    truncation: Truncation = "mask"  # pipeline.advantages.TRUNCATIONS
    admission: Admission = "batch"
    inflight_samples: int | None = Field(
        None, ge=1, description="stream mode: samples kept in flight; None: (ahead + 1) batches' worth"
    )
    backfill: Literal["sample", "group"] = Field(
        "sample", description="stream mode: a sample's credit is released when it ends (sample), "
        "or held until its whole group has ended (group: the legacy group-gated baseline)")
    oversample_start: Literal["group", "straggler", "replace"] = Field(
        "group", description="stream mode: the oversample extra rollouts of a group are "
        "submitted with it (group), or only once no more than oversample of its rollouts are "
        "still running (straggler: a backup for the slowest), or one for each admitted "
        "rollout that the next handover will make stale, as that handover nears (replace: "
        "see replace_ahead)")
    replace_ahead: float = Field(
        0.5, gt=0, le=1, description="stream mode, oversample_start=replace: while the trainer "
        "waits for a step that lacks at most this share of its groups, every admitted rollout "
        "of a waiting group that the next handover will make stale gets a replacement (an "
        "extra rollout, or the slot of a member it replaced before); a replaced member that "
        "goes stale is not run again while its group can still complete")
    backup_limit: int | None = Field(
        None, ge=1, description="stream mode, oversample_start=straggler: most backup rollouts "
        "queued or running at once (groups whose members are oldest are backed up first); "
        "None: no limit. A group that can only complete with its extra rollouts (a failure "
        "used up a sample's attempts) is backed up whatever the limit")
    group_start: Literal["any", "handover"] = Field(
        "any", description="stream mode: new groups start whenever credits allow (any), or "
        "only as the trainer hands over a step, its weights just pushed (handover: with a "
        "rollout's staleness counted from its end, a group started then keeps its first results "
        "longest); between handovers freed credits wait, except for resubmissions, backups and "
        "replacements, and except while the groups not yet trained cannot fill a step")
    supply: int | None = Field(
        None, ge=1, description="stream mode: task batches registered beyond the step being "
        "trained, the window new groups are drawn from; None: three in-flight targets' worth "
        "of groups, at least ahead (see registered_ahead)")
    end_backups: int = Field(
        0, ge=0, description="stream mode: while the trainer waits for one of its run's last "
        "end_backups steps (its handovers say how many steps follow), every running rollout of "
        "a group not yet complete gets one backup from the group's extra rollouts (oversample; "
        "counted with backup_limit's backups, never held back by it): with no later step to "
        "start work for, a slot is better spent racing a straggler. 0: off")
    stale_running: Literal["cancel", "finish"] = Field(
        "cancel", description="a running rollout submitted past the bound: cancelled at once "
        "(its first call was made under that version), or left to finish and judged by its "
        "result's oldest call (sources whose first call comes late, or work queued for a slot)")
    width: int = Field(2048, ge=1, description="tokens per packed row")
    rows: int = Field(8, ge=1, description="packed rows per step (this process's share)")
    support_capacity: int | None = Field(None, ge=1, description="per-row room for sampling support")

    @property
    def group_size(self) -> int:
        """Samples submitted per group: `groups + oversample`."""
        return self.groups + self.oversample

    @property
    def registered_ahead(self) -> int:
        """Task batches the trainer registers beyond the one it trains. Batch mode: `ahead`.
        Stream mode: `supply`, by default enough batches for three times the in-flight
        target's groups (partly admitted groups hold tasks while their stragglers run), and
        never fewer than `ahead`; a stream group's staleness counts from its samples'
        submissions, not from its batch's registration, so the window does not touch the
        bound."""
        if self.admission != "stream":
            return self.ahead
        if self.supply is not None:
            return max(self.ahead, self.supply)
        if self.inflight_samples is None:  # (ahead + 1) batches in flight
            return 3 * (self.ahead + 1)
        if self.batch_size is None:
            return self.ahead + 1
        return max(self.ahead, math.ceil(3 * self.inflight_samples / (self.group_size * self.batch_size)))

    @model_validator(mode="after")
    def _cross_field(self) -> "SchedulerConfig":
        bound = self.ahead + self.sync_every - 1
        if self.max_lag < bound:
            raise ValueError(
                f"max_lag={self.max_lag} is below ahead + sync_every - 1 = {bound}: a first "
                "submission could be stale at consumption"
            )
        if self.admit is not None and self.batch_size is not None and self.admit > self.batch_size:
            raise ValueError(f"admit={self.admit} exceeds batch_size={self.batch_size}")
        for name, default in (("oversample_start", "group"), ("group_start", "any")):  # stream-only
            if getattr(self, name) != default and self.admission != "stream":
                raise ValueError(f"{name}={getattr(self, name)!r} needs admission='stream'")
        if self.end_backups and self.admission != "stream":
            raise ValueError(f"end_backups={self.end_backups} needs admission='stream'")
        if self.end_backups and self.oversample < 1:
            raise ValueError(f"end_backups={self.end_backups} needs oversample >= 1: a group's "
                             "backups are its extra rollouts")
        if self.oversample_start == "replace" and self.oversample < 1:
            raise ValueError("oversample_start='replace' needs oversample >= 1: a group's first "
                             "replacement is one of its extra rollouts")
        if self.backup_limit is not None and self.backup_limit < self.oversample:
            raise ValueError(
                f"backup_limit={self.backup_limit} is below oversample={self.oversample}: "
                "no group could ever be backed up")
        if self.inflight_samples is not None and self.inflight_samples < self.group_size:
            raise ValueError(
                f"inflight_samples={self.inflight_samples} is below one group "
                f"(groups + oversample = {self.group_size})"
            )
        return self


def scheduler_differences(run: Any, ours: SchedulerConfig) -> list[str]:
    """The fields where the run's scheduler config (`run`: the trainer's, as a JSON-native
    map) differs from `ours` (an admission consumer's), as `name: run's value != ours`;
    a `run` that is not a valid SchedulerConfig is one difference naming why."""
    try:
        theirs = SchedulerConfig.model_validate(run).model_dump(mode="json")
    except ValidationError as exc:
        return [f"the trainer's scheduler config is invalid here: {describe(exc, SchedulerConfig)}"]
    mine = ours.model_dump(mode="json")
    return [f"{name}: {theirs[name]!r} != {mine[name]!r}" for name in mine if theirs[name] != mine[name]]


class RedisConfig(_Model):
    """Where the pipeline's streams live. Credentials come from the environment or a file,
    never from the config itself: `password_env` names a variable, `password_file` a file."""

    url: str = Field("redis://127.0.0.1:6379/0", description="redis:// or rediss:// URL")
    namespace: str = Field("default", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    username: str | None = None
    password_env: str | None = "ROLLSTREAM_REDIS_PASSWORD"
    password_file: str | None = None
    tls_ca_file: str | None = None
    socket_timeout_s: float = Field(30.0, gt=0)
    reconnect_s: float = Field(
        300.0, gt=0, description="how long a consumer keeps reconnecting after losing Redis before it gives up"
    )
    start_wait_s: float = Field(
        10.0, ge=0, description="at start, how long an unreachable Redis is waited for (a restart in "
        "progress) before the process gives up with one line naming the URL")

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        scheme = url.partition("://")[0]
        if scheme.lower() not in ("redis", "rediss", "unix"):
            raise ValueError(f"url must start with redis://, rediss:// or unix://, got {url.rpartition('@')[2]!r}")
        if urlsplit(url).password is not None:  # the URL is logged and shown; a password is not
            raise ValueError("must not hold a password: give it through password_env (an environment "
                             "variable's name) or password_file")
        return url

    @model_validator(mode="after")
    def _one_user(self) -> "RedisConfig":
        named = _url_user(self.url)
        if named is not None and self.username is not None and named != self.username:
            raise ValueError(f"url names user {named!r} and username is {self.username!r}: give the user once")
        return self

    @property
    def user(self) -> str | None:
        """The ACL user to connect as: `username`, or the URL's (`redis://NAME@host`), as
        redis-py reads it; None: Redis's `default` user."""
        return self.username if self.username is not None else _url_user(self.url)

    def password(self) -> str | None:
        """The password, from `password_file` or else the variable `password_env` names."""
        if self.password_file is not None:
            try:
                return Path(self.password_file).read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise ConfigError(f"redis.password_file: cannot read {self.password_file}: {exc.strerror}") from None
            except UnicodeDecodeError:
                raise ConfigError(f"redis.password_file: {self.password_file} is not UTF-8 text") from None
        if self.password_env:
            return os.environ.get(self.password_env) or None
        return None


def _url_user(url: str) -> str | None:
    """The user name a `redis://NAME@host` URL holds (percent-decoded), or None."""
    name = urlsplit(url).username
    return unquote(name) if name else None


def metrics_address(addr: str, offsets: Sequence[str] = (), **values: int) -> tuple[str, int]:
    """`(host, port)` of a `metrics_addr`: `host:port`, `[v6]:port` or `:port` (127.0.0.1);
    port 0 binds any free port. `host:port+shard` (or `+rank`: a name of `offsets`) adds the
    process's shard (rank), given in `values`, to the port, so that the processes started
    from one file on one machine bind distinct ports. Raises ValueError saying what is wrong."""
    base, plus, offset = addr.partition("+")
    host, sep, port = base.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535 or (plus and not offset):
        shapes = " or ".join(["host:port", *(f"host:port+{o}" for o in offsets)])
        raise ValueError(f"must be {shapes}, got {addr!r}")
    number = int(port)
    if plus:
        if offset not in offsets:
            raise ValueError(f"{addr!r}: +{offset} means nothing here " + (
                f"(only +{' or +'.join(offsets)})" if offsets else "(give a port, or port 0 for a free one)"))
        if number == 0:
            raise ValueError(f"{addr!r}: port 0 picks a free port already; drop +{offset}")
        number += values.get(offset, 0)
        if number > 65535:
            raise ValueError(f"{addr!r}: {offset} {values[offset]} makes port {number}, past 65535")
    return host.strip("[]") or "127.0.0.1", number


# every process's `metrics_targets`: where it lists its /metrics for a Prometheus outside Kubernetes
MetricsTargets = Annotated[str | None, Field(
    description="a folder where the process lists its /metrics address for Prometheus's "
    "file_sd_configs (one JSON file, labelled component and release = redis.namespace; created "
    "at start, removed at exit), for a Prometheus outside Kubernetes; None: not listed")]


class AdmissionConfig(_Model):
    """`rollstream admission`: one per trainer rank (shard)."""

    redis: RedisConfig = Field(default_factory=RedisConfig)
    shard: int = Field(0, ge=0)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    block_ms: int = Field(1000, ge=1, description="longest blocking read")
    lease_s: float = Field(30.0, gt=0, description="work whose lease is older than this is reclaimed")
    shard_lease_s: float = Field(
        15.0, gt=0, description="the shard's lease: a second admission consumer of the shard waits "
        "until its holder has not renewed it for this long, then takes the shard over (the first "
        "is fenced: its next transaction is refused and it stops)")
    trim_every_s: float = Field(10.0, gt=0)
    snapshot_every: int = Field(
        1000, ge=1, description="transitions between scheduler snapshots (each replaces the journal); "
        "when the last snapshot held more samples than this (the scheduler's groups' running, "
        "admitted and awaiting ones), that many transitions instead")
    control_retention_s: float = Field(
        600.0, gt=0, description="age past which cancels leave the control stream and the cancelled set"
    )
    vocab: int | None = Field(
        None, ge=1, description="the model's vocabulary size: a result with a token id >= vocab is "
        "dead-lettered and its sample resubmitted; None: any non-negative int32 id")
    max_message_bytes: int = Field(
        MAX_MESSAGE_BYTES, ge=1024, description="largest entry read (bigger ones are dead-lettered) or written")
    metrics_addr: str = Field(
        "127.0.0.1:9400+shard", description="host:port of /metrics, /healthz and /readyz; +shard adds "
        "the shard to the port (shard 0: 9400, shard 1: 9401), port 0 picks a free one")
    metrics_targets: MetricsTargets = None

    @field_validator("metrics_addr")
    @classmethod
    def _metrics_addr(cls, addr: str) -> str:
        metrics_address(addr, ("shard",))
        return addr


class ConsumerConfig(_Model):
    """`rollstream consumer`: a stateless rollout consumer with `slots` concurrent sessions."""

    redis: RedisConfig = Field(default_factory=RedisConfig)
    slots: int = Field(8, ge=1)
    source: str = Field("consumers.sources.sleep:SleepSource", pattern=r"^[\w.]+:[\w.]+$")
    source_args: dict[str, Any] = Field(default_factory=dict)
    lease_s: float = Field(30.0, gt=0, description="lease renewed every lease_s / 3")
    block_ms: int = Field(1000, ge=1)
    grace_s: float = Field(30.0, ge=0, description="on SIGTERM, time to finish running sessions")
    vocab: int | None = Field(
        None, ge=1, description="the model's vocabulary size: a session with a token id >= vocab is "
        "reported as an infra_error (and dead-lettered) instead of published; None: no bound")
    max_message_bytes: int = Field(
        MAX_MESSAGE_BYTES, ge=1024, description="largest entry read (bigger ones are dead-lettered) or "
        "written (a bigger result is reported as an infra_error instead)")
    metrics_addr: str = Field(
        "127.0.0.1:0", description="host:port of /metrics and /healthz; port 0 (the default) picks "
        "a free one, so that several consumers run from one file on one machine")
    metrics_targets: MetricsTargets = None

    @field_validator("metrics_addr")
    @classmethod
    def _metrics_addr(cls, addr: str) -> str:
        metrics_address(addr)
        return addr

    @model_validator(mode="after")
    def _drain(self) -> "ConsumerConfig":
        if self.grace_s > self.lease_s * 10:
            raise ValueError(f"grace_s={self.grace_s} exceeds ten leases (lease_s={self.lease_s})")
        return self


M = TypeVar("M", bound=BaseModel)


def _name(part: str | int) -> str:
    """One step of a field's path: a field name or list index as it is, any other key quoted
    (an unknown key `''` or `'a.b'` must not read as a path)."""
    return str(part) if isinstance(part, int) or part.isidentifier() else repr(part)


def describe(exc: ValidationError, model: type[BaseModel] | None = None) -> str:
    """One clause per offending field, `a.b: reason`, on one line. Given the `model`, an
    unknown field gets a hint: the field it is close to ("did you mean"), or the section
    that has a field of that name; several unknown fields that all belong to one section
    (a section's content written at the top level) get one clause that says so."""
    clauses: list[str] = []
    misplaced: dict[tuple[tuple[Any, ...], str], list[tuple[str, str]]] = {}
    for err in exc.errors():
        loc = err["loc"]
        where = ".".join(_name(p) for p in loc) or "(config)"
        reason = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden" and model is not None and loc and isinstance(loc[-1], str):
            parent = _model_at(model, loc[:-1])
            section = _section_of(parent, loc[-1]) if parent is not None else None
            if section is not None:
                misplaced.setdefault((loc[:-1], section), []).append((where, reason))
                continue
            hint = _close_field(parent, loc) if parent is not None else None
            reason += f" (did you mean {hint}?)" if hint else ""
        clauses.append(f"{where}: {reason}")
    for (parent_loc, section), fields in misplaced.items():
        full = ".".join([*map(_name, parent_loc), section])
        if len(fields) == 1:
            where, reason = fields[0]
            clauses.append(f"{where}: {reason} (did you mean {full}.{where.rpartition('.')[2]}?)")
        else:
            names = ", ".join(w for w, _ in fields)
            clauses.append(f"{names}: Extra inputs are not permitted here; they are fields of the "
                           f"{full} section: put them under `{section.rpartition('.')[2]}:`")
    return "; ".join(clauses)


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (`X`, `X | None`), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _submodel(arg)
            if found is not None:
                return found
    return None


def _model_at(model: type[BaseModel], loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The model of the section at `loc` under `model`, or None (not a section)."""
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        sub = _submodel(field.annotation) if field is not None else None
        if sub is None:
            return None
        model = sub
    return model


def _section_of(model: type[BaseModel], name: str, depth: int = 3) -> str | None:
    """The dotted path of the nearest section under `model` that has a field `name`."""
    frontier = [("", model)]
    for _ in range(depth):
        deeper = []
        for path, m in frontier:
            for field_name, field in m.model_fields.items():
                sub = _submodel(field.annotation)
                if sub is None:
                    continue
                sub_path = f"{path}.{field_name}" if path else field_name
                if name in sub.model_fields:
                    return sub_path
                deeper.append((sub_path, sub))
        frontier = deeper
    return None


def _close_field(model: type[BaseModel], loc: Sequence[str | int]) -> str | None:
    """The dotted name of `model`'s field closest to the unknown `loc[-1]`, if one is close."""
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.75)
    return ".".join([*map(_name, loc[:-1]), close[0]]) if close else None


def build(model: type[M], data: Any) -> M:
    """Validate `data` as `model`, raising ConfigError that names the fields."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid {model.__name__}: {describe(exc, model)}") from None


class _Loader(yaml.SafeLoader):
    """YAML's safe loader, reading `1e-06` and `1E+3` as floats as YAML 1.2 does (PyYAML's
    YAML 1.1 resolver wants a dot, so `lr: 1e-06`, as Helm's toYaml writes it, was a string)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def load(model: type[M], path: str | os.PathLike[str]) -> M:
    """Read a YAML or JSON file into `model`; a ConfigError names the file."""
    data = _read(path)
    try:
        return build(model, data)
    except ConfigError as exc:
        raise ConfigError(f"config {path}: {exc}") from None


def load_redis_section(path: str | os.PathLike[str]) -> RedisConfig:
    """The `redis` section of any process's config file (`rollstream status --config`,
    `rollstream engine --redis-config`): who to connect as, where and in which namespace."""
    section = _read(path).get("redis", {})
    if not isinstance(section, dict):
        raise ConfigError(f"config {path}: redis must be a mapping, got {type(section).__name__}")
    try:
        return build(RedisConfig, section)
    except ConfigError as exc:
        raise ConfigError(f"config {path}: redis: {exc}") from None


def load_scheduler_section(path: str | os.PathLike[str]) -> SchedulerConfig:
    """The `scheduler` section of the trainer's or an admission consumer's config file
    (`rollstream tune --current`). Where the section leaves `batch_size` out, a trainer
    config's `data.batch_size` (its tasks per step and shard) fills it in."""
    data = _read(path)
    section = data.get("scheduler")
    if not isinstance(section, dict):
        raise ConfigError(f"config {path}: needs a scheduler section (a mapping), got "
                          f"{'none' if section is None else type(section).__name__}")
    trainer_data = data.get("data")
    tasks = trainer_data.get("batch_size") if isinstance(trainer_data, dict) else None
    try:
        return build(SchedulerConfig, {"batch_size": tasks, **section} if tasks is not None else section)
    except ConfigError as exc:
        raise ConfigError(f"config {path}: scheduler: {exc}") from None


def _read(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The top-level mapping of a YAML or JSON file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config {p}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config {p} is not UTF-8 text") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader)
    except Exception as exc:  # noqa: BLE001 (PyYAML's constructors raise many kinds: `!!int x`, `!!bool x`, ...)
        raise ConfigError(f"config {p} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: "
                          f"{_syntax_error(exc)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config {p} must be a mapping at the top level, got {type(data).__name__}")
    return data


def _syntax_error(exc: Exception) -> str:
    """A JSON or YAML parser's error in one line, with the line and column it names."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        return f"{at}{exc.problem or exc.context}"
    return " ".join(str(exc).split())
