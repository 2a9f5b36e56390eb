"""--token and SKAN_TOKEN on the command-line tools, against a broker with users."""

from __future__ import annotations

import os
import sys

import trio

from tests.brokerproc import ROOT, BrokerProcess
from tests.security.common import SENSOR_TOKEN, USERS


async def test_skan_cli_token_flag_and_environment():
    with BrokerProcess(USERS) as b:
        host, port = b.skan
        base = ["-m", "clients.cli", "--host", host, "--port", str(port)]
        ok = await trio.run_process([*_python(), *base, "pub", "telemetry", "x"],
                                    env=_env(SKAN_TOKEN=SENSOR_TOKEN), capture_stdout=True,
                                    capture_stderr=True, check=False)
        assert ok.returncode == 0, ok.stderr
        flag = await trio.run_process([*_python(), *base, "--token", "wrong", "stats"],
                                      env=_env(SKAN_TOKEN=SENSOR_TOKEN), capture_stdout=True,
                                      capture_stderr=True, check=False)
        assert flag.returncode == 1
        assert b"skan: broker refused: not authorised" in flag.stderr
        assert b"Traceback" not in flag.stderr


def _python() -> list[str]:
    return [sys.executable]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


async def test_eventer_cli_token_from_environment():
    with BrokerProcess(USERS) as b:
        host, port = b.addr["eventer"]
        base = ["-m", "clients.eventer_cli", "--host", host, "--port", str(port), "query", "latest"]
        ok = await trio.run_process([*_python(), *base], env=_env(SKAN_TOKEN=SENSOR_TOKEN),
                                    capture_stdout=True, capture_stderr=True, check=False)
        assert ok.returncode == 0, ok.stderr
        bad = await trio.run_process([*_python(), *base], env=_env(SKAN_TOKEN="wrong"),
                                     capture_stdout=True, capture_stderr=True, check=False)
        assert bad.returncode != 0 and b"not authorised" in bad.stderr, bad.stderr
        assert b"Traceback" not in bad.stderr
