"""Eventer server and client state machines talking to each other in memory, and to vectors."""

from __future__ import annotations

import json
import pathlib

import pytest

from wire.chatter import Envelope, encode_frame, sbs
from wire.eventer import (
    BinaryPayload,
    ClientConnection,
    ConversationExpired,
    Event,
    EventId,
    EventsAcked,
    EventsNotified,
    InitReq,
    InitRequest,
    InitResult,
    JsonPayload,
    Order,
    OrderBy,
    ProtocolError,
    QueryLatestParams,
    QueryRequest,
    QueryResponse,
    QueryServerParams,
    QueryTimeseriesParams,
    RegisterEvent,
    RegisterRequest,
    RegisterResult,
    ServerConnection,
    Status,
    StatusChanged,
    Timestamp,
    encode_event,
)
from wire.eventer import messages as m

V = json.loads((pathlib.Path(__file__).parent / "hat_vectors.json").read_text())["vectors"]

EV = Event(EventId(1, 7, 1), ("a", "b"), Timestamp(1700000000, 500000), None,
           JsonPayload({"value": 42}))


def pump(src, dst, now=0.0):
    return dst.receive_data(src.data_to_send(), now)


def opened(envelope=Envelope.HATCHATTER, credit=2):
    client = ClientConnection(InitReq("test/client", subscriptions=(("a", "*"),)),
                              envelope=envelope)
    server = ServerConnection(notify_credit=credit)
    (req,) = pump(client, server)
    assert isinstance(req, InitRequest)
    assert req.request == InitReq("test/client", None, (("a", "*"),), None, False)
    server.accept(req.conv, Status.OPERATIONAL)
    assert pump(server, client) == [InitResult(Status.OPERATIONAL, None)]
    return client, server


def test_event_encoding_matches_vector():
    data = bytes.fromhex(V["eventer_A_hatchatter_events_notify_json"]["data_hex"])
    decoded = sbs.decode("HatEventer.MsgEventsNotify", data)
    assert m.event_from_sbs(decoded[0]) == EV
    # hat-event writes JSON as '{"value": 42}' (the same default separators)
    assert sbs.encode_array([encode_event(EV)]) == data


def test_init_request_vector_decodes():
    server = ServerConnection()
    (req,) = server.receive_data(bytes.fromhex(V["eventer_A_hatchatter_init_req"]["frame_hex"]))
    assert req.request.subscriptions == (("a", "*"),)
    server.accept(req.conv, Status.OPERATIONAL)
    assert server.data_to_send().hex() == V[
        "eventer_A_hatchatter_init_res_success_operational"]["frame_hex"]


@pytest.mark.parametrize("envelope", list(Envelope))
def test_notify_ack_and_credit(envelope):
    client, server = opened(envelope, credit=2)
    assert server.credit == 2
    server.notify([encode_event(EV)], now=0.0)
    server.notify([encode_event(EV), encode_event(EV)], now=0.0)
    assert server.credit == 0
    a, b = pump(server, client)
    assert isinstance(a, EventsNotified) and a.events == (EV,) and a.ack_conv is not None
    assert len(b.events) == 2
    client.ack(a.ack_conv)
    client.ack(b.ack_conv)
    acks = pump(client, server)
    assert [type(x) for x in acks] == [EventsAcked, EventsAcked]
    assert server.credit == 2


def test_unacked_notify_expires():
    _client, server = opened()
    conv = server.notify([encode_event(EV)], now=10.0)
    assert server.check_timeouts(14.0) == []
    assert server.check_timeouts(15.0) == [ConversationExpired(conv, "notify")]
    assert server.credit == 2


def test_register_with_and_without_response():
    client, server = opened()
    reg = [RegisterEvent(("a", "x"), Timestamp(5, 6), BinaryPayload("blob", b"\x00\xff")),
           RegisterEvent(("a",), None, None)]
    assert client.register(reg, with_response=False) is None
    conv = client.register(reg, with_response=True)
    first, second = pump(client, server)
    assert first == RegisterRequest(None, tuple(reg))
    assert second.conv is not None and second.events == tuple(reg)
    ev = Event(EventId(1, 2, 3), ("a", "x"), Timestamp(7, 8), Timestamp(5, 6), reg[0].payload)
    server.register_result(second.conv, [encode_event(ev)])
    assert pump(server, client) == [RegisterResult(conv, (ev,))]
    conv = client.register(reg, with_response=True)
    (req,) = pump(client, server)
    server.register_result(req.conv, None)
    assert pump(server, client) == [RegisterResult(conv, None)]


