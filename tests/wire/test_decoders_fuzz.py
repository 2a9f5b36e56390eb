"""Every decoder, fed random or mutated input, raises only the RemoteProtocolError family.

Anything else (ValueError, KeyError, RecursionError, UnicodeError, ...) would
be a traceback in the broker's log: the property each test checks.
"""

from __future__ import annotations

import contextlib
import json
import pathlib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.examples import examples
from wire import boundedjson, hsp
from wire.chatter import ChatterConnection, Envelope, sbs
from wire.errors import RemoteProtocolError
from wire.eventer import ClientConnection, InitReq, ServerConnection, Status
from wire.mariner import CLIENT, SERVER, MarinerConnection, encode_frame
from wire.skan import FrameSplitter, decode, decode_header, encode

HERE = pathlib.Path(__file__).parent
HAT = json.loads((HERE / "hat_vectors.json").read_text())["vectors"]
MARINER_BODIES = [v["body_utf8"].encode() for k, v in HAT.items() if k.startswith("mariner_")]

FUZZ = settings(max_examples=examples(300), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@st.composite
def mutated(draw, base: bytes) -> bytes:
    """``base`` with a few bytes replaced, inserted or deleted."""
    raw = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["set", "insert", "delete"]))
        if op == "insert" or not raw:
            raw.insert(draw(st.integers(0, len(raw))), draw(st.integers(0, 255)))
        elif op == "set":
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
        else:
            del raw[draw(st.integers(0, len(raw) - 1))]
    return bytes(raw)


def only_protocol_errors(fn, *args) -> None:
    with contextlib.suppress(RemoteProtocolError):
        fn(*args)


# ---- Skan and HSP -----------------------------------------------------------------


@FUZZ
@given(st.dictionaries(st.text(min_size=1, max_size=8), json_values.filter(
    lambda v: not isinstance(v, bool | float)), max_size=5), st.data())
def test_skan_mutated_messages(message, data):
    try:
        raw = encode(message)
    except Exception:  # values Skan cannot carry (bools in lists, empty tags): not peer input
        return
    bad = data.draw(mutated(raw))
    only_protocol_errors(decode, bad)
    only_protocol_errors(decode_header, bad)
    only_protocol_errors(FrameSplitter(1 << 16).receive_data, len(bad).to_bytes(4, "big") + bad)


@FUZZ
@given(st.binary(max_size=300), st.integers(1, 64))
def test_skan_splitter_random_stream(data, cut):
    splitter = FrameSplitter(1 << 10)
    for i in range(0, len(data), cut):
        try:
            splitter.receive_data(data[i : i + cut])
        except RemoteProtocolError:
            return


@FUZZ
@given(st.data())
def test_hsp_connection_mutated_streams(data):
    events = [hsp.DataAck.make(1, 1, b"x" * 10), hsp.Ping(), hsp.Data.make(7, b"y"),
              hsp.Pong()]
    stream = b"".join(hsp.encode(e) for e in events)
    conn = hsp.HSPConnection(max_payload=64)
    only_protocol_errors(conn.receive_data, data.draw(mutated(stream)))


# ---- Chatter and Eventer -----------------------------------------------------------


C2S = [k for k, v in HAT.items() if v.get("direction") == "c2s" and "frame_hex" in v
       and not k.startswith("mariner")]
C2S_TYPES = ["HatEventer.MsgInitReq", "HatEventer.MsgRegisterReq", "HatEventer.MsgQueryReq",
             "HatEventer.MsgEventsAck", "HatChatter.Ping", "HatChatter.Pong"]
S2C_TYPES = ["HatEventer.MsgInitRes", "HatEventer.MsgEventsNotify", "HatEventer.MsgRegisterRes",
             "HatEventer.MsgQueryRes", "HatEventer.MsgStatusNotify", "HatChatter.Ping"]


@FUZZ
@given(st.sampled_from(C2S), st.data())
def test_chatter_server_mutated_vector_frames(name, data):
    frame = bytes.fromhex(HAT[name]["frame_hex"])
    only_protocol_errors(ChatterConnection().receive_data, data.draw(mutated(frame)))
    only_protocol_errors(ServerConnection().receive_data, data.draw(mutated(frame)))


