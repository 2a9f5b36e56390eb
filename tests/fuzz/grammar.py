"""Grammar-aware input for the fuzz suite: valid-shaped messages of every protocol,
then mutated.

Each ``*_streams()`` strategy draws a byte string a peer could send on one
connection: a sequence of well-formed messages of that protocol (built with
the project's own encoders, so they get past framing and into the message
handlers), hostile shapes the hardening issue found (deep nesting, huge
integers, lone surrogates, many items, oversized lengths), and random
mutations (flipped, inserted, deleted and truncated bytes) of all of these.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from wire import hsp
from wire import mariner as mw
from wire.eventer import (
    BinaryPayload,
    ClientConnection,
    InitReq,
    JsonPayload,
    QueryLatestParams,
    QueryServerParams,
    RegisterEvent,
    Timestamp,
)
from wire.skan import encode as skan_encode
from wire.skan import encode_frame as skan_frame

# ---- shared pieces -------------------------------------------------------------

# Short byte strings from a small alphabet collide often (same group, same
# tag), which reaches more branches than uniformly random bytes.
small_bytes = st.one_of(
    st.sampled_from([b"", b"*", b"g", b"i", b"normal", b"meonly", b"promisc", b"0", b"-1",
                     b"\xff\xfe", b"\xed\xa0\x80", b"a/b", b"9" * 40]),
    st.binary(max_size=12),
)
text = st.one_of(
    st.sampled_from(["", "*", "?", "g", "a/b", "\ud800", "é", "9" * 5000]),
    st.text(max_size=10),
)


def _deep(depth: int, open_: str, close: str, inner: str = "0") -> str:
    return open_ * depth + inner + close * depth


# Hostile JSON texts: deep nesting, huge integers and floats, lone surrogates,
# very many items.
hostile_json = st.sampled_from([
    _deep(5000, "[", "]"),
    _deep(3000, '{"a":', "}"),
    "9" * 10_000,
    "1e999999",
    "-" + "1" * 4301,
    '"\\ud800"',
    '"\\udfff\\ud800"',
    "[" + ",".join(["null"] * 20000) + "]",
    '{"' + 'a' * 300 + '": 1}',
    "NaN",
    "[1, 2",
    "\x00",
])

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
              text),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(text, children, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def mutated(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` with a few random edits (or unchanged)."""
    buf = bytearray(data)
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "dup", "big"]))
        pos = draw(st.integers(0, len(buf))) if buf else 0
        if op == "flip" and buf:
            i = min(pos, len(buf) - 1)
            buf[i] = draw(st.integers(0, 255))
        elif op == "insert":
            buf[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and buf:
            del buf[pos : pos + draw(st.integers(1, 8))]
        elif op == "truncate":
            del buf[pos:]
        elif op == "dup" and buf:
            buf[pos:pos] = buf[max(0, pos - 16) : pos]
        elif op == "big":
            buf[pos:pos] = draw(st.sampled_from(
                [b"\xff\xff\xff\xff", b"\x7f\xff\xff\xff", b"\x00\x00\x00\x00", b"\x80"]))
    return bytes(buf)


def _streams(messages: st.SearchStrategy[list[bytes]]) -> st.SearchStrategy[bytes]:
    return messages.map(b"".join).flatmap(
        lambda data: st.one_of(st.just(data), mutated(data))
    )


# ---- Skan ----------------------------------------------------------------------

skan_values = st.recursive(
    st.one_of(st.none(), small_bytes),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.binary(min_size=1, max_size=6), children, max_size=4),
    ),
    max_leaves=10,
)

SKAN_TYPES = [b"getlname", b"subscribe", b"unsubscribe", b"send", b"stats", b"bogus"]
SKAN_FIELDS = [b"group", b"instance", b"to", b"from", b"seq", b"msg", b"subtype", b"repl",
               b"reply", b"payload-type", b"source-timestamp"]


