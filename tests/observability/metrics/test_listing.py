"""GET /connections and /subscriptions on a real broker, its protection, `skan connections`.

One broker carries clients on all four protocols (Skan, HSP, Eventer,
Mariner) and a slow consumer (a raw Skan subscriber that stops reading):
the listing must show each with sensible figures, and sorting by queue
depth must put the slow one first.  Other brokers check the protection of
the metrics listener (bearer token, basic auth, 401 with WWW-Authenticate;
the listing off on a non-loopback bind without credentials) and a real
Prometheus scraping with a bearer token.
"""

from __future__ import annotations

import base64
import calendar
import json
import os
import socket
import sys
import time

import pytest
import trio

from broker.core.auth import hash_token
from broker.observability.access import MetricsAccess
from clients.hsp import SkanOverHSP
from clients.skan import SkanClient
from tests.brokerproc import ROOT, BrokerProcess
from tests.observability.metrics.httpc import RawHTTP, samples, value
from tests.observability.metrics.prometheus import PrometheusServer, ensure_prometheus
from tests.rawskan import RawSkan
from toolkit.eventer_client import EventerClient
from toolkit.mariner_client import MarinerClient

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
PUB_TOKEN = "publisher-token"
PAYLOAD = "x" * 16384
# Messages the publisher sends to the firehose: ~12 MiB, far more than the
# slow consumer's socket buffers take, far less than its queue's
# high-water mark (so no back-pressure and no disconnect).
FIREHOSE = 750

CONFIG = f"""
[broker]
queue_limit = {128 * 1024 * 1024}

[auth]
allow_anonymous = true

[[users]]
name = "publisher"
token = "{PUB_TOKEN}"
publish = ["*"]
"""


async def get(addr: tuple[str, int], target: str, auth: str | None = None):
    conn = await RawHTTP.open(addr)
    try:
        extra = f"Authorization: {auth}\r\n" if auth else ""
        await conn.send(f"GET {target} HTTP/1.1\r\nHost: t\r\n{extra}Connection: close\r\n\r\n"
                        .encode())
        return await conn.response()
    finally:
        await conn.aclose()


async def listing(addr: tuple[str, int], target: str, auth: str | None = None) -> dict:
    resp = await get(addr, target, auth)
    assert resp.status == 200, resp
    assert resp.headers["content-type"] == "application/json"
    return json.loads(resp.body)


async def open_slow_consumer(addr: tuple[str, int], group: str) -> tuple[RawSkan, bytes]:
    """A Skan subscriber with a tiny receive buffer that never reads after subscribing."""
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect(addr)
    slow = RawSkan(trio.SocketStream(sock))
    lname = await slow.getlname()
    await slow.send({"type": "subscribe", "group": group, "instance": "*"})
    await slow.getlname()  # barrier: the subscription is in place
    return slow, lname


@pytest.fixture(scope="module")
def busy_broker():
    with BrokerProcess(CONFIG) as proc:
        yield proc


