"""Decoder limits (wire/limits.py, docs/limits.md) over real sockets, each with a bystander pair.

A frame of millions of items, conversations a client never closes, and peer
JSON that used to raise RecursionError/ValueError are each refused as a
counted protocol error with no traceback, while a bystander keeps routing.
"""

from __future__ import annotations

import time

import pytest
import trio

from tests.brokerproc import BrokerProcess
from tests.rawskan import RawSkan
from tests.serving.test_limits import Bystander, metric_samples, sample, wait_eof
from wire import mariner as mw
from wire.eventer import ClientConnection, InitReq, InitResult, Status
from wire.limits import MAX_ITEMS
from wire.skan import encode

pytestmark = pytest.mark.trio


@pytest.fixture(scope="module")
def lbroker():
    with BrokerProcess() as proc:
        yield proc
    assert proc.proc is not None and proc.proc.returncode == 0, "".join(proc.stderr_lines[-40:])
    assert not any("Traceback" in line for line in proc.stderr_lines), "".join(
        proc.stderr_lines[-60:])


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def watch(bystander: Bystander, done: trio.Event, gaps: list[float]) -> None:
    """Route through the bystander pair until ``done``; record each round trip."""
    while not done.is_set():
        gaps.append(await bystander.check(timeout=5.0))
        await trio.sleep(0.005)


async def test_frame_of_8_million_nulls_is_refused_without_stalling_others(lbroker):
    bystander = await Bystander.open(lbroker.skan)
    attacker = await RawSkan.open(lbroker.skan)
    lname = await attacker.getlname()
    body = b"\x04" * 8_000_000
    message = encode({"type": "send", "group": "g", "instance": "i", "to": "*",
                      "from": lname, "seq": "1"}) + b"\x03msg\x03" + len(body).to_bytes(4, "big")
    done, gaps = trio.Event(), []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch, bystander, done, gaps)
        await trio.sleep(0.1)
        await attacker.send_bytes(len(message + body).to_bytes(4, "big") + message + body)
        (error,) = await attacker.expect_closed(timeout=10)
        assert error[b"type"] == b"error"
        assert f"more than {MAX_ITEMS} items".encode() in error[b"error"]
        await trio.sleep(0.2)
        done.set()
    assert max(gaps) < 0.25, f"bystander's largest gap {max(gaps):.3f}s"
    samples = await metric_samples(lbroker.addr["metrics"])
    assert sample(samples, "skan_protocol_errors_total", protocol="skan", reason="malformed") >= 1
    await bystander.aclose()


async def test_200000_conversations_left_open_close_the_connection(lbroker):
    bystander = await Bystander.open(lbroker.skan)
    pid = lbroker.proc.pid
    stream = await trio.open_tcp_stream(*lbroker.addr["eventer"])
    client = ClientConnection(InitReq("opener"))
    await stream.send_all(client.data_to_send())
    (result,) = client.receive_data(await stream.receive_some(65536))
    assert result == InitResult(Status.OPERATIONAL, None)
    before = rss_kib(pid)
    closed = False
    for _ in range(200):  # 200 writes of 1,000 MsgEventsAck conversations with last=false
        for _ in range(1000):
            client.chatter.send_value("HatEventer.MsgEventsAck", None, last=False)
        try:
            await stream.send_all(client.data_to_send())
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            closed = True
            break
    if not closed:
        await wait_eof(stream, 10.0)
    grown = rss_kib(pid) - before
    assert grown < 30 * 1024, f"RSS grew by {grown} KiB"
    await bystander.check()
    samples = await metric_samples(lbroker.addr["metrics"])
    assert sample(samples, "skan_protocol_errors_total", protocol="eventer",
                  reason="bad-message") >= 1
    await bystander.aclose()


@pytest.mark.parametrize("payload", [
    "[" * 50_000 + "]" * 50_000,
    "1" * 10_000,
    '{"k": "\\ud800"}',
], ids=["deep-nesting", "10000-digit-integer", "lone-surrogate"])
async def test_hostile_eventer_json_payloads_are_protocol_errors(lbroker, payload):
    bystander = await Bystander.open(lbroker.skan)
    stream = await trio.open_tcp_stream(*lbroker.addr["eventer"])
    client = ClientConnection(InitReq("json"))
    await stream.send_all(client.data_to_send())
    client.receive_data(await stream.receive_some(65536))
    events = [{"type": ["g", "x"], "sourceTimestamp": ("none", None),
               "payload": ("value", ("json", payload))}]
    client.chatter.send_value("HatEventer.MsgRegisterReq", events, last=False)
    await stream.send_all(client.data_to_send())
    await wait_eof(stream, 10.0)
    await bystander.check()
    await bystander.aclose()


@pytest.mark.parametrize("body", [
    b'{"type": "init", "client_id": "c", "client_token": null, "subscriptions": [], '
    b'"last_event_id": {"server": 1, "session": ' + b"9" * 10_000 + b', "instance": 1}}',
    b'{"type": "init", "client_id": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"type": "init", "client_id": "\\udfff", "client_token": null, "subscriptions": [], '
    b'"last_event_id": null}',
], ids=["10000-digit-integer", "deep-nesting", "lone-surrogate"])
async def test_hostile_mariner_json_is_answered_with_an_error(lbroker, body):
    bystander = await Bystander.open(lbroker.skan)
    stream = await trio.open_tcp_stream(*lbroker.addr["mariner"])
    started = time.process_time()
    await stream.send_all(mw.encode_frame(body))
    data = await wait_eof(stream, 10.0)
    conn = mw.MarinerConnection(mw.CLIENT, 1 << 20)
    conn.initialised = True
    (error,) = conn.receive_data(data)
    assert isinstance(error, mw.Error)
    assert time.process_time() - started < 5
    await bystander.check()
    await bystander.aclose()


async def test_the_broker_logged_no_traceback(lbroker):
    """Everything above was a peer fault: one log line each, never a traceback."""
    raw = await RawSkan.open(lbroker.skan)
    await raw.getlname()  # the broker is still serving
    await raw.aclose()
    assert not any("Traceback" in line for line in lbroker.stderr_lines), "".join(
        lbroker.stderr_lines[-60:])