@st.composite
def skan_messages(draw: st.DrawFn) -> dict[bytes, Any]:
    msg: dict[bytes, Any] = {}
    if draw(st.booleans()) or True:
        msg[b"type"] = draw(st.one_of(st.sampled_from(SKAN_TYPES), skan_values))
    for field in draw(st.lists(st.sampled_from(SKAN_FIELDS), max_size=8, unique=True)):
        msg[field] = draw(skan_values)
    return msg


def _skan_frame(msg: dict[bytes, Any]) -> bytes:
    return skan_frame(msg)


# A frame of very many items (the 8M-NULL attack, scaled down) and hostile raw frames.
HOSTILE_SKAN = [
    skan_frame({b"type": b"send", b"msg": [None] * 100_000}),
    b"\x00\x00\x00\x08Skan\x03\x00\x00\x00",
    b"\xff\xff\xff\xffSkan",
    b"\x00\x00\x00\x04Skan",
    b"\x00\x00\x00\x06Skan\x02\x00" + b"\x04" * 4,
    b"\x00\x00\x00\x05Skan\x44",
]

skan_streams = _streams(st.lists(
    st.one_of(
        skan_messages().map(_skan_frame),
        st.sampled_from(HOSTILE_SKAN),
        st.binary(max_size=40),
    ),
    max_size=6,
).map(lambda frames: [skan_frame({b"type": b"getlname"}), *frames]))


# ---- HSP -----------------------------------------------------------------------


def _skan_payload(msg: dict[bytes, Any]) -> bytes:
    return skan_encode(msg)


hsp_payloads = st.one_of(
    skan_messages().map(_skan_payload),
    st.binary(max_size=40),
)
hsp_types = st.one_of(st.just(1), st.integers(0, 255))
message_ids = st.integers(0, 0xFFFFFFFF)

hsp_commands = st.one_of(
    st.builds(hsp.Data.make, hsp_types, hsp_payloads),
    st.builds(hsp.DataAck.make, message_ids, hsp_types, hsp_payloads),
    st.builds(hsp.Ack, message_ids),
    st.just(hsp.Ping()),
    st.just(hsp.Pong()),
    st.builds(hsp.Error, message_ids, st.integers(0, 255), st.binary(max_size=10)),
    st.builds(hsp.ErrorUndef, message_ids),
).map(hsp.encode)

hsp_streams = _streams(st.lists(
    st.one_of(hsp_commands, st.binary(max_size=20),
              st.just(b"\x04\x00\x00\x00\x01\x01\xff\xff\xff\xff")),
    max_size=6,
).map(lambda cmds: [hsp.encode(hsp.DataAck.make(1, 1, skan_encode({b"type": b"getlname"}))),
                    *cmds]))


# ---- Chatter / Eventer (SBS) ---------------------------------------------------

event_types = st.lists(text, min_size=0, max_size=4).map(tuple)


@st.composite
def payloads(draw: st.DrawFn) -> Any:
    kind = draw(st.sampled_from(["none", "json", "hostile", "binary"]))
    if kind == "none":
        return None
    if kind == "binary":
        return BinaryPayload(draw(text), draw(st.binary(max_size=30)))
    if kind == "hostile":
        # JsonPayload holds a parsed value; a hostile text goes in as a string
        # the broker must re-parse (and the SBS field is JSON text).
        return JsonPayload(draw(hostile_json))
    return JsonPayload(draw(json_values))


