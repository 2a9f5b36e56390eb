"""The one mapping between routed Skan messages and Hat events (Eventer and Mariner).

BROKER-SPEC section 3:
- (group G, instance I) <-> event type ``(G, *I.split("/"))``; instance "*" <-> ``(G,)``.
- ``msg`` <-> payload: HASH<->object, LIST<->array, NULL<->null, DATA<->string
  (UTF-8); numbers and bools become DATA decimal / "true" / "false".
- A binary payload travels as ``msg`` DATA with its type name in the routing
  tag ``payload-type``; DATA that is not UTF-8 becomes a binary payload.
- EventId = (server_id, session, instance) and one timestamp per routed
  message, assigned by the router, identical on every protocol.
- An event's source timestamp travels in the routing tag ``source-timestamp``
  as decimal seconds with six decimals ("1700000000.250000"), read back
  exactly (to the microsecond, not through a float); a message without it
  (or with a value that is not such a number) has none.
- Payload fidelity: a JSON payload whose Skan view is lossy (numbers,
  booleans, a JSON ``null`` payload, keys that cannot be tags) also travels
  exactly in the routing tag ``payload-json`` (:mod:`wire.skan.eventjson`);
  Hat consumers take the payload from that tag when present (a tag that is
  not valid JSON within the limits is ignored: the Skan view is used), Skan
  subscribers read ``msg``.

The event model itself (Event, EventId, Timestamp, payloads) is the one in
:mod:`wire.hat`, which the Eventer and Mariner codecs encode; this module
only maps between it and routed Skan messages.  Pure: no trio, no protocol
encoding.
"""

from __future__ import annotations

import math
import re
from typing import Any

from broker.core.inject import Injected, build_send
from broker.core.router import Routed
from broker.core.router import event_type as router_event_type
from wire import hat
from wire.errors import ProtocolError
from wire.hat import BinaryPayload, EventType, JsonPayload, Payload
from wire.skan import Nested, item_bytes
from wire.skan.eventjson import PAYLOAD_JSON_TAG, loads_exact, skan_view
from wire.skan.jsonvalue import JsonValueError
from wire.skan.jsonvalue import json_to_skan as _json_to_skan

PAYLOAD_TYPE_TAG = b"payload-type"
SOURCE_TIMESTAMP_TAG = b"source-timestamp"
# Type name of a binary payload made from a msg that is not JSON-representable
# as a whole (non-UTF-8 DATA nested in a HASH/LIST): the data is the Skan
# item encoding of ``msg``.
SKAN_ITEM_TYPE = "skan-item"


class MappingError(ValueError):
    """An event cannot be expressed as a Skan message (or the reverse)."""


# ---- types ----------------------------------------------------------------


def event_type(group: bytes, instance: bytes) -> EventType:
    """The Hat event type of (group, instance): the router's rule, as text."""
    return tuple(
        seg.decode("utf-8", errors="replace") for seg in router_event_type(group, instance)
    )


def group_instance(etype: EventType | list[str]) -> tuple[str, str]:
    """Event type -> (group, instance); ``(G,)`` -> (G, "*")."""
    if not etype or not etype[0]:
        raise MappingError("an event type needs at least a non-empty first segment (the group)")
    if len(etype) == 1:
        return etype[0], "*"
    return etype[0], "/".join(etype[1:])


def pattern_bytes(pattern: EventType | list[str]) -> tuple[bytes, ...]:
    """A Hat event-type pattern as the router's subscription pattern."""
    return tuple(seg.encode() for seg in pattern)


# ---- payloads -------------------------------------------------------------


class _NotText(Exception):
    pass