@pytest.mark.parametrize("params", [
    QueryLatestParams(None),
    QueryLatestParams((("a", "*"), ("b", "?"))),
    QueryTimeseriesParams((("a", "*"),), Timestamp(1, 0), Timestamp(2, 0), None,
                          Timestamp(3, 4), Order.ASCENDING, OrderBy.SOURCE_TIMESTAMP, 10,
                          EventId(1, 2, 3)),
    QueryServerParams(7, True, None, EventId(7, 1, 1)),
])
def test_query_round_trip(params):
    client, server = opened()
    conv = client.query(params)
    (req,) = pump(client, server)
    assert req == QueryRequest(req.conv, params)
    server.query_result(req.conv, [encode_event(EV)], True)
    (res,) = pump(server, client)
    assert res == QueryResponse(conv, m.QueryResult((EV,), True))


def test_status_notify_and_refusal():
    client, server = opened()
    server.notify_status(Status.STOPPING)
    assert pump(server, client) == [StatusChanged(Status.STOPPING)]
    client = ClientConnection(InitReq("x", client_token="bad"))
    server = ServerConnection()
    (req,) = pump(client, server)
    server.refuse(req.conv, "token mismatch")
    assert pump(server, client) == [InitResult(None, "token mismatch")]
    client.register([], with_response=False)
    with pytest.raises(ProtocolError, match="refused"):
        pump(client, server)


def test_server_requires_init_first():
    client, _server = opened()
    rogue = ServerConnection()
    client.query(QueryLatestParams())
    with pytest.raises(ProtocolError, match="first message must be MsgInitReq"):
        rogue.receive_data(client.data_to_send())


@pytest.mark.parametrize(
    ("mtype", "value", "last", "match"),
    [
        ("HatEventer.MsgEventsNotify", [], True, "may not send"),
        ("HatEventer.MsgQueryReq", ("latest", {"eventTypes": ("none", None)}), True, "open"),
        ("HatEventer.MsgRegisterReq", [{"type": ["a"], "sourceTimestamp": ("none", None),
                                        "payload": ("value", ("json", "{nope"))}], True,
         "not valid JSON"),
    ],
)
def test_server_refuses_bad_client_messages(mtype, value, last, match):
    client, server = opened()
    client.chatter.send_value(mtype, value, last=last)
    with pytest.raises(ProtocolError, match=match):
        pump(client, server)


def test_malformed_inner_data_is_a_protocol_error():
    _client, server = opened()
    body = sbs.encode("HatChatter.Msg", {"id": 9, "first": 9, "owner": True, "token": True,
                                         "last": False, "data": {
                                             "type": "HatEventer.MsgQueryReq",
                                             "data": b"\x07"}})
    with pytest.raises(ProtocolError, match=r"malformed HatEventer\.MsgQueryReq"):
        server.receive_data(encode_frame(body))


def test_client_requires_init_res_first():
    client = ClientConnection(InitReq("x"))
    server = ServerConnection()
    (req,) = pump(client, server)
    server.accept(req.conv, Status.OPERATIONAL)
    server.data_to_send()
    server.notify_status(Status.OPERATIONAL)
    with pytest.raises(ProtocolError, match="expected MsgInitRes"):
        pump(server, client)


def test_client_pings_and_sees_expiry():
    client, server = opened()
    client.ping(now=0.0, timeout=1.0)
    assert pump(client, server) == []
    assert pump(server, client) == []
    assert client.check_timeouts(5.0) == []
    client.ping(now=10.0, timeout=1.0)
    (exp,) = client.check_timeouts(11.0)
    assert exp.kind == "ping"


def test_timestamp_from_float():
    assert Timestamp.from_float(1700000000.5) == Timestamp(1700000000, 500000)
    assert Timestamp.from_float(-0.25) == Timestamp(-1, 750000)
    assert Timestamp.from_float(1.9999999) == Timestamp(2, 0)
    assert Timestamp(3, 250000).to_float() == 3.25