def opened() -> tuple[ClientConnection, ServerConnection]:
    client = ClientConnection(InitReq("fuzz", subscriptions=(("a", "*"),)))
    server = ServerConnection()
    (req,) = server.receive_data(client.data_to_send())
    server.accept(req.conv, Status.OPERATIONAL)
    client.receive_data(server.data_to_send())
    return client, server


@FUZZ
@given(st.sampled_from(C2S_TYPES), st.binary(max_size=64), st.booleans(), st.booleans())
def test_eventer_server_random_message_data(msg_type, payload, last, token):
    """Well-framed messages of every client type carrying random SBS data and flags."""
    client, server = opened()
    client.chatter.send(msg_type, payload, last=last, token=token)
    only_protocol_errors(server.receive_data, client.data_to_send())


@FUZZ
@given(st.sampled_from(["[1, 2]", '{"a": null}', '"x"', "3.5"]), st.data())
def test_eventer_server_mutated_json_payloads(text, data):
    client, server = opened()
    payload = data.draw(mutated(text.encode())).decode("utf-8", errors="replace")
    events = [{"type": ["a", "b"], "sourceTimestamp": ("none", None),
               "payload": ("value", ("json", payload))}]
    client.chatter.send_value("HatEventer.MsgRegisterReq", events, last=False)
    only_protocol_errors(server.receive_data, client.data_to_send())


@FUZZ
@given(st.sampled_from(S2C_TYPES), st.binary(max_size=64), st.booleans(), st.booleans())
def test_eventer_client_random_message_data(msg_type, payload, last, token):
    client, server = opened()
    server.chatter.send(msg_type, payload, last=last, token=token)
    only_protocol_errors(client.receive_data, server.data_to_send())


@FUZZ
@given(st.binary(max_size=200))
def test_chatter_random_bytes(data):
    only_protocol_errors(ChatterConnection().receive_data, data)
    only_protocol_errors(ChatterConnection(envelope=Envelope.HAT).receive_data, data)


@FUZZ
@given(st.sampled_from(["HatEventer.MsgRegisterReq", "HatEventer.MsgQueryReq",
                        "HatEventer.MsgEventsNotify", "HatEventer.Event", "HatChatter.Msg",
                        "Hat.Msg"]), st.binary(max_size=100))
def test_sbs_random_bytes(name, data):
    only_protocol_errors(sbs.decode, name, data)


# ---- Mariner and JSON ---------------------------------------------------------------


@FUZZ
@given(st.sampled_from(MARINER_BODIES), st.data())
def test_mariner_mutated_vector_bodies(body, data):
    bad = data.draw(mutated(body))
    for role in (SERVER, CLIENT):
        conn = MarinerConnection(role, 1 << 16)
        conn.initialised = True
        only_protocol_errors(conn.receive_data, encode_frame(bad))
    only_protocol_errors(MarinerConnection(SERVER, 1 << 16).receive_data, encode_frame(bad))


@FUZZ
@given(json_values, st.sampled_from(["init", "events", "ping", "error"]))
def test_mariner_random_values_in_message_shapes(value, mtype):
    for body in (
        {"type": mtype, "client_id": value, "client_token": None, "last_event_id": value,
         "subscriptions": value},
        {"type": mtype, "events": [{"id": value, "type": ["a"], "timestamp": value,
                                    "source_timestamp": None, "payload": value}]},
        {"type": mtype, "events": value, "error": value},
    ):
        text = json.dumps(body).encode()
        for role in (SERVER, CLIENT):
            conn = MarinerConnection(role, 1 << 16)
            conn.initialised = mtype != "init"
            only_protocol_errors(conn.receive_data, encode_frame(text))


@FUZZ
@given(st.one_of(st.text(max_size=200), json_values.map(json.dumps)), st.data())
def test_bounded_json_random_and_mutated_text(text, data):
    only_protocol_errors(boundedjson.loads, text)
    only_protocol_errors(boundedjson.loads, data.draw(mutated(text.encode())))
