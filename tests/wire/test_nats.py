"""The sans-IO NATS client codec: every server operation, split anywhere, and its refusals."""

from __future__ import annotations

import contextlib
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wire import nats
from wire.errors import MalformedError, ProtocolError

STREAM = (
    b'INFO {"server_id":"X","max_payload":1048576,"headers":true}\r\n'
    b"+OK\r\n"
    b"PING\r\n"
    b"MSG sk.g.1._ 7 5\r\nhello\r\n"
    b"MSG sk.g.1._ 7 _INBOX.1 0\r\n\r\n"
    b"HMSG sk.g.1._ 8 20 25\r\nNATS/1.0\r\nA: b c\r\n\r\nhello\r\n"
    b"pong\r\n"
    b"-ERR 'Unknown Protocol Operation'\r\n"
)
EXPECTED = [
    nats.Info({"server_id": "X", "max_payload": 1048576, "headers": True}),
    nats.Ok(),
    nats.Ping(),
    nats.Msg(b"sk.g.1._", b"7", None, b"hello"),
    nats.Msg(b"sk.g.1._", b"7", b"_INBOX.1", b""),
    nats.Msg(b"sk.g.1._", b"8", None, b"hello", b"NATS/1.0\r\nA: b c\r\n\r\n"),
    nats.Pong(),
    nats.Err("Unknown Protocol Operation"),
]


def test_every_server_operation():
    assert nats.NatsConnection().receive_data(STREAM) == EXPECTED


@given(st.lists(st.integers(0, len(STREAM)), max_size=12))
def test_split_anywhere(cuts):
    conn = nats.NatsConnection()
    events = []
    bounds = [0, *sorted(cuts), len(STREAM)]
    for a, b in itertools.pairwise(bounds):
        events += conn.receive_data(STREAM[a:b])
    assert events == EXPECTED


def test_headers_round_trip():
    block = nats.header_block([(b"Skan-Origin", b"1 2 3 4.5")])
    assert nats.parse_headers(block) == {b"Skan-Origin": b"1 2 3 4.5"}
    cmd = nats.hpub(b"s", block, b"payload")
    head, rest = cmd.split(b"\r\n", 1)
    assert head == b"HPUB s %d %d" % (len(block), len(block) + 7)
    assert rest == block + b"payload\r\n"


def test_commands():
    assert nats.pub(b"a.b", b"xy") == b"PUB a.b 2\r\nxy\r\n"
    assert nats.pub(b"a.b", b"xy", b"r") == b"PUB a.b r 2\r\nxy\r\n"
    assert nats.sub(b"a.>", b"3") == b"SUB a.> 3\r\n"
    assert nats.unsub(b"3") == b"UNSUB 3\r\n"
    assert nats.connect({"echo": False}) == b'CONNECT {"echo":false}\r\n'


@pytest.mark.parametrize("data, words", [
    (b"X" * 5000, "longer than"),
    (b"HELLO\r\n", "unknown protocol operation"),
    (b"MSG a 1\r\n", "arguments"),
    (b"MSG a 1 -5\r\n", "size"),
    (b"MSG a 1 99999999999\r\n", "size"),
    (b"MSG a 1 2\r\nabcd", "CRLF"),
    (b"INFO {nope\r\n", "not JSON"),
    (b"INFO [1]\r\n", "not a JSON object"),
    (b'INFO {"max_payload":4}\r\nMSG a 1 5\r\n', "out of bounds"),
])
def test_refusals(data, words):
    conn = nats.NatsConnection()
    with pytest.raises(nats.NatsError, match=words):
        conn.receive_data(data)
    with pytest.raises(nats.NatsError):  # unusable after a fault
        conn.receive_data(b"PING\r\n")


def test_a_header_block_that_is_not_nats_1_is_a_message_not_a_fault():
    """Any client may publish a bad header block and NATS forwards it: the
    message comes through as is (parse_headers refuses it), the connection stays."""
    conn = nats.NatsConnection()
    [msg] = conn.receive_data(b"HMSG a 1 3 3\r\nabc\r\n")
    assert msg.headers == b"abc"
    with pytest.raises(MalformedError):
        nats.parse_headers(msg.headers)
    assert conn.receive_data(b"PING\r\n") == [nats.Ping()]


@given(st.binary(max_size=300))
def test_random_bytes_raise_only_protocol_errors(data):
    with contextlib.suppress(ProtocolError):
        nats.NatsConnection().receive_data(data)
