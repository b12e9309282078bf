"""`rollstream`: the command line. Each subcommand parses its arguments and calls one
function of the module that owns the role."""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import logging
import os
import sys

from pipeline.config import (
    AdmissionConfig, ConfigError, ConsumerConfig, RedisConfig, SchedulerConfig, build, load, load_redis_section,
)
from pipeline.errors import guarded


SIMULATE_ONLY = {"admission": "batch", "oversample": 1, "ahead": 1, "timeout_s": 300.0,
                 "groups": 4, "batch_size": 8, "slots": 64, "steps": 20}
"""`rollstream simulate`'s defaults without `--frontier`."""
PER_POLICY = ("admission", "oversample", "ahead", "timeout_s")
"""The options `--frontier` sets per policy and `max_lag` itself, so it refuses them."""
FRONTIER_ONLY = ("policies", "plot", "seeds", "stream_config", "jobs")
"""`rollstream simulate --frontier`'s own options."""


def _given(args: argparse.Namespace, names) -> list[str]:
    return ["--" + n.replace("_", "-") for n in names if getattr(args, n) is not None]


def _simulate(args: argparse.Namespace) -> int:
    from rollstream.simulate import StepReport, Workload, run

    if args.frontier:
        return _simulate_frontier(args)
    if given := _given(args, FRONTIER_ONLY):
        raise ConfigError(f"{', '.join(given)}: only with --frontier")
    for name, default in SIMULATE_ONLY.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    config = build(SchedulerConfig, {
        "admission": args.admission, "groups": args.groups, "oversample": args.oversample,
        "ahead": args.ahead, "max_lag": args.ahead, "batch_size": args.batch_size,
        "timeout_s": args.timeout_s,
    })
    workload = Workload(slots=args.slots, batch_size=args.batch_size, seed=args.seed,
                        **({} if args.median_ms is None else {"median_s": args.median_ms / 1000}),
                        **({} if args.sigma is None else {"sigma": args.sigma}))

    def show(report: StepReport) -> None:
        rec = report.record.fields()
        if args.json:
            print(json.dumps({"step": report.step, "time_s": round(report.time_s, 3), **rec}))
            return
        resub = ",".join(f"{k}={v}" for k, v in rec["resubmitted"].items() if v) or "-"
        print(f"step {report.step:4d}  t={report.time_s:9.1f}s  groups={rec['groups']:3d}  "
              f"version={rec['version']:3d}  lag={rec['lag']}  waited={rec['waited']:7.1f}s  "
              f"cancelled={rec['cancelled']:3d}  abandoned={rec['abandoned']}  resubmitted={resub}")

    if not args.json:
        print(f"rollstream simulate: the scheduling core over a simulated workload "
              f"({args.admission} admission, {args.slots} slots, log-normal sessions, "
              f"median {workload.median_s:g}s, virtual clock)")
    summary = run(config, workload, args.steps, show)
    print(json.dumps({"summary": summary}) if args.json else f"summary: {json.dumps(summary)}")
    return 0


def _simulate_frontier(args: argparse.Namespace) -> int:
    """`rollstream simulate --frontier`: `bench schedule --frontier`'s workload and figures
    from the pure scheduler on a virtual clock."""
    from rollstream import bench_schedule
    from rollstream.sim_workers import default_workers

    if given := _given(args, PER_POLICY):
        raise ConfigError(f"{', '.join(given)}: not with --frontier, which sets them per policy and "
                          "max_lag (the stream policy's fields: --stream-config)")
    try:
        workload = bench_schedule.workload_for(
            False, steps=args.steps, median_ms=args.median_ms, sigma=args.sigma, slots=args.slots,
            procs=None if args.slots is None else 1,  # no processes to divide the slots among
            groups=args.groups, batch_size=args.batch_size, seed=args.seed, stream_config=args.stream_config)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    policies = tuple(x for x in (args.policies or ",".join(bench_schedule.POLICIES)).split(",") if x)
    unknown = set(policies) - set(bench_schedule.POLICIES)
    if unknown:
        raise SystemExit(f"unknown policies: {sorted(unknown)}")
    seeds = 1 if args.seeds is None else args.seeds
    if seeds < 1:
        raise SystemExit("--seeds must be >= 1")
    jobs = default_workers() if args.jobs is None else args.jobs
    if jobs < 1:
        raise ConfigError(f"--jobs must be >= 1 (got {jobs})")
    result = bench_schedule.simulate_frontier(workload, policies, seeds=seeds, workers=jobs)
    if args.plot:
        bench_schedule.plot_frontier(result, args.plot)
    print(json.dumps(result) if args.json else bench_schedule.format_frontier(result))
    return 0


