"""Every broker metric moves exactly as the traffic says (direct scrapes of a real broker)."""

from __future__ import annotations

import re

import pytest
import trio
from prometheus_client.exposition import generate_latest

from broker.core.reasons import CloseReason, ErrorKind, RefusalReason
from broker.core.router import Router
from broker.observability.metrics import build_registry, exported_groups, prune_group_stats
from broker.serving.bridge_runner import BridgeStatus, BufferedBridgeEndpoint
from broker.serving.config import BridgeSection, Config, MetricsSection
from broker.serving.context import BrokerContext
from clients.skan import SkanClient
from tests.brokerproc import ROOT, BrokerProcess
from tests.observability.metrics.httpc import samples, scrape, value
from tests.rawhsp import RawHSP
from tests.rawmariner import RawMariner
from tests.rawskan import RawSkan
from wire.skan import encode_frame

CONFIG = """
[broker]
max_frame = 65536
queue_limit = 1048576
slow_consumer = "drop"
# Drop at once instead of pausing the publisher first (back-pressure).
slow_consumer_grace = 0

[metrics]
groups = ["alpha"]
top_groups = 2
"""


@pytest.fixture(scope="module")
def mbroker():
    with BrokerProcess(CONFIG) as proc:
        yield proc
    assert proc.proc is not None and proc.proc.returncode == 0, "".join(proc.stderr_lines[-40:])


async def _barrier(*clients: SkanClient) -> None:
    for c in clients:
        await c.barrier()


async def test_traffic_counts_are_exact(mbroker):
    addr = mbroker.addr["metrics"]
    before = await scrape(addr)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - before.get((name, frozenset(labels.items())), 0)

    async with (
        SkanClient.connect(*mbroker.skan) as pub,
        SkanClient.connect(*mbroker.skan) as s1,
        SkanClient.connect(*mbroker.skan) as s2,
    ):
        await s1.subscribe("alpha")
        await s2.subscribe("alpha", "i1")
        for i in range(10):
            await pub.send("alpha", f"m{i}", instance="i1")
        for _ in range(3):
            await pub.send("alpha", "x", instance="other")  # s1 only
        for _ in range(4):
            await pub.send("nobody-listens", "x")
        await _barrier(pub)
        for _ in range(13):
            await s1.receive()
        for _ in range(10):
            await s2.receive()
        after = await scrape(addr)
        sent_bytes = sum(len(encode_frame({
            "type": "send", "from": pub.lname, "to": "*", "group": g, "instance": inst,
            "seq": str(seq), "msg": m})) for seq, (g, inst, m) in enumerate(
            [("alpha", "i1", f"m{i}") for i in range(10)]
            + [("alpha", "other", "x")] * 3 + [("nobody-listens", "*", "x")] * 4, start=1))
        assert delta("skan_messages_received_total", protocol="skan") == 17
        assert delta("skan_received_bytes_total", protocol="skan") == sent_bytes
        assert delta("skan_messages_delivered_total", protocol="skan") == 23
        assert delta("skan_messages_undeliverable_total") == 4
        assert delta("skan_routing_latency_seconds_count") == 17
        # Routing endpoints only: the scrapes' HTTP connections are not counted.
        assert delta("skan_connections_accepted_total", protocol="skan") == 3
        assert value(after, "skan_group_messages_total", group="alpha") - before.get(
            ("skan_group_messages_total", frozenset({"group": "alpha"}.items())), 0) == 13


async def test_connections_open_closed_and_errors(mbroker):
    addr = mbroker.addr["metrics"]
    before = await scrape(addr)
    open_before = value(before, "skan_connections_open", protocol="skan")

    def delta(data, name: str, **labels: str) -> float:
        return value(data, name, **labels) - before.get((name, frozenset(labels.items())), 0)

    raws = [await RawSkan.open(mbroker.skan) for _ in range(3)]
    for raw in raws:
        await raw.getlname()
    during = await scrape(addr)
    assert value(during, "skan_connections_open", protocol="skan") == open_before + 3
    # 1: malformed message -> error, closed; 2: frame over max_frame -> closed;
    # 3: a semantic fault (stays open) then a clean close.
    await raws[0].send_bytes(b"\x00\x00\x00\x05Skan\x09")
    await raws[1].send_bytes((70000).to_bytes(4, "big"))
    await raws[2].send({"type": "bogus", "seq": "1"})
    for raw in raws[:2]:
        await raw.expect_closed()
    await raws[2].message()
    await raws[2].aclose()
    with trio.fail_after(10):
        while True:
            after = await scrape(addr)
            if value(after, "skan_connections_open", protocol="skan") == open_before:
                break
            await trio.sleep(0.05)
    assert delta(after, "skan_protocol_errors_total", protocol="skan", reason="malformed") == 1
    assert delta(after, "skan_protocol_errors_total", protocol="skan", reason="bad-frame") == 1
    assert delta(after, "skan_protocol_errors_total", protocol="skan", reason="rejected") == 1
    assert delta(after, "skan_connections_closed_total", protocol="skan",
                 reason="protocol-error") == 2
    assert delta(after, "skan_connections_closed_total", protocol="skan", reason="eof") == 1
    assert delta(after, "skan_connections_accepted_total", protocol="skan") == 3