async def test_listing_shows_every_protocol_and_the_slow_consumer_first(busy_broker):
    b = busy_broker
    metrics = b.addr["metrics"]
    async with (
        SkanClient.connect(*b.skan, token=PUB_TOKEN) as pub,
        SkanOverHSP.connect(*b.addr["hsp"]) as hsp,
        EventerClient.connect(*b.addr["eventer"], subscriptions=[("ev", "*")]),
        MarinerClient.connect(*b.addr["mariner"], client_id="watch",
                              subscriptions=[("mar", "*")]) as mar,
    ):
        slow, slow_lname = await open_slow_consumer(b.skan, "firehose")
        await hsp.subscribe("hsp-group")
        await hsp.barrier()
        await mar.barrier()
        for _ in range(FIREHOSE):
            await pub.send("firehose", PAYLOAD)
        await pub.send("ev", "to eventer")
        await pub.send("mar", "to mariner")
        await pub.send("hsp-group", "to hsp")
        await pub.barrier()
        assert (await hsp.receive()).msg == b"to hsp"

        # The snapshot is up to a second old: poll until it shows the traffic.
        deadline = trio.current_time() + 20
        while True:
            data = await listing(metrics, "/connections?sort=queue&subs=1")
            rows = {r["lname"]: r for r in data["connections"]}
            first = data["connections"][0] if data["connections"] else None
            if (first and first["lname"] == slow_lname.decode()
                    and first["queue_bytes"] > 1 << 20
                    and all(r["msgs_out"] >= 1 for r in rows.values()
                            if r["protocol"] in ("eventer", "mariner"))):
                break
            assert trio.current_time() < deadline, data
            await trio.sleep(0.3)

        assert data["total"] == 5 and data["sort"] == "queue" and data["order"] == "desc"
        assert {r["protocol"] for r in rows.values()} == {"skan", "hsp", "eventer", "mariner"}
        slow_row = rows[slow_lname.decode()]
        assert slow_row["queue_frames"] > 10
        assert slow_row["subscription_list"] == [
            {"group": "firehose", "instance": "*", "subtype": "normal"}]
        # Everything queued or sent was counted as delivered to it.
        assert slow_row["msgs_out"] == FIREHOSE
        assert slow_row["bytes_out"] > FIREHOSE * len(PAYLOAD)
        assert slow_row["queue_bytes"] <= slow_row["bytes_out"]
        for r in data["connections"][1:]:
            assert r["queue_bytes"] < slow_row["queue_bytes"]
        pub_row = rows[pub.lname]
        assert (pub_row["user"], pub_row["auth"]) == ("publisher", "token")
        assert pub_row["msgs_in"] == FIREHOSE + 3
        assert pub_row["bytes_in"] > FIREHOSE * len(PAYLOAD)
        assert pub_row["subscriptions"] == 0 and pub_row["msgs_out"] == 0
        by_proto = {r["protocol"]: r for r in rows.values() if r["protocol"] != "skan"}
        assert by_proto["eventer"]["subscription_list"] == [{"pattern": "ev/*",
                                                             "subtype": "normal"}]
        assert by_proto["mariner"]["subscription_list"] == [{"pattern": "mar/*",
                                                             "subtype": "normal"}]
        assert by_proto["hsp"]["msgs_out"] == 1 and by_proto["hsp"]["user"] is None
        now = time.time()
        for r in rows.values():
            assert r["remote"].startswith("127.0.0.1:")
            assert r["auth"] in ("anonymous", "token") and r["dropped"] == 0
            assert 0 <= r["uptime"] < 120
            since = calendar.timegm(time.strptime(r["since"][:19], "%Y-%m-%dT%H:%M:%S"))
            assert abs(since - (now - r["uptime"])) < 5

        # Filters, paging, other sorts.
        only = await listing(metrics, "/connections?protocol=eventer")
        assert [r["protocol"] for r in only["connections"]] == ["eventer"]
        only = await listing(metrics, "/connections?user=publisher")
        assert [r["lname"] for r in only["connections"]] == [pub.lname]
        only = await listing(metrics, "/connections?group=firehose")
        assert [r["lname"] for r in only["connections"]] == [slow_lname.decode()]
        only = await listing(metrics, "/connections?group=mar")  # the pattern mar/*
        assert [r["protocol"] for r in only["connections"]] == ["mariner"]
        page = await listing(metrics, "/connections?sort=since&limit=2&offset=3")
        assert page["total"] == 5 and len(page["connections"]) == 2
        oldest = await listing(metrics, "/connections?sort=since&limit=1")
        assert oldest["connections"][0]["lname"] == pub.lname  # connected first
        busiest = await listing(metrics, "/connections?sort=msgs_in&limit=1")
        assert busiest["connections"][0]["lname"] == pub.lname

        subs = await listing(metrics, "/subscriptions")
        assert subs["subscriptions_total"] == subs["total"] == 4 and not subs["truncated"]
        entries = {(s["protocol"], s.get("group"), s.get("pattern")) for s in
                   subs["subscriptions"]}
        assert entries == {("skan", "firehose", None), ("hsp", "hsp-group", None),
                           ("eventer", None, "ev/*"), ("mariner", None, "mar/*")}
        subs = await listing(metrics, "/subscriptions?group=firehose")
        assert [s["lname"] for s in subs["subscriptions"]] == [slow_lname.decode()]

        # The command line's table: the slow consumer on the first row.
        proc = await trio.run_process(
            [sys.executable, "-m", "clients.cli", "--host", metrics[0], "connections",
             "--metrics-port", str(metrics[1]), "--sort", "queue", "--limit", "3"],
            capture_stdout=True, capture_stderr=True, env=ENV, check=False)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.decode().splitlines()
        assert lines[0].split()[:4] == ["LNAME", "PROTO", "USER", "REMOTE"]
        assert lines[1].startswith(slow_lname.decode()) and "MiB" in lines[1]
        assert lines[-1] == "# 1-3 of 5 connections, sorted by queue (desc)" or \
            lines[-1].startswith("# 1-3 of 5 connections, sorted by queue (desc);")
        proc = await trio.run_process(
            [sys.executable, "-m", "clients.cli", "--host", metrics[0], "subscriptions",
             "--metrics-port", str(metrics[1]), "--proto", "eventer"],
            capture_stdout=True, capture_stderr=True, env=ENV, check=False)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.decode().splitlines()
        assert "pattern ev/*" in lines[1] and lines[-1].startswith("# 1-1 of 1 subscription")
        await slow.aclose()
    assert not any("Traceback" in line for line in b.stderr_lines)


