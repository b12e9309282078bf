"""`rollstream tune`: the stream setting that does best on your workload, by simulation.

The stream settings of `docs/operations.md` were tuned on one workload (log-normal sessions
of shape 1, 256 slots, steps of 32 groups of 8, staleness counted from a session's last
call). On another shape the best setting differs: at shape 1.5 and `max_lag` 1 the
recommended `group_start: handover` trains less than `replace` alone. This command runs
every setting of `SETTINGS` and the `batch` policy (`oversample` 2, the frontier's
reference) through the pure scheduler on a virtual clock (`bench_schedule.simulate_policy`,
what `rollstream simulate --frontier` runs) on the sessions, slots, group size, step size,
trainer step time and `max_lag` given, and picks one:

- by default (the frontier's goal: at least `batch`'s share of the capacity bound at no more
  than half its waste share), the setting with the least waste share among those that
  train at least `batch`'s share (waste shares within half a hundredth of the least count
  as equal, and then the most share wins); if none does, the one nearest the goal: the least of the
  larger of two ratios, `batch`'s share over the setting's and the setting's waste share
  over half `batch`'s (`distance`);
- with `--max-waste W`, the setting that trains most at a waste share of at most W (shares
  within half a hundredth of the most count as equal, and then the least waste wins); if
  none wastes that little, the one that wastes least.

Where the pick has a knob (`KNOBS`), `tune` then tries the knob's values halfway to the
nearest tried on either side, or one step past the grid's end (`neighbours`), and picks
again from all the settings tried (`--refine` rounds). The simulations run in worker
processes (`rollstream.sim_workers`, `--jobs`), with the same figures as in one process.

It prints every setting's figures, on how many of the draws the chosen one met each half of
the goal against `batch` on the same sessions (`draws`), and its `scheduler` fields, to merge
into the `scheduler` section of the trainer's config and every admission consumer's. The
workload comes from the options, or from a running pipeline's Prometheus (`--prometheus`,
one run's series picked by `--select`; `rollstream.session_shape`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipeline.config import SchedulerConfig, build, load_scheduler_section
from pipeline.errors import ConfigError
from rollstream.bench_schedule import policy_config, workload_for
from rollstream.session_shape import ENDED, from_prometheus
from rollstream.sim_workers import default_workers, simulate_over_seeds

Z90 = 1.2815515655446004
"""The standard normal's 0.9 quantile: a log-normal's p90 over its p50 is exp(sigma x Z90)."""

FIGURES = ("capacity_share", "waste_share", "trained_length_vs_workload", "lag_max")
"""The figures reported per setting (`bench_schedule._report`'s names)."""


@dataclass(frozen=True)
class Setting:
    """A stream setting: `scheduler` fields over the stream policy's (`policy_config`), and
    the samples kept in flight as a multiple of the slots; `family` and `value` name the
    knob it was made from (`KNOBS`), where it has one."""

    name: str
    fields: dict
    inflight: float | None = 1.0
    family: str = ""
    value: float | None = None

    def inflight_samples(self, workload: dict) -> int | None:
        """The multiple of the slots, and at least one group with its extra samples; None:
        the fields' own `inflight_samples`, or the scheduler's default."""
        if self.inflight is None:
            return None
        return max(workload["groups"] + self.fields.get("oversample", 0), round(self.inflight * workload["slots"]))


CURRENT = "current"
"""The row of the setting `--current` reads from a config file."""

_WORKLOAD_FIELDS = ("groups", "batch_size", "max_lag", "width", "rows")
"""The scheduler fields the workload sets for every setting, a current one included."""


def current_setting(config: SchedulerConfig) -> Setting:
    """A config file's `scheduler` section as a setting: every field of it over the stream
    policy's (its admission, `ahead` and samples in flight included), but those the workload
    sets."""
    fields = {k: v for k, v in config.model_dump(mode="json").items() if k not in _WORKLOAD_FIELDS}
    return Setting(CURRENT, fields, None)


@dataclass(frozen=True)
class Knob:
    """A family of settings over one knob: the `field` of the `scheduler` section, or where
    it is None the samples in flight as a multiple of the slots. `grid` is what `tune`
    tries first, `low` and `top` the knob's range (`top` None: unbounded)."""

    fields: dict
    field: str | None
    grid: tuple[float, ...]
    low: float
    top: float | None

    def setting(self, family: str, value: float, stale: str) -> Setting:
        value = round(value, 4)
        fields = {**self.fields, "stale_running": stale}
        if self.field:
            return Setting(f"{family}-{value:g}/{stale}", {**fields, self.field: value}, family=family, value=value)
        return Setting(f"{family}-{value:g}x/{stale}", fields, value, family, value)

    def holds(self, value: float) -> bool:
        return self.low <= value and (self.top is None or value <= self.top)


_REPLACE = {"oversample": 4, "oversample_start": "replace"}
KNOBS = {"replace": Knob(_REPLACE, "replace_ahead", (0.2, 0.3, 0.4, 0.55, 0.7, 0.85), 0.05, 1.0),
         "handover": Knob({**_REPLACE, "replace_ahead": 0.55, "group_start": "handover"}, None,
                          (1.1, 1.2, 1.3, 1.4, 1.5, 1.7), 1.0, None)}
STALE = ("cancel", "finish")
_PLAIN = (
    Setting("plain", {}),
    Setting("oversample-1", {"oversample": 1}),
    Setting("backups", {"oversample": 1, "oversample_start": "straggler"}),
    Setting("backups-1.06x", {"oversample": 1, "oversample_start": "straggler"}, 1.06),
    Setting("backups-2", {"oversample": 2, "oversample_start": "straggler"}, 1.06),
)
SETTINGS = (*(Setting(f"{s.name}/{stale}", {**s.fields, "stale_running": stale}, s.inflight)
              for s in _PLAIN for stale in STALE),
            *(knob.setting(family, value, stale)
              for family, knob in KNOBS.items() for value in knob.grid for stale in STALE))
"""What `tune` tries first: the families the frontier kept or measured (BENCHMARKS.md, "The
staleness-throughput-waste frontier"), over their knobs (`replace_ahead` for replacements,
the samples in flight for groups started at handovers), each with running work past the
bound cancelled and left to finish."""


def neighbours(chosen: Setting, tried: Sequence[Setting]) -> list[Setting]:
    """The settings `tune` tries next around `chosen`: in its family and `stale_running`, the
    knob's values halfway to the nearest tried below and above it, or one gap past it where
    it is the smallest or the largest tried (within the knob's range); none where it has no
    knob."""
    if chosen.value is None:
        return []
    knob, stale, x = KNOBS[chosen.family], chosen.fields["stale_running"], chosen.value
    values = sorted({s.value for s in tried if s.family == chosen.family and s.value is not None
                     and s.fields["stale_running"] == stale})
    below, above = [v for v in values if v < x], [v for v in values if v > x]
    if below and above:
        new = [(below[-1] + x) / 2, (x + above[0]) / 2]
    elif below:
        new = [(below[-1] + x) / 2, x + (x - below[-1])]
    elif above:
        new = [x - (above[0] - x), (x + above[0]) / 2]
    else:
        new = []
    names = {s.name for s in tried}
    made = [knob.setting(chosen.family, v, stale) for v in new if knob.holds(round(v, 4))]
    return [s for s in made if s.name not in names]


def sigma_from_quantiles(p50_ms: float, p90_ms: float) -> float:
    """The log-normal shape whose p90 over its p50 is `p90_ms / p50_ms`."""
    if not 0 < p50_ms < p90_ms:
        raise ConfigError(f"--p90-ms must exceed --median-ms, both above 0 (got {p50_ms:g} and {p90_ms:g})")
    return math.log(p90_ms / p50_ms) / Z90


def scheduler_fields(setting: Setting, workload: dict) -> dict:
    """The chosen setting's `scheduler` fields on `workload` (validated as a SchedulerConfig):
    every field the setting and the workload set, the group and step sizes included, less
    `sync_every` and `backfill` where they keep their defaults."""
    fields = policy_config("stream", workload["groups"], workload["batch_size"], workload["max_lag"],
                           setting.inflight_samples(workload), workload["ahead"], setting.fields)
    config = build(SchedulerConfig, fields)
    defaults = SchedulerConfig()
    return {k: v for k, v in config.model_dump(mode="json").items()
            if k in fields and (k not in ("sync_every", "backfill") or v != getattr(defaults, k))}


def measure(workload: dict, seeds: int, settings: Sequence[Setting] = SETTINGS, workers: int = 1,
            progress: Callable[[str], None] | None = None, reference: dict | None = None) -> dict:
    """`batch` (unless its figures are given as `reference`) and every setting on `workload`,
    each the mean over `seeds` seeds from the workload's, the runs spread over `workers`
    processes; per setting also its share and waste share over `batch`'s."""
    runs = ([] if reference else [("batch", None, None, "batch (oversample 2)")]) + [
        ("stream", s.fields, s.inflight_samples(workload), s.name) for s in settings]
    cases = [(policy, {**workload, "stream_config": stream, "inflight": inflight}) for policy, stream, inflight, _ in runs]
    means = [_figures(mean) for mean in simulate_over_seeds(
        cases, seeds, workers, progress and (lambda i: progress(runs[i][3])))]
    reference = reference or means.pop(0)
    rows = [{"name": setting.name, **figures,
             "share_vs_batch": _ratio(figures["capacity_share"], reference["capacity_share"]),
             "waste_vs_batch": _ratio(figures["waste_share"], reference["waste_share"]),
             "distance": round(distance(reference, figures), 4)}
            for setting, figures in zip(settings, means)]
    return {"reference": reference, "settings": rows}


def _figures(mean: dict) -> dict:
    return {k: mean[k] for k in (*FIGURES, "per_seed") if k in mean}


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def distance(reference: dict, row: dict) -> float:
    """How far `row` is from the frontier's goal (at least `batch`'s share at no more than half
    its waste share): the larger of `batch`'s share over its share and its waste share over
    half `batch`'s. At 1 or below it dominates `batch`."""
    share = reference["capacity_share"] / row["capacity_share"] if row["capacity_share"] else math.inf
    waste = 2 * row["waste_share"] / reference["waste_share"] if reference["waste_share"] else math.inf
    return max(share, waste)


NOISE = 0.005
"""Figures this close count as equal when `choose` picks: half a hundredth, below the noise
of a few simulated draws."""


def choose(reference: dict, rows: list[dict], max_waste: float | None = None) -> dict:
    """The row `tune` picks (see the module docstring). Waste shares within `NOISE` of the
    least count as equal, and then the most share wins (with `max_waste`: shares within
    `NOISE` of the most, and then the least waste)."""
    if max_waste is None:
        fits = [r for r in rows if r["capacity_share"] >= reference["capacity_share"]]
        if fits:
            least = min(r["waste_share"] for r in fits)
            return max((r for r in fits if r["waste_share"] <= least + NOISE),
                       key=lambda r: (r["capacity_share"], -r["waste_share"]))
        return min(rows, key=lambda r: (distance(reference, r), r["waste_share"]))
    fits = [r for r in rows if r["waste_share"] <= max_waste]
    if fits:
        most = max(r["capacity_share"] for r in fits)
        return min((r for r in fits if r["capacity_share"] >= most - NOISE),
                   key=lambda r: (r["waste_share"], -r["capacity_share"]))
    return min(rows, key=lambda r: (r["waste_share"], -r["capacity_share"]))


def draws(reference: dict, row: dict) -> dict | None:
    """Draw by draw (`batch` and `row` on the same sessions): on how many of the seeds `row`
    trained at least `batch`'s share, and wasted at most half its waste share. A pick whose
    means sit near `batch`'s share falls short of it on some draws, and so may on a run's
    own sessions. None for a single seed."""
    ref, own = reference.get("per_seed"), row.get("per_seed")
    if not ref or not own:
        return None
    pairs = list(zip(own["capacity_share"], own["waste_share"], ref["capacity_share"], ref["waste_share"], strict=True))
    return {"seeds": len(pairs),
            "share_at_least_batch": sum(share >= base for share, _, base, _ in pairs),
            "waste_at_most_half_batch": sum(2 * waste <= base for _, waste, _, base in pairs)}


def dominates(reference: dict, row: dict) -> bool:
    """The frontier's goal: at least `batch`'s share at no more than half its waste share."""
    return distance(reference, row) <= 1


def tune(workload: dict, seeds: int, max_waste: float | None = None, refine: int = 1, workers: int = 1,
         progress: Callable[[str], None] | None = None, current: Setting | None = None) -> dict:
    """Every setting of `SETTINGS` (and `current`, a run's own) measured, then `refine`
    rounds of the chosen one's `neighbours`; the one chosen of all and its `scheduler`
    fields (None where the run's own setting is chosen: it is kept)."""
    first = (*SETTINGS, current) if current else SETTINGS
    result = measure(workload, seeds, first, workers=workers, progress=progress)
    tried = {s.name: s for s in first}
    chosen = choose(result["reference"], result["settings"], max_waste)
    for _ in range(refine):
        more = neighbours(tried[chosen["name"]], list(tried.values()))
        if not more:
            break
        rows = measure(workload, seeds, more, workers, progress, result["reference"])["settings"]
        result["settings"] += [{**r, "refined": True} for r in rows]
        tried |= {s.name: s for s in more}
        chosen = choose(result["reference"], result["settings"], max_waste)
    shown = ("slots", "groups", "batch_size", "median_ms", "sigma", "cap", "train_ms", "max_lag",
             "steps", "seed", "call_at_end")
    return {"workload": {k: workload[k] for k in shown} | {"seeds": seeds}
            | {k: workload[k] for k in ("read", "current_config") if k in workload},
            "goal": ("the least waste at batch's share or more" if max_waste is None
                     else f"most share at a waste share of {max_waste:g} or less"),
            **result, "chosen": chosen["name"],
            "dominates_batch": dominates(result["reference"], chosen),
            "chosen_draws": draws(result["reference"], chosen),
            "scheduler": None if chosen["name"] == CURRENT else scheduler_fields(tried[chosen["name"]], workload)}


def format_result(result: dict) -> str:
    w, ref = result["workload"], result["reference"]
    calls = "a session's last call" if w["call_at_end"] else "a session's first call"
    lines = [f"workload: {w['slots']} slots, groups of {w['groups']}, {w['batch_size']} groups a step, "
             f"sessions log-normal (median {w['median_ms']:g} ms, shape {w['sigma']:.3g}), trainer step "
             f"{w['train_ms']:g} ms, max_lag {w['max_lag']} counted from {calls}; "
             f"{w['steps']} simulated steps, seeds {w['seed']}..{w['seed'] + w['seeds'] - 1}",
             *_read_line(w.get("read")),
             *([f"the run's own setting (row {CURRENT}): the scheduler section of {w['current_config']}"]
               if "current_config" in w else []),
             f"goal: {result['goal']}",
             f"{'setting':22s} {'share':>6s} {'waste':>6s} {'length':>6s} {'vs batch':>17s} {'distance':>8s}",
             f"{'batch (oversample 2)':22s} {ref['capacity_share']:6.3f} {ref['waste_share']:6.3f} "
             f"{ref['trained_length_vs_workload']:6.2f}"]
    first_refined = next((r["name"] for r in result["settings"] if r.get("refined")), None)
    for r in result["settings"]:
        if r["name"] == first_refined:
            lines.append("  refined around the pick so far (halfway to its neighbours in its family):")
        mark = "*" if r["name"] == result["chosen"] else " "
        vs = f"{r['share_vs_batch']:.3f}x / {r['waste_vs_batch']:.3f}x" if r["waste_vs_batch"] is not None else "-"
        lines.append(f"{mark}{r['name']:21s} {r['capacity_share']:6.3f} {r['waste_share']:6.3f} "
                     f"{r['trained_length_vs_workload']:6.2f} {vs:>17s} {r['distance']:8.3f}")
    verdict = "meets" if result["dominates_batch"] else "does not meet"
    lines.append(f"chosen: {result['chosen']}; it {verdict} the frontier's goal (at least batch's share "
                 "at no more than half its waste share)")
    if d := result.get("chosen_draws"):
        lines.append(f"  draw by draw, against batch on the same sessions: at least its share on "
                     f"{d['share_at_least_batch']} of {d['seeds']}, at most half its waste share on "
                     f"{d['waste_at_most_half_batch']} of {d['seeds']}"
                     + ("" if min(d["share_at_least_batch"], d["waste_at_most_half_batch"]) == d["seeds"]
                        else " (near the edge: more --seeds tell how often)"))
    rows = {r["name"]: r for r in result["settings"]}
    if result["scheduler"] is None:
        return "\n".join([*lines, "the run's own setting (--current) does best: keep its scheduler section"])
    if CURRENT in rows:
        pick, now = rows[result["chosen"]], rows[CURRENT]
        lines.append(f"against the run's own setting (--current): share {_against(pick, now, 'capacity_share')}, "
                     f"waste share {_against(pick, now, 'waste_share')}")
    return "\n".join([*lines, "scheduler fields to merge into the trainer's and every admission consumer's config:",
                      "  scheduler: " + json.dumps(result["scheduler"])])


def _against(row: dict, base: dict, figure: str) -> str:
    ratio = f" ({row[figure] / base[figure]:.3f}x)" if base[figure] else ""
    return f"{row[figure]:.3f} against {base[figure]:.3f}{ratio}"


DEFAULTS = {"slots": 256, "median_ms": 1000.0, "sigma": 1.0, "train_ms": 20.0}
"""The workload where neither an option nor `--prometheus` gives it (`bench schedule`'s
frontier workload)."""


def _read_line(read: dict | None) -> list[str]:
    if not read:
        return []
    cut = sum(n for status, n in read["sessions"].items() if status not in ENDED)
    train = "no trainer series" if read["train_ms"] is None else f"step and push {read['train_ms']:g} ms"
    return [f"read from {read['url']} over {read['window']}: {sum(read['sessions'].values())} sessions "
            f"({cut} cut short), median {read['median_ms']:g} ms, shape {read['sigma']:.3g}; "
            f"{read['slots']} slots a shard over {read['shards']} shard(s); {train} "
            "(options given explicitly win)"]


def _workload(args: argparse.Namespace) -> tuple[dict, Setting | None]:
    """The workload to tune on: each option given, else what `--current`'s config or
    `--prometheus` read, else `DEFAULTS` (with `read`, what was read); and the setting of
    `--current`'s config (`current_setting`), if given."""
    current = load_scheduler_section(args.current) if args.current else None
    for name, default in (("max_lag", None), ("groups", 8), ("batch_size", 32)):
        given, run = getattr(args, name), getattr(current, name, None)
        if given is not None and run is not None and given != run:
            raise ConfigError(f"--{name.replace('_', '-')} {given} differs from {name} {run} in {args.current}: "
                              "leave the option out to tune on the run's own")
        setattr(args, name, next((v for v in (given, run, default) if v is not None), None))
    if args.max_lag is None:
        raise ConfigError("--max-lag is required (or --current CONFIG, whose max_lag it takes)")
    if args.max_lag < 1:
        raise ConfigError(f"--max-lag must be >= 1 (got {args.max_lag})")
    if args.seeds < 1 or args.steps < 1:
        raise ConfigError(f"--seeds and --steps must be >= 1 (got {args.seeds} and {args.steps})")
    if args.jobs < 1 or args.refine < 0:
        raise ConfigError(f"--jobs must be >= 1 and --refine >= 0 (got {args.jobs} and {args.refine})")
    if args.max_waste is not None and not 0 <= args.max_waste < 1:
        raise ConfigError(f"--max-waste must be in [0, 1) (got {args.max_waste:g})")
    if args.sigma is not None and args.p90_ms is not None:
        raise ConfigError("--sigma and --p90-ms: give one (the shape, or the p90 it comes from)")
    read = from_prometheus(args.prometheus, args.window, select=args.select) if args.prometheus else {}
    value = {k: next(v for v in (getattr(args, k), read.get(k), default) if v is not None)
             for k, default in DEFAULTS.items()}
    if args.p90_ms is not None:
        value["sigma"] = sigma_from_quantiles(value["median_ms"], args.p90_ms)
    for name in ("slots", "groups", "batch_size", "median_ms", "sigma"):
        given = value.get(name, getattr(args, name))
        if given <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0 (got {given:g})")
    if value["train_ms"] < 0:
        raise ConfigError(f"--train-ms must be >= 0 (got {value['train_ms']:g})")
    workload = workload_for(False, procs=1, groups=args.groups, batch_size=args.batch_size,
                            steps=args.steps, seed=args.seed, ahead=args.max_lag,
                            max_lag=args.max_lag, **value)
    workload = {**workload, "call_at_end": args.calls == "end", **({"read": read} if read else {}),
                **({"current_config": str(args.current)} if current else {})}
    return workload, current_setting(current) if current else None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollstream tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--max-lag", type=int, help="the run's max_lag (ahead is set to it; default: --current's)")
    p.add_argument("--current", metavar="CONFIG",
                   help="the trainer's or an admission consumer's config file: its scheduler section is "
                   "simulated beside the settings (the row 'current'; kept where it does best), and its "
                   "group size, max_lag and, where it gives one, step size are the workload's")
    p.add_argument("--prometheus", metavar="URL",
                   help="read the sessions' shape (a log-normal fit in which cancelled sessions count as "
                   "cut short), the slots per shard and the trainer's step and push from the run's "
                   "Prometheus, over --window; an option given explicitly wins over what is read")
    p.add_argument("--window", default="1h", help="--prometheus: the PromQL range read (default 1h)")
    p.add_argument("--select", default="", metavar="MATCHERS",
                   help="--prometheus: PromQL label matchers that pick the run where the Prometheus "
                   "scrapes several, e.g. 'namespace=\"rl\", release=\"rs\"' (the labels the chart's "
                   "monitors give); without it, several runs' sessions are refused, not mixed")
    p.add_argument("--slots", type=int,
                   help="session slots serving the shard: all consumers' slots over the shards "
                   f"(default {DEFAULTS['slots']})")
    p.add_argument("--groups", type=int, help="samples per group (default: --current's, else 8)")
    p.add_argument("--batch-size", type=int,
                   help="groups (tasks) per step and shard (default: --current's, else 32)")
    p.add_argument("--median-ms", type=float,
                   help=f"the sessions' median (p50) in milliseconds (default {DEFAULTS['median_ms']:g})")
    p.add_argument("--sigma", type=float, help=f"the sessions' log-normal shape (default {DEFAULTS['sigma']:g})")
    p.add_argument("--p90-ms", type=float, help="the sessions' p90 in milliseconds, instead of --sigma: "
                   "sigma = ln(p90 / p50) / 1.28, of the sessions' lengths uncut (--prometheus fits it)")
    p.add_argument("--train-ms", type=float,
                   help=f"the trainer's step, from the rows' arrival to its push (default {DEFAULTS['train_ms']:g})")
    p.add_argument("--calls", choices=("end", "start"), default="end",
                   help="when a session's staleness starts: its one call as it ends, as SleepSource "
                   "(end, the default), or a first call at once, as an agent's (start)")
    p.add_argument("--max-waste", type=float,
                   help="pick the setting that trains most at this waste share or less (default: the "
                   "least waste at batch's share or more)")
    p.add_argument("--steps", type=int, default=100, help="simulated steps per run (default 100)")
    p.add_argument("--seeds", type=int, default=3, help="runs per setting, seeds --seed on (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--refine", type=int, default=1,
                   help="rounds of settings tried around the pick, halfway to its neighbours in its "
                   "family's knob (replace_ahead, or the samples in flight), or one step past the grid's "
                   "end (default 1; 0: the grid alone)")
    p.add_argument("--jobs", type=int, default=default_workers(),
                   help="simulations run at once, in as many worker processes (default: the CPUs "
                   "this process may use, within its cgroup's CPU quota; here %(default)s)")
    p.add_argument("--json", action="store_true", help="print the result as JSON only")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    workload, current = _workload(args)

    def progress(name: str) -> None:
        print(f"  simulated {name}", file=sys.stderr, flush=True)

    result = tune(workload, args.seeds, args.max_waste, args.refine, args.jobs, None if args.json else progress,
                  current)
    print(json.dumps(result) if args.json else format_result(result))
    return 0
