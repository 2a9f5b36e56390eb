"""Run the real console scripts (``skan``, ``skan-eventer``...) as subprocesses.

The scripts are the ones installed next to the running interpreter; the
project's checkout comes first on PYTHONPATH, so they run this tree's code.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import attrs

from tests.brokerproc import ROOT

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
BIN = pathlib.Path(sys.executable).parent


def script(name: str) -> list[str]:
    path = BIN / name
    if not path.exists():  # pragma: no cover - an environment without the entry points
        raise RuntimeError(f"console script {name} is not installed next to {sys.executable}")
    return [str(path)]


@attrs.frozen
class Result:
    returncode: int
    stdout: str
    stderr: str
    seconds: float = 0.0

    def assert_clean(self) -> None:
        """No Python traceback, whatever the exit code."""
        assert "Traceback" not in self.stderr, self.stderr
        assert "Traceback" not in self.stdout, self.stdout

    def one_line_error(self) -> str:
        self.assert_clean()
        lines = [line for line in self.stderr.splitlines() if not line.startswith("#")]
        assert len(lines) == 1, self.stderr
        return lines[0]


def run(name: str, *args: str, timeout: float = 60.0) -> Result:
    started = time.monotonic()
    proc = subprocess.run([*script(name), *args], env=ENV, capture_output=True, text=True,
                          timeout=timeout)
    return Result(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started)


class Running:
    """A long-running command (sub, reply) read line by line, stopped with a signal."""

    def __init__(self, name: str, *args: str) -> None:
        self.proc = subprocess.Popen([*script(name), *args], env=ENV, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)

    def wait_stderr(self, needle: str, timeout: float = 20.0) -> str:
        """Read stderr lines until one contains ``needle``; returns that line."""
        assert self.proc.stderr is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise AssertionError(f"exited ({self.proc.poll()}) before printing {needle!r}")
            if needle in line:
                return line
        raise AssertionError(f"no {needle!r} within {timeout}s")

    def readline(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().rstrip("\n")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 20.0) -> Result:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        out, err = self.proc.communicate(timeout=timeout)
        return Result(self.proc.returncode, out, err)

    def wait(self, timeout: float = 20.0) -> Result:
        out, err = self.proc.communicate(timeout=timeout)
        return Result(self.proc.returncode, out, err)