def _skan_to_json(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise _NotText from None
    if isinstance(value, list):
        return [_skan_to_json(v) for v in value]
    result = {}
    for k, v in value.items():
        try:
            key = k.decode("utf-8")
        except UnicodeDecodeError:
            raise _NotText from None
        result[key] = _skan_to_json(v)
    return result


def payload_from_routed(routed: Routed) -> Payload:
    """The event payload of a routed message: its ``payload-json`` tag, else its ``msg``."""
    header = routed.header
    exact = header.get(PAYLOAD_JSON_TAG)
    if type(exact) is bytes:
        try:
            return JsonPayload(loads_exact(exact))
        except ProtocolError:
            pass  # validated where it entered; if not (a foreign cluster peer), the Skan view
    msg = header.get(b"msg")
    ptype = header.get(PAYLOAD_TYPE_TAG)
    if isinstance(msg, bytes):
        if isinstance(ptype, bytes):
            return BinaryPayload(ptype.decode("utf-8", errors="replace"), msg)
        try:
            return JsonPayload(msg.decode("utf-8"))
        except UnicodeDecodeError:
            return BinaryPayload("", msg)
    if msg is None:
        return None
    value = item_bytes(routed.frame, header, b"msg")
    try:
        return JsonPayload(_skan_to_json(value))
    except _NotText:
        assert isinstance(msg, Nested)
        start = msg.start - (5 if msg.stop - msg.start > 0xFFFF else 3)
        return BinaryPayload(SKAN_ITEM_TYPE, _raw_item(routed.frame, msg, start))


def _raw_item(frame: bytes, nested: Nested, guess: int) -> bytes:
    # The TyLen sits 2, 3 or 5 bytes before the body depending on the length
    # code the sender chose; find the one that describes exactly this body.
    n = nested.stop - nested.start
    for width, code in ((1, 0x20), (2, 0x10), (4, 0x00)):
        pos = nested.start - 1 - width
        if pos >= 0 and frame[pos] == (nested.type | code) and int.from_bytes(
            frame[pos + 1 : nested.start], "big"
        ) == n:
            return frame[pos : nested.stop]
    return frame[guess : nested.stop]


def json_to_skan(value: Any, path: str = "payload") -> Any:
    """JSON value -> Skan value (the rule lives in :mod:`wire.skan.jsonvalue`)."""
    try:
        return _json_to_skan(value, path)
    except JsonValueError as exc:
        raise MappingError(str(exc)) from None


# ---- both directions ------------------------------------------------------


def format_timestamp(t: hat.Timestamp | float) -> bytes:
    """Decimal seconds with six decimals, as the ``source-timestamp`` tag holds them.

    ``t`` is a Hat timestamp (exact) or float seconds (rounded to the microsecond).
    """
    us = t.s * 1_000_000 + t.us if isinstance(t, hat.Timestamp) else round(t * 1_000_000)
    sign = "-" if us < 0 else ""
    s, frac = divmod(abs(us), 1_000_000)
    return f"{sign}{s}.{frac:06d}".encode()


# The form format_timestamp writes: optional sign, whole seconds, six decimals.
_EXACT_TIMESTAMP = re.compile(rb"(-?)([0-9]{1,18})\.([0-9]{6})")


def source_timestamp_exact(header: dict[bytes, Any]) -> hat.Timestamp | None:
    """The ``source-timestamp`` tag as a Hat timestamp, to the microsecond.

    The tag's own form (``format_timestamp``) is read without a float in
    between, so what a Hat client registered comes back exactly; any other
    decimal number is read as float seconds (rounded to the microsecond).
    """
    raw = header.get(SOURCE_TIMESTAMP_TAG)
    if type(raw) is not bytes:
        return None
    m = _EXACT_TIMESTAMP.fullmatch(raw)
    if m is None:
        value = source_timestamp(header)
        return None if value is None else hat.Timestamp.from_float(value)
    us = int(m[2]) * 1_000_000 + int(m[3])
    s, us = divmod(-us if m[1] else us, 1_000_000)
    return hat.Timestamp(s, us)


def source_timestamp(header: dict[bytes, Any]) -> float | None:
    """The ``source-timestamp`` tag of a routing header as float seconds, or None."""
    raw = header.get(SOURCE_TIMESTAMP_TAG)
    if type(raw) is not bytes:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def event_from_routed(routed: Routed, server_id: int) -> hat.Event:
    header = routed.header
    return hat.Event(
        # A message from the cluster backplane keeps its origin's EventId.
        id=hat.EventId(routed.server or server_id, routed.session, routed.instance),
        type=event_type(header[b"group"], header[b"instance"]),
        timestamp=hat.Timestamp.from_float(routed.timestamp),
        source_timestamp=source_timestamp_exact(header),
        payload=payload_from_routed(routed),
    )


def send_for_event(
    etype: EventType | list[str],
    payload: Payload,
    *,
    sender: bytes,
    seq: int,
    source_timestamp: hat.Timestamp | float | None = None,
) -> Injected:
    """The Skan ``send`` an adapter routes for an incoming event (frame and header).

    ``to`` is "*" and ``from`` is the lname of the connection (or bridge)
    the event came in on (see :func:`broker.core.inject.build_send`).  An
    SBS payload (Mariner) is routed as its binary form (:mod:`wire.hat`).
    ``source_timestamp`` is the event's (a float, in seconds, is accepted for
    messages the broker makes itself).
    """
    group, instance = group_instance(tuple(etype))
    tags: dict[bytes, Any] = {}
    if isinstance(payload, hat.SbsPayload):
        payload = payload.to_binary()
    if isinstance(payload, BinaryPayload):
        tags[PAYLOAD_TYPE_TAG] = payload.type.encode("utf-8")
        msg: Any = payload.data
    elif isinstance(payload, JsonPayload):
        # The Skan view in msg, and the exact JSON beside it when the view is lossy.
        try:
            msg, exact = skan_view(payload.data)
        except JsonValueError as exc:
            raise MappingError(str(exc)) from None
        if exact is not None:
            tags[PAYLOAD_JSON_TAG] = exact
    else:
        msg = None
    if source_timestamp is not None:
        tags[SOURCE_TIMESTAMP_TAG] = format_timestamp(source_timestamp)
    return build_send(sender, group.encode("utf-8"), instance.encode("utf-8"), seq, msg, tags)