async def test_drops_and_queue_depth_with_a_stalled_consumer(mbroker):
    addr = mbroker.addr["metrics"]
    before = await scrape(addr)
    stalled = await RawSkan.open(mbroker.skan)
    await stalled.getlname()
    await stalled.send({"type": "subscribe", "group": "flood", "instance": "*"})
    await stalled.getlname()
    payload = "x" * 8000
    sent = 2000  # 16 MB: far more than the socket buffers plus the 1 MiB queue
    async with SkanClient.connect(*mbroker.skan) as pub:
        for _ in range(sent):
            await pub.send("flood", payload)
        await pub.barrier()
        during = await scrape(addr)
        assert value(during, "skan_outgoing_queue_max_bytes", protocol="skan") > 0
        assert value(during, "skan_outgoing_queue_bytes", protocol="skan") >= value(
            during, "skan_outgoing_queue_max_bytes", protocol="skan")
        assert value(during, "skan_outgoing_queue_limit_bytes") == 1048576
        # Now read everything that was queued; the rest was dropped and counted.
        received = 0
        while True:
            try:
                frame = await stalled.frame(timeout=1.0)
            except trio.TooSlowError:
                break
            received += frame.count(b"flood") > 0
        after = await scrape(addr)
    await stalled.aclose()
    dropped = value(after, "skan_messages_dropped_total", protocol="skan",
                    reason="queue-full") - before.get(
        ("skan_messages_dropped_total",
         frozenset({"protocol": "skan", "reason": "queue-full"}.items())), 0)
    assert 0 < received < sent
    assert dropped == sent - received


async def test_per_group_series_are_bounded(mbroker):
    addr = mbroker.addr["metrics"]
    async with SkanClient.connect(*mbroker.skan) as pub:
        for group, n in (("busy-1", 40), ("busy-2", 30), ("quiet-3", 2), ("quiet-4", 1)):
            for _ in range(n):
                await pub.send(group, "x")
        await pub.send("alpha", "x")
        await pub.barrier()
        data = await scrape(addr)
    groups = {dict(labels)["group"] for name, labels in data
              if name == "skan_group_messages_total"}
    # The allow-listed group plus the top 2 by traffic (the flood group of an
    # earlier test may be among them); never the quiet ones.
    assert "alpha" in groups and "busy-1" in groups
    assert len(groups) == 3
    assert not groups & {"quiet-3", "quiet-4"}
    assert value(data, "skan_groups_tracked") >= 5


def test_group_table_pruning_keeps_allowed_and_busiest():
    stats = {f"g{i}".encode(): [i, i] for i in range(200)}
    stats[b"allowed"] = [0, 0]
    prune_group_stats(stats, [b"allowed"], top=2, limit=50)
    assert b"allowed" in stats and b"g199" in stats
    assert len(stats) <= 21 + 1  # max(top * 10, limit // 10) busiest + allowed
    assert exported_groups(stats, [b"allowed"], 2) == [b"allowed", b"g199", b"g198"]
    small = {b"a": [1, 1]}
    prune_group_stats(small, [], top=0, limit=50)
    assert small == {b"a": [1, 1]}


