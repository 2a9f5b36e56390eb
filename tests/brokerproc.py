"""Run a real broker process for tests: ``skan-broker`` on free ports, read its addresses."""

from __future__ import annotations

import atexit
import os
import pathlib
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from broker.app.listening import all_listening

ROOT = pathlib.Path(__file__).resolve().parent.parent


class BrokerProcess:
    """A broker subprocess started with a TOML config and ``--*-port 0`` flags.

    ``addr[protocol]`` is ``(host, port)`` from the ``listening`` lines.
    Diagnostic output (stderr) is collected in ``self.stderr_lines``.
    """

    def __init__(self, config: str = "", args: tuple[str, ...] = (), *,
                 workdir: pathlib.Path | None = None, env: dict[str, str] | None = None,
                 preexec_fn: Callable[[], None] | None = None) -> None:
        if workdir is None:
            workdir = pathlib.Path(tempfile.mkdtemp(prefix="skan-broker-"))
            # Tests may read the routing log after stopping the broker, so the
            # directory goes when the test process ends, not at stop().
            atexit.register(shutil.rmtree, workdir, True)
        self.workdir = workdir
        self.config_path = self.workdir / "broker.toml"
        self.config_path.write_text(config)
        self.args = args
        self.env = env or {}
        # Run in the child before the broker starts (e.g. to set resource limits).
        self.preexec_fn = preexec_fn
        self.addr: dict[str, tuple[str, int]] = {}
        self.stderr_lines: list[str] = []
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> BrokerProcess:
        cmd = [
            sys.executable, "-m", "broker", "--config", str(self.config_path),
            "--skan-port", "0", "--hsp-port", "0", "--eventer-port", "0",
            "--mariner-port", "0", "--metrics-port", "0",
            "--log-dir", str(self.workdir / "log"), *self.args,
        ]
        if os.environ.get("SKAN_TEST_STORE_WRITER") and "--store-writer" not in self.args:
            # Run a suite with the other store writer ([store] writer; docs/store.md).
            cmd += ["--store-writer", os.environ["SKAN_TEST_STORE_WRITER"]]
        env = {**os.environ, "PYTHONPATH": str(ROOT), **self.env}
        self.proc = subprocess.Popen(
            cmd, cwd=self.workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            bufsize=0, preexec_fn=self.preexec_fn,
        )
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        out = b""
        # The broker prints all its 'listening' lines in one write once every
        # listener is up (broker/app/listening.py).
        while time.monotonic() < deadline:
            if all_listening(out):
                break
            ready, _, _ = select.select([fd], [], [], 0.5)
            if not ready:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        "broker exited before listening:\n" + "".join(self.stderr_lines[-40:])
                    )
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(
                    "broker exited before listening:\n" + "".join(self.stderr_lines[-40:])
                )
            out += chunk
        else:
            raise RuntimeError("broker did not print its listening lines in time")
        for line in out.decode().splitlines():
            if line.startswith("listening "):
                _, proto, hostport = line.split()
                host, _, port = hostport.rpartition(":")
                self.addr[proto] = (host, int(port))
        threading.Thread(target=self._drain_stdout, daemon=True).start()
        return self

    def _drain_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr_lines.append(line.decode(errors="replace"))

    def _drain_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for _ in self.proc.stdout:
            pass

    @property
    def skan(self) -> tuple[str, int]:
        return self.addr["skan"]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> BrokerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
