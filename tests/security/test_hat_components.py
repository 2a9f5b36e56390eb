"""Section 11: token-less Hat components on a secured broker.

hat-gateway and hat-gui have no client-token setting.  The Eventer listener's
``anonymous_user`` gives its token-less clients a limited user of their own
while ``[auth] allow_anonymous = false`` keeps every other anonymous client
out; a client certificate on the Eventer listener identifies a component
that reaches the broker through a TLS tunnel.  Tested with the REAL
hat-event 0.9.44 client (no token) and the real hat-gateway 0.6.48.
"""

from __future__ import annotations

import pathlib
import tempfile

import pytest
import trio

from clients.skan import SkanClient, SkanClientError
from tests.brokerproc import BrokerProcess
from tests.hatpeer import PeerProcess
from tests.hatsystem import PREFIX, free_port, gateway
from tests.peerenv import EVENTER09_PEER, HAT_GATEWAY_PEER
from tests.security.common import OP_TOKEN, USERS
from tests.tlsfiles import server_cert

pytestmark = [pytest.mark.trio, pytest.mark.peers]

# The users of section 7's examples plus one for the Hat components: it may
# register and subscribe in the gateway's groups only.
HAT_USERS = USERS + """
[[users]]
name = "hat-components"
publish = ["gateway"]
subscribe = ["gateway"]
max_connections = 4
"""

WITH_LISTENER_USER = HAT_USERS + '\n[eventer]\nanonymous_user = "hat-components"\n'


@pytest.fixture(scope="module")
def hbroker():
    with BrokerProcess(WITH_LISTENER_USER) as b:
        yield b
    assert not any("Traceback" in line for line in b.stderr_lines), "".join(b.stderr_lines)


async def hat_client(port: int, **kw) -> tuple[PeerProcess, dict]:
    peer = await PeerProcess.start(EVENTER09_PEER, "eventer09_client.py")
    return peer, await peer.call("connect", port=port, **kw)


async def test_token_less_hat_client_gets_the_listener_user_rights(hbroker):
    peer, res = await hat_client(hbroker.addr["eventer"][1], name="gateway/gw",
                                 subscriptions=[["gateway", "*"]])
    async with peer, SkanClient.connect(*hbroker.skan, token=OP_TOKEN) as op:
        assert res == {"status": "operational"}
        await op.subscribe("gateway")
        await op.subscribe("telemetry")
        ok = await peer.call("register", events=[
            {"type": ["gateway", "modbus_master", "dev1", "gateway", "running"],
             "payload": {"json": True}}])
        assert ok["events"][0]["payload"] == {"json": True}
        assert (await op.receive()).instance == "modbus_master/dev1/gateway/running"
        # Outside its 'publish': MsgRegisterRes failure, nothing routed.
        refused = await peer.call("register", events=[
            {"type": ["telemetry", "t1"], "payload": {"json": 1}}])
        assert refused == {"events": None}
        with trio.move_on_after(0.3):
            raise AssertionError(f"a refused registration was routed: {await op.receive()}")
        # It receives what the operator sends in its groups.
        await op.send("gateway", "x", instance="modbus_master/dev1/system/enable")
        # (Its own registration first: it is subscribed to it, as on hat-event-server.)
        got = (await peer.call("events", count=2))["events"]
        assert [e["type"] for e in got] == [
            ["gateway", "modbus_master", "dev1", "gateway", "running"],
            ["gateway", "modbus_master", "dev1", "system", "enable"]]


async def test_token_less_hat_client_may_not_subscribe_outside(hbroker):
    peer, res = await hat_client(hbroker.addr["eventer"][1], subscriptions=[["telemetry", "*"]])
    async with peer:
        assert "not authorised: subscription" in res["init_error"], res


async def test_the_listener_user_is_not_anonymous_access_elsewhere(hbroker):
    # A Skan client without a token is still refused ...
    with pytest.raises(SkanClientError, match="not authorised: anonymous"):
        async with SkanClient.connect(*hbroker.skan) as c:
            await c.stats()
    # ... and a wrong token on the Eventer listener is refused, not admitted anonymous.
    peer, res = await hat_client(hbroker.addr["eventer"][1], token="wrong")
    async with peer:
        assert res["init_error"].startswith("not authorised: ")


async def test_without_the_setting_the_token_less_hat_client_is_refused():
    with BrokerProcess(HAT_USERS) as b:
        peer, res = await hat_client(b.addr["eventer"][1], subscriptions=[["gateway", "*"]])
        async with peer:
            assert "anonymous clients are not allowed" in res["init_error"], res


async def test_a_client_certificate_identifies_a_hat_client(tmp_path):
    """A component behind a TLS tunnel holding its certificate (CN = user)."""
    server = server_cert(tmp_path)
    client = server.ca.issue_cert("hat.example", common_name="hat-components")
    client.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "client.pem"))
    config = HAT_USERS + "\n" + server.section("eventer") + (
        f'tls_ca = "{server.ca_pem}"\ntls_client_auth = "require"\n')
    with BrokerProcess(config) as b:
        port = b.addr["eventer"][1]
        tls = {"ca": str(server.ca_pem), "cert": str(tmp_path / "client.pem")}
        peer, res = await hat_client(port, subscriptions=[["gateway", "*"]], tls=tls)
        async with peer:
            assert res == {"status": "operational"}
            ok = await peer.call("register", events=[
                {"type": ["gateway", "x"], "payload": {"json": 1}}])
            assert ok["events"][0]["payload"] == {"json": 1}
            assert (await peer.call("register", events=[
                {"type": ["telemetry", "x"], "payload": {"json": 1}}])) == {"events": None}
        # Without a certificate the TLS handshake is refused.
        peer, res = await hat_client(port, tls={"ca": tls["ca"]})
        async with peer:
            assert "status" not in res, res


async def test_hat_gateway_on_a_secured_broker():
    """The real hat-gateway, no token, admitted by [eventer] anonymous_user:
    enabled by an operator's Hat client (with a token), it runs its device."""
    with tempfile.TemporaryDirectory(prefix="hat-gateway-secured-") as tmpdir:
        tmp = pathlib.Path(tmpdir)
        slave_port = free_port()
        with BrokerProcess(WITH_LISTENER_USER) as b:
            port = b.addr["eventer"][1]
            slave = await PeerProcess.start(HAT_GATEWAY_PEER, "modbus_slave.py",
                                            str(slave_port))
            gw = gateway(tmp, {"eventer_server": {"host": "127.0.0.1", "port": port}},
                         slave_port)
            try:
                assert await slave.line(30) == {"listening": slave_port}
                await trio.to_thread.run_sync(gw.start)
                op, res = await hat_client(port, token=OP_TOKEN,
                                           subscriptions=[[*PREFIX, "gateway", "*"]])
                async with op:
                    assert res == {"status": "operational"}
                    await op.call("register", events=[
                        {"type": [*PREFIX, "system", "enable"], "payload": {"json": True}}])
                    seen = []
                    with trio.move_on_after(45):
                        while {"json": "CONNECTED"} not in [
                                e["payload"] for e in seen if e["type"][-1] == "status"]:
                            seen += (await op.call("events", count=1, timeout=1.0))["events"]
                    running = [e["payload"] for e in seen if e["type"][-1] == "running"]
                    assert running == [{"json": True}], (seen, gw.output()[-3000:])
                    assert {"json": "CONNECTED"} in [e["payload"] for e in seen
                                                     if e["type"][-1] == "status"], seen
            finally:
                gw.stop()
                await slave.aclose()
        assert "not authorised" not in gw.output(), gw.output()[-2000:]
