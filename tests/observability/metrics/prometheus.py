"""A real Prometheus server for tests: installed from Debian when missing, run on a free port."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from typing import Any

INSTALL = "apt-get update && apt-get install -y prometheus"


def ensure_prometheus() -> str:
    """Path of the ``prometheus`` binary; installs the Debian package when it is missing.

    Raises RuntimeError (never skips) when it is missing and cannot be installed.
    """
    path = shutil.which("prometheus") or (
        "/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None
    )
    if path:
        return path
    if os.geteuid() != 0:
        raise RuntimeError(f"prometheus is not installed and this is not root; run: {INSTALL}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # Other jobs may hold the dpkg lock for a while: wait for it instead of failing.
    cmd = ("apt-get update && apt-get install -y -o DPkg::Lock::Timeout=300 prometheus")
    result = subprocess.run(["sh", "-c", cmd], env=env, capture_output=True, text=True,
                            timeout=900)
    path = shutil.which("prometheus") or "/usr/bin/prometheus"
    if result.returncode != 0 or not os.access(path, os.X_OK):
        raise RuntimeError(f"installing prometheus failed ({cmd}):\n{result.stdout[-3000:]}\n"
                           f"{result.stderr[-3000:]}")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrometheusServer:
    """``prometheus`` scraping ``targets`` every second, with its own config and storage."""

    def __init__(self, binary: str, targets: list[tuple[str, int]], job: str = "skan") -> None:
        self.binary = binary
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="skan-prometheus-"))
        self.targets = targets
        self.job = job
        self.port = 0
        self.proc: subprocess.Popen | None = None

    def _config(self) -> str:
        targets = ", ".join(f"'{h}:{p}'" for h, p in self.targets)
        return (
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
            f"scrape_configs:\n  - job_name: {self.job}\n    static_configs:\n"
            f"      - targets: [{targets}]\n"
        )

    def start(self, timeout: float = 30.0) -> PrometheusServer:
        (self.dir / "prometheus.yml").write_text(self._config())
        for _attempt in range(3):  # the free port may be taken between probe and bind
            self.port = free_port()
            with open(self.dir / "prometheus.log", "wb") as log:
                self.proc = subprocess.Popen(
                    [self.binary, f"--config.file={self.dir / 'prometheus.yml'}",
                     f"--storage.tsdb.path={self.dir / 'data'}",
                     f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                    stdout=subprocess.DEVNULL, stderr=log,
                )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                        if r.status == 200:
                            return self
                except OSError:
                    time.sleep(0.1)
            self.stop()
        raise RuntimeError(f"prometheus did not become ready:\n{self.log()[-3000:]}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return (self.dir / "prometheus.log").read_text(errors="replace")

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus API error for {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query now; the result vector (``metric`` labels and ``value``)."""
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def value(self, expr: str) -> float | None:
        """The single value of ``expr`` now (None when empty)."""
        result = self.query(expr)
        if not result:
            return None
        assert len(result) == 1, f"{expr} returned {len(result)} series: {result}"
        return float(result[0]["value"][1])

    def wait_value(self, expr: str, expected: float, timeout: float = 20.0) -> float | None:
        """Poll until ``expr`` equals ``expected`` (Prometheus scrapes every second)."""
        deadline = time.monotonic() + timeout
        got = None
        while time.monotonic() < deadline:
            got = self.value(expr)
            if got == expected:
                return got
            time.sleep(0.2)
        return got

    def wait_scraping(self, targets: int, timeout: float = 30.0) -> None:
        """Wait for the first successful scrape of every target.

        Prometheus hands new targets to its scrapers in a 5-second cycle, so
        this takes up to about six seconds after start.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.query(f'up{{job="{self.job}"}} == 1')) == targets:
                return
            time.sleep(0.2)
        raise RuntimeError(f"Prometheus did not scrape its {targets} targets: "
                           f"{self.api('targets')}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
