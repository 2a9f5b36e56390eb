"""A real Prometheus scrapes real brokers while traffic flows; the dashboard's queries work.

Every PromQL expression of grafana/dashboards/skan-broker.json is evaluated
through Prometheus' HTTP API and must return data, and the scraped
counters must equal what the traffic did.  Broker A drops for slow
consumers (policy drop), broker B disconnects them; both carry an HSP
bridge to an address where nothing listens (up 0, reconnecting).  Broker C
has no bridge and no traffic: what an operator sees on a quiet new broker.
"""

from __future__ import annotations

import json
import math
import re
import time

import attrs
import pytest
import trio

from clients.skan import SkanClient
from tests.brokerproc import ROOT, BrokerProcess
from tests.observability.metrics.httpc import scrape
from tests.observability.metrics.prometheus import PrometheusServer, ensure_prometheus, free_port
from tests.rawskan import RawSkan
from wire.skan import encode_frame

pytestmark = pytest.mark.prometheus

DASHBOARD = ROOT / "grafana" / "dashboards" / "skan-broker.json"
JOB = "skan"
# Grafana variables, as the dashboard would expand them for "All" over this test's job.
VARIABLES = {"$job": JOB, "$instance": ".*", "$__rate_interval": "1m"}

BRIDGE = """
[[bridges]]
protocol = "hsp"
address = "127.0.0.1:{dead_port}"
group = "bridged"
backoff_initial = 0.1
backoff_max = 0.3
"""

CONFIG_A = """
[broker]
max_frame = 65536
queue_limit = 1048576
slow_consumer = "drop"
slow_consumer_grace = 0

[metrics]
groups = ["alpha"]
top_groups = 3
""" + BRIDGE

CONFIG_C = """
[metrics]
groups = ["alpha"]
"""

CONFIG_B = """
[broker]
max_frame = 65536
queue_limit = 1048576
slow_consumer = "disconnect"
slow_consumer_grace = 0
""" + BRIDGE


def dashboard_expressions() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    out = []
    for panel in panels:
        for target in panel.get("targets", []):
            out.append((f"{panel['title']} / {target['refId']}", target["expr"]))
    return out


def expand(expr: str, instance: str | None = None) -> str:
    """Grafana's expansion of the variables: all instances, or the one given."""
    variables = VARIABLES if instance is None else {**VARIABLES, "$instance": instance}
    for name, value in variables.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"unexpanded variable in {expr}"
    return expr


@attrs.define
class Traffic:
    """What the traffic generator did, to compare with the scraped counters."""

    routed: int = 0
    routed_bytes: int = 0
    delivered: int = 0
    undeliverable: int = 0
    alpha: int = 0
    accepted: int = 0
    eof_closes: int = 0
    flood_sent: int = 0
    flood_received: int = 0
    subscriptions: int = 0


def _send_size(lname: str, seq: int, group: str, instance: str, msg: str) -> int:
    return len(encode_frame({"type": "send", "from": lname, "to": "*", "group": group,
                             "instance": instance, "seq": str(seq), "msg": msg}))


