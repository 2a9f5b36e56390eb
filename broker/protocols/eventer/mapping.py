"""Eventer's own part of the event mapping: routed messages as HatEventer.Event bytes.

broker/core/events.py maps a routed message to the shared Hat event
(wire/hat.py) and the Eventer codec (wire/eventer) encodes it; this module
adds only the notify hot path, which goes from a routed message straight to
the same bytes.  Shared by the Eventer listener and queries.
"""

from __future__ import annotations

from json.encoder import encode_basestring  # type: ignore[attr-defined]

from broker.core import events
from broker.core.bounded import BoundedCache
from broker.core.router import Routed
from wire import eventer as w
from wire.chatter.sbs import encode_integer
from wire.hattime import split_timestamp


def encode_routed(routed: Routed, server_id: int) -> bytes:
    """The ``HatEventer.Event`` encoding of one routed message (the reference path)."""
    return w.encode_event(events.event_from_routed(routed, server_id))


# ---- the hot path: a routed message straight to its HatEventer.Event bytes ----------
#
# Equal, byte for byte, to ``encode_routed`` (tests/protocols/eventer/test_mapping.py
# checks it), without building the intermediate objects: every Eventer
# subscriber's notification pays this once per routed message.

_NONE = b"\x80"  # Optional none / Choice index 0
_VALUE = b"\x81"  # Optional value / Choice index 1
_JSON = b"\x81"  # EventPayload.json (Choice index 1)
_BINARY = b"\x80"  # EventPayload.binary (Choice index 0)
# Cached encodings: type arrays per (group, instance), id prefixes per session.
_TYPE_CACHE_LIMIT = 10_000
_type_cache: BoundedCache[tuple[bytes, bytes], bytes] = BoundedCache(_TYPE_CACHE_LIMIT)
_prefix: list = [None, None, b""]  # server, session, encoded server+session
_second: list = [None, b""]  # whole seconds, encoded
_SMALL = [encode_integer(i) for i in range(4096)]


def _int(value: int) -> bytes:
    return _SMALL[value] if 0 <= value < 4096 else encode_integer(value)


def _string(raw: bytes) -> bytes:
    return _int(len(raw)) + raw


def _type_bytes(group: bytes, instance: bytes) -> bytes:
    key = (group, instance)
    cached = _type_cache.get(key)
    if cached is None:
        etype = events.hat_event_type(group, instance)
        cached = _type_cache.put(
            key, _int(len(etype)) + b"".join(_string(seg.encode()) for seg in etype))
    return cached


def _timestamp(t: float) -> bytes:
    s, us = split_timestamp(t)
    if s != _second[0]:
        _second[0] = s
        _second[1] = encode_integer(s)
    if us < 4096:
        return _second[1] + _SMALL[us]
    if us < 8192:  # two 7-bit groups, the first below 64 (sign bit clear)
        return _second[1] + bytes((us >> 7, 0x80 | (us & 0x7F)))
    # 8192 <= us < 2**20: three 7-bit groups
    return _second[1] + bytes((us >> 14, (us >> 7) & 0x7F, 0x80 | (us & 0x7F)))


def fast_encode_routed(routed: Routed, server_id: int) -> bytes:
    """``encode_routed`` for the common shapes, falling back to it for the rest."""
    header = routed.header
    msg = header[b"msg"]
    if (type(msg) is not bytes or events.PAYLOAD_TYPE_TAG in header
            or events.SOURCE_TIMESTAMP_TAG in header or events.PAYLOAD_JSON_TAG in header):
        if (msg is not None or events.SOURCE_TIMESTAMP_TAG in header
                or events.PAYLOAD_JSON_TAG in header):
            return encode_routed(routed, server_id)
        payload = _NONE
    else:
        try:
            text = msg.decode("utf-8")
        except UnicodeDecodeError:
            return encode_routed(routed, server_id)
        # encode_basestring is what json.dumps(text, ensure_ascii=False) uses.
        payload = _VALUE + _JSON + _string(encode_basestring(text).encode())
    server_id = routed.server or server_id  # a cluster message keeps its origin's EventId
    if _prefix[0] != server_id or _prefix[1] != routed.session:
        _prefix[0] = server_id
        _prefix[1] = routed.session
        _prefix[2] = encode_integer(server_id) + encode_integer(routed.session)
    return b"".join((
        _prefix[2], _int(routed.instance),
        _type_bytes(header[b"group"], header[b"instance"]),
        _timestamp(routed.timestamp), _NONE, payload,
    ))