def _bench_pack(args: argparse.Namespace) -> int:
    from rollstream import bench_pack

    return bench_pack.main(["--json"] if args.json else [])


def _bench_scale(args: argparse.Namespace) -> int:
    from rollstream import bench_scale

    return bench_scale.run_from_args(args)


def _bench_schedule(args: argparse.Namespace) -> int:
    from rollstream import bench_schedule

    return bench_schedule.run_from_args(args)


def _bench_admission(args: argparse.Namespace) -> int:
    from rollstream import bench_admission

    return bench_admission.run_from_args(args)


def _bench_consumer(args: argparse.Namespace) -> int:
    from rollstream import bench_consumer

    return bench_consumer.run_from_args(args)


def _bench_vllm(args: argparse.Namespace) -> int:
    from rollstream import bench_vllm

    return bench_vllm.run_from_args(args)


def _override(config, model, **values):
    """`config` with the command line's values (those given) applied, validated again."""
    given = {k: v for k, v in values.items() if v is not None}
    return build(model, {**config.model_dump(), **given}) if given else config


def _admission(args: argparse.Namespace) -> int:
    from consumers import admission

    config = _override(load(AdmissionConfig, args.config), AdmissionConfig, shard=args.shard)
    return admission.main(config, snapshot_every=args.snapshot_every)


def _consumer(args: argparse.Namespace) -> int:
    from consumers import rollout

    config = _override(load(ConsumerConfig, args.config), ConsumerConfig,
                       source=args.source, slots=args.slots)
    return rollout.main(config, name=args.name)


def _trainer(args: argparse.Namespace) -> int:
    from trainer import main as trainer_main
    from trainer.run_config import RunConfig

    config = _override(load(RunConfig, args.config), RunConfig, steps=args.steps)
    return trainer_main.main(config)


def _status(args: argparse.Namespace) -> int:
    from rollstream import status
    from pipeline.keys import Keys
    from pipeline.redis_io import check, connect

    if args.config:
        config = load_redis_section(args.config)
    else:
        config = build(RedisConfig, {"url": args.url, "namespace": args.namespace})
    r = connect(config)
    check(r, config)
    return status.main(r, Keys(config.namespace), config.url, shards=args.shards, as_json=args.json)


def _engine(args: argparse.Namespace) -> int:
    from consumers import cpu_engine as engine

    return engine.main(args)


def _gateway(args: argparse.Namespace) -> int:
    from consumers import gateway

    return gateway.main(args)


def _chart_run(args: argparse.Namespace) -> int:
    from rollstream import chart_run

    return chart_run.run_from_args(args)


