"""skan-analytics over the log of a live broker: stream (exactly once, restartable),
report (tables, charts, HTML), the CLI and plain spark-submit."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import pytest
import trio
from pyspark.sql import functions as F

from analytics import cli, report, stream
from clients.hsp import SkanOverHSP
from clients.skan import SkanClient
from tests.brokerproc import ROOT, BrokerProcess
from wire.skan import encode_frame

pytestmark = pytest.mark.spark

WINDOW = "2 seconds"  # short windows: the traffic spans several


class Expected:
    """What the test sent: per group and per protocol (as the stream job reports them)."""

    def __init__(self) -> None:
        self.group: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.proto: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def add(self, group: str, size: int, sender: str, receivers: list[str]) -> None:
        g = self.group[group]
        g["messages"] += 1
        g["bytes"] += size
        g["deliveries"] += len(receivers)
        g["undeliverable"] += not receivers
        p = self.proto[sender]
        p["messages_in"] += 1
        p["bytes_in"] += size
        p["undeliverable"] += not receivers
        for r in receivers:
            self.proto[r]["deliveries_out"] += 1
            self.proto[r]["bytes_out"] += size

    def plus(self, other: Expected) -> Expected:
        out = Expected()
        for src in (self, other):
            for k, v in src.group.items():
                out.group[k].update(v)
            for k, v in src.proto.items():
                out.proto[k].update(v)
        return out


# Group -> protocols of its subscribers (the senders never subscribe).
SUBSCRIBERS = {"alpha": ["skan", "hsp"], "beta": ["skan"], "void": []}


async def traffic(b: BrokerProcess, plan: list[tuple[str, str, int]], tick: str
                  ) -> tuple[Expected, Expected]:
    """Send ``plan`` [(sender protocol, group, count)], wait past a window, then
    one message on group ``tick``, alone in the last window (which the stream
    job must count too).  Returns what the plan sent and what the tick sent."""
    expected, ticked = Expected(), Expected()
    async with (
        SkanClient.connect(*b.skan) as skan_pub,
        SkanOverHSP.connect(*b.addr["hsp"]) as hsp_pub,
        SkanClient.connect(*b.skan) as skan_sub,
        SkanOverHSP.connect(*b.addr["hsp"]) as hsp_sub,
    ):
        subs = {"skan": skan_sub, "hsp": hsp_sub}
        for group, protos in SUBSCRIBERS.items():
            for proto in protos:
                await subs[proto].subscribe(group)
        pubs = {"skan": skan_pub, "hsp": hsp_pub}
        seq = 0
        for proto, group, count in plan:
            pub = pubs[proto]
            for _ in range(count):
                seq += 1
                msg = {"type": "send", "from": pub.lname, "to": "*", "group": group,
                       "instance": "*", "seq": str(seq), "msg": b"x" * (seq % 50)}
                await pub.send_raw(msg)
                expected.add(group, len(encode_frame(msg)), proto, SUBSCRIBERS[group])
        for pub in pubs.values():
            await pub.barrier()
        await trio.sleep(2.5)
        msg = {"type": "send", "from": skan_pub.lname, "to": "*", "group": tick,
               "instance": "*", "seq": "0", "msg": b"tick"}
        await skan_pub.send_raw(msg)
        ticked.add(tick, len(encode_frame(msg)), "skan", [])
        await skan_pub.barrier()
    return expected, ticked


def run_broker(workdir: pathlib.Path, plan, tick: str) -> tuple[Expected, Expected]:
    """A broker on ``workdir/log``: send the plan, stop it gracefully (SIGTERM)."""
    b = BrokerProcess("", workdir=workdir).start()
    try:
        sent = trio.run(traffic, b, plan, tick)
    finally:
        assert b.stop(signal.SIGTERM) == 0, "".join(b.stderr_lines[-20:])
    return sent


PHASE1 = [("skan", "alpha", 30), ("hsp", "alpha", 25), ("skan", "beta", 20),
          ("hsp", "beta", 10), ("skan", "void", 5)]
PHASE2 = [("hsp", "alpha", 3), ("skan", "gamma", 7)]
SUBSCRIBERS["gamma"] = ["hsp"]


@pytest.fixture(scope="module")
def phase1(tmp_path_factory) -> tuple[pathlib.Path, Expected, Expected]:
    work = tmp_path_factory.mktemp("phase1")
    return (work / "log", *run_broker(work, PHASE1, "tick-1"))


def group_totals(spark, path: str) -> dict[str, dict[str, int]]:
    cols = ["messages", "bytes", "deliveries", "undeliverable"]
    rows = spark.read.parquet(path).groupBy("group").agg(*(F.sum(c).alias(c) for c in cols))
    return {r["group"]: {c: r[c] for c in cols} for r in rows.collect()}


def proto_totals(spark, path: str) -> dict[str, dict[str, int]]:
    cols = ["messages_in", "bytes_in", "undeliverable", "deliveries_out", "bytes_out"]
    rows = spark.read.parquet(path).groupBy("protocol").agg(*(F.sum(c).alias(c) for c in cols))
    return {r["protocol"]: {c: r[c] for c in cols} for r in rows.collect()}


def as_tables(expected: Expected) -> tuple[dict, dict]:
    g = {k: {c: v[c] for c in ("messages", "bytes", "deliveries", "undeliverable")}
         for k, v in expected.group.items()}
    p = {k: {c: v[c] for c in ("messages_in", "bytes_in", "undeliverable", "deliveries_out",
                               "bytes_out")} for k, v in expected.proto.items()}
    return g, p


def test_stream_counts_exactly_once_across_restarts(spark, phase1, tmp_path):
    log_src, first, tick1 = phase1
    work = tmp_path / "broker"
    shutil.copytree(log_src, work / "log")  # this test adds to the log: use a copy
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")

    def once() -> tuple[dict, dict]:
        stream.run(spark, str(work / "log"), ckpt, out, window=WINDOW, once=True)
        return (group_totals(spark, os.path.join(out, "by_group")),
                proto_totals(spark, os.path.join(out, "by_protocol")))

    # Every record present is counted, the last window's too (nothing waits
    # for later traffic).
    assert once() == as_tables(first.plus(tick1))
    # A broker restart adds files; the job restarted from its checkpoint counts
    # only those.
    second, tick2 = run_broker(work, PHASE2, "tick-2")
    want = as_tables(first.plus(tick1).plus(second).plus(tick2))
    assert once() == want
    # Nothing new: a third run changes nothing.
    assert once() == want


def test_report_matches_what_was_sent(spark, phase1, tmp_path):
    log_dir, sent, tick = phase1
    expected = sent.plus(tick)
    result = report.run(spark, str(log_dir), str(tmp_path / "report"), top=3, quiet=True)
    groups, protos = as_tables(expected)
    t = result.totals
    assert t["messages"] == sum(g["messages"] for g in groups.values())
    assert t["bytes"] == sum(g["bytes"] for g in groups.values())
    assert t["deliveries"] == sum(g["deliveries"] for g in groups.values())
    assert t["undeliverable"] == groups["void"]["messages"] + 1  # + the tick
    assert (t["groups"], t["senders"]) == (4, 2)
    top = result.tables["groups_by_messages"]
    assert [r[0] for r in top.rows] == ["alpha", "beta", "void"]  # top 3, most first
    for row in top.rows:
        assert row[1:] == [groups[row[0]][c] for c in top.columns[1:]]
    by_bytes = result.tables["groups_by_bytes"]
    assert [r[2] for r in by_bytes.rows] == sorted((g["bytes"] for g in groups.values()),
                                                   reverse=True)[:3]
    mix = {r[0]: r[1:] for r in result.tables["protocols"].rows}
    assert mix == {p: [protos[p][c] for c in result.tables["protocols"].columns[1:]]
                   for p in ("skan", "hsp")}
    fan = dict(result.tables["fanout"].rows)
    assert (fan["0"], fan["1"], fan["2"]) == (
        groups["void"]["messages"] + 1, groups["beta"]["messages"], groups["alpha"]["messages"])
    assert sum(fan.values()) == t["messages"]
    assert sum(r[1] for r in result.tables["per_minute"].rows) == t["messages"]
    undeliv = {r[0]: r[1:] for r in result.tables["undeliverable"].rows}
    assert undeliv == {"void": [5, 5, 1.0], "tick-1": [1, 1, 1.0]}
    senders = result.tables["top_senders"].rows
    assert all(r[2] is None for r in senders)  # anonymous senders: no user
    assert sorted((r[1], r[3]) for r in senders) == sorted(
        (p, protos[p]["messages_in"]) for p in ("skan", "hsp"))
    # Files: a PNG per view, one self-contained HTML page, the numbers as JSON.
    out = tmp_path / "report"
    for name in ("groups_by_messages", "groups_by_bytes", "top_senders", "fanout",
                 "protocols", "per_minute", "undeliverable"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 7 and "http" not in page
    assert json.loads((out / "report.json").read_text())["totals"]["messages"] == t["messages"]


def test_cli_report_prints_tables(spark, phase1, tmp_path, capsys):
    log_dir, sent, _tick = phase1
    assert cli.main(["report", "--log-dir", str(log_dir), "--out", str(tmp_path / "r")],
                    spark=spark) == 0
    out = capsys.readouterr().out
    assert "Top 10 groups by messages" in out and "Protocol mix" in out
    alpha = sent.group["alpha"]["messages"]
    assert any(line.split()[:2] == ["alpha", str(alpha)] for line in out.splitlines())
    assert (tmp_path / "r" / "report.html").exists()


def test_cli_errors_are_readable(spark, tmp_path, capsys):
    missing = str(tmp_path / "no-such-log")
    assert cli.main(["report", "--log-dir", missing, "--out", str(tmp_path / "r")],
                    spark=spark) == 1
    err = capsys.readouterr().err
    assert err.startswith("skan-analytics: ") and "no-such-log" in err
    with pytest.raises(SystemExit) as info:
        cli.main(["report", "--log-dir", missing, "--conf", "no-equals-sign"], spark=spark)
    assert info.value.code == 2
    assert "expected key=value" in capsys.readouterr().err


def test_empty_log_directory_gives_an_empty_report(spark, tmp_path):
    (tmp_path / "log").mkdir()
    (tmp_path / "log" / ".routelog-1-x-000001.jsonl.tmp").write_text('{"time_us": 1')
    result = report.run(spark, str(tmp_path / "log"), str(tmp_path / "r"), quiet=True)
    assert result.totals["messages"] == 0 and result.charts == {}
    assert (tmp_path / "r" / "report.html").exists()


def test_plain_spark_submit_runs_the_report(phase1, tmp_path):
    log_dir, sent, tick = phase1
    import pyspark

    submit = pathlib.Path(pyspark.__file__).parent / "bin" / "spark-submit"
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable,
           "PYSPARK_DRIVER_PYTHON": sys.executable}
    env.pop("PYTHONPATH", None)  # the script makes its checkout importable itself
    proc = subprocess.run(
        [str(submit), "--master", "local[1]", "--conf", "spark.ui.enabled=false",
         str(ROOT / "analytics" / "cli.py"), "report", "--log-dir", str(log_dir),
         "--out", str(tmp_path / "r")],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    totals = json.loads((tmp_path / "r" / "report.json").read_text())["totals"]
    assert totals["messages"] == sum(c["messages"] for c in sent.plus(tick).group.values())
