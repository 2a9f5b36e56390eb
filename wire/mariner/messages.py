"""Mariner messages: attrs types, a small explicit schema validator, JSON encoding.

Events, ids, timestamps and payloads are the shared Hat event model
(:mod:`wire.hat`); a binary payload's type name does not travel on Mariner
(decoded as ``""``, dropped when encoding).

The schema is ``hat-event://mariner.yaml#`` (specs/mariner.txt): ping, pong,
init and events.  :func:`decode_message` turns one message body (UTF-8 JSON)
into a typed message or raises :class:`SchemaError` naming the field and
what is wrong with it (``init.last_event_id.session must be an integer, not
string``).  Properties the schema does not name are ignored, as a JSON
Schema validator would.

``error`` is a broker extension outside the schema: ``{"type": "error",
"error": REASON}``, sent by the broker only immediately before it closes a
connection, so a peer that does not know it loses nothing.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import attrs

from wire import boundedjson
from wire.errors import MalformedError
from wire.hat import (
    BinaryPayload,
    Event,
    EventId,
    EventType,
    JsonPayload,
    Payload,
    SbsPayload,
    Timestamp,
)
from wire.keepalive import Ping, Pong
from wire.limits import ENVELOPE_DEPTH, MAX_DEPTH, MAX_ITEMS, MAX_PAYLOAD_ITEMS, ItemBudget

# A message body that is not a valid Mariner message; the reason says why
# (one class, see wire.errors).
SchemaError = MalformedError


@attrs.frozen
class Init:
    client_id: str
    client_token: str | None = None
    last_event_id: EventId | None = None
    subscriptions: tuple[EventType, ...] = ()


@attrs.frozen
class Events:
    events: tuple[Event, ...]


@attrs.frozen
class Error:
    """Broker extension: why the broker is about to close the connection."""

    error: str


Message = Ping | Pong | Init | Events | Error


# ---- decoding and validation ------------------------------------------------


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _field(obj: dict[str, Any], key: str, path: str, hint: str = "") -> Any:
    if key not in obj:
        raise SchemaError(f"{path} needs the property '{key}'{hint}")
    return obj[key]


def _object(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SchemaError(f"{path} must be an object, not {_kind(value)}")
    return value


def _string(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise SchemaError(f"{path} must be a string, not {_kind(value)}")
    try:
        # JSON escapes can spell lone surrogates ("\ud800"), which no UTF-8 can carry.
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise SchemaError(f"{path} is not valid Unicode (a lone surrogate)") from None
    return value


def _integer(value: Any, path: str) -> int:
    # JSON true/false are Python ints; the schema's integer excludes them.
    if not isinstance(value, int) or isinstance(value, bool):
        raise SchemaError(f"{path} must be an integer, not {_kind(value)}")
    return value


def _array(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise SchemaError(f"{path} must be an array, not {_kind(value)}")
    return value


def _base64(value: Any, path: str) -> bytes:
    text = _string(value, path)
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (UnicodeEncodeError, binascii.Error):
        raise SchemaError(f"{path} must be base64 text") from None


def decode_event_id(value: Any, path: str) -> EventId:
    obj = _object(value, path)
    return EventId(
        _integer(_field(obj, "server", path), f"{path}.server"),
        _integer(_field(obj, "session", path), f"{path}.session"),
        _integer(_field(obj, "instance", path), f"{path}.instance"),
    )


def decode_event_type(value: Any, path: str) -> EventType:
    return tuple(_string(seg, f"{path}[{i}]") for i, seg in enumerate(_array(value, path)))


def decode_timestamp(value: Any, path: str) -> Timestamp:
    obj = _object(value, path)
    s = _integer(_field(obj, "s", path), f"{path}.s")
    us = _integer(_field(obj, "us", path), f"{path}.us")
    if not 0 <= us < 1_000_000:
        raise SchemaError(f"{path}.us must be from 0 to 999999, not {us}")
    return Timestamp(s, us)


def decode_payload(value: Any, path: str) -> Payload:
    if value is None:
        return None
    obj = _object(value, path)
    ptype = _string(_field(obj, "type", path), f"{path}.type")
    data = _field(obj, "data", path)
    if ptype == "json":
        # The message was parsed whole within its own limits; the payload
        # alone must also fit a Skan message (what a bridge builds from it).
        boundedjson.check_value(data, MAX_PAYLOAD_ITEMS, MAX_DEPTH, f"{path}.data")
        return JsonPayload(data)
    if ptype == "binary":
        # Mariner binary payloads carry no type name.
        return BinaryPayload("", _base64(data, f"{path}.data"))
    if ptype == "sbs":
        sbs = _object(data, f"{path}.data")
        module = _field(sbs, "module", f"{path}.data", " (null is allowed)")
        if module is not None:
            _string(module, f"{path}.data.module")
        return SbsPayload(
            module,
            _string(_field(sbs, "type", f"{path}.data"), f"{path}.data.type"),
            _base64(_field(sbs, "data", f"{path}.data"), f"{path}.data.data"),
        )
    raise SchemaError(f"{path}.type must be 'json', 'binary' or 'sbs', not {ptype!r}")


def decode_event(value: Any, path: str) -> Event:
    obj = _object(value, path)
    # Checked in the schema's order, so the first fault is the one reported.
    eid = decode_event_id(_field(obj, "id", path), f"{path}.id")
    etype = decode_event_type(_field(obj, "type", path), f"{path}.type")
    timestamp = decode_timestamp(_field(obj, "timestamp", path), f"{path}.timestamp")
    source = _field(obj, "source_timestamp", path, " (null is allowed)")
    return Event(
        id=eid,
        type=etype,
        timestamp=timestamp,
        source_timestamp=(
            None if source is None else decode_timestamp(source, f"{path}.source_timestamp")
        ),
        payload=decode_payload(
            _field(obj, "payload", path, " (null is allowed)"), f"{path}.payload"
        ),
    )


def _decode_init(obj: dict[str, Any]) -> Init:
    client_id = _string(_field(obj, "client_id", "init"), "init.client_id")
    token = _field(obj, "client_token", "init", " (null is allowed)")
    if token is not None:
        _string(token, "init.client_token")
    last = _field(obj, "last_event_id", "init", " (null is allowed)")
    subs = _array(_field(obj, "subscriptions", "init"), "init.subscriptions")
    return Init(
        client_id=client_id,
        client_token=token,
        last_event_id=None if last is None else decode_event_id(last, "init.last_event_id"),
        subscriptions=tuple(
            decode_event_type(s, f"init.subscriptions[{i}]") for i, s in enumerate(subs)
        ),
    )


def _decode_events(obj: dict[str, Any]) -> Events:
    items = _array(_field(obj, "events", "events"), "events.events")
    return Events(tuple(decode_event(e, f"events.events[{i}]") for i, e in enumerate(items)))


def parse_json(body: bytes, max_items: int = MAX_ITEMS) -> Any:
    """Strict UTF-8 JSON (no NaN/Infinity) within the decoder limits, with readable errors.

    A payload may nest MAX_DEPTH levels below the message's own envelope.
    """
    return boundedjson.loads(
        body, what="message", budget=ItemBudget(max_items), max_depth=MAX_DEPTH + ENVELOPE_DEPTH
    )


def decode_message(body: bytes, max_items: int = MAX_ITEMS) -> Message:
    """One message body -> a typed message; :class:`SchemaError` when invalid.

    ``max_items`` bounds the JSON values of the whole message.
    """
    obj = parse_json(body, max_items)
    if not isinstance(obj, dict):
        raise SchemaError(f"a message must be a JSON object, not {_kind(obj)}")
    mtype = _field(obj, "type", "message")
    if not isinstance(mtype, str):
        raise SchemaError(f"message.type must be a string, not {_kind(mtype)}")
    if mtype == "ping":
        return Ping()
    if mtype == "pong":
        return Pong()
    if mtype == "init":
        return _decode_init(obj)
    if mtype == "events":
        return _decode_events(obj)
    if mtype == "error":
        return Error(_string(_field(obj, "error", "error"), "error.error"))
    raise SchemaError(
        f"unknown message type {mtype!r} (expected ping, pong, init or events)"
    )


# ---- encoding ----------------------------------------------------------------


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def event_id_json(eid: EventId) -> dict[str, int]:
    return {"server": eid.server, "session": eid.session, "instance": eid.instance}


def _timestamp_json(ts: Timestamp | None) -> dict[str, int] | None:
    return None if ts is None else {"s": ts.s, "us": ts.us}


def _payload_json(payload: Payload) -> dict[str, Any] | None:
    if payload is None:
        return None
    if isinstance(payload, JsonPayload):
        return {"type": "json", "data": payload.data}
    if isinstance(payload, BinaryPayload):
        return {"type": "binary", "data": base64.b64encode(payload.data).decode("ascii")}
    return {
        "type": "sbs",
        "data": {
            "module": payload.module,
            "type": payload.type,
            "data": base64.b64encode(payload.data).decode("ascii"),
        },
    }


def event_json(event: Event) -> dict[str, Any]:
    return {
        "id": event_id_json(event.id),
        "type": list(event.type),
        "timestamp": _timestamp_json(event.timestamp),
        "source_timestamp": _timestamp_json(event.source_timestamp),
        "payload": _payload_json(event.payload),
    }


def encode_event(event: Event) -> str:
    """One event as JSON text, for :func:`encode_events_body` (lets a server encode once)."""
    eid = event.id
    return encode_event_fields(
        eid.server, eid.session, eid.instance, _dumps(list(event.type)),
        event.timestamp.s, event.timestamp.us, event.source_timestamp, event.payload,
    )


def encode_event_fields(
    server: int,
    session: int,
    instance: int,
    type_json: str,
    s: int,
    us: int,
    source_timestamp: Timestamp | None,
    payload: Payload,
) -> str:
    """An event's JSON text from its parts (``type_json``: the event type already as JSON).

    Builds the text directly: a server encodes every routed message once per
    Mariner delivery batch, and going through dicts and a full ``json.dumps``
    costs about twice as much.
    """
    if payload is None:
        payload_text = "null"
    elif isinstance(payload, JsonPayload):
        payload_text = '{"type":"json","data":' + _dumps(payload.data) + "}"
    else:
        payload_text = _dumps(_payload_json(payload))
    source = (
        "null" if source_timestamp is None
        else f'{{"s":{source_timestamp.s},"us":{source_timestamp.us}}}'
    )
    return (
        f'{{"id":{{"server":{server},"session":{session},"instance":{instance}}},'
        f'"type":{type_json},"timestamp":{{"s":{s},"us":{us}}},'
        f'"source_timestamp":{source},"payload":{payload_text}}}'
    )


def encode_event_type(etype: EventType) -> str:
    """An event type as JSON text (for :func:`encode_event_fields`)."""
    return _dumps(list(etype))


def encode_events_body(encoded_events: list[str]) -> bytes:
    """An ``events`` message body from events already encoded by :func:`encode_event`."""
    return ('{"type":"events","events":[' + ",".join(encoded_events) + "]}").encode("utf-8")


def message_json(msg: Message) -> dict[str, Any]:
    if isinstance(msg, Ping):
        return {"type": "ping"}
    if isinstance(msg, Pong):
        return {"type": "pong"}
    if isinstance(msg, Init):
        return {
            "type": "init",
            "client_id": msg.client_id,
            "client_token": msg.client_token,
            "last_event_id": None if msg.last_event_id is None else event_id_json(
                msg.last_event_id
            ),
            "subscriptions": [list(s) for s in msg.subscriptions],
        }
    if isinstance(msg, Events):
        return {"type": "events", "events": [event_json(e) for e in msg.events]}
    return {"type": "error", "error": msg.error}


def encode_message(msg: Message) -> bytes:
    """A message body (UTF-8 JSON, no header)."""
    return _dumps(message_json(msg)).encode("utf-8")
