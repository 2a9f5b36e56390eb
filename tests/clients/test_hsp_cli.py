"""The ``skan`` command over HSP (``--protocol hsp``)."""

from __future__ import annotations

import os
import sys

import pytest
import trio

from tests.brokerproc import ROOT, BrokerProcess
from tests.cliproc import read_lines, start_subscriber

pytestmark = pytest.mark.trio

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def small_broker():
    # A small max_frame so a command-line message can be "too large".
    with BrokerProcess("[broker]\nmax_frame = 1024\n") as proc:
        yield proc


async def test_pub_sub_stats_over_hsp(small_broker):
    host, port = small_broker.addr["hsp"]
    base = [sys.executable, "-m", "clients.cli", "--protocol", "hsp", "--host", host,
            "--port", str(port)]
    sub = await start_subscriber([*base, "sub", "cli-hsp", "--count", "2"], ENV)
    for extra in ([], ["--acked"]):
        pub = await trio.run_process([*base, "pub", "cli-hsp", f"hello{extra}", *extra],
                                     env=ENV, check=False)
        assert pub.returncode == 0
    lines = await read_lines(sub, 2)
    assert lines[0].endswith(": hello[]") and lines[1].endswith(": hello['--acked']")
    stats = await trio.run_process([*base, "stats"], env=ENV, capture_stdout=True)
    assert "hsp=" in stats.stdout.decode()


@pytest.mark.parametrize("acked", [False, True])
async def test_refused_pub_over_hsp_exits_nonzero(small_broker, acked):
    host, port = small_broker.addr["hsp"]
    cmd = [sys.executable, "-m", "clients.cli", "--protocol", "hsp", "--host", host,
           "--port", str(port), "pub", "g", "x" * 2000]
    proc = await trio.run_process(cmd + (["--acked"] if acked else []), env=ENV, check=False,
                                  capture_stderr=True)
    assert proc.returncode == 1
    assert b"broker refused" in proc.stderr and b"exceeds the limit of 1024" in proc.stderr
    if acked:
        assert b"ERROR 3" in proc.stderr


async def test_acked_needs_hsp():
    proc = await trio.run_process(
        [sys.executable, "-m", "clients.cli", "pub", "g", "x", "--acked"], env=ENV,
        check=False, capture_stderr=True,
    )
    assert proc.returncode == 2 and b"--acked needs --protocol hsp" in proc.stderr
