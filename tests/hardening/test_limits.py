"""Per-connection state and broker-built frames are bounded (BROKER-SPEC section 9).

``[broker] max_subscriptions`` on every protocol, and frames the broker
builds itself (an HSP bridge payload, a Hat event registered over Eventer)
held to ``max_frame`` at the edge where they enter -- each over real
sockets, with a bystander pair proving others are undisturbed.
"""

from __future__ import annotations

import pytest
import trio

from clients.skan import SkanClient
from tests.brokerproc import BrokerProcess
from tests.hardening.bystander import bystander, tracebacks
from tests.protocols.hsp.test_bridge import PeerServer, bridge_config, free_port, until
from tests.rawhsp import RawHSP
from tests.rawmariner import RawMariner
from tests.rawskan import RawSkan
from toolkit.eventer_client import EventerClient, EventerInitError
from wire.eventer import BinaryPayload, RegisterEvent
from wire.hsp import Error

MAX_SUBS = 5
SMALL_FRAME = 65536


@pytest.fixture(scope="module")
def limited():
    config = f"[broker]\nmax_subscriptions = {MAX_SUBS}\nmax_frame = {SMALL_FRAME}\n" \
             f"queue_limit = 1048576\n"
    with BrokerProcess(config) as proc:
        yield proc
    assert not tracebacks(proc.stderr_lines), "".join(proc.stderr_lines[-40:])


@pytest.mark.trio
async def test_skan_subscribe_past_the_limit_gets_error_with_seq(limited):
    async with bystander(limited.skan) as b:
        async with b.measure():
            c = await RawSkan.open(limited.skan)
            await c.getlname()
            for i in range(MAX_SUBS):
                await c.send({"type": "subscribe", "group": "lim", "instance": str(i)})
            # Replacing the subtype of a held subscription is no new subscription.
            await c.send({"type": "subscribe", "group": "lim", "instance": "0",
                          "subtype": "promisc"})
            await c.send({"type": "subscribe", "group": "lim", "instance": "new", "seq": "77"})
            err = await c.message()
            assert err[b"type"] == b"error" and err[b"seq"] == b"77"
            assert b"max_subscriptions" in err[b"error"]
            # The connection stays open; freeing one makes room again.
            await c.send({"type": "unsubscribe", "group": "lim", "instance": "1"})
            await c.send({"type": "subscribe", "group": "lim", "instance": "new", "seq": "78"})
            await c.send({"type": "stats"})
            stats = (await c.message())[b"stats"]
            assert stats[b"subscriptions_refused"] == b"1"
            await c.aclose()
            await trio.sleep(0.2)
        await b.settle()
        fig = b.figures()
    assert fig.lost == 0 and fig.received > 0


@pytest.mark.trio
async def test_hsp_subscribe_past_the_limit_is_error_2(limited):
    h = await RawHSP.open(limited.addr["hsp"])
    await h.data_ack({"type": "getlname"})
    await h.events_n(2)  # ACK, lname
    for i in range(MAX_SUBS):
        await h.data({"type": "subscribe", "group": "hl", "instance": str(i)})
    mid = await h.data_ack({"type": "subscribe", "group": "hl", "instance": "x"})
    ev = await h.event()
    assert type(ev) is Error and ev.message_id == mid and ev.type == 2
    assert "max_subscriptions" in ev.reason
    await h.stream.aclose()


@pytest.mark.trio
async def test_eventer_and_mariner_init_past_the_limit_are_refused(limited):
    too_many = [("ev", str(i)) for i in range(MAX_SUBS + 1)]
    with pytest.raises(EventerInitError, match="too many subscriptions"):
        async with EventerClient.connect(*limited.addr["eventer"], "t",
                                         subscriptions=too_many):
            pass  # pragma: no cover
    async with EventerClient.connect(*limited.addr["eventer"], "t",
                                     subscriptions=too_many[:MAX_SUBS]) as ok:
        assert ok.is_open
    raw = await RawMariner.open(limited.addr["mariner"])
    await raw.init(subscriptions=[list(s) for s in too_many])
    [error] = await raw.expect_closed()
    assert error["error"] == f"too many subscriptions: {MAX_SUBS + 1} " \
                             f"(at most {MAX_SUBS} per connection)"


@pytest.mark.trio
async def test_eventer_register_over_max_frame_fails_and_fitting_one_routes(limited):
    async with (
        SkanClient.connect(*limited.skan) as sub,
        EventerClient.connect(*limited.addr["eventer"], "t", max_message=1 << 20) as pub,
    ):
        await sub.subscribe("big")
        before = int((await sub.stats())["protocol_errors"])
        # Fits the Eventer message limit, but its Skan message would not fit max_frame.
        over = RegisterEvent(("big",), None, BinaryPayload("b", bytes(SMALL_FRAME - 60)))
        assert await pub.register([over]) is None
        fits = RegisterEvent(("big",), None, BinaryPayload("b", bytes(SMALL_FRAME - 400)))
        evs = await pub.register([fits])
        assert evs is not None and len(evs) == 1
        got = await sub.receive()
        assert len(got.msg) == SMALL_FRAME - 400
        stats = await sub.stats()
        assert int(stats["protocol_errors"]) == before + 1


@pytest.mark.trio
async def test_hsp_bridge_payload_whose_frame_exceeds_max_frame_is_refused():
    port = free_port()
    server = PeerServer(port)
    config = bridge_config(port, group="hb") + f"[broker]\nmax_frame = {SMALL_FRAME}\n"
    async with trio.open_nursery() as nursery:
        await server.start(nursery)
        with BrokerProcess(config) as proc:
            await until(lambda: server.connections == 1)
            async with SkanClient.connect(*proc.skan) as sub:
                await sub.subscribe("hb")
                peer = server.peer
                assert peer is not None
                from clients.hsp import HSPError

                # Under the HSP payload limit (max_frame), over it once wrapped in a send.
                with pytest.raises(HSPError) as info:
                    await peer.send_ack(5, bytes(SMALL_FRAME - 10), timeout=5)
                assert info.value.code == 3 and "max_frame" in info.value.reason
                await peer.send(5, bytes(SMALL_FRAME - 10))  # DATA: refused, counted
                await peer.send_ack(5, bytes(SMALL_FRAME - 300), timeout=5)
                got = await sub.receive()
                assert len(got.msg) == SMALL_FRAME - 300
                stats = await sub.stats()
                assert int(stats["protocol_errors"]) == 2
        server.stop()
        assert not tracebacks(proc.stderr_lines), "".join(proc.stderr_lines[-40:])


@pytest.mark.parametrize("value", [0, -3])
def test_max_subscriptions_must_be_positive(value):
    from broker.serving import config as cfgmod

    with pytest.raises(cfgmod.ConfigError) as info:
        cfgmod.from_mapping({"broker": {"max_subscriptions": value}})
    assert info.value.key == "broker.max_subscriptions"
    assert cfgmod.from_mapping({}).broker.max_subscriptions == 10_000
