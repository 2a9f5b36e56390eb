"""wire.mariner: framing, schema validation and conversation rules (sans-IO)."""

from __future__ import annotations

import json
import pathlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wire import mariner as mw

VECTORS = json.loads(
    (pathlib.Path(__file__).parent / "mariner_vectors.json").read_text()
)["vectors"]


def frame_json(obj: object) -> bytes:
    return mw.encode_frame(json.dumps(obj).encode())


# ---- recorded vectors -------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(VECTORS))
def test_vector_decodes_to_recorded_value(name):
    vec = VECTORS[name]
    frame = bytes.fromhex(vec["frame_hex"])
    role = mw.SERVER if vec["direction"] == "c2s" else mw.CLIENT
    conn = mw.MarinerConnection(role, 1 << 20)
    if role is mw.SERVER and name != "mariner_init":
        conn.receive_data(bytes.fromhex(VECTORS["mariner_init"]["frame_hex"]))
    if role is mw.CLIENT:
        conn.send(mw.Init("x"))
    [msg] = conn.receive_data(frame)
    assert mw.messages.message_json(msg) == vec["decoded"]


@pytest.mark.parametrize("name", sorted(VECTORS))
def test_vector_header_is_minimal_and_matches_ours(name):
    vec = VECTORS[name]
    body = vec["body_utf8"].encode()
    # Byte-exact with Hat's framing for the same body.
    assert mw.encode_frame(body).hex() == vec["frame_hex"]
    assert bytes.fromhex(vec["header_hex"]) == mw.encode_frame(body)[: -len(body)]


def test_vector_events_fields():
    msg = mw.decode_message(VECTORS["mariner_events"]["body_utf8"].encode())
    assert msg == mw.Events((
        mw.Event(
            id=mw.EventId(1, 7, 1),
            type=("a", "b"),
            timestamp=mw.Timestamp(1700000000, 500000),
            source_timestamp=None,
            payload=mw.JsonPayload({"value": 42}),
        ),
    ))


# ---- framing --------------------------------------------------------------------------


def test_header_size_grows_with_length():
    assert mw.encode_frame(b"x" * 255)[:2] == b"\x01\xff"
    assert mw.encode_frame(b"x" * 256)[:3] == b"\x02\x01\x00"
    assert mw.encode_frame(b"x" * 70000)[:4] == b"\x03\x01\x11\x70"


def test_longer_than_needed_length_is_accepted():
    splitter = mw.FrameSplitter(1000)
    assert splitter.receive_data(b"\x08" + (3).to_bytes(8, "big") + b"abc") == [b"abc"]


@pytest.mark.parametrize("m", [0, 9, 255])
def test_bad_length_size_rejected(m):
    with pytest.raises(mw.FramingError, match=f"m={m}"):
        mw.FrameSplitter(1000).receive_data(bytes([m, 1, 2, 3]))


def test_oversized_message_rejected_from_its_header():
    splitter = mw.FrameSplitter(100)
    with pytest.raises(mw.FramingError, match="101 bytes exceeds the limit of 100"):
        splitter.receive_data(b"\x01\x65")
    # An 8-byte length announcing an exabyte is refused before any body arrives.
    with pytest.raises(mw.FramingError, match="exceeds"):
        mw.FrameSplitter(100).receive_data(b"\x08" + b"\xff" * 8)


@given(
    bodies=st.lists(st.binary(min_size=0, max_size=600), max_size=6),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=8),
)
def test_split_anywhere(bodies, cuts):
    stream = b"".join(mw.encode_frame(b) for b in bodies)
    splitter = mw.FrameSplitter(1 << 20)
    got = []
    pos = 0
    for cut in sorted(c for c in cuts if c <= len(stream)):
        got += splitter.receive_data(stream[pos:cut])
        pos = cut
    got += splitter.receive_data(stream[pos:])
    assert got == bodies
    assert splitter.buffered == 0


# ---- schema --------------------------------------------------------------------------

INIT = {
    "type": "init", "client_id": "c", "client_token": None, "last_event_id": None,
    "subscriptions": [["a", "*"]],
}
EVENT = {
    "id": {"server": 1, "session": 2, "instance": 3}, "type": ["a", "b"],
    "timestamp": {"s": 10, "us": 5}, "source_timestamp": None,
    "payload": {"type": "json", "data": [1, "x", None]},
}


def with_(base: dict, path: str, value: object) -> dict:
    obj = json.loads(json.dumps(base))
    *parents, last = path.split(".")
    target = obj
    for p in parents:
        target = target[int(p)] if isinstance(target, list) else target[p]
    if value is KeyError:
        del target[last]
    elif isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value
    return obj


def events_msg(event: dict) -> dict:
    return {"type": "events", "events": [event]}