def _alert_rules(args: argparse.Namespace) -> int:
    from rollstream import chart_run

    return chart_run.alert_rules_from_args(args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollstream", description=__doc__)
    p.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo", add_help=False,
        help="the main job: embedded Redis, the pipeline and a one-rank DeepSpeed trainer "
             "learning a toy task (rollstream demo --help for its options)")
    demo.set_defaults(run=None)  # main() hands `rollstream demo ...` to rollstream.demo
    chaos = sub.add_parser(
        "chaos", add_help=False,
        help="a real multi-process run under faults (kills, a Redis restart, a trainer resume), "
             "then an audit of trained tasks (rollstream chaos --help)")
    chaos.set_defaults(run=None)  # main() hands `rollstream chaos ...` to rollstream.chaos

    tune = sub.add_parser(
        "tune", add_help=False,
        help="the stream setting that does best on your sessions' shape, slots and max_lag, by "
             "simulation (rollstream tune --help)")
    tune.set_defaults(run=None)  # main() hands `rollstream tune ...` to rollstream.tune
    sim = sub.add_parser("simulate", help="the scheduling core over a simulated heavy-tailed workload")
    from rollstream.bench_schedule import add_stream_config, add_workload_arguments
    from rollstream.simulate import Workload

    sim.add_argument("--steps", type=int, help="trainer steps (default 20; --frontier: 30, as bench schedule)")
    sim.add_argument("--admission", choices=["batch", "stream"], help="(default batch)")
    sim.add_argument("--oversample", type=int, help="(default 1)")
    sim.add_argument("--ahead", type=int, help="(default 1)")
    sim.add_argument("--timeout-s", type=float, help="(default 300)")
    add_workload_arguments(sim, {**{k: SIMULATE_ONLY[k] for k in ("slots", "groups", "batch_size")},
                                 "median_ms": Workload.median_s * 1000})
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--json", action="store_true", help="one JSON record per line")
    sim.add_argument("--frontier", action="store_true",
                     help="bench schedule's workload (or the one --slots, --groups, --batch-size, "
                          "--median-ms and --sigma give), every policy at max_lag 1, 2, 4 (one "
                          "JSON), and the least-waste bound at batch's share, and the most any "
                          "policy trains at half batch's waste share")
    sim.add_argument("--policies", help="--frontier: comma-separated subset (default: all)")
    sim.add_argument("--plot", help="--frontier: write the frontier plot here")
    sim.add_argument("--seeds", type=int,
                     help="--frontier: every point the mean over seeds --seed .. --seed + N - 1")
    sim.add_argument("--jobs", type=int,
                     help="--frontier: simulations run at once, in as many worker processes (default: "
                          "the CPUs this process may use, within its cgroup's CPU quota)")
    add_stream_config(sim)
    sim.set_defaults(run=_simulate)

    adm = sub.add_parser("admission", help="run one shard's admission consumer")
    adm.add_argument("--config", required=True, help="AdmissionConfig YAML or JSON")
    adm.add_argument("--shard", type=int, help="override the config's shard (a trainer rank)")
    adm.add_argument("--snapshot-every", type=int, help="transitions between scheduler snapshots (overrides the config)")
    adm.set_defaults(run=_admission)

    con = sub.add_parser("consumer", help="run a stateless rollout consumer")
    con.add_argument("--config", required=True, help="ConsumerConfig YAML or JSON")
    con.add_argument("--source", help="module:factory of the SessionSource (overrides the config)")
    con.add_argument("--slots", type=int, help="concurrent sessions (overrides the config)")
    con.add_argument("--name", help="the consumer's name (default: host-pid-random)")
    con.set_defaults(run=_consumer)

    tr = sub.add_parser("trainer", help="run one trainer process (a DeepSpeed rank; under torchrun for several)")
    tr.add_argument("--config", required=True, help="RunConfig YAML or JSON (trainer/run_config.py)")
    tr.add_argument("--steps", type=int, help="override the config's steps")
    tr.set_defaults(run=_trainer)

    st = sub.add_parser("status", help="streams, groups, pending work and versions of a run")
    st.add_argument("--config", help="any process's config file (its redis section is used)")
    st.add_argument("--url", default="redis://127.0.0.1:6379/0")
    st.add_argument("--namespace", default="default")
    st.add_argument("--shards", type=int, default=1)
    st.add_argument("--json", action="store_true")
    st.set_defaults(run=_status)

    eng = sub.add_parser("engine", help="a small OpenAI-compatible inference server on CPU (token ids, "
                                        "log-probs, weight versions) for harnesses and tests")
    eng.add_argument("--model", default="tiny",
                     help="tiny | a trainer ModelConfig YAML/JSON | a Hugging Face directory (config.json)")
    eng.add_argument("--host", default="127.0.0.1")
    eng.add_argument("--port", type=int, default=8001)
    eng.add_argument("--max-tokens", type=int, default=16, help="a request's max_tokens when it gives none")
    eng.add_argument("--weights-redis", help="load each version announced on this Redis's weights stream")
    eng.add_argument("--namespace", default="default", help="the run's namespace (with --weights-redis)")
    eng.add_argument("--redis-config", help="instead of --weights-redis: follow the run that the redis section "
                                            "of a process config file names (its user, password source, TLS)")
    eng.add_argument("--weights-dir", help="load the newest v<N>.safetensors a DirectoryPublisher writes here")
    eng.add_argument("--threads", type=int, help="torch CPU threads")
    eng.set_defaults(run=_engine)

    gw = sub.add_parser("gateway", help="the recording gateway: per-session OpenAI base URLs in front "
                                        "of the engines, recording every call")
    gw.add_argument("--engine", action="append", required=True, help="an engine's base URL (repeat for several)")
    gw.add_argument("--host", default="127.0.0.1")
    gw.add_argument("--port", type=int, default=8000)
    gw.add_argument("--timeout-s", type=float, default=600.0, help="per forwarded call")
    gw.add_argument("--health-interval-s", type=float, default=2.0, help="how often a down engine is probed")
    gw.add_argument("--session-ttl-s", type=float, default=3600.0, help="idle sessions are dropped after this")
    gw.add_argument("--temperature", type=float, help="force this sampling temperature (the trainer's) on every call")
    gw.set_defaults(run=_gateway)

    from rollstream import chart_run

    chart = sub.add_parser("chart-run", help="render the Helm chart and run every workload it renders as local "
                                             "processes: probes, a few trainer steps, the helm test hook")
    chart_run.add_arguments(chart)
    chart.set_defaults(run=_chart_run)
    rules = sub.add_parser("alert-rules", help="the chart's alerts for one run as a Prometheus rule file "
                                               "(for a Prometheus outside Kubernetes)")
    chart_run.add_alert_arguments(rules)
    rules.set_defaults(run=_alert_rules)

    bench = sub.add_parser("bench", help="benchmarks that print JSON")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    pack = bench_sub.add_parser("pack", help="non-pad share and packing time per length mix")
    pack.add_argument("--json", action="store_true")
    pack.set_defaults(run=_bench_pack)
    from rollstream import bench_admission, bench_scale, bench_schedule

    scale = bench_sub.add_parser("scale", help="scheduler cost per event, 1k to 100k in flight")
    bench_scale.add_arguments(scale)
    scale.set_defaults(run=_bench_scale)

    schedule = bench_sub.add_parser("schedule", help="sync, group, batch and stream policies on the whole pipeline")
    bench_schedule.add_arguments(schedule)
    schedule.set_defaults(run=_bench_schedule)
    admission_bench = bench_sub.add_parser("admission", help="admission + packing against the raw Redis floor")
    bench_admission.add_arguments(admission_bench)
    admission_bench.set_defaults(run=_bench_admission)
    from rollstream import bench_consumer

    consumer_bench = bench_sub.add_parser("consumer", help="a rollout consumer's overhead against the raw Redis floor")
    bench_consumer.add_arguments(consumer_bench)
    consumer_bench.set_defaults(run=_bench_consumer)
    from rollstream import bench_vllm

    vllm_bench = bench_sub.add_parser("vllm", help="a real vLLM server: push seconds, tokens/s, mismatch")
    bench_vllm.add_arguments(vllm_bench)
    vllm_bench.set_defaults(run=_bench_vllm)
    learn = bench_sub.add_parser(
        "learn", add_help=False, help="sync, batch and stream training: reward per sample and per "
        "second (rollstream bench learn --help for its options)")
    learn.set_defaults(run=None)  # main() hands `rollstream bench learn ...` to rollstream.bench_learn
    return p


