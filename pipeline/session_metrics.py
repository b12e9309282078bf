"""`session_metrics`: the `SchedulerRecord.metrics` of one trainer call.

Computed over the admitted rollouts that were packed (groups cut or refused by `pack`
did not train and are left out) and the packed batch itself. Keys (all floats; a key whose
value is undefined, such as a latency without timings, is omitted):

- ``rollouts``: rollouts counted;
- ``merge_ratio``: share of call tokens saved by merging calls into chains,
  ``1 - chain tokens / sum of (prompt + completion) over calls`` (`pipeline.chains`);
- ``share_completed``, ``share_agent_error``, ``share_truncated``: share of rollouts by status;
- ``masked_share``: share of rollouts that do not train (truncated under ``mask``);
  ``masked_token_share``: share of completion tokens excluded from the loss for that reason;
- ``reward_mean``: mean verifier reward over rollouts that have one (the raw reward, before
  any truncation policy); ``reward_<component>_mean``: mean of each reward component over
  the rollouts that report it (the name lowercased, non-alphanumerics as ``_``);
- ``latency_s_p50``, ``latency_s_p90``, ``latency_s_p99``, ``latency_s_max``:
  submission-to-finish seconds, from `Session.timings["latency_s"]` when present, else
  ``timings["finished"] - timings["submitted"]``; rollouts with neither are skipped;
  percentiles by linear interpolation;
- ``token_lag_mean``, ``token_lag_max``: ``updates - version`` over the packed loss tokens
  (how many updates behind the weights that sampled each trained token are);
- ``non_pad_share``: the packed batch's non-padding share.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np

from pipeline.packing import Group, PackedBatch, Rollout
from pipeline.sessions import Status

_STATUSES = (Status.COMPLETED, Status.AGENT_ERROR, Status.TRUNCATED)


def latency_s(timings: Mapping[str, float]) -> float | None:
    """Submission-to-finish seconds of one rollout, or None without the timings."""
    if "latency_s" in timings:
        return float(timings["latency_s"])
    if "submitted" in timings and "finished" in timings:
        return float(timings["finished"]) - float(timings["submitted"])
    return None


def _component_key(name: str) -> str:
    return "reward_" + re.sub(r"[^0-9a-z]+", "_", name.lower()).strip("_") + "_mean"


def _merge_ratio(rollouts: Sequence[Rollout]) -> float:
    chains = [c for r in rollouts for c in r.chains]
    call_tokens = sum([c.call_tokens for c in chains])
    return 1.0 - sum([len(c.tokens) for c in chains]) / call_tokens if call_tokens else 0.0


def _masking(groups: Sequence[Group], rollouts: Sequence[Rollout], packed: PackedBatch) -> dict[str, float]:
    """Share of rollouts, and of their completion tokens, that do not train."""
    if len(rollouts) == len(packed.rollout_group):  # these are the packed rollouts (usually)
        completion = packed.completion_tokens  # their chains' (empty ones aside)
        if packed.rollout_trained.all():
            masked: list[Rollout] = []
        else:
            masked = _masked(groups, packed)
    else:  # a group id admitted twice, one of them not packed: each rollout by its key
        completion = _completion_tokens(rollouts)
        masked = _masked(groups, packed)
    out: dict[str, float] = {}
    if rollouts:
        out["masked_share"] = len(masked) / len(rollouts)
    if completion:
        out["masked_token_share"] = (_completion_tokens(masked) if masked else 0) / completion
    return out


def _masked(groups: Sequence[Group], packed: PackedBatch) -> list[Rollout]:
    """The rollouts of `groups` that do not train, by (group, sample) in `packed`."""
    trained = dict(zip(zip(packed.rollout_group.tolist(), packed.rollout_sample.tolist(), strict=True),
                       packed.rollout_trained.tolist(), strict=True))
    return [r for g in groups for r in g.rollouts if not trained.get((g.group, r.sample), True)]


def _completion_tokens(rollouts: Sequence[Rollout]) -> int:
    """The completion (loss) tokens of the rollouts' chains."""
    return sum(c.loss_tokens for r in rollouts for c in r.chains)


def _rewards(rollouts: Sequence[Rollout]) -> dict[str, float]:
    out: dict[str, float] = {}
    rewards = [r.reward for r in rollouts if r.reward is not None]
    if rewards:
        out["reward_mean"] = math.fsum(rewards) / len(rewards)
    components: dict[str, list[float]] = defaultdict(list)
    for r in rollouts:
        for name, value in r.components.items():
            components[_component_key(name)].append(float(value))
    out.update({key: math.fsum(values) / len(values) for key, values in sorted(components.items())})
    return out


def _latency(rollouts: Sequence[Rollout]) -> dict[str, float]:
    values = [v for v in (latency_s(r.timings) for r in rollouts) if v is not None]
    if not values:
        return {}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {
        "latency_s_p50": float(p50),
        "latency_s_p90": float(p90),
        "latency_s_p99": float(p99),
        "latency_s_max": float(max(values)),
    }


def _token_lag(packed: PackedBatch, updates: int) -> dict[str, float]:
    spans = packed.spans
    if spans is not None:  # each chain's loss tokens one span of one version: read per segment
        trained = packed.rollout_trained[packed.segment_table.rollout]
        counts, versions = spans.n[trained], spans.version[trained]
        count = int(counts.sum())
        lowest = int(versions.min()) if count else 0
        version_sum = int(np.dot(counts, versions))
    else:
        versions = packed.cells("versions")[packed.cells("loss_mask")]  # the padding has no loss
        count = versions.size
        lowest = int(versions.min()) if count else 0
        version_sum = int(np.add.reduce(versions, dtype=np.int64))
    if not count:
        return {}
    # the lags' sum, exact in int64: the mean is that sum over the count, as numpy's mean gives
    lag_sum = updates * count - version_sum
    return {"token_lag_mean": lag_sum / count, "token_lag_max": float(updates - lowest)}


def session_metrics(admitted: Sequence[Group], packed: PackedBatch, *, updates: int) -> dict[str, float]:
    """The metrics of one trainer call (module docstring). `updates` is the trainer's
    update count at this call."""
    packed_ids = set(packed.groups)
    groups = [g for g in admitted if g.group in packed_ids]
    rollouts = [r for g in groups for r in g.rollouts]
    out: dict[str, float] = {"rollouts": float(len(rollouts)), "merge_ratio": _merge_ratio(rollouts)}
    if rollouts:
        statuses = [r.status for r in rollouts]
        for status in _STATUSES:
            out[f"share_{status.value}"] = statuses.count(status) / len(rollouts)
    out.update(_masking(groups, rollouts, packed))
    out.update(_rewards(rollouts))
    out.update(_latency(rollouts))
    out.update(_token_lag(packed, updates))
    out["non_pad_share"] = packed.non_pad_share
    return out