async def _drive_a(addr: tuple[str, int], t: Traffic) -> None:
    """Steady traffic for a few seconds, protocol errors, and a stalled consumer."""
    async with (
        SkanClient.connect(*addr) as pub,
        SkanClient.connect(*addr) as s1,
        SkanClient.connect(*addr) as s2,
    ):
        t.accepted += 3
        await s1.subscribe("alpha")
        await s2.subscribe("alpha", "i1")
        t.subscriptions = 2
        got = {"s1": 0, "s2": 0}

        async def count(name: str, client: SkanClient) -> None:
            async for _ in client:
                got[name] += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(count, "s1", s1)
            nursery.start_soon(count, "s2", s2)
            seq = 0
            end = trio.current_time() + 3.0  # three seconds of traffic: several scrapes
            while trio.current_time() < end:
                for group, instance, n, receivers in (("alpha", "i1", 40, 2),
                                                      ("alpha", "other", 10, 1),
                                                      ("nobody", "*", 5, 0)):
                    for _ in range(n):
                        seq += 1
                        await pub.send(group, "payload", instance=instance)
                        t.routed += 1
                        t.routed_bytes += _send_size(pub.lname, seq, group, instance, "payload")
                        t.delivered += receivers
                        t.undeliverable += receivers == 0
                        t.alpha += group == "alpha"
                await trio.sleep(0.05)
            await pub.barrier()
            with trio.fail_after(20):
                while got["s1"] + got["s2"] < t.delivered:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        assert got["s1"] + got["s2"] == t.delivered

        # Protocol errors: one rejected (stays open), one malformed (closed).
        bad = await RawSkan.open(addr)
        await bad.getlname()
        await bad.send({"type": "nonsense", "seq": "1"})
        await bad.message()
        await bad.send_bytes(b"\x00\x00\x00\x05Skan\x09")
        await bad.expect_closed()
        t.accepted += 1

        # A consumer that stops reading: the publisher floods it, the queue
        # fills, the rest is dropped and counted.
        stalled = await RawSkan.open(addr)
        await stalled.getlname()
        await stalled.send({"type": "subscribe", "group": "flood", "instance": "*"})
        await stalled.getlname()
        t.accepted += 1
        t.subscriptions += 1
        payload = "x" * 8000
        for _ in range(1500):
            seq += 1
            await pub.send("flood", payload)
            t.routed += 1
            t.routed_bytes += _send_size(pub.lname, seq, "flood", "*", payload)
            t.flood_sent += 1
        await pub.barrier()
        while True:
            try:
                await stalled.frame(timeout=1.0)
            except trio.TooSlowError:
                break
            t.flood_received += 1
        t.delivered += t.flood_received
        await stalled.aclose()
        t.eof_closes += 1
        t.subscriptions -= 1
    t.eof_closes += 3


async def _drive_b(addr: tuple[str, int]) -> None:
    """A consumer that stops reading is disconnected (policy disconnect)."""
    stalled = await RawSkan.open(addr)
    await stalled.getlname()
    await stalled.send({"type": "subscribe", "group": "flood", "instance": "*"})
    await stalled.getlname()
    async with SkanClient.connect(*addr) as pub:
        for _ in range(1500):
            await pub.send("flood", "x" * 8000)
        await pub.barrier()
    await stalled.aclose()


@attrs.define
class Setup:
    prom: PrometheusServer
    a: BrokerProcess
    b: BrokerProcess
    c: BrokerProcess
    traffic: Traffic
    families_a: set[str]

    def inst(self, broker: BrokerProcess) -> str:
        host, port = broker.addr["metrics"]
        return f"{host}:{port}"


@pytest.fixture(scope="module")
def setup():
    binary = ensure_prometheus()
    dead = free_port()  # nothing listens here: the bridges stay down and reconnect
    a = BrokerProcess(CONFIG_A.format(dead_port=dead)).start()
    b = BrokerProcess(CONFIG_B.format(dead_port=dead)).start()
    c = BrokerProcess(CONFIG_C).start()
    prom = PrometheusServer(binary, [a.addr["metrics"], b.addr["metrics"], c.addr["metrics"]],
                            JOB)
    try:
        prom.start()
        prom.wait_scraping(3)
        traffic = Traffic()

        async def drive() -> set[str]:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_drive_a, a.skan, traffic)
                nursery.start_soon(_drive_b, b.skan)
            return {name for name, _ in await scrape(a.addr["metrics"])}

        families = trio.run(drive)
        s = Setup(prom, a, b, c, traffic, families)
        # Wait until Prometheus has scraped the final state of both brokers.
        inst = s.inst(a)
        got = prom.wait_value(
            f'skan_messages_received_total{{instance="{inst}",protocol="skan"}}', traffic.routed)
        assert got == traffic.routed, (got, traffic.routed)
        got = prom.wait_value(
            f'skan_slow_consumer_disconnects_total{{instance="{s.inst(b)}"}}', 1)
        assert got == 1
        time.sleep(1.5)  # one more scrape of everything that settled with it
        yield s
    finally:
        prom.cleanup()
        a.stop()
        b.stop()
        c.stop()


@pytest.mark.parametrize(("panel", "expr"), dashboard_expressions(),
                         ids=[p for p, _ in dashboard_expressions()])
