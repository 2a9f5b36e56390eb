"""Routing logs of two brokers joined by a real nats-server: skan-analytics counts each
message once, deliveries on every broker, and undeliverable only where no broker delivered."""

from __future__ import annotations

import json
import pathlib
import signal

import pytest
import trio

from analytics import cli, report
from clients.hsp import SkanOverHSP
from clients.skan import SkanClient
from tests.analytics.conftest import spark  # noqa: F401 - the one local Spark session
from tests.cluster.natsproc import NatsCluster, cluster_broker
from tests.observability.routelog.logfiles import read_log

pytestmark = pytest.mark.spark

# (sender: "a" = Skan client on broker 1, "b" = HSP client on broker 2, group, count)
PLAN = [("a", "alpha", 10), ("a", "beta", 6), ("b", "alpha", 4), ("a", "void", 3)]
# Subscribers: alpha on both brokers, beta only on broker 2, void nowhere.
COPIES = {"alpha": 2, "beta": 1, "void": 0}


async def _traffic(one, two) -> None:
    async with (
        SkanClient.connect(*one.skan) as pub_a,
        SkanOverHSP.connect(*two.addr["hsp"]) as pub_b,
        SkanClient.connect(*one.skan) as sub_1,
        SkanClient.connect(*two.skan) as sub_2,
    ):
        await sub_1.subscribe("alpha")
        await sub_2.subscribe("alpha")
        await sub_2.subscribe("beta")
        await trio.sleep(0.3)  # NATS has the subscriptions
        pubs = {"a": pub_a, "b": pub_b}
        for who, group, count in PLAN:
            for i in range(count):
                await pubs[who].send(group, str(i))
        want_1 = sum(n for _, g, n in PLAN if g == "alpha")
        want_2 = want_1 + sum(n for _, g, n in PLAN if g == "beta")
        with trio.fail_after(10):
            for _ in range(want_1):
                await sub_1.receive()
            for _ in range(want_2):
                await sub_2.receive()


@pytest.fixture(scope="module")
def two_logs(tmp_path_factory) -> list[pathlib.Path]:
    """Each broker's routing-log directory after the traffic and a graceful stop."""
    work = tmp_path_factory.mktemp("cluster-logs")
    dirs = [work / "b1", work / "b2"]
    for d in dirs:
        d.mkdir()
    with NatsCluster(1) as nats:
        url = nats.nodes[0].url
        with (cluster_broker(1, url, workdir=dirs[0]) as one,
              cluster_broker(2, url, workdir=dirs[1]) as two):
            trio.run(_traffic, one, two)
            assert one.stop(signal.SIGTERM) == 0 and two.stop(signal.SIGTERM) == 0
    return [d / "log" for d in dirs]


def _records(log_dir: pathlib.Path) -> list[dict]:
    return read_log(log_dir)


def test_each_broker_logs_with_its_server_id(two_logs):
    one, two = (_records(d) for d in two_logs)
    assert {r["server"] for r in one} == {1} and {r["server"] for r in two} == {2}
    # A message is logged on its origin broker with the sender's protocol and
    # on the broker that received it from NATS with protocol "cluster".
    assert sorted(r["proto"] for r in one) == ["cluster"] * 4 + ["skan"] * 19
    assert sorted(r["proto"] for r in two) == ["cluster"] * 16 + ["hsp"] * 4
    beta_1 = [r for r in one if r["group"] == "beta"]
    assert all(r["undeliverable"] for r in beta_1)  # nobody on broker 1 ...
    assert all(not r["undeliverable"] for r in two if r["group"] == "beta")  # ... but on 2


def test_report_counts_each_message_once(spark, two_logs, tmp_path):  # noqa: F811
    result = report.run(spark, [str(d) for d in two_logs], str(tmp_path / "r"), quiet=True)
    t = result.totals
    messages = sum(n for _, _, n in PLAN)
    assert t["messages"] == messages
    assert t["deliveries"] == sum(n * COPIES[g] for _, g, n in PLAN)
    # "beta" had no recipient on the broker it entered, but one on the other.
    assert t["undeliverable"] == 3
    assert (t["groups"], t["senders"]) == (3, 2)
    groups = {r[0]: r[1:] for r in result.tables["groups_by_messages"].rows}
    assert {g: (row[0], row[2], row[3]) for g, row in groups.items()} == {
        "alpha": (14, 28, 0), "beta": (6, 6, 0), "void": (3, 0, 3)}
    fan = dict(result.tables["fanout"].rows)
    assert (fan["0"], fan["1"], fan["2"]) == (3, 6, 14)
    mix = {r[0]: r[1:] for r in result.tables["protocols"].rows}
    assert mix["skan"][0] == 19 and mix["hsp"][0] == 4  # messages_in
    assert mix["skan"][3] == 34  # deliveries_out: every subscriber is a Skan client
    assert mix.get("cluster", [0])[0] == 0  # backplane records carry no messages
    assert {r[0]: r[1] for r in result.tables["undeliverable"].rows} == {"void": 3}
    cols = result.tables["top_senders"].columns
    senders = sorted((r[cols.index("proto")], r[cols.index("messages")])
                     for r in result.tables["top_senders"].rows)
    assert senders == [("hsp", 4), ("skan", 19)]


def test_cli_takes_several_directories_or_a_glob(spark, two_logs, tmp_path, capsys):  # noqa: F811
    args = [a for d in two_logs for a in ("--log-dir", str(d))]
    assert cli.main(["report", *args, "--out", str(tmp_path / "r1")], spark=spark) == 0
    pattern = str(two_logs[0].parent.parent / "b*" / "log")
    assert cli.main(["report", "--log-dir", pattern, "--out", str(tmp_path / "r2")],
                    spark=spark) == 0
    for out in ("r1", "r2"):
        totals = json.loads((tmp_path / out / "report.json").read_text())["totals"]
        assert (totals["messages"], totals["undeliverable"]) == (23, 3), out
    # One directory alone is that broker's own view.
    assert cli.main(["report", "--log-dir", str(two_logs[1]), "--out", str(tmp_path / "r3")],
                    spark=spark) == 0
    totals = json.loads((tmp_path / "r3" / "report.json").read_text())["totals"]
    assert totals["messages"] == 4
