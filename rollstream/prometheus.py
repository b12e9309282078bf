"""A local Prometheus server (Debian's `prometheus` package, or any `prometheus` binary on
PATH) and the Grafana dashboard's panel queries, for the integration tests and
`rollstream.dashboard_plot`.

    with Prometheus(folder, ["127.0.0.1:9400", ...]) as prom:    # scrapes every second
        prom.wait_scraped()
        prom.query("rollstream_samples_in_flight")                # instant vector
        prom.query_range(expr, start, end, step_s=2.0)            # matrix

`labels` gives a target's series the labels the chart's monitors would (namespace,
release, component), and `rules` loads rule files, evaluated every scrape (`rules_state()`: each
rule's health and, for an alert, its state).

`panels()` reads `helm/rollstream/dashboards/rollstream.json`: each panel's row, title,
unit and `(expr, legend)` targets; `promql(expr, rate_interval)` makes a panel expression
plain PromQL (all shards, every run or the one named, a fixed rate window), as Grafana
does before it sends it.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import CommandError

DASHBOARD = Path(__file__).resolve().parents[1] / "helm/rollstream/dashboards/rollstream.json"


def api(url: str, path: str, params: dict[str, Any], timeout_s: float = 10.0) -> list[dict]:
    """The `result` of Prometheus's HTTP API `path` (`query`, `query_range`) at `url` with
    `params`; a server that does not answer, or refuses (its JSON error), is a CommandError
    naming `url`."""
    address = f"{url.rstrip('/')}/api/v1/{path}?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(address, timeout=timeout_s) as reply:  # noqa: S310 (a Prometheus URL)
            body = reply.read()
    except urllib.error.HTTPError as exc:  # 4xx/5xx: the API says why in its JSON body
        body = exc.read()
    except OSError as exc:
        raise CommandError(f"Prometheus at {url} did not answer {params}: {exc}") from None
    try:
        data = json.loads(body)
    except ValueError:
        raise CommandError(f"Prometheus at {url} answered {path} with no JSON: {body[:200]!r}") from None
    if data.get("status") != "success":
        raise CommandError(f"Prometheus at {url} refused {params}: {data.get('error', data)}")
    return data["data"]["result"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """`with Prometheus(folder, ["127.0.0.1:9400", ...]) as prom: prom.query("up")`: a
    Prometheus server on a free port, its TSDB and log under `folder`, scraping `targets`
    every `scrape_s` seconds (job `rollstream`)."""

    BINARY = "prometheus"

    def __init__(self, directory: Path, targets: list[str], *, scrape_s: int = 1,
                 labels: dict[str, dict[str, str]] | None = None, rules: tuple[Path, ...] = ()) -> None:
        self.dir = Path(directory)
        self.targets = targets
        self.scrape_s = scrape_s
        self.labels = labels or {}  # target -> labels its series get (as Kubernetes discovery gives)
        self.rules = rules  # rule files, evaluated every scrape_s
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @classmethod
    def available(cls) -> bool:
        return shutil.which(cls.BINARY) is not None

    def __enter__(self) -> Prometheus:
        self.dir.mkdir(parents=True, exist_ok=True)
        config = self.dir / "prometheus.yml"
        every = f"{self.scrape_s}s"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": every, "evaluation_interval": every},
            "rule_files": [str(Path(f).resolve()) for f in self.rules],
            "scrape_configs": [{"job_name": "rollstream", "static_configs": [
                {"targets": [t], "labels": self.labels.get(t, {})} for t in self.targets]}],
        }))
        self.log = open(self.dir / "prometheus.log", "wb")  # noqa: SIM115 (closed in __exit__)
        self.proc = subprocess.Popen(
            [self.BINARY, f"--config.file={config}", f"--storage.tsdb.path={self.dir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self._wait(lambda: b"Ready" in (self._get("/-/ready") or b""), 30, "Prometheus to start")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def _get(self, path: str) -> bytes | None:
        """The body of `path` (an API error's too); None while the server does not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.read()
        except urllib.error.HTTPError as exc:  # 4xx/5xx: the API says why in its JSON body
            return exc.read()
        except OSError:
            return None

    def _wait(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(self.dir / 'prometheus.log').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s}s for {what}")
            time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _api(self, path: str, params: dict[str, Any]) -> list[dict]:
        return api(self.url, path, params)

    def query(self, expr: str) -> list[dict]:
        """The instant-vector result of `expr` now (empty when there is no data)."""
        return self._api("query", {"query": expr})

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict]:
        """The matrix of `expr` from `start` to `end` (unix seconds) every `step_s`:
        `[{"metric": {...}, "values": [[t, "v"], ...]}, ...]`."""
        return self._api("query_range", {"query": expr, "start": f"{start:.3f}",
                                         "end": f"{end:.3f}", "step": f"{step_s:g}"})

    def rules_state(self) -> dict[str, dict]:
        """Every loaded rule by name: its `health` ("ok" once evaluated without an error),
        `lastError`, and for an alert its `state` (inactive, pending, firing)."""
        body = self._get("/api/v1/rules")
        if body is None:
            raise CommandError(f"Prometheus at {self.url} did not answer /api/v1/rules")
        return {r["name"]: r for g in json.loads(body)["data"]["groups"] for r in g["rules"]}

    def scraped_since(self, t: float) -> bool:
        """Every target has been scraped at or after `t` (unix seconds)."""
        scrapes = self.query('timestamp(up{job="rollstream"})')
        return len(scrapes) == len(self.targets) and all(float(s["value"][1]) >= t for s in scrapes)

    def wait_scraped_since(self, t: float, timeout_s: float = 30) -> None:
        self._wait(lambda: self.scraped_since(t), timeout_s, f"every target to be scraped after {t}")

    def wait_scraped(self, timeout_s: float = 30) -> None:
        """Until every target has been scraped successfully at least once."""
        def all_up() -> bool:
            up = self.query('up{job="rollstream"}')
            return len(up) == len(self.targets) and all(s["value"][1] == "1" for s in up)
        self._wait(all_up, timeout_s, "every target to be scraped")


@dataclass(frozen=True)
class Panel:
    """One dashboard panel: its row, title, type, unit and `(expr, legend)` targets."""

    row: str
    title: str
    kind: str
    unit: str
    targets: list[tuple[str, str]]


def panels(path: Path = DASHBOARD) -> list[Panel]:
    """Every panel of the dashboard JSON at `path`, in order (rows themselves excluded)."""
    out: list[Panel] = []
    row = ""

    def walk(panel: dict) -> None:
        nonlocal row
        if panel["type"] == "row":
            row = panel["title"]
        else:
            out.append(Panel(row, panel["title"], panel["type"],
                             panel.get("fieldConfig", {}).get("defaults", {}).get("unit", ""),
                             [(t["expr"], t.get("legendFormat", "")) for t in panel.get("targets", [])]))
        for inner in panel.get("panels", []):
            walk(inner)

    for panel in json.loads(Path(path).read_text())["panels"]:
        walk(panel)
    return out


def promql(expr: str, rate_interval: str = "1m", *, namespace: str = ".*", release: str = ".*") -> str:
    """A panel expression as plain PromQL: every shard, the run picked by `namespace` and
    `release` (regular expressions, as the dashboard's variables put them; `.*`: any, or
    none), `rate_interval` for `$__rate_interval` and for the Frontier row's `$window`."""
    return (expr.replace('"$shard"', '".*"').replace('"$namespace"', json.dumps(namespace))
            .replace('"$release"', json.dumps(release)).replace("$__rate_interval", rate_interval)
            .replace("$window", rate_interval))