@pytest.mark.parametrize(
    ("obj", "error"),
    [
        ([1, 2], "a message must be a JSON object, not array"),
        ({"client_id": "x"}, "message needs the property 'type'"),
        ({"type": 5}, "message.type must be a string, not integer"),
        ({"type": "hello"}, "unknown message type 'hello'"),
        (with_(INIT, "client_id", KeyError), "init needs the property 'client_id'"),
        (with_(INIT, "client_id", 7), "init.client_id must be a string, not integer"),
        (with_(INIT, "client_token", KeyError),
         r"init needs the property 'client_token' \(null is allowed\)"),
        (with_(INIT, "client_token", True), "init.client_token must be a string, not boolean"),
        (with_(INIT, "last_event_id", KeyError), "init needs the property 'last_event_id'"),
        (with_(INIT, "last_event_id", {"server": 1, "session": "2", "instance": 3}),
         "init.last_event_id.session must be an integer, not string"),
        (with_(INIT, "last_event_id", {"server": 1, "session": 2}),
         "init.last_event_id needs the property 'instance'"),
        (with_(INIT, "last_event_id", {"server": 1.0, "session": 2, "instance": 3}),
         "init.last_event_id.server must be an integer, not number"),
        (with_(INIT, "last_event_id", {"server": True, "session": 2, "instance": 3}),
         "init.last_event_id.server must be an integer, not boolean"),
        (with_(INIT, "subscriptions", {"a": 1}),
         "init.subscriptions must be an array, not object"),
        (with_(INIT, "subscriptions", [["a", 1]]),
         r"init.subscriptions\[0\]\[1\] must be a string, not integer"),
        (with_(INIT, "subscriptions", ["a"]),
         r"init.subscriptions\[0\] must be an array, not string"),
        ({"type": "events"}, "events needs the property 'events'"),
        ({"type": "events", "events": {}}, "events.events must be an array, not object"),
        (events_msg(with_(EVENT, "id", KeyError)), r"events.events\[0\] needs the property 'id'"),
        (events_msg(with_(EVENT, "timestamp.us", 1_000_000)),
         r"events.events\[0\].timestamp.us must be from 0 to 999999"),
        (events_msg(with_(EVENT, "source_timestamp", KeyError)),
         r"needs the property 'source_timestamp' \(null is allowed\)"),
        (events_msg(with_(EVENT, "source_timestamp", {"s": 1})),
         r"events.events\[0\].source_timestamp needs the property 'us'"),
        (events_msg(with_(EVENT, "payload", {"type": "xml", "data": ""})),
         r"payload.type must be 'json', 'binary' or 'sbs', not 'xml'"),
        (events_msg(with_(EVENT, "payload", {"type": "json"})),
         r"events.events\[0\].payload needs the property 'data'"),
        (events_msg(with_(EVENT, "payload", {"type": "binary", "data": "%%%"})),
         r"events.events\[0\].payload.data must be base64 text"),
        (events_msg(with_(EVENT, "payload", {"type": "binary", "data": 5})),
         r"payload.data must be a string, not integer"),
        (events_msg(with_(EVENT, "payload", {"type": "sbs", "data": {"type": "T", "data": ""}})),
         r"payload.data needs the property 'module' \(null is allowed\)"),
        (events_msg(with_(EVENT, "payload",
                          {"type": "sbs", "data": {"module": 3, "type": "T", "data": ""}})),
         r"payload.data.module must be a string, not integer"),
        (events_msg(with_(EVENT, "type", ["a", None])),
         r"events.events\[0\].type\[1\] must be a string, not null"),
        ({"type": "error"}, "error needs the property 'error'"),
    ],
)
def test_schema_errors_say_what_is_wrong(obj, error):
    with pytest.raises(mw.SchemaError, match=error):
        mw.decode_message(json.dumps(obj).encode())


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"\xff\xfe{}", "not UTF-8"),
        (b'{"type": "ping"', "not valid JSON"),
        (b"", "not valid JSON"),
        (b'{"type": "init", "client_id": NaN}', "NaN is not valid JSON"),
        (b'{"type": "init", "client_id": "\\ud800"}', "not valid Unicode"),
        (b"[" * 5_000 + b"]" * 5_000, "nested too deeply"),
        (b"[" + b"0," * 200_000 + b"0]", "more than 100000 items"),
    ],
)
def test_bad_json_rejected(body, error):
    with pytest.raises(mw.SchemaError, match=error):
        mw.decode_message(body)


def test_valid_messages_roundtrip():
    messages = [
        mw.Ping(),
        mw.Pong(),
        mw.Init("c", "tok", mw.EventId(1, 2, 3), (("a", "*"), ("b", "?", "c"))),
        mw.Events((
            mw.Event(mw.EventId(1, 2, 3), ("a",), mw.Timestamp(1, 0)),
            mw.Event(mw.EventId(1, 2, 4), ("a", "b"), mw.Timestamp(1, 999999),
                     mw.Timestamp(0, 1), mw.BinaryPayload("", b"\x00\xff")),
            mw.Event(mw.EventId(1, 2, 5), ("a", "ü"), mw.Timestamp(1, 2), None,
                     mw.SbsPayload(None, "T", b"\x01")),
            mw.Event(mw.EventId(1, 2, 6), ("a",), mw.Timestamp(1, 2), None,
                     mw.SbsPayload("M", "T", b"")),
            mw.Event(mw.EventId(1, 2, 7), ("a",), mw.Timestamp(1, 2), None,
                     mw.JsonPayload({"k": [1, 2.5, True, None, "ü"]})),
        )),
        mw.Error("why"),
    ]
    for msg in messages:
        assert mw.decode_message(mw.encode_message(msg)) == msg


