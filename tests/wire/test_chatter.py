"""Chatter framing, SBS guard and connection state machine against the recorded Hat vectors."""

from __future__ import annotations

import json
import pathlib
import time

import pytest
from hat.sbs import parser
from hat.sbs.serializer.pyserializer import _encode_Integer
from hypothesis import given
from hypothesis import strategies as st

from wire.chatter import (
    ChatterConnection,
    Conversation,
    Envelope,
    FrameSplitter,
    FramingError,
    encode_frame,
    sbs,
)
from wire.errors import LocalProtocolError, RemoteProtocolError

VECTORS = json.loads((pathlib.Path(__file__).parent / "hat_vectors.json").read_text())
V = VECTORS["vectors"]
CHATTER_VECTORS = {k: v for k, v in V.items() if "envelope" in v}


def frame(name: str) -> bytes:
    return bytes.fromhex(V[name]["frame_hex"])


def envelope_of(v: dict) -> str:
    return "Hat.Msg" if v["envelope"].startswith("Hat.Msg") else "HatChatter.Msg"


# ---- framing -------------------------------------------------------------------


def test_frame_header_matches_vectors():
    for v in CHATTER_VECTORS.values():
        body = bytes.fromhex(v["body_hex"])
        assert encode_frame(body).hex() == v["frame_hex"]


@given(st.lists(st.binary(max_size=300), max_size=8), st.integers(1, 50))
def test_splitter_reassembles_any_chunking(bodies, chunk):
    stream = b"".join(encode_frame(b) for b in bodies)
    splitter = FrameSplitter(1000)
    out = []
    for i in range(0, len(stream), chunk):
        out += splitter.receive_data(stream[i : i + chunk])
    assert out == bodies
    assert splitter.buffered == 0


def test_splitter_accepts_long_and_zero_length_headers():
    # m = 3 for a 2-byte body (longer than needed) and m = 0 (k = 0).
    assert FrameSplitter(10).receive_data(b"\x03\x00\x00\x02ab\x00") == [b"ab", b""]


def test_splitter_refuses_oversized_announcement_before_buffering():
    splitter = FrameSplitter(1024)
    with pytest.raises(FramingError, match="exceeds the limit"):
        splitter.receive_data(b"\x08" + (2**60).to_bytes(8, "big"))
    with pytest.raises(FramingError):
        FrameSplitter(10).receive_data(b"\x01\x0b")


# ---- SBS -------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CHATTER_VECTORS))
def test_vectors_decode_and_reencode_exactly(name):
    v = CHATTER_VECTORS[name]
    body = bytes.fromhex(v["body_hex"])
    env = sbs.decode(envelope_of(v), body)
    assert {k: env[k] for k in ("id", "first", "owner", "token", "last")} == v["msg"]
    assert sbs.encode(envelope_of(v), env) == body
    data = bytes(env["data"]["data"])
    assert data.hex() == v["data_hex"]
    mtype = env["data"]["type"]
    if envelope_of(v) == "Hat.Msg":
        mtype = f"{env['data']['module'][1]}.{mtype}"
    value = sbs.decode(mtype, data)
    assert sbs.encode(mtype, value) == data
    assert json.loads(json.dumps(value, default=list)) == v["data_decoded"]


def test_primitive_vectors():
    for p in VECTORS["sbs_primitives_hat_sbs_0.7.6"]:
        if p["type"] == "Integer":
            assert sbs.encode_integer(p["value"]).hex() == p["hex"]


@given(st.integers(-(2**63), 2**63 - 1))
def test_encode_integer_equals_hat_sbs(value):
    assert sbs.encode_integer(value) == bytes(_encode_Integer(value))
    assert sbs.decode("HatEventer.Timestamp", sbs.encode_integer(value) + b"\x80") == {
        "s": value, "us": 0}


def test_array_assembled_from_elements_equals_hat_sbs():
    ev = CHATTER_VECTORS["eventer_A_hatchatter_events_notify_json"]
    notify = sbs.decode("HatEventer.MsgEventsNotify", bytes.fromhex(ev["data_hex"]))
    one = sbs.encode("HatEventer.Event", notify[0])
    assert sbs.encode_array([one] * 70) == sbs.encode("HatEventer.MsgEventsNotify", notify * 70)