async def test_a_burst_of_requests_shares_one_snapshot_and_bad_queries_are_400(busy_broker):
    metrics = busy_broker.addr["metrics"]
    stamps = set()
    async with trio.open_nursery() as nursery:
        async def one() -> None:
            stamps.add((await listing(metrics, "/connections"))["snapshot"])

        for _ in range(20):
            nursery.start_soon(one)
    # One walk serves them all (two if the burst straddled an expiry).
    assert len(stamps) <= 2
    for target, why in [("/connections?limit=5000", "at most 1000"),
                        ("/connections?sort=colour", "must be one of"),
                        ("/connections?offset=-1", "non-negative integer"),
                        ("/connections?nosuch=1", "unknown parameter"),
                        ("/subscriptions?sort=since", "must be one of"),
                        ("/connections?order=up", "'asc' or 'desc'")]:
        resp = await get(metrics, target)
        assert resp.status == 400 and why in resp.body.decode(), (target, resp)


TOKEN = "scrape-s3cret"
PASSWORD = "pr0m-password"
PROTECTED = f"""
[metrics]
token = "{TOKEN}"
username = "prom"
password_sha256 = "{hash_token(PASSWORD)}"
"""


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


async def raw_response(addr: tuple[str, int], target: str) -> bytes:
    """The whole response, bytes as sent (repeated header fields kept)."""
    stream = await trio.open_tcp_stream(*addr)
    async with stream:
        await stream.send_all(f"GET {target} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
                              .encode())
        out = b""
        with trio.fail_after(10):
            while data := await stream.receive_some(65536):
                out += data
    return out


async def test_credentials_are_required_once_configured():
    with BrokerProcess(PROTECTED) as b:
        metrics = b.addr["metrics"]
        for path in ("/metrics", "/connections", "/subscriptions", "/"):
            raw = await raw_response(metrics, path)
            assert raw.startswith(b"HTTP/1.1 401 "), raw
            assert b'\r\nWWW-Authenticate: Bearer realm="skan-broker metrics"\r\n' in raw
            assert b'\r\nWWW-Authenticate: Basic realm="skan-broker metrics"' in raw
            assert b"skan_" not in raw and b"lname" not in raw
        for wrong in (f"Bearer {TOKEN}x", "Bearer ", basic("prom", "nope"),
                      basic("other", PASSWORD), "Basic !!notbase64", f"Token {TOKEN}"):
            assert (await get(metrics, "/metrics", wrong)).status == 401, wrong
        # Liveness probes need no credentials.
        assert (await get(metrics, "/healthz")).status == 200
        for good in (f"Bearer {TOKEN}", f"bearer {TOKEN}", basic("prom", PASSWORD)):
            resp = await get(metrics, "/metrics", good)
            assert resp.status == 200 and b"skan_uptime_seconds" in resp.body
            assert (await get(metrics, "/connections", good)).status == 200
        data = samples((await get(metrics, "/metrics", f"Bearer {TOKEN}")).body.decode())
        assert value(data, "skan_auth_failures_total", protocol="metrics") == 4 + 6

        base = [sys.executable, "-m", "clients.cli", "--host", metrics[0], "connections",
                "--metrics-port", str(metrics[1])]
        proc = await trio.run_process(base, capture_stdout=True, capture_stderr=True,
                                      env=ENV, check=False)
        assert proc.returncode == 1
        assert b"401" in proc.stderr and b"--metrics-token" in proc.stderr
        proc = await trio.run_process([*base, "--metrics-token", TOKEN], capture_stdout=True,
                                      capture_stderr=True, env=ENV, check=False)
        assert proc.returncode == 0 and proc.stdout.startswith(b"LNAME"), proc.stderr
        proc = await trio.run_process(base, capture_stdout=True, capture_stderr=True,
                                      env={**ENV, "SKAN_METRICS_USER": f"prom:{PASSWORD}"},
                                      check=False)
        assert proc.returncode == 0, proc.stderr