def test_unknown_properties_ignored():
    assert mw.decode_message(json.dumps({**INIT, "extra": 1}).encode()) == mw.Init(
        "c", None, None, (("a", "*"),)
    )


def test_events_body_from_preencoded_events():
    events = (
        mw.Event(mw.EventId(1, 2, 3), ("a",), mw.Timestamp(1, 0)),
        mw.Event(mw.EventId(1, 2, 4), ("a", "b"), mw.Timestamp(1, 1), None,
                 mw.JsonPayload("x")),
    )
    body = mw.encode_events_body([mw.encode_event(e) for e in events])
    assert mw.decode_message(body) == mw.Events(events)


# ---- conversation rules -------------------------------------------------------------


def server() -> mw.MarinerConnection:
    return mw.MarinerConnection(mw.SERVER, 1 << 20)


def test_server_accepts_init_then_ping_pong():
    conn = server()
    got = conn.receive_data(frame_json(INIT) + frame_json({"type": "ping"}))
    assert got == [mw.Init("c", None, None, (("a", "*"),)), mw.Ping()]
    assert conn.receive_data(frame_json({"type": "pong"})) == [mw.Pong()]
    assert conn.send(mw.Pong()) == mw.encode_frame(b'{"type":"pong"}')


@pytest.mark.parametrize(
    ("first", "error"),
    [
        ({"type": "ping"}, "the first message must be init, not ping"),
        ({"type": "events", "events": []}, "the first message must be init, not events"),
    ],
)
def test_server_requires_init_first(first, error):
    with pytest.raises(mw.ProtocolError, match=error):
        server().receive_data(frame_json(first))


@pytest.mark.parametrize(
    ("later", "error"),
    [
        (INIT, "init may be sent only once"),
        ({"type": "events", "events": [EVENT]}, "Mariner clients only receive"),
        ({"type": "error", "error": "x"}, "unknown message type 'error'"),
    ],
)
def test_server_rejects_after_init(later, error):
    conn = server()
    conn.receive_data(frame_json(INIT))
    with pytest.raises(mw.ProtocolError, match=error):
        conn.receive_data(frame_json(later))
    # Dead from then on.
    with pytest.raises(mw.ProtocolError, match=error):
        conn.receive_data(frame_json({"type": "ping"}))


def test_protocol_error_wraps_framing_and_schema():
    with pytest.raises(mw.ProtocolError, match="length size m=0"):
        server().receive_data(b"\x00")
    with pytest.raises(mw.ProtocolError, match="invalid Mariner message: message is not valid"):
        server().receive_data(mw.encode_frame(b"{"))


def test_client_rules():
    conn = mw.MarinerConnection(mw.CLIENT, 1 << 20)
    with pytest.raises(mw.LocalProtocolError, match="must send init first"):
        conn.send(mw.Ping())
    conn.send(mw.Init("c"))
    with pytest.raises(mw.LocalProtocolError, match="only once"):
        conn.send(mw.Init("c"))
    with pytest.raises(mw.LocalProtocolError, match="only init, ping and pong"):
        conn.send(mw.Events(()))
    conn.send(mw.Ping())
    got = conn.receive_data(frame_json({"type": "events", "events": [EVENT]})
                            + frame_json({"type": "error", "error": "bye"}))
    assert isinstance(got[0], mw.Events) and got[1] == mw.Error("bye")
    with pytest.raises(mw.ProtocolError, match="a server may not send init"):
        conn.receive_data(frame_json(INIT))


def test_server_may_not_send_init():
    with pytest.raises(mw.LocalProtocolError):
        server().send(mw.Init("c"))


@pytest.mark.parametrize(
    "payload",
    [None, mw.JsonPayload({"a": ["ü", 1.5, None]}), mw.JsonPayload("s"),
     mw.BinaryPayload("", b"\x00\xff"), mw.SbsPayload(None, "T", b"\x01"),
     mw.SbsPayload("M", "T", b"")],
)
@pytest.mark.parametrize("source", [None, mw.Timestamp(3, 4)])
def test_direct_event_text_equals_the_schema_form(payload, source):
    event = mw.Event(mw.EventId(1, 2, 3), ("a", "b\"c"), mw.Timestamp(5, 999999), source, payload)
    text = mw.encode_event(event)
    assert json.loads(text) == mw.event_json(event)
    assert mw.decode_message(mw.encode_events_body([text])) == mw.Events((event,))