def test_bridge_status_and_buffer_series():
    """Bridges export up, connects, reconnects, overflow, sent, received, buffered."""
    config = Config(metrics=MetricsSection(), bridges=(
        BridgeSection(protocol="hsp", address="127.0.0.1:1", group="g"),))
    ctx = BrokerContext(config=config, router=Router())
    up = BridgeStatus("hsp-0-127.0.0.1:1", "hsp", "127.0.0.1:1", up=True, connects=2,
                      reconnects=1, sent=5, received=7)
    down = BridgeStatus("mariner-1-h:2", "mariner", "h:2", reconnects=4)
    ctx.bridges += [up, down]
    ep = BufferedBridgeEndpoint("bridge-hsp", up, limit=2)
    ctx.router.attach(ep)
    ctx.router.subscribe(ep, b"g", b"*", 0)
    sender = BufferedBridgeEndpoint("bridge-mariner", down, limit=2)
    ctx.router.attach(sender)
    frames = []
    for i in range(3):
        frame = encode_frame({"type": "send", "group": "g", "instance": "*", "to": "*",
                              "from": sender.lname.decode(), "seq": str(i), "msg": "x" * i})
        frames.append(frame)
        ctx.router.route(sender, frame, {b"group": b"g", b"instance": b"*", b"to": b"*"})
    data = samples(generate_latest(build_registry(ctx, ["skan", "bridge-hsp"])).decode())
    hsp = {"bridge": up.name, "protocol": "hsp"}
    assert value(data, "skan_bridge_up", address="127.0.0.1:1", **hsp) == 1
    assert value(data, "skan_bridge_up", bridge=down.name, protocol="mariner", address="h:2") == 0
    assert value(data, "skan_bridge_connects_total", **hsp) == 2
    assert value(data, "skan_bridge_reconnects_total", bridge=down.name, protocol="mariner") == 4
    assert value(data, "skan_bridge_sent_messages_total", **hsp) == 5
    assert value(data, "skan_bridge_received_messages_total", **hsp) == 7
    assert value(data, "skan_bridge_overflow_messages_total", **hsp) == 1
    assert value(data, "skan_bridge_buffered_messages", **hsp) == 2
    assert value(data, "skan_messages_dropped_total", protocol="bridge-hsp",
                 reason="bridge-buffer-full") == 1
    assert value(data, "skan_connections_open", protocol="bridge-hsp") == 1
    assert value(data, "skan_messages_received_total", protocol="bridge-mariner") == 3
    # The two newest frames wait in the bridge buffer (the oldest overflowed).
    buffered = len(frames[1]) + len(frames[2])
    assert value(data, "skan_outgoing_queue_bytes", protocol="bridge-hsp") == buffered
    assert value(data, "skan_outgoing_queue_max_bytes", protocol="bridge-hsp") == buffered
    assert value(data, "skan_outgoing_queue_bytes", protocol="bridge-mariner") == 0


async def test_hsp_and_mariner_errors_carry_protocol_and_reason(mbroker):
    addr = mbroker.addr["metrics"]
    before = await scrape(addr)

    def delta(data, protocol: str, reason: str) -> float:
        key = ("skan_protocol_errors_total",
               frozenset({"protocol": protocol, "reason": reason}.items()))
        return data.get(key, 0) - before.get(key, 0)

    hsp = await RawHSP.open(mbroker.addr["hsp"])
    await hsp.getlname()
    await hsp.data({"type": "getlname"}, type=7)  # DATA of an unknown Type: dropped, counted
    await hsp.data_ack({"type": "getlname"}, type=7)  # DATA_ACK: ERROR 2
    await hsp.event()
    await hsp.data_ack(b"Skan\x09")  # malformed inner Skan message: ERROR 1
    await hsp.event()
    await hsp.data_ack({"type": "bogus"})  # well-formed, refused: ERROR 2
    await hsp.event()
    await hsp.stream.aclose()
    mariner = await RawMariner.open(mbroker.addr["mariner"])
    await mariner.send_bytes(b"\x00\x00\x00\x02{]")  # not JSON
    await mariner.expect_closed()
    eventer = await trio.open_tcp_stream(*mbroker.addr["eventer"])
    await eventer.send_all(b"\x01\x03abc")  # a Chatter frame whose body is not a message
    with trio.fail_after(5):
        while await eventer.receive_some(4096):
            pass
    await eventer.aclose()
    after = await scrape(addr)
    assert delta(after, "hsp", "unknown-type") == 1
    assert delta(after, "hsp", "rejected") == 2
    assert delta(after, "hsp", "malformed") == 1
    assert delta(after, "mariner", "bad-message") == 1
    assert delta(after, "eventer", "bad-message") == 1
    unlabelled = ("skan_protocol_errors_total",
                  frozenset({"protocol": "unknown", "reason": "unlabelled"}.items()))
    assert after[unlabelled] == 0  # every error above carried its protocol and reason


# ---- every known label value exists from the first scrape -----------------------


