"""toolkit/eventer_client.py against a running broker (both envelopes), and its error paths."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import trio

from clients.skan import SkanClient
from tests.brokerproc import BrokerProcess
from toolkit.eventer_client import EventerClient, EventerError, EventerInitError, EventerTimeout
from wire.chatter import Envelope
from wire.eventer import (
    BinaryPayload,
    JsonPayload,
    QueryLatestParams,
    QueryServerParams,
    RegisterEvent,
    Status,
    Timestamp,
)

pytestmark = pytest.mark.trio


@pytest.fixture(scope="module")
def tbroker():
    with BrokerProcess('[eventer]\ntoken = "t"\nping_delay = 0.3\nping_timeout = 1.0\n') as p:
        yield p


def connect(b, **kw):
    return EventerClient.connect(*b.addr["eventer"], "test/client", token="t", **kw)


@pytest.mark.parametrize("envelope", list(Envelope))
async def test_subscribe_register_query(tbroker, envelope):
    async with connect(tbroker, subscriptions=[("cl", "*")], envelope=envelope) as sub, \
            connect(tbroker, envelope=envelope) as pub, \
            SkanClient.connect(*tbroker.skan) as skan:
        assert sub.status is Status.OPERATIONAL
        evs = await pub.register([
            RegisterEvent(("cl", "a"), Timestamp(10, 5), JsonPayload({"x": [1, "y"]})),
            RegisterEvent(("cl",), None, BinaryPayload("bin", b"\x00")),
        ])
        assert evs is not None and [e.type for e in evs] == [("cl", "a"), ("cl",)]
        assert evs[0].source_timestamp == Timestamp(10, 5)
        assert evs[0].payload == JsonPayload({"x": [1, "y"]})  # exactly as registered
        assert type(evs[0].payload.data["x"][0]) is int
        batch = await sub.receive()
        assert batch == evs
        await skan.send("cl", "from skan", instance="b/c")
        (ev,) = await sub.receive()
        assert (ev.type, ev.payload) == (("cl", "b", "c"), JsonPayload("from skan"))
        assert await pub.register([RegisterEvent(("cl", "q"))], with_response=False) is None
        (quiet,) = await sub.receive()
        assert quiet.type == ("cl", "q") and quiet.payload is None
        latest = await pub.query(QueryLatestParams((("cl", "?"),)))
        assert {e.type for e in latest.events} == {("cl", "a"), ("cl", "q")}
        page = await pub.query(QueryServerParams(1, max_results=1, last_event_id=evs[0].id))
        assert page.events == (evs[1],) and page.more_follows
        await trio.sleep(0.8)  # broker pings after 0.3 s idle; the client answers
        assert sub.is_open and pub.is_open


async def test_wrong_token_raises_init_error(tbroker):
    with pytest.raises(EventerInitError, match="token"):
        async with EventerClient.connect(*tbroker.addr["eventer"], "x", token="nope"):
            pass  # pragma: no cover


async def test_too_many_subscriptions_are_refused(tbroker):
    with pytest.raises(EventerInitError, match="too many subscriptions"):
        async with connect(tbroker, subscriptions=[("s", str(i)) for i in range(10_001)]):
            pass  # pragma: no cover
    async with connect(tbroker, subscriptions=[("s", str(i)) for i in range(10_000)]) as c:
        assert c.status is Status.OPERATIONAL


async def test_server_that_never_answers_times_out():
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(EventerTimeout, match="MsgInitRes"):
            async with EventerClient.connect("127.0.0.1", port, "x", timeout=0.3):
                pass  # pragma: no cover


async def test_requests_fail_once_the_broker_is_gone():
    with BrokerProcess("") as b:
        async with EventerClient.connect(*b.addr["eventer"], "x", subscriptions=[("z", "*")]
                                         ) as client:
            b.stop()
            with pytest.raises(EventerError):
                for _ in range(50):
                    await client.receive()
            assert not client.is_open
            with pytest.raises(EventerError):
                await client.register([RegisterEvent(("z",))])


def cli(b, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "clients.eventer_cli", "--port", str(b.addr["eventer"][1]),
         "--token", "t", *args], capture_output=True, text=True, timeout=30)


async def test_command_line_register_query_subscribe(tbroker):
    sub = await trio.lowlevel.open_process(
        [sys.executable, "-m", "clients.eventer_cli", "--port", str(tbroker.addr["eventer"][1]),
         "--token", "t", "subscribe", "cli/*"], stdout=subprocess.PIPE)
    try:
        await trio.sleep(1.0)  # let it subscribe
        res = await trio.to_thread.run_sync(
            cli, tbroker, "register", "cli/x", "--json", '{"v": 1}', "--source-timestamp", "5")
        assert res.returncode == 0, res.stderr
        created = json.loads(res.stdout)
        assert created["type"] == ["cli", "x"] and created["payload"] == {"json": {"v": 1}}
        assert created["source_timestamp"] == 5.0
        res = await trio.to_thread.run_sync(cli, tbroker, "register", "cli", "--binary",
                                            "raw:00ff")
        binary = json.loads(res.stdout)
        assert binary["payload"] == {"binary": {"type": "raw", "data": "AP8="}}
        res = await trio.to_thread.run_sync(cli, tbroker, "query", "timeseries", "--types",
                                            "cli/*", "--max-results", "1")
        assert [json.loads(line)["id"] for line in res.stdout.splitlines()] == [binary["id"]]
        assert "more events follow" in res.stderr
        buf = b""
        with trio.fail_after(10):
            while buf.count(b"\n") < 2:
                buf += await sub.stdout.receive_some(65536)
        assert [json.loads(line)["id"] for line in buf.decode().splitlines()] == [
            created["id"], binary["id"]]
    finally:
        sub.kill()
        await sub.wait()
    res = await trio.to_thread.run_sync(
        lambda: subprocess.run([sys.executable, "-m", "clients.eventer_cli", "--port",
                                str(tbroker.addr["eventer"][1]), "query", "latest"],
                               capture_output=True, text=True, timeout=30))
    assert res.returncode == 1 and "token" in res.stderr