@pytest.mark.parametrize(
    ("name", "data", "match"),
    [
        # six bytes announcing 2**31 events: refused at once, no allocation
        ("HatEventer.MsgRegisterReq", bytes(_encode_Integer(2**31)) + b"\0" * 4, "count"),
        ("HatEventer.MsgEventsNotify", bytes(_encode_Integer(2**62)), "count"),
        ("HatEventer.MsgInitRes", b"\x85", "Choice index"),
        ("HatEventer.Timestamp", bytes(_encode_Integer(2**70)) + b"\x80", "64 bits"),
        ("HatEventer.Timestamp", b"\x00" * 12, "wider than 64 bits"),
        ("HatEventer.Timestamp", b"\x81", "truncated"),
        ("HatEventer.MsgEventsAck", b"\x00", "trailing"),
        ("HatEventer.EventPayloadJson", b"\x85ab", "overruns"),
        ("HatEventer.EventPayloadJson", b"\x82\xff\xfe", "UTF-8"),
        ("HatEventer.MsgStatusNotify", b"", "truncated"),
    ],
)
def test_guard_refuses_malformed_input(name, data, match):
    start = time.monotonic()
    with pytest.raises(sbs.SbsError, match=match):
        sbs.decode(name, data)
    assert time.monotonic() - start < 0.5


def test_unknown_type_name_is_refused():
    assert not sbs.known("HatEventer.Nope")
    with pytest.raises(LocalProtocolError):
        sbs.encode("HatEventer.Timestamp", {"s": "x", "us": 0})
    with pytest.raises(sbs.SbsError, match="unknown SBS type"):
        sbs.decode("HatEventer.Nope", b"")


def test_schemas_match_the_real_hat_repositories():
    peers = pathlib.Path(__file__).parent.parent / "peers"
    ref = json.loads((peers / "hat_event_0.9.44_sbs_repo.json").read_text())
    mine = {mod.name: mod for mod in map(parser.parse, sbs.schema_texts())}
    hat_eventer = next(mod for mod in ref if mod["name"] == "HatEventer")
    assert parser.module_to_json(mine["HatEventer"]) == hat_eventer


# ---- connection state machine -------------------------------------------------------


def server_after(name: str) -> tuple[ChatterConnection, list]:
    conn = ChatterConnection()
    return conn, conn.receive_data(frame(name))


@pytest.mark.parametrize(
    ("req", "res", "envelope"),
    [
        ("eventer_A_hatchatter_init_req", "eventer_A_hatchatter_init_res_success_operational",
         Envelope.HATCHATTER),
        ("eventer_B_seedchatter_init_req", "eventer_B_seedchatter_init_res_success_operational",
         Envelope.HAT),
    ],
)
def test_server_detects_envelope_and_answers_in_kind(req, res, envelope):
    conn, msgs = server_after(req)
    assert conn.envelope is envelope
    (msg,) = msgs
    assert msg.type == "HatEventer.MsgInitReq" and msg.first and not msg.last
    assert msg.conv == Conversation(owner=False, first=1)
    conn.send_value("HatEventer.MsgInitRes", ("success", ("operational", None)), conv=msg.conv)
    assert conn.data_to_send() == frame(res)
    assert not conn.is_open(msg.conv)


@pytest.mark.parametrize(
    ("ping", "pong", "init"),
    [
        ("hatchatter_ping_request", "hatchatter_pong_response", "eventer_A_hatchatter_init_req"),
        ("chatter05_ping_request", "chatter05_pong_response", "eventer_B_seedchatter_init_req"),
    ],
)
def test_ping_is_answered_in_the_same_conversation(ping, pong, init):
    conn, _ = server_after(init)
    conn.data_to_send()
    assert conn.receive_data(frame(ping)) == []
    out = conn.data_to_send()
    env = sbs.decode(envelope_of(V[pong]), out[2:])
    expected = dict(V[pong]["msg"])
    assert {k: env[k] for k in ("first", "owner", "token", "last")} == {
        k: expected[k] for k in ("first", "owner", "token", "last")}
    assert env["data"] == sbs.decode(envelope_of(V[pong]), bytes.fromhex(V[pong]["body_hex"]))[
        "data"]
    assert conn.pings_answered == 1


def client_server(envelope=Envelope.HATCHATTER, timeout=5.0):
    client = ChatterConnection(envelope=envelope, timeout=timeout)
    server = ChatterConnection(timeout=timeout)
    return client, server


def pump(src: ChatterConnection, dst: ChatterConnection, now: float = 0.0) -> list:
    return dst.receive_data(src.data_to_send(), now)