async def test_closed_and_error_series_exist_at_zero_from_the_first_scrape():
    with BrokerProcess("[log]\nenabled = false\n") as proc:
        data = await scrape(proc.addr["metrics"])
    for proto in ("skan", "hsp", "eventer", "mariner"):
        for reason in CloseReason:
            assert value(data, "skan_connections_closed_total", protocol=proto,
                         reason=reason) == 0, (proto, reason)
        for kind in ErrorKind:
            assert value(data, "skan_protocol_errors_total", protocol=proto,
                         reason=kind) == 0, (proto, kind)
        for refusal in RefusalReason:
            assert value(data, "skan_connections_refused_total", protocol=proto,
                         reason=refusal) == 0, (proto, refusal)
    # A few spelled out, so the test does not only compare the code with itself.
    for proto, reason in (("skan", "eof"), ("skan", "slow-consumer"), ("hsp", "ping-timeout"),
                          ("eventer", "conversation-timeout"), ("mariner", "unauthorised")):
        assert value(data, "skan_connections_closed_total", protocol=proto, reason=reason) == 0
    for proto, reason in (("skan", "malformed"), ("hsp", "too-large"),
                          ("eventer", "bad-message"), ("metrics", "request-timeout"),
                          ("metrics", "malformed"), ("unknown", "unlabelled")):
        assert value(data, "skan_protocol_errors_total", protocol=proto, reason=reason) == 0
    # No bridge configured: no bridge protocols, no bridge series.
    assert not any(proto.startswith("bridge-") for (name, labels) in data
                   for key, proto in labels if key == "protocol")


def test_every_reason_the_code_uses_is_an_enum_member():
    """Reasons passed to protocol_error(), refuse(), detach(), kill() or set as
    ``closing`` in broker/ are members of the StrEnums of broker.core.reasons
    (all initialised at 0 above), never string literals that would start absent."""
    literal = re.compile(r'(?:protocol_error\(|refuse\(|detach\()[^()"]*,\s*"'
                         r'|closing = "|kill\("')
    calls = re.compile(r"protocol_error\(|refuse\(|detach\(|closing = |kill\(")
    found = 0
    for path in (ROOT / "broker").rglob("*.py"):
        text = path.read_text()
        found += len(calls.findall(text))
        assert not literal.search(text), (path, literal.search(text).group())
    assert found > 20  # the patterns still find the call sites


def test_routelog_lag_is_the_age_of_the_oldest_waiting_record_and_drops_count(tmp_path):
    """``skan_routelog_lag_seconds``: the oldest record the writer has not taken
    (not the time since the queue was last empty); ``skan_routelog_dropped_records``:
    each record dropped with when_full = "drop"."""
    import time

    from broker.observability.routelog.files import LogDirectory
    from broker.observability.routelog.writer import RoutingLog
    from tests.observability.routelog.test_record import send, sink

    ctx = BrokerContext(config=Config(metrics=MetricsSection()), router=Router())
    directory = LogDirectory(str(tmp_path), 1)
    directory.open()
    rl = ctx.routelog = RoutingLog(directory, rotate_bytes=1 << 30, rotate_seconds=3600.0,
                                   queue_records=8, when_full="drop")
    rl.attach(ctx.router)
    pub = sink(ctx.router)

    def scraped() -> dict:
        return samples(generate_latest(build_registry(ctx, ["skan"])).decode())

    assert value(scraped(), "skan_routelog_lag_seconds") == 0
    send(ctx.router, pub)  # the writer is not running: it waits
    time.sleep(0.4)
    for _ in range(19):
        send(ctx.router, pub)  # 2 per hand-off: the first 10 are taken, then dropped
    data = scraped()
    assert 0.4 <= value(data, "skan_routelog_lag_seconds") < 2.0
    assert value(data, "skan_routelog_dropped_records_total") == 10
    assert value(data, "skan_routelog_queued_records") == 10
    rl.start()
    rl.stop()
    rl.join()
    data = scraped()
    assert value(data, "skan_routelog_lag_seconds") == 0
    assert value(data, "skan_routelog_records_total") == 10


async def test_routelog_recovery_at_start_up_is_on_metrics(tmp_path):
    """A killed broker's unfinished files, repaired at start-up, show on /metrics
    (the Parquet file's records are lost: operators alert on that series)."""
    from broker.observability.routelog.files import LogDirectory

    log_dir = tmp_path / "log"
    old = LogDirectory(str(log_dir), 1)
    old.open()
    old.suffix = ".jsonl"
    torn = old.new_file()
    torn.write(b'{"n":1}\n{"n":2,"to')
    torn.abandon()
    old.suffix = ".parquet"
    for _ in range(2):
        unfinished = old.new_file()
        unfinished.write(b"PAR1 row groups but no footer")
        unfinished.abandon()
    old.close()
    with BrokerProcess("", ("--log-dir", str(log_dir))) as proc:
        data = await scrape(proc.addr["metrics"])
    assert value(data, "skan_routelog_recovered_files_total") == 1
    assert value(data, "skan_routelog_recovered_torn_bytes_total") == len(b'{"n":2,"to')
    assert value(data, "skan_routelog_recovered_empty_files_total") == 0
    assert value(data, "skan_routelog_recovered_unfinished_parquet_files_total") == 2
