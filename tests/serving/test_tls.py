"""TLS on the Skan listener, with certificates made by trustme for the test."""

from __future__ import annotations

import ssl

import pytest
import trio

from clients.skan import SkanClient
from tests.brokerproc import BrokerProcess
from tests.tlsfiles import server_cert


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory):
    cert = server_cert(tmp_path_factory.mktemp("tls"))
    with BrokerProcess(cert.section("skan")) as b:
        yield b, cert.ca


async def test_tls_round_trip(tls_broker):
    b, ca = tls_broker
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    async with (
        SkanClient.connect(*b.skan, ssl_context=ctx) as sub,
        SkanClient.connect(*b.skan, ssl_context=ctx) as pub,
    ):
        await sub.subscribe("secure")
        await pub.send("secure", "over tls")
        assert (await sub.receive()).msg == b"over tls"


async def test_plaintext_client_on_tls_port_does_not_disturb_others(tls_broker):
    b, ca = tls_broker
    stream = await trio.open_tcp_stream(*b.skan)
    await stream.send_all(b"\x00\x00\x00\x13Skan\x04type\x21\x08getlname")
    with trio.fail_after(10):
        while await stream.receive_some(4096):
            pass  # the broker ends the failed handshake
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    async with SkanClient.connect(*b.skan, ssl_context=ctx) as c:
        assert c.lname
