"""`rollstream`: the command line. Each subcommand parses its arguments and calls one
function of the module that owns the role."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from pipeline.config import ConfigError, SchedulerConfig, build


def _demo(args: argparse.Namespace) -> int:
    from pipeline.simulate import StepReport, Workload, run

    config = build(SchedulerConfig, {
        "admission": args.admission, "groups": args.groups, "oversample": args.oversample,
        "ahead": args.ahead, "max_lag": args.ahead, "batch_size": args.batch_size,
        "timeout_s": args.timeout_s,
    })
    workload = Workload(slots=args.slots, batch_size=args.batch_size, seed=args.seed)

    def show(report: StepReport) -> None:
        rec = dataclasses.asdict(report.record)
        if args.json:
            print(json.dumps({"step": report.step, "time_s": round(report.time_s, 3), **rec}))
            return
        resub = ",".join(f"{k}={v}" for k, v in rec["resubmitted"].items() if v) or "-"
        print(f"step {report.step:4d}  t={report.time_s:9.1f}s  groups={rec['groups']:3d}  "
              f"version={rec['version']:3d}  lag={rec['lag']}  waited={rec['waited']:7.1f}s  "
              f"cancelled={rec['cancelled']:3d}  abandoned={rec['abandoned']}  resubmitted={resub}")

    if not args.json:
        print(f"rollstream demo: the scheduling core over a simulated workload "
              f"({args.admission} admission, {args.slots} slots, log-normal sessions, "
              f"median {workload.median_s:g}s, virtual clock)")
    summary = run(config, workload, args.steps, show)
    print(json.dumps({"summary": summary}) if args.json else f"summary: {json.dumps(summary)}")
    return 0


def _bench_pack(args: argparse.Namespace) -> int:
    from pipeline import bench_pack

    return bench_pack.main(["--json"] if args.json else [])


def _bench_scale(args: argparse.Namespace) -> int:
    from pipeline import bench_scale

    return bench_scale.main((["--json"] if args.json else []) + ["--events", str(args.events)])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollstream", description=__doc__)
    p.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the scheduling core over a synthetic workload")
    demo.add_argument("--steps", type=int, default=20)
    demo.add_argument("--admission", choices=["batch", "stream"], default="batch")
    demo.add_argument("--groups", type=int, default=4)
    demo.add_argument("--oversample", type=int, default=1)
    demo.add_argument("--ahead", type=int, default=1)
    demo.add_argument("--batch-size", type=int, default=8)
    demo.add_argument("--slots", type=int, default=64)
    demo.add_argument("--timeout-s", type=float, default=300.0)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", action="store_true", help="one JSON record per line")
    demo.set_defaults(run=_demo)

    bench = sub.add_parser("bench", help="benchmarks that print JSON")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    pack = bench_sub.add_parser("pack", help="non-pad share and packing time per length mix")
    pack.add_argument("--json", action="store_true")
    pack.set_defaults(run=_bench_pack)
    scale = bench_sub.add_parser("scale", help="scheduler cost per event, 1k to 100k in flight")
    scale.add_argument("--json", action="store_true")
    scale.add_argument("--events", type=int, default=20_000)
    scale.set_defaults(run=_bench_scale)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except ConfigError as exc:
        print(f"rollstream: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
