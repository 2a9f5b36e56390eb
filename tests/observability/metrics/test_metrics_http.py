"""The metrics HTTP server of a running broker: content, keep-alive and every error path."""

from __future__ import annotations

import functools

import pytest
import trio
import trio.testing
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from broker.app import lifecycle as app
from broker.observability import http as metrics_http
from broker.observability.http import MAX_HEAD
from broker.serving import config
from clients.skan import SkanClient
from tests.brokerproc import BrokerProcess
from tests.observability.metrics.httpc import RawHTTP, get, samples, scrape, value


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
    await conn.send(b"DELETE /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    resp = await conn.response()
    assert resp.status == 405 and resp.headers["allow"] == "GET, HEAD"
    # Two pipelined requests in one write are answered in order.
    await conn.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
                    b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await conn.response()).body == b"ok\n"
    assert b"skan_connections_open" in (await conn.response()).body
    await conn.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
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
        (b"GET / HTTP/1.1\r\nHost: x\r\nbroken header\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\n\r\n", 400),
        (b"GET / HTTP/3.0\r\n\r\n", 505),
        (b"GET /" + b"a" * (MAX_HEAD + 10), 431),
        (b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc", 405),
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc", 413),
        (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n", 400),
    ],
    ids=["bad-request-line", "extra-field", "bad-header", "no-host", "http3", "oversized",
         "post-body", "get-body", "huge-length"],
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


async def test_idle_keep_alive_connections_make_room_for_new_ones(broker):
    """At the cap, a new connection takes the place of the longest-idle one."""
    conns = [await RawHTTP.open(broker.addr["metrics"])
             for _ in range(metrics_http.MAX_CONNECTIONS)]
    # Make sure all of them are being served (each answered once, then idle).
    for conn in conns:
        await conn.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await conn.response()).status == 200
    with trio.fail_after(2):
        resp = await get(broker.addr["metrics"], "/healthz")
    assert resp.status == 200
    # The first (longest idle) connection was closed for it; the others still work.
    assert await conns[0].closed_by_peer()
    await conns[-1].send(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await conns[-1].response()).status == 200
    for conn in conns:
        await conn.aclose()


async def test_idle_clients_cannot_lock_out_scrapes(broker):
    """40 connections that never send a byte: a scrape still succeeds at once, and
    the silent ones are closed within REQUEST_TIMEOUT."""
    addr = broker.addr["metrics"]
    idle = [await RawHTTP.open(addr) for _ in range(40)]
    await trio.sleep(0.2)  # let the broker admit all of them
    started = trio.current_time()
    with trio.fail_after(3):
        data = await scrape(addr)
    assert value(data, "skan_uptime_seconds") > 0
    assert trio.current_time() - started < 3
    with trio.fail_after(metrics_http.REQUEST_TIMEOUT + 5):
        for conn in idle:
            assert await conn.closed_by_peer()
    data = await scrape(addr)
    timeouts = value(data, "skan_protocol_errors_total", protocol="metrics",
                     reason="request-timeout")
    assert timeouts >= 40 - metrics_http.MAX_CONNECTIONS - 1 > 0
    for conn in idle:
        await conn.aclose()


async def test_trickling_clients_cannot_lock_out_scrapes(broker):
    """Clients sending a request one byte a second get 408 after REQUEST_TIMEOUT;
    scrapes meanwhile succeed."""
    addr = broker.addr["metrics"]
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
    slow = [await RawHTTP.open(addr) for _ in range(metrics_http.MAX_CONNECTIONS + 4)]

    async def trickle(conn: RawHTTP) -> None:
        try:
            for byte in request[:-1]:
                await conn.send(bytes([byte]))
                await trio.sleep(1)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async with trio.open_nursery() as nursery:
        for conn in slow:
            nursery.start_soon(trickle, conn)
        await trio.sleep(1.5)
        for _ in range(3):
            with trio.fail_after(3):
                assert (await get(addr, "/healthz")).status == 200
            await trio.sleep(0.5)
        with trio.fail_after(metrics_http.REQUEST_TIMEOUT + 5):
            answers = [await conn.response() for conn in slow[-8:]]
        assert {r.status for r in answers} == {408}
        nursery.cancel_scope.cancel()
    for conn in slow:
        await conn.aclose()


async def test_metrics_host_binds_the_metrics_port_apart():
    """[metrics] host: the metrics listener on its own address, the others on [broker] host."""
    with BrokerProcess('[broker]\nhost = "127.0.0.1"\n[metrics]\nhost = "127.0.0.2"\n') as proc:
        assert proc.addr["metrics"][0] == "127.0.0.2"
        assert proc.addr["skan"][0] == "127.0.0.1"
        assert (await get(proc.addr["metrics"], "/healthz")).status == 200
        async with SkanClient.connect(*proc.skan) as c:
            assert c.lname


def test_metrics_host_must_be_a_string():
    with pytest.raises(config.ConfigError) as err:
        config.from_mapping({"metrics": {"host": 5}})
    assert err.value.key == "metrics.host"
    assert config.from_mapping({}).metrics.host is None


async def test_metrics_disabled_means_no_listener():
    with BrokerProcess("[metrics]\nenabled = false\n") as proc:
        assert "metrics" not in proc.addr
        assert "skan" in proc.addr


# ---- timeouts, in-process with a virtual clock ---------------------------------