def test_conversation_token_and_last_flags():
    client, server = client_server()
    conv = client.send_value("HatEventer.MsgQueryReq", ("latest", {"eventTypes": ("none", None)}),
                             last=False)
    (req,) = pump(client, server)
    with pytest.raises(LocalProtocolError, match="token"):
        client.send_value("HatEventer.MsgEventsAck", None, conv=conv)
    server.send_value("HatEventer.MsgQueryRes", {"events": [], "moreFollows": False},
                      conv=req.conv, last=False, token=False)
    # the server kept the token: it may send again, the client may not
    server.send_value("HatEventer.MsgQueryRes", {"events": [], "moreFollows": True},
                      conv=req.conv)
    a, b = pump(server, client)
    assert (a.conv, a.last, b.last) == (conv, False, True)
    assert not client.is_open(conv) and not server.is_open(req.conv)
    with pytest.raises(LocalProtocolError, match="over"):
        server.send_value("HatEventer.MsgEventsAck", None, conv=req.conv)


def test_message_while_we_hold_the_token_is_a_protocol_error():
    client, server = client_server()
    client.send_value("HatEventer.MsgQueryReq", ("latest", {"eventTypes": ("none", None)}),
                      last=False)
    (req,) = pump(client, server)
    # forge a second client message in that conversation (the server holds the token)
    forged = sbs.encode("HatChatter.Msg", {
        "id": 2, "first": req.conv.first, "owner": True, "token": True, "last": False,
        "data": {"type": "HatEventer.MsgEventsAck", "data": b""}})
    with pytest.raises(RemoteProtocolError, match="token"):
        server.receive_data(encode_frame(forged))


def test_ids_must_increase():
    conn, _ = server_after("eventer_A_hatchatter_init_req")
    with pytest.raises(RemoteProtocolError, match="does not increase"):
        conn.receive_data(frame("eventer_A_hatchatter_init_req"))


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (encode_frame(b"\x00\x01\x02"), "neither"),
        (b"\x01\x05abc", None),  # incomplete: nothing happens yet
        (b"\x08" + (2**40).to_bytes(8, "big"), "exceeds"),
    ],
)
def test_garbage_first_message(data, match):
    conn = ChatterConnection()
    if match is None:
        assert conn.receive_data(data) == []
        return
    with pytest.raises(RemoteProtocolError, match=match):
        conn.receive_data(data)


def test_unknown_type_closes():
    body = sbs.encode("HatChatter.Msg", {"id": 1, "first": 1, "owner": True, "token": True,
                                         "last": True, "data": {"type": "Foo.Bar", "data": b""}})
    with pytest.raises(RemoteProtocolError, match="neither"):
        ChatterConnection().receive_data(encode_frame(body))
    client, server = client_server()
    client.send_value("HatEventer.MsgEventsAck", None)
    pump(client, server)
    with pytest.raises(RemoteProtocolError, match="unknown message type"):
        server.receive_data(encode_frame(sbs.encode("HatChatter.Msg", {
            "id": 5, "first": 5, "owner": True, "token": True, "last": True,
            "data": {"type": "HatChatter.Msg", "data": b""}})))


def test_conversation_timeout_and_stray_answer():
    client, server = client_server(timeout=5.0)
    conv = client.send_value("HatEventer.MsgQueryReq", ("latest", {"eventTypes": ("none", None)}),
                             last=False, now=100.0)
    assert client.next_deadline() == 105.0
    (req,) = pump(client, server)
    assert client.check_timeouts(104.9) == []
    assert client.check_timeouts(105.0) == [conv]
    assert client.next_deadline() is None
    server.send_value("HatEventer.MsgQueryRes", {"events": [], "moreFollows": False},
                      conv=req.conv)
    assert pump(server, client) == []
    assert client.stray == 1


def test_own_ping_expires_without_pong_and_clears_with_it():
    client, server = client_server(Envelope.HAT)
    client.send_value("HatEventer.MsgEventsAck", None)
    pump(client, server)
    conv = client.ping(now=0.0, timeout=1.0)
    assert pump(client, server) == []
    assert pump(server, client) == []  # the pong
    assert not client.is_open(conv)
    conv = client.ping(now=10.0, timeout=1.0)
    assert client.check_timeouts(11.0) == [conv]


def test_hat_envelope_round_trip():
    client, server = client_server(Envelope.HAT)
    client.send_value("HatEventer.MsgStatusNotify", ("stopping", None))
    (msg,) = pump(client, server)
    assert server.envelope is Envelope.HAT
    assert sbs.decode(msg.type, msg.data) == ("stopping", None)
