"""TLS client certificates (section 7) with a CA generated for the test (trustme).

A verified certificate whose subject CN is a user's name authenticates as
that user without a token; ``tls_client_auth = "require"`` refuses clients
without one at the handshake (counted as an authentication failure).
"""

from __future__ import annotations

import ssl

import pytest
import trio
import trustme

from clients.hsp import SkanOverHSP
from clients.skan import SkanClient, SkanClientError
from tests.brokerproc import BrokerProcess
from tests.observability.metrics.httpc import scrape
from tests.security.common import SENSOR_TOKEN, USERS
from tests.tlsfiles import server_cert
from toolkit.eventer_client import EventerClient


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    return server_cert(d).ca, d  # d holds broker.pem, broker.key and ca.pem


@pytest.fixture(scope="module")
def mtls_broker(pki):
    _, d = pki
    tls = (f'tls_cert = "{d / "broker.pem"}"\ntls_key = "{d / "broker.key"}"\n'
           f'tls_ca = "{d / "ca.pem"}"\n')
    config = (USERS + f'\n[skan]\n{tls}tls_client_auth = "require"\n'
              f'\n[hsp]\n{tls}tls_client_auth = "optional"\n'
              f'\n[eventer]\n{tls}tls_client_auth = "optional"\n')
    with BrokerProcess(config) as b:
        yield b
    assert b.proc is not None and b.proc.returncode == 0, "".join(b.stderr_lines[-40:])
    # Every refusal is one log line, never a traceback.
    assert not any("Traceback" in line for line in b.stderr_lines), "".join(b.stderr_lines)


def client_context(ca: trustme.CA, common_name: str | None = None,
                   issuer: trustme.CA | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    if common_name is not None:
        (issuer or ca).issue_cert(f"{common_name}.example", common_name=common_name
                                  ).configure_cert(ctx)
    return ctx


async def test_certificate_cn_authenticates_as_that_user(pki, mtls_broker):
    ca, _ = pki
    async with (
        SkanClient.connect(*mtls_broker.skan, ssl_context=client_context(ca, "sensor")) as sensor,
        SkanClient.connect(*mtls_broker.skan,
                           ssl_context=client_context(ca, "dashboard")) as dash,
    ):
        await dash.subscribe("telemetry")
        await sensor.send("telemetry", "over mTLS")
        assert (await dash.receive()).msg == b"over mTLS"
        # The sensor's permissions apply: it may not subscribe to telemetry.
        await sensor.send_raw({"type": "subscribe", "group": "telemetry", "instance": "*",
                               "seq": "2"})
        await sensor.barrier()
        assert [e.seq for e in sensor.errors] == [b"2"]


async def test_required_certificate_missing_or_foreign_is_refused(pki, mtls_broker):
    ca, _ = pki
    before = await scrape(mtls_broker.addr["metrics"])
    for ctx in (client_context(ca), client_context(ca, "sensor", issuer=trustme.CA())):
        with pytest.raises((trio.BrokenResourceError, SkanClientError, ssl.SSLError)):
            async with SkanClient.connect(*mtls_broker.skan, ssl_context=ctx) as c:
                await c.stats()
    after = await scrape(mtls_broker.addr["metrics"])
    key = ("skan_auth_failures_total", frozenset({"protocol": "skan"}.items()))
    assert after[key] - before.get(key, 0) == 2


async def test_unknown_cn_is_anonymous(pki, mtls_broker):
    ca, _ = pki
    # Verified, but no user has that name: anonymous, and anonymous is not allowed.
    with pytest.raises(SkanClientError, match="not authorised: anonymous"):
        async with SkanClient.connect(*mtls_broker.skan,
                                      ssl_context=client_context(ca, "stranger")):
            pass


async def test_optional_client_auth_falls_back_to_tokens(pki, mtls_broker):
    ca, _ = pki
    async with SkanOverHSP.connect(*mtls_broker.addr["hsp"], ssl_context=client_context(ca),
                                   token=SENSOR_TOKEN) as c:
        assert c.lname
    with pytest.raises(SkanClientError, match="not authorised"):
        async with SkanOverHSP.connect(*mtls_broker.addr["hsp"],
                                       ssl_context=client_context(ca)):
            pass
    async with SkanOverHSP.connect(*mtls_broker.addr["hsp"],
                                   ssl_context=client_context(ca, "operator")) as op:
        await op.subscribe("anything", subtype="promisc")
        assert not op.errors


async def test_eventer_client_certificate(pki, mtls_broker):
    ca, _ = pki
    async with (
        EventerClient.connect(*mtls_broker.addr["eventer"], subscriptions=[("telemetry", "*")],
                              ssl_context=client_context(ca, "dashboard")) as ev,
        SkanClient.connect(*mtls_broker.skan, ssl_context=client_context(ca, "sensor")) as sensor,
    ):
        await sensor.send("telemetry", "1", instance="a")
        batch = await ev.receive()
        assert [e.type for e in batch] == [("telemetry", "a")]


async def test_bridge_presents_a_client_certificate(pki, mtls_broker, tmp_path):
    """A second broker bridges to this one's Eventer listener as user 'dashboard',
    authenticated by its client certificate alone."""
    ca, d = pki
    leaf = ca.issue_cert("dashboard.example", common_name="dashboard")
    leaf.cert_chain_pems[0].write_to_path(str(tmp_path / "bridge.pem"))
    leaf.private_key_pem.write_to_path(str(tmp_path / "bridge.key"))
    host, port = mtls_broker.addr["eventer"]
    bridge = f"""
[[bridges]]
protocol = "eventer"
address = "{host}:{port}"
group = "telemetry"
subscriptions = [["telemetry", "*"]]
tls = true
tls_ca = "{d / "ca.pem"}"
tls_cert = "{tmp_path / "bridge.pem"}"
tls_key = "{tmp_path / "bridge.key"}"
backoff_initial = 0.05
backoff_max = 0.2
"""
    with BrokerProcess(bridge) as downstream:
        async with (
            SkanClient.connect(*downstream.skan) as local,
            SkanClient.connect(*mtls_broker.skan, ssl_context=client_context(ca, "sensor")) as s,
        ):
            await local.subscribe("telemetry")
            with trio.fail_after(20):
                while True:
                    await s.send("telemetry", "bridged over mTLS", instance="b")
                    with trio.move_on_after(0.3):
                        got = await local.receive()
                        break
            assert got.msg == b"bridged over mTLS"
