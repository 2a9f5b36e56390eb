"""TLS on the metrics listener ([metrics] tls_cert / tls_key), certificates from trustme."""

from __future__ import annotations

import os
import ssl
import sys

import pytest
import trio

from broker.serving.config import ConfigError, from_mapping
from tests.brokerproc import ROOT, BrokerProcess
from tests.observability.metrics.httpc import RawHTTP
from tests.tlsfiles import server_cert


@pytest.fixture(scope="module")
def tls_metrics(tmp_path_factory):
    cert = server_cert(tmp_path_factory.mktemp("metrics-tls"), "m")
    with BrokerProcess(cert.section("metrics")) as b:
        ctx = ssl.create_default_context()
        cert.ca.configure_trust(ctx)
        yield b, ctx


async def test_https_scrape_and_health(tls_metrics):
    broker, ctx = tls_metrics
    conn = await RawHTTP.open(broker.addr["metrics"], ctx)
    await conn.send(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert (await conn.response()).body == b"ok\n"
    await conn.send(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    resp = await conn.response()
    assert resp.status == 200 and b"skan_connections_open" in resp.body
    await conn.aclose()


async def test_plaintext_on_the_tls_port_is_dropped_and_harmless(tls_metrics):
    broker, ctx = tls_metrics
    stream = await trio.open_tcp_stream(*broker.addr["metrics"])
    await stream.send_all(b"GET /metrics HTTP/1.1\r\n\r\n")
    with trio.fail_after(10):
        try:
            while await stream.receive_some(4096):
                pass  # the broker ends the failed handshake
        except trio.BrokenResourceError:
            pass
    await stream.aclose()
    conn = await RawHTTP.open(broker.addr["metrics"], ctx)
    await conn.send(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    assert (await conn.response()).status == 200
    await conn.aclose()
    assert not any("Traceback" in line for line in broker.stderr_lines), broker.stderr_lines


def test_cert_without_key_is_refused():
    with pytest.raises(ConfigError) as err:
        from_mapping({"metrics": {"tls_cert": "/x.pem"}})
    assert err.value.key == "metrics.tls_cert"


async def test_a_required_client_certificate_opens_the_listing_off_loopback(tmp_path):
    cert = server_cert(tmp_path, "m")
    ca = cert.ca
    config = (cert.section("metrics") + f'host = "0.0.0.0"\ntls_ca = "{cert.ca_pem}"\n'
              'tls_client_auth = "require"\n')
    with BrokerProcess(config) as b:
        addr = ("127.0.0.1", b.addr["metrics"][1])
        ctx = ssl.create_default_context()
        ca.configure_trust(ctx)
        ca.issue_cert("scraper").configure_cert(ctx)
        conn = await RawHTTP.open(addr, ctx)
        await conn.send(b"GET /connections HTTP/1.1\r\nHost: localhost\r\n"
                        b"Connection: close\r\n\r\n")
        resp = await conn.response()
        assert resp.status == 200 and b'"connections"' in resp.body
        await conn.aclose()
        # Without a certificate the handshake fails: nothing is answered.
        bare = ssl.create_default_context()
        ca.configure_trust(bare)
        with pytest.raises((trio.BrokenResourceError, EOFError)):
            conn = await RawHTTP.open(addr, bare)
            await conn.send(b"GET /connections HTTP/1.1\r\nHost: localhost\r\n\r\n")
            await conn.response()
        assert not any("listing is off" in line for line in b.stderr_lines)
        # The command line presents its certificate with the usual TLS options.
        client = ca.issue_cert("operator")
        client.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "op.pem"))
        proc = await trio.run_process(
            [sys.executable, "-m", "clients.cli", "--host", "127.0.0.1", "--tls-ca",
             str(tmp_path / "ca.pem"), "--tls-cert", str(tmp_path / "op.pem"), "connections",
             "--metrics-port", str(addr[1])],
            capture_stdout=True, capture_stderr=True, check=False,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith(b"LNAME") and b"# 0-0 of 0 connections" in proc.stdout