async def _serve_pair(nursery: trio.Nursery) -> trio.testing.MemoryStapledStream:
    client, server = trio.testing.memory_stream_pair()
    nursery.start_soon(metrics_http.MetricsHTTP(lambda: b"m 1\n").handle, server)
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
        await client.send_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        started = trio.current_time()
        data = await _read_all(client)
        assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(b"m 1\n")
        assert trio.current_time() - started == pytest.approx(metrics_http.IDLE_TIMEOUT)


async def test_failing_collector_gives_500_not_a_crash(autojump_clock):
    def broken() -> bytes:
        raise RuntimeError("collector bug")

    client, server = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(metrics_http.MetricsHTTP(broken).handle, server)
        await client.send_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = await _read_all(client)
    assert data.startswith(b"HTTP/1.1 500 ")


async def test_silent_connection_is_closed_without_an_answer(autojump_clock):
    async with trio.open_nursery() as nursery:
        client = await _serve_pair(nursery)
        started = trio.current_time()
        assert await _read_all(client) == b""
        assert trio.current_time() - started == pytest.approx(metrics_http.REQUEST_TIMEOUT)


async def test_connection_cap_answers_503_when_every_slot_is_answering(autojump_clock):
    """Only connections busy answering are never evicted: with all of them
    blocked sending (lockstep streams, clients not reading), a new one gets 503."""
    faults: list[tuple[str, str]] = []
    server = metrics_http.MetricsHTTP(lambda: b"m 1\n",
                                      lambda proto, reason: faults.append((proto, reason)))
    async with trio.open_nursery() as nursery:
        clients = []
        for _ in range(metrics_http.MAX_CONNECTIONS):
            client, srv = trio.testing.lockstep_stream_pair()
            nursery.start_soon(server.handle, srv)
            await client.send_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            clients.append(client)
            await trio.sleep(0.001)  # distinct start times: clients[0] is stuck longest
        await trio.sleep(metrics_http.ANSWER_GRACE / 2)  # all blocked sending their answer
        extra, srv = trio.testing.lockstep_stream_pair()
        nursery.start_soon(server.handle, srv)
        data = await _read_all(extra)
        assert data.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        assert faults == [("metrics", "too-many-connections")]
        # Past ANSWER_GRACE the one stuck longest gives its slot to a new connection.
        await trio.sleep(metrics_http.ANSWER_GRACE)
        newer, srv = trio.testing.lockstep_stream_pair()
        nursery.start_soon(server.handle, srv)
        await newer.send_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await _read_all(newer)).endswith(b"ok\n")
        assert faults[1:] == [("metrics", "send-timeout")]
        await _read_all(clients[0])  # ends: the connection was closed
        # The other blocked ones time out (SEND_TIMEOUT) and are counted, not crashed.
        await trio.sleep(metrics_http.SEND_TIMEOUT + 1)
        assert faults.count(("metrics", "send-timeout")) == metrics_http.MAX_CONNECTIONS
        assert not server.slots
        nursery.cancel_scope.cancel()


async def test_unfinished_request_is_evicted_before_idle_is_kept(autojump_clock):
    """At the cap, idle keep-alive connections go first, then the oldest unfinished."""
    faults: list[tuple[str, str]] = []
    server = metrics_http.MetricsHTTP(lambda: b"m 1\n",
                                      lambda proto, reason: faults.append((proto, reason)))
    async with trio.open_nursery() as nursery:
        pairs = []
        for i in range(metrics_http.MAX_CONNECTIONS):
            client, srv = trio.testing.memory_stream_pair()
            nursery.start_soon(server.handle, srv)
            if i == 5:  # one idle keep-alive connection
                await client.send_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            pairs.append(client)
            await trio.sleep(0.01)
        await trio.sleep(0.1)
        _new, srv = trio.testing.memory_stream_pair()
        nursery.start_soon(server.handle, srv)
        await trio.sleep(0.1)
        assert (await _read_all(pairs[5])).startswith(b"HTTP/1.1 200 ")  # then closed
        assert faults == []  # evicting an idle connection is no fault
        newer, srv = trio.testing.memory_stream_pair()
        nursery.start_soon(server.handle, srv)
        await trio.sleep(0.1)
        assert await _read_all(pairs[0]) == b""  # the oldest unfinished one
        assert faults == [("metrics", "evicted")]
        await newer.send_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await _read_all(newer)).endswith(b"ok\n")
        nursery.cancel_scope.cancel()


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


async def test_store_series_follow_the_writer(broker):
    """The durable store (on by default) is visible: commits, messages written, spool counters."""
    before = await scrape(broker.addr["metrics"])
    async with SkanClient.connect(*broker.skan) as pub:
        for i in range(20):
            await pub.send("stored", str(i))
        await pub.stats()
    with trio.fail_after(10):
        while True:
            after = await scrape(broker.addr["metrics"])
            if (value(after, "skan_store_written_messages_total")
                    >= value(before, "skan_store_written_messages_total") + 20):
                break
            await trio.sleep(0.05)
    assert value(after, "skan_store_commits_total") > value(before, "skan_store_commits_total")
    assert value(after, "skan_store_failed_commits_total") == 0
    for name in ("skan_store_spool_dropped_messages_total",
                 "skan_store_spool_retried_operations_total",
                 "skan_store_spool_lost_operations_total"):
        assert value(after, name) == 0, name