OWN_PARSERS = {("demo",): "rollstream.demo", ("bench", "learn"): "rollstream.bench_learn",
               ("chaos",): "rollstream.chaos", ("tune",): "rollstream.tune"}
"""Commands handed whole to a module's own `main(argv)`, by their leading words."""


def _leading_level(argv: list[str]) -> tuple[str | None, list[str]]:
    """The `--log-level` given before the command (None: not given), and the rest."""
    if argv[:1] == ["--log-level"] and len(argv) > 1:
        return argv[1], argv[2:]
    if argv[:1] and argv[0].startswith("--log-level="):
        return argv[0].split("=", 1)[1], argv[1:]
    return None, argv


def _set_level(given: str) -> str:
    """Configures logging at `given` (any case); its name, or a usage error (exit 2)."""
    level = given.upper()
    if not isinstance(logging.getLevelName(level), int):
        parser().error(f"--log-level {given}: not a logging level (DEBUG, INFO, WARNING, ERROR)")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return level


def main(argv: list[str] | None = None) -> int:
    """Run one command. Its configuration, credential, connection, import, bind and model
    errors end in one line naming what to fix and exit code 2 (what was given cannot run)
    or 1 (it cannot run now); `--log-level DEBUG` adds the traceback (`pipeline.errors`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # a module the config names (a source, a verifier) may live in the current folder, as
    # under `python -m`; searched last, so it never shadows an installed package
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    level, rest = _leading_level(argv)
    for words, module in OWN_PARSERS.items():  # these parse their own options (CMD --help)
        if tuple(rest[:len(words)]) == words:
            debug = level is not None and _set_level(level) == "DEBUG"
            run = functools.partial(importlib.import_module(module).main, rest[len(words):])
            return guarded("rollstream " + " ".join(words), run, debug=debug)
    args = parser().parse_args(argv)
    level = _set_level(args.log_level)
    return guarded(f"rollstream {args.command}", lambda: args.run(args), debug=level == "DEBUG",
                   config=getattr(args, "config", None) or getattr(args, "redis_config", None))


if __name__ == "__main__":
    sys.exit(main())
