"""Crashers found by fuzzing (and by the hardening issue's attacks), kept as regressions.

Each input once made a decoder raise something other than its protocol's
error -- a traceback in the broker's log instead of a counted protocol
error.  They are checked at the decoder and, in one broker, over TCP.
"""

from __future__ import annotations

import contextlib
import time

import pytest

from tests.brokerproc import BrokerProcess
from tests.fuzz.syncpeer import SyncBystander, send_stream
from tests.fuzz.test_decoders import http_exchange
from wire import hsp
from wire import mariner as mw
from wire.errors import RemoteProtocolError
from wire.eventer import ClientConnection, InitReq, ServerConnection
from wire.skan import FrameSplitter, decode, encode_frame


def _mariner(text: str) -> bytes:
    return mw.encode_frame(text.encode("utf-8", "surrogatepass"))


def _init_with(value: str) -> str:
    return ('{"type": "init", "client_id": "x", "client_token": null, '
            f'"last_event_id": {value}, "subscriptions": []}}')


MARINER_CRASHERS = {
    # ValueError: Exceeds the limit (4300 digits) for integer string conversion
    "10,000-digit integer": _mariner("9" * 10_000),
    "4301-digit negative integer": _mariner("-" + "1" * 4301),
    "huge integer inside init": _mariner(_init_with("9" * 10_000)),
    "huge event id field": _mariner(_init_with(
        '{"server": 1, "session": ' + "9" * 5000 + ', "instance": 1}')),
    "deep nesting": _mariner("[" * 100_000 + "]" * 100_000),
    "lone surrogate client id": _mariner(
        '{"type": "init", "client_id": "\\ud800", "client_token": null, '
        '"last_event_id": null, "subscriptions": [["\\udfff"]]}'),
}


def _eventer_register(json_text: str) -> bytes:
    conn = ClientConnection(InitReq("fuzz", None, (), None, False), max_message=1 << 24)
    conn.chatter.send_value("HatEventer.MsgRegisterReq", [{
        "type": ["g"], "sourceTimestamp": ("none", None),
        "payload": ("value", ("json", json_text)),
    }], last=False, now=0.0)
    return conn.data_to_send()


EVENTER_CRASHERS = {
    # RecursionError while parsing the JSON payload
    "deeply nested JSON payload": _eventer_register("[" * 100_000 + "]" * 100_000),
    "deeply nested object payload": _eventer_register('{"a":' * 50_000 + "0" + "}" * 50_000),
    "10,000-digit integer payload": _eventer_register("9" * 10_000),
    "surrogate in payload": _eventer_register('"\\ud800"'),
}

HTTP_CRASHERS = {
    "10,000-digit Content-Length": b"GET /metrics HTTP/1.1\r\nContent-Length: "
                                   + b"9" * 10_000 + b"\r\n\r\n",
    "non-ASCII header": b"GET /metrics HTTP/1.1\r\nX: \xff\xfe\r\n\r\n",
}

SKAN_CRASHERS = {
    # Many items in one frame: must be refused or decoded in bounded time.
    "LIST of 200,000 NULLs": encode_frame({b"type": b"getlname"}) + encode_frame(
        {b"type": b"send", b"msg": [None] * 200_000}),
}

HSP_CRASHERS = {
    "DATA_ACK with a Skan LIST of 200,000 NULLs": hsp.encode(hsp.DataAck.make(
        1, 1, encode_frame({b"type": b"getlname", b"x": [None] * 200_000})[4:])),
}


def _cases(crashers: dict[str, bytes]) -> list[str]:
    return sorted(crashers)


@pytest.mark.parametrize("name", _cases(MARINER_CRASHERS))
def test_mariner_decoder(name):
    conn = mw.MarinerConnection(mw.SERVER, 1 << 20)
    with contextlib.suppress(RemoteProtocolError):
        conn.receive_data(MARINER_CRASHERS[name])


@pytest.mark.parametrize("name", _cases(EVENTER_CRASHERS))
def test_eventer_decoder(name):
    conn = ServerConnection(max_message=1 << 24)
    with contextlib.suppress(RemoteProtocolError):
        conn.receive_data(EVENTER_CRASHERS[name], 0.0)


@pytest.mark.parametrize("name", _cases(HTTP_CRASHERS))
def test_http_decoder(name):
    http_exchange([HTTP_CRASHERS[name]])


@pytest.mark.parametrize("name", _cases(SKAN_CRASHERS))
def test_skan_decoder(name):
    for frame in FrameSplitter(8 << 20).receive_data(SKAN_CRASHERS[name]):
        with contextlib.suppress(RemoteProtocolError):
            decode(frame[4:])


@pytest.mark.parametrize("name", _cases(HSP_CRASHERS))
def test_hsp_decoder(name):
    with contextlib.suppress(RemoteProtocolError):
        hsp.HSPConnection(8 << 20).receive_data(HSP_CRASHERS[name])


LISTENER_CRASHERS = {
    "mariner": MARINER_CRASHERS,
    "eventer": EVENTER_CRASHERS,
    "metrics": HTTP_CRASHERS,
    "skan": SKAN_CRASHERS,
    "hsp": HSP_CRASHERS,
}


@pytest.fixture(scope="module")
def broker_and_bystander():
    with BrokerProcess() as proc:
        bystander = SyncBystander(proc.skan)
        yield proc, bystander
        bystander.close()


def _over_tcp(broker_and_bystander, listener: str, name: str) -> None:
    proc, bystander = broker_and_bystander
    before = len(proc.stderr_lines)
    send_stream(proc.addr[listener], [LISTENER_CRASHERS[listener][name]])
    # A bystander round trip also waits for the broker to have handled the input.
    assert bystander.check() < 2.0
    time.sleep(0.1)
    lines = proc.stderr_lines[before:]
    traces = [i for i, line in enumerate(lines) if "Traceback" in line]
    assert not traces, "".join(lines[max(0, traces[0] - 2) : traces[0] + 30])


@pytest.mark.parametrize(
    ("listener", "name"),
    [(lst, name) for lst, crashers in sorted(LISTENER_CRASHERS.items())
     for name in sorted(crashers)],
)
def test_crasher_over_tcp_leaves_no_traceback(broker_and_bystander, listener, name):
    _over_tcp(broker_and_bystander, listener, name)