def test_dashboard_expression_has_data(setup, panel, expr):
    result = setup.prom.query(expand(expr))
    assert result, f"{panel}: {expand(expr)} returned nothing"
    values = [float(r["value"][1]) for r in result]
    if "histogram_quantile" in expr or "_sum" in expr:
        assert all(math.isfinite(v) for v in values), f"{panel}: {values}"


def test_dashboard_uses_only_known_metrics(setup):
    names = set()
    for _, expr in dashboard_expressions():
        names |= set(re.findall(r"\b((?:skan|process)_[a-z_]+)\{", expr))
    missing = names - setup.families_a
    assert not missing, f"dashboard uses metrics the broker does not export: {missing}"


def test_counts_equal_the_traffic(setup):
    t = setup.traffic
    a = f'instance="{setup.inst(setup.a)}"'
    v = setup.prom.value
    assert v(f'skan_messages_received_total{{{a},protocol="skan"}}') == t.routed
    assert v(f'skan_received_bytes_total{{{a},protocol="skan"}}') == t.routed_bytes
    assert v(f'skan_messages_delivered_total{{{a},protocol="skan"}}') == t.delivered
    assert v(f"skan_messages_undeliverable_total{{{a}}}") == t.undeliverable
    assert v(f'skan_group_messages_total{{{a},group="alpha"}}') == t.alpha
    assert v(f"skan_routing_latency_seconds_count{{{a}}}") == t.routed
    assert v(f'skan_connections_accepted_total{{{a},protocol="skan"}}') == t.accepted
    assert v(f'skan_connections_open{{{a},protocol="skan"}}') == 0
    assert v(f'skan_connections_closed_total{{{a},protocol="skan",reason="eof"}}') == t.eof_closes
    assert v(f'skan_connections_closed_total{{{a},protocol="skan",reason="protocol-error"}}') == 1
    assert v(f'skan_protocol_errors_total{{{a},protocol="skan",reason="rejected"}}') == 1
    assert v(f'skan_protocol_errors_total{{{a},protocol="skan",reason="malformed"}}') == 1
    assert 0 < t.flood_received < t.flood_sent
    assert v(f'skan_messages_dropped_total{{{a},protocol="skan",reason="queue-full"}}') == (
        t.flood_sent - t.flood_received)
    assert v(f"skan_slow_consumer_disconnects_total{{{a}}}") == 0
    # Every client has gone; the HSP bridge still holds its subscription on its group.
    assert v(f"skan_subscriptions{{{a}}}") == 1
    assert v(f'skan_group_subscriptions{{{a},group="bridged"}}') is None  # not a top group
    assert v(f"skan_groups{{{a}}}") == 1
    # The busiest groups have series; the allow-listed one always.
    groups = {r["metric"]["group"] for r in setup.prom.query(f"skan_group_messages_total{{{a}}}")}
    assert groups == {"alpha", "flood", "nobody"}


def test_slow_consumer_disconnect_is_counted(setup):
    b = f'instance="{setup.inst(setup.b)}"'
    v = setup.prom.value
    assert v(f"skan_slow_consumer_disconnects_total{{{b}}}") == 1
    assert v(f'skan_connections_closed_total{{{b},protocol="skan",reason="slow-consumer"}}') == 1
    assert v(f'skan_messages_dropped_total{{{b},protocol="skan",reason="queue-full"}}') == 0


def test_latency_quantiles_are_plausible(setup):
    a = f'instance="{setup.inst(setup.a)}"'
    p50 = setup.prom.value(
        f"histogram_quantile(0.5, sum by (le) "
        f"(rate(skan_routing_latency_seconds_bucket{{{a}}}[1m])))")
    p99 = setup.prom.value(
        f"histogram_quantile(0.99, sum by (le) "
        f"(rate(skan_routing_latency_seconds_bucket{{{a}}}[1m])))")
    assert p50 is not None and p99 is not None
    assert 0 < p50 <= p99 < 1.0


def test_bridges_are_down_and_reconnecting(setup):
    for broker in (setup.a, setup.b):
        inst = f'instance="{setup.inst(broker)}"'
        assert setup.prom.value(f"sum(skan_bridge_up{{{inst}}})") == 0
        assert setup.prom.value(f"sum(skan_bridge_reconnects_total{{{inst}}})") >= 2