@st.composite
def eventer_streams(draw: st.DrawFn) -> bytes:
    subs = draw(st.lists(event_types, max_size=4))
    try:
        conn = ClientConnection(InitReq(draw(text), None, tuple(subs), None, False),
                                max_message=1 << 24)
        out = [conn.data_to_send()]
    except Exception:
        # Not encodable (a surrogate in a name): an init that is.
        conn = ClientConnection(InitReq("fuzz", None, (), None, False), max_message=1 << 24)
        out = [conn.data_to_send()]
    for _ in range(draw(st.integers(0, 4))):
        what = draw(st.sampled_from(["register", "hostile", "query", "ping", "raw"]))
        try:
            if what == "hostile":
                # A JSON payload whose text is hostile (the client encoder
                # would never produce it): deep nesting, huge numbers, ...
                conn.chatter.send_value("HatEventer.MsgRegisterReq", [{
                    "type": list(draw(event_types)),
                    "sourceTimestamp": ("none", None),
                    "payload": ("value", ("json", draw(hostile_json))),
                }], last=False, now=0.0)
            elif what == "register":
                conn.register([RegisterEvent(draw(event_types),
                                             draw(st.none() | st.builds(
                                                 Timestamp, st.integers(-2**63, 2**63 - 1),
                                                 st.integers(0, 2**32 - 1))),
                                             draw(payloads()))
                               for _ in range(draw(st.integers(0, 3)))],
                              with_response=draw(st.booleans()))
            elif what == "query":
                conn.query(draw(st.sampled_from([
                    QueryLatestParams((("*",),)),
                    QueryServerParams(1, max_results=draw(st.integers(0, 2**31))),
                ])))
            elif what == "ping":
                conn.ping(0.0)
            else:
                out.append(draw(st.binary(max_size=20)))
        except Exception:
            # The client-side encoder refused the value (e.g. a surrogate):
            # nothing to send for it.
            continue
        out.append(conn.data_to_send())
    return draw(mutated(b"".join(out)) | st.just(b"".join(out)))


# ---- Mariner (JSON) ------------------------------------------------------------

mariner_objects = st.one_of(
    st.fixed_dictionaries({
        "type": st.just("init"),
        "client_id": st.one_of(text, json_values),
        "client_token": st.one_of(st.none(), text),
        "last_event_id": st.one_of(st.none(), json_values, st.fixed_dictionaries({
            "server": st.integers(), "session": st.integers(), "instance": st.integers()})),
        "subscriptions": st.one_of(st.lists(st.lists(text, max_size=3), max_size=3),
                                   json_values),
    }),
    st.sampled_from([{"type": "ping"}, {"type": "pong"}, {"type": "events", "events": []}]),
    st.dictionaries(text, json_values, max_size=4),
).map(lambda obj: json.dumps(obj).encode("utf-8", "surrogatepass"))

mariner_messages = st.one_of(
    mariner_objects,
    hostile_json.map(lambda t: t.encode("utf-8", "surrogatepass")),
    # Hostile values inside an otherwise valid message.
    hostile_json.map(lambda t: (
        '{"type": "init", "client_id": "x", "client_token": null, "last_event_id": ' + t
        + ', "subscriptions": [["a", ' + t + ']]}').encode("utf-8", "surrogatepass")),
    st.binary(max_size=30),
).map(mw.encode_frame)

mariner_streams = _streams(st.lists(
    st.one_of(mariner_messages, st.binary(max_size=12),
              st.just(b"\x09" + b"\xff" * 9)),
    max_size=5,
))


# ---- HTTP (metrics listener) ---------------------------------------------------

http_methods = st.sampled_from([b"GET", b"HEAD", b"POST", b"get", b"G\x00T", b""])
http_paths = st.sampled_from([b"/metrics", b"/healthz", b"/", b"/nope", b"*", b"/%ff",
                              b"/" + b"a" * 9000])
http_versions = st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1x", b""])
http_headers = st.lists(st.one_of(
    st.sampled_from([b"Host: x", b"Connection: close", b"Connection: keep-alive",
                     b"Content-Length: 5", b"Content-Length: " + b"9" * 10_000,
                     b"Content-Length: -1", b"Transfer-Encoding: chunked", b"X: \xff",
                     b"NoColon", b" folded: x", b"Content-Length: 1, 2"]),
    st.binary(max_size=20),
), max_size=6)


@st.composite
def http_requests(draw: st.DrawFn) -> bytes:
    eol = draw(st.sampled_from([b"\r\n", b"\n"]))
    line = b" ".join([draw(http_methods), draw(http_paths), draw(http_versions)])
    head = eol.join([line, *draw(http_headers)]) + eol + eol
    return head + draw(st.binary(max_size=8))


http_streams = _streams(st.lists(http_requests(), min_size=1, max_size=3))


STREAMS = {
    "skan": skan_streams,
    "hsp": hsp_streams,
    "eventer": eventer_streams(),
    "mariner": mariner_streams,
    "metrics": http_streams,
}
