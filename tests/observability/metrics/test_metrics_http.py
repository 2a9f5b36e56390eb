"""The metrics HTTP server of a running broker: content, keep-alive and every error path."""

from __future__ import annotations

import functools

import pytest
import trio
import trio.testing
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from broker.observability import http as metrics_http
from broker.runtime import app, config
from clients.skan import SkanClient
from tests.brokerproc import BrokerProcess
from tests.observability.metrics.httpc import RawHTTP, get, samples
from wire.http import MAX_HEAD


async def test_metrics_endpoint_serves_prometheus_text(broker):
    resp = await get(broker.addr["metrics"], "/metrics")
    assert resp.status == 200
    assert resp.headers["content-type"] == CONTENT_TYPE_LATEST
    data = samples(resp.body.decode())
    names = {name for name, _ in data}
    for name in ("skan_connections_open", "skan_messages_received_total",
                 "skan_routing_latency_seconds_bucket", "process_cpu_seconds_total",
                 "python_info", "skan_uptime_seconds"):
        assert name in names, name


async def test_healthz_head_and_index(broker):
    resp = await get(broker.addr["metrics"], "/healthz")
    assert (resp.status, resp.body) == (200, b"ok\n")
    full = await get(broker.addr["metrics"], "/metrics")
    head = await get(broker.addr["metrics"], "/metrics", "HEAD")
    assert head.status == 200 and head.body == b""
    assert int(head.headers["content-length"]) > 0
    assert head.headers["content-type"] == full.headers["content-type"]
    assert (await get(broker.addr["metrics"], "/")).status == 200


async def test_keep_alive_serves_several_requests_incl_404_and_405(broker):
    conn = await RawHTTP.open(broker.addr["metrics"])
    await conn.send(b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
    resp = await conn.response()
    assert resp.status == 404 and b"/nope" in resp.body
    assert resp.headers["connection"] == "keep-alive"
    await conn.send(b"DELETE /metrics HTTP/1.1\r\n\r\n")
    resp = await conn.response()
    assert resp.status == 405 and resp.headers["allow"] == "GET, HEAD"
    # Two pipelined requests in one write are answered in order.
    await conn.send(b"GET /healthz HTTP/1.1\r\n\r\nGET /metrics HTTP/1.1\r\n\r\n")
    assert (await conn.response()).body == b"ok\n"
    assert b"skan_connections_open" in (await conn.response()).body
    await conn.send(b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")
    resp = await conn.response()
    assert resp.status == 200 and resp.headers["connection"] == "close"
    assert await conn.closed_by_peer()


async def test_http10_gets_one_answer_then_close(broker):
    conn = await RawHTTP.open(broker.addr["metrics"])
    await conn.send(b"GET /healthz HTTP/1.0\r\n\r\n")
    assert (await conn.response()).status == 200
    assert await conn.closed_by_peer()


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET / HTTP/1.1 extra\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nbroken header\r\n\r\n", 400),
        (b"GET / HTTP/3.0\r\n\r\n", 505),
        (b"GET /" + b"a" * (MAX_HEAD + 10), 431),
        (b"POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc", 405),
        (b"GET /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc", 413),
    ],
    ids=["bad-request-line", "extra-field", "bad-header", "http3", "oversized", "post-body",
         "get-body"],
)
async def test_bad_requests_answered_then_closed(broker, request_bytes, status):
    conn = await RawHTTP.open(broker.addr["metrics"])
    await conn.send(request_bytes)
    resp = await conn.response()
    assert resp.status == status
    assert resp.headers["connection"] == "close"
    assert await conn.closed_by_peer()
    # The broker is unharmed: metrics and Skan still work.
    assert (await get(broker.addr["metrics"], "/healthz")).status == 200
    async with SkanClient.connect(*broker.skan) as c:
        assert c.lname


async def test_connection_cap_answers_503(broker):
    conns = [await RawHTTP.open(broker.addr["metrics"])
             for _ in range(metrics_http.MAX_CONNECTIONS)]
    # Make sure all of them are being served (each answered once).
    for conn in conns:
        await conn.send(b"GET /healthz HTTP/1.1\r\n\r\n")
        assert (await conn.response()).status == 200
    extra = await RawHTTP.open(broker.addr["metrics"])
    resp = await extra.response()
    assert resp.status == 503 and await extra.closed_by_peer()
    for conn in conns:
        await conn.aclose()
    with trio.fail_after(10):
        while True:  # slots free up once the broker notices the closes
            if (await get(broker.addr["metrics"], "/healthz")).status == 200:
                break
            await trio.sleep(0.05)


async def test_metrics_disabled_means_no_listener():
    with BrokerProcess("[metrics]\nenabled = false\n") as proc:
        assert "metrics" not in proc.addr
        assert "skan" in proc.addr


# ---- timeouts, in-process with a virtual clock ---------------------------------


async def _serve_pair(nursery: trio.Nursery) -> trio.testing.MemoryStapledStream:
    client, server = trio.testing.memory_stream_pair()
    nursery.start_soon(metrics_http.serve_connection, server, lambda: b"m 1\n")
    return client


async def _read_all(stream: trio.abc.Stream) -> bytes:
    out = b""
    while data := await stream.receive_some(65536):
        out += data
    return out


async def test_incomplete_request_times_out_with_408(autojump_clock):
    async with trio.open_nursery() as nursery:
        client = await _serve_pair(nursery)
        await client.send_all(b"GET /metr")
        started = trio.current_time()
        data = await _read_all(client)
        assert data.startswith(b"HTTP/1.1 408 ")
        assert trio.current_time() - started == pytest.approx(metrics_http.REQUEST_TIMEOUT)


async def test_idle_keep_alive_connection_is_closed(autojump_clock):
    async with trio.open_nursery() as nursery:
        client = await _serve_pair(nursery)
        await client.send_all(b"GET /metrics HTTP/1.1\r\n\r\n")
        started = trio.current_time()
        data = await _read_all(client)
        assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(b"m 1\n")
        assert trio.current_time() - started == pytest.approx(metrics_http.IDLE_TIMEOUT)


async def test_failing_collector_gives_500_not_a_crash(autojump_clock):
    def broken() -> bytes:
        raise RuntimeError("collector bug")

    client, server = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(metrics_http.serve_connection, server, broken)
        await client.send_all(b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n")
        data = await _read_all(client)
    assert data.startswith(b"HTTP/1.1 500 ")


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
async def test_per_message_bookkeeping_follows_enabled(enabled):
    """In-process: [metrics] enabled=false leaves group counts and latency timing off."""
    cfg = config.from_mapping({
        "skan": {"port": 0}, "metrics": {"enabled": enabled, "port": 0},
        "hsp": {"enabled": False}, "eventer": {"enabled": False},
        "mariner": {"enabled": False}, "log": {"enabled": False},
        "store": {"enabled": False},
    })
    ctxs: list = []
    lines: list[str] = []
    up, stop = trio.Event(), trio.Event()

    def ready(got: list[str]) -> None:
        lines.extend(got)
        up.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(app.run, cfg, ready=ready, stop=stop, ctx_out=ctxs))
        await up.wait()
        router = ctxs[0].router
        host, port = next(line.split()[2] for line in lines
                          if line.startswith("listening skan")).rsplit(":", 1)
        async with SkanClient.connect(host, int(port)) as c:
            await c.send("g", "x")
            await c.barrier()
        assert any(line.startswith("listening metrics") for line in lines) == enabled
        if enabled:
            assert router.latency.count == 1
            assert router.group_stats == {b"g": [1, 0]}
        else:
            assert router.latency is None and router.group_stats is None
        stop.set()
