"""A real Prometheus server for tests: Debian's ``prometheus`` on a free loopback port.

Why a real server: the dashboard and the alert rules are PromQL, and the only proof that a
query is valid and finds the series the sidecars and the operator export is to run it against
Prometheus after it has scraped them. ``tools/prometheus.sh`` installs the package (the
Makefile's ``build`` target runs it).

Use it through the ``prometheus_server`` fixture (a factory; every server it starts is stopped
at the end of the test)::

    def test_x(prometheus_server):
        prom = prometheus_server([ScrapeTarget(name="sidecar", address="127.0.0.1:9440",
                                               labels={"namespace": "ns", "job": "tj"})])
        prom.wait_for_targets()
        prom.query("up")

Targets can be replaced while the server runs (:meth:`PrometheusServer.set_targets` rewrites
the configuration and reloads it), so an end-to-end test can follow pods as they come and go.

Label convention (docs/observability.md): sidecar targets carry ``namespace`` and ``job`` (the
TrainingJob) as target labels; the operator's target is scraped with ``honor_labels`` so that
its own per-job ``namespace``/``job`` labels win.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from baton_testing.ports import free_port

__all__ = [
    "GRAFANA_VARIABLES",
    "PrometheusError",
    "PrometheusServer",
    "ScrapeTarget",
    "dashboard_queries",
    "prometheus_binary",
    "prometheus_server",
    "promtool_binary",
    "rule_queries",
    "substitute",
]

GRAFANA_VARIABLES: dict[str, str] = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$namespace": ".*",
    "$job": ".*",
}
"""What Grafana puts in for the dashboard's variables when "All" is selected, with a rate
window of a few scrape intervals (Grafana's $__rate_interval is at least four)."""


def dashboard_queries(path: Path) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every variable query of a Grafana dashboard."""
    board = json.loads(path.read_text())
    queries = [
        (f"panel {p['title']!r} {t['refId']}", t["expr"])
        for p in board["panels"]
        for t in p["targets"]
    ]
    for var in board["templating"]["list"]:
        if var["type"] != "query":
            continue
        # label_values(<selector>, <label>) is Grafana's, not PromQL: run the selector.
        match = re.fullmatch(r"label_values\((.*), *(\w+)\)", var["query"]["query"])
        if match is None:
            raise PrometheusError(f"variable {var['name']}: unexpected query {var['query']}")
        queries.append((f"variable ${var['name']}", match.group(1)))
    return queries


def rule_queries(path: Path) -> list[tuple[str, str]]:
    """(where, PromQL) for every alerting and recording rule of a rules file."""
    groups = yaml.safe_load(path.read_text())["groups"]
    return [
        (f"rule {r.get('alert') or r.get('record')}", r["expr"]) for g in groups for r in g["rules"]
    ]


def substitute(expr: str) -> str:
    """``expr`` with Grafana's variables replaced as in :data:`GRAFANA_VARIABLES`."""
    for name in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_VARIABLES[name])
    if "$" in expr:
        raise PrometheusError(f"an unknown Grafana variable is left in {expr!r}")
    return expr


