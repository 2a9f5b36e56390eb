"""Between the broker's event model (broker/events.py) and the Eventer wire model (wire/eventer).

broker/events.py owns the Skan<->event mapping (types, payloads, EventIds);
this module only changes representation: float seconds <-> ``(s, us)``
timestamps and the payload classes.  Shared by the Eventer listener, the
Eventer bridge and queries.
"""

from __future__ import annotations

from broker import events
from broker.router import Routed
from wire import eventer as w


def payload_to_wire(p: events.Payload) -> w.Payload:
    if isinstance(p, events.BinaryPayload):
        return w.BinaryPayload(p.type, p.data)
    if isinstance(p, events.JsonPayload):
        return w.JsonPayload(p.data)
    return None


def payload_from_wire(p: w.Payload) -> events.Payload:
    if isinstance(p, w.BinaryPayload):
        return events.BinaryPayload(p.type, p.data)
    if isinstance(p, w.JsonPayload):
        return events.JsonPayload(p.data)
    return None


def ts_from_wire(t: w.Timestamp | None) -> float | None:
    return None if t is None else t.to_float()


def ts_to_wire(t: float | None) -> w.Timestamp | None:
    return None if t is None else w.Timestamp.from_float(t)


def event_to_wire(e: events.Event) -> w.Event:
    return w.Event(
        id=w.EventId(e.id.server, e.id.session, e.id.instance),
        type=e.type,
        timestamp=w.Timestamp.from_float(e.timestamp),
        source_timestamp=ts_to_wire(e.source_timestamp),
        payload=payload_to_wire(e.payload),
    )


def encode_routed(routed: Routed, server_id: int) -> bytes:
    """The ``HatEventer.Event`` encoding of one routed message."""
    return w.encode_event(event_to_wire(events.event_from_routed(routed, server_id)))