def test_routing_log_counts_every_routed_message(setup):
    a = f'instance="{setup.inst(setup.a)}"'
    got = setup.prom.wait_value(f"skan_routelog_records_total{{{a}}}", setup.traffic.routed)
    assert got == setup.traffic.routed
    assert setup.prom.value(f"skan_routelog_lag_seconds{{{a}}}") < 5


def test_dashboard_variables_resolve(setup):
    """The Job and Instance variables' label_values() queries find both brokers."""
    found = {}
    for var in json.loads(DASHBOARD.read_text())["templating"]["list"]:
        if var["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"])
        assert match, var["query"]
        selector, label = expand(match.group(1)), match.group(2)
        found[var["name"]] = set(setup.prom.api(f"label/{label}/values", **{"match[]": selector}))
    assert found == {"job": {JOB}, "instance": {setup.inst(setup.a), setup.inst(setup.b),
                                                 setup.inst(setup.c)}}


def _panel_values(setup, broker: BrokerProcess, panel_part: str) -> dict[str, list[float]]:
    """Each query of the panels whose title contains ``panel_part``, for one broker."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    out = {}
    for panel in panels:
        if panel_part not in panel["title"]:
            continue
        for target in panel.get("targets", []):
            result = setup.prom.query(expand(target["expr"], setup.inst(broker)))
            out[f"{panel['title']} / {target['refId']}"] = [float(r["value"][1])
                                                            for r in result]
    return out


def test_bridge_panels_show_a_value_without_bridges(setup):
    """Broker C has no bridge: the bridge panels show 0 (and "no bridges"), not "no data"."""
    values = _panel_values(setup, setup.c, "Bridge")
    assert len(values) == 6, values
    for name, got in values.items():
        expected = [-1.0] if name.startswith("Bridge up") else [0.0]
        assert got == expected, name
    # With bridges (broker A) the fallback series is absent: only real bridges.
    up = setup.prom.query(expand(
        next(t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"]
             if p["title"] == "Bridge up" for t in p["targets"]), setup.inst(setup.a)))
    bridges = [r["metric"]["bridge"] for r in up]
    assert len(bridges) == 1 and bridges[0].startswith("hsp-0-127.0.0.1:"), bridges


def test_error_and_close_rates_are_zero_not_absent_on_a_quiet_broker(setup):
    """From the first scrape, closed-by-reason and protocol-error series exist at 0,
    so rate() over them is 0 and the panels draw a line."""
    c = f'instance="{setup.inst(setup.c)}"'
    for metric in ("skan_connections_closed_total", "skan_protocol_errors_total"):
        rates = setup.prom.query(f"rate({metric}{{{c}}}[1m])")
        assert rates and all(float(r["value"][1]) == 0 for r in rates), metric
    for panel, got in _panel_values(setup, setup.c, "Protocol errors").items():
        assert got and set(got) == {0.0}, panel
    closed = _panel_values(setup, setup.c, "Connections accepted and closed")
    assert closed and all(got and set(got) == {0.0} for got in closed.values()), closed
    reasons = {(r["metric"]["protocol"], r["metric"]["reason"])
               for r in setup.prom.query(f"skan_protocol_errors_total{{{c}}}")}
    assert {("skan", "malformed"), ("metrics", "request-timeout")} <= reasons


def test_reason_panels_draw_only_reasons_that_happened(setup):
    """Dozens of reasons exist at 0; the panels draw the non-zero ones, or one
    "all none" line at 0 when there are none."""
    panel = next(p for p in json.loads(DASHBOARD.read_text())["panels"]
                 if p["title"] == "Protocol errors / s")
    expr = panel["targets"][0]["expr"]
    seen_a = {(r["metric"]["protocol"], r["metric"]["reason"])
              for r in setup.prom.query(expand(expr, setup.inst(setup.a)))}
    assert seen_a == {("skan", "rejected"), ("skan", "malformed")}
    quiet = setup.prom.query(expand(expr, setup.inst(setup.c)))
    assert [(r["metric"], float(r["value"][1])) for r in quiet] == [
        ({"protocol": "all", "reason": "none"}, 0.0)]