async def test_listing_is_off_on_a_public_bind_without_credentials():
    with BrokerProcess('[metrics]\nhost = "0.0.0.0"\n') as b:
        addr = ("127.0.0.1", b.addr["metrics"][1])
        resp = await get(addr, "/connections")
        assert resp.status == 403 and b"not a loopback address" in resp.body
        assert (await get(addr, "/subscriptions")).status == 403
        # /metrics stays as it always was: open.
        assert (await get(addr, "/metrics")).status == 200
        assert any("the connection listing is off" in line for line in b.stderr_lines)
    with BrokerProcess(f'[metrics]\nhost = "0.0.0.0"\ntoken = "{TOKEN}"\n') as b:
        addr = ("127.0.0.1", b.addr["metrics"][1])
        assert (await get(addr, "/connections")).status == 401
        assert (await get(addr, "/connections", f"Bearer {TOKEN}")).status == 200
        assert not any("listing is off" in line for line in b.stderr_lines)


def test_access_rules():
    open_ = MetricsAccess(loopback=True)
    assert open_.allows(None) and open_.listing_served and open_.challenge() == ()
    public = MetricsAccess(loopback=False)
    assert public.allows(None) and not public.listing_served
    certs = MetricsAccess(loopback=False, client_certificates=True)
    assert certs.listing_served and certs.allows(None)

    class Section:
        token = None
        token_sha256 = hash_token("t")
        username = None
        password = None
        password_sha256 = None
        tls_client_auth = "none"

    hashed = MetricsAccess.from_section(Section(), loopback=False)
    assert hashed.listing_served and hashed.allows("Bearer t") and not hashed.allows("Bearer u")
    assert not hashed.allows(basic("t", "t")) and not hashed.allows(None)
    assert hashed.challenge() == (("WWW-Authenticate", 'Bearer realm="skan-broker metrics"'),)


@pytest.mark.prometheus
def test_prometheus_scrapes_with_a_bearer_token():
    binary = ensure_prometheus()
    with BrokerProcess(PROTECTED) as b:

        class WithToken(PrometheusServer):
            def _config(self) -> str:
                return super()._config() + f"    authorization:\n      credentials: {TOKEN}\n"

        class Without(PrometheusServer):
            pass

        prom = WithToken(binary, [b.addr["metrics"]], job="with-token").start()
        bare = Without(binary, [b.addr["metrics"]], job="without").start()
        try:
            prom.wait_scraping(1)
            # The broker's own series arrived through the authenticated scrape.
            assert prom.wait_value('count(skan_uptime_seconds{job="with-token"})', 1.0) == 1.0
            # The scraper without credentials is refused: its target is down.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                targets = bare.api("targets")["activeTargets"]
                if targets and targets[0]["health"] == "down":
                    break
                time.sleep(0.3)
            assert targets[0]["health"] == "down" and "401" in targets[0]["lastError"], targets
        finally:
            prom.cleanup()
            bare.cleanup()


async def test_drops_of_a_slow_consumer_are_listed():
    config = ('[broker]\nmax_frame = 65536\nqueue_limit = 4194304\nslow_consumer = "drop"\n'
              "slow_consumer_grace = 0\n")
    with BrokerProcess(config) as b:
        async with SkanClient.connect(*b.skan) as pub, SkanClient.connect(*b.skan) as fine:
            await fine.subscribe("other")
            slow, slow_lname = await open_slow_consumer(b.skan, "firehose")
            for _ in range(FIREHOSE):  # ~12 MiB into a 4 MiB queue
                await pub.send("firehose", PAYLOAD)
            await pub.barrier()
            deadline = trio.current_time() + 20
            while True:
                data = await listing(b.addr["metrics"], "/connections?sort=dropped")
                first = data["connections"][0]
                if first["lname"] == slow_lname.decode() and first["dropped"] > 0:
                    break
                assert trio.current_time() < deadline, data
                await trio.sleep(0.3)
            assert first["msgs_out"] + first["dropped"] == FIREHOSE
            assert first["queue_bytes"] <= 4194304
            assert all(r["dropped"] == 0 for r in data["connections"][1:])
            await slow.aclose()