class PrometheusError(Exception):
    """The server did not start, a target was not scraped, or a query failed."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScrapeTarget:
    """One endpoint to scrape (its own scrape job)."""

    name: str
    """The scrape job's name; also the ``job`` label unless ``labels`` sets one."""
    address: str
    """``host:port`` of the /metrics endpoint."""
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Target labels added to every series (``namespace`` and ``job`` for sidecars)."""
    honor_labels: bool = False
    """Keep the scraped series' own labels on a clash (the operator's per-job labels)."""
    path: str = "/metrics"
    """The metrics path."""


def _binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise PrometheusError(
            f"{name} is not installed: run tools/prometheus.sh (or `make build`), which "
            "installs Debian's prometheus package"
        )
    return found


def prometheus_binary() -> str:
    """The path of the ``prometheus`` server binary."""
    return _binary("prometheus")


def promtool_binary() -> str:
    """The path of ``promtool``."""
    return _binary("promtool")


class PrometheusServer:
    """A running ``prometheus`` process with a generated scrape configuration."""

    def __init__(
        self,
        targets: Sequence[ScrapeTarget],
        *,
        workdir: Path,
        scrape_interval: str = "1s",
        rule_files: Sequence[Path] = (),
        start_timeout: float = 60.0,
    ) -> None:
        self._workdir = workdir
        self._interval = scrape_interval
        self._rule_files = [str(p) for p in rule_files]
        self._config = workdir / "prometheus.yml"
        self._write_config(targets)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = (workdir / "prometheus.log").open("wb")
        self._proc = subprocess.Popen(
            [
                prometheus_binary(),
                f"--config.file={self._config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
                "--storage.tsdb.retention.time=1d",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        try:
            self._wait(lambda: self._get("/-/ready", raw=True) is not None, start_timeout, "ready")
        except BaseException:
            self.stop()
            raise

    # -- configuration ----------------------------------------------------------------------

    def _write_config(self, targets: Sequence[ScrapeTarget]) -> None:
        names = [t.name for t in targets]
        if len(set(names)) != len(names):
            raise PrometheusError(f"scrape target names must be unique, got {names}")
        config: dict[str, Any] = {
            "global": {"scrape_interval": self._interval, "evaluation_interval": self._interval},
            "scrape_configs": [
                {
                    "job_name": t.name,
                    "metrics_path": t.path,
                    "honor_labels": t.honor_labels,
                    "scrape_timeout": self._interval,
                    "static_configs": [{"targets": [t.address], "labels": dict(t.labels)}],
                }
                for t in targets
            ],
        }
        if self._rule_files:
            config["rule_files"] = self._rule_files
        tmp = self._config.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(config, sort_keys=False))
        os.replace(tmp, self._config)

    def set_targets(self, targets: Sequence[ScrapeTarget]) -> None:
        """Replace the scrape targets and reload the configuration."""
        self._write_config(targets)
        self._post("/-/reload")

    # -- HTTP ---------------------------------------------------------------------------------

    def _get(self, path: str, *, raw: bool = False) -> Any:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as response:
                body = response.read()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None
        return body if raw else json.loads(body)

    def _post(self, path: str) -> None:
        request = urllib.request.Request(self.url + path, method="POST", data=b"")
        try:
            with urllib.request.urlopen(request, timeout=10):
                pass
        except urllib.error.URLError as e:
            raise PrometheusError(f"POST {path} failed: {e}; see {self.log_path}") from e

    def api(self, endpoint: str, **params: str) -> Any:
        """GET ``/api/v1/<endpoint>`` and return its ``data``; raises with Prometheus' error."""
        url = f"{self.url}/api/v1/{endpoint}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                payload = json.loads(response.read())
        except urllib.error.HTTPError as e:
            # 400/422 carry a JSON body with errorType and error: the useful part.
            try:
                payload = json.loads(e.read())
            except ValueError:
                raise PrometheusError(f"{endpoint} {params}: HTTP {e.code}") from e
        if payload.get("status") != "success":
            raise PrometheusError(
                f"{endpoint} {params} failed: {payload.get('errorType')}: {payload.get('error')}"
            )
        return payload["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Evaluate an instant query now; the result vector (or a one-element scalar list)."""
        data = self.api("query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def series(self, selector: str) -> list[dict[str, str]]:
        """The label sets of the series matching ``selector``."""
        result: list[dict[str, str]] = self.api("series", **{"match[]": selector})
        return result

    def rules(self) -> list[dict[str, Any]]:
        """The loaded rule groups (with each rule's health and lastError)."""
        groups: list[dict[str, Any]] = self.api("rules")["groups"]
        return groups

    # -- waiting ------------------------------------------------------------------------------

    def _wait(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise PrometheusError(
                    f"prometheus exited with {self._proc.returncode} while waiting for {what}: "
                    f"{self.log_tail()}"
                )
            if ready():
                return
            time.sleep(0.2)
        raise PrometheusError(
            f"timed out after {timeout:.0f}s waiting for {what}: {self.log_tail()}"
        )

    def wait_for_targets(self, *, scrapes: int = 2, timeout: float = 60.0) -> None:
        """Wait until every configured target is up and has been scraped ``scrapes`` times.

        Two scrapes are the minimum for ``rate()`` to return anything.
        """
        seen: dict[str, int] = {}
        last: dict[str, str] = {}

        def ready() -> bool:
            data = self._get("/api/v1/targets?state=active")
            if data is None:
                return False
            active = data["data"]["activeTargets"]
            if not active:
                return False
            for target in active:
                url = target["scrapeUrl"]
                if target["health"] != "up":
                    last[url] = f"{target['health']}: {target.get('lastError')}"
                    return False
                stamp = target["lastScrape"]
                if last.get(url) != stamp:
                    last[url] = stamp
                    seen[url] = seen.get(url, 0) + 1
            return all(seen.get(t["scrapeUrl"], 0) > scrapes for t in active)

        try:
            self._wait(ready, timeout, f"{scrapes} scrapes of every target")
        except PrometheusError as e:
            raise PrometheusError(f"{e}; target states: {last}") from None

    def wait_for_series(self, expr: str, *, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Wait until ``expr`` returns at least one series; return them."""
        found: list[dict[str, Any]] = []

        def ready() -> bool:
            nonlocal found
            found = self.query(expr)
            return bool(found)

        self._wait(ready, timeout, f"series for {expr!r}")
        return found

    # -- lifetime -----------------------------------------------------------------------------

    @property
    def log_path(self) -> Path:
        """The server's own log (kept in the test's temporary directory)."""
        return self._workdir / "prometheus.log"

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the server's log, for error messages."""
        self._log.flush()
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s)."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()


@pytest.fixture
def prometheus_server() -> Iterator[Callable[..., PrometheusServer]]:
    """Factory fixture: ``prometheus_server(targets, rule_files=..., scrape_interval=...)``."""
    started: list[PrometheusServer] = []
    with tempfile.TemporaryDirectory(prefix="baton-prometheus-") as root:

        def start(targets: Sequence[ScrapeTarget], **kwargs: Any) -> PrometheusServer:
            workdir = Path(root) / str(len(started))
            workdir.mkdir()
            server = PrometheusServer(targets, workdir=workdir, **kwargs)
            started.append(server)
            return server

        try:
            yield start
        finally:
            for server in started:
                server.stop()
