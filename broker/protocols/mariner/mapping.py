"""Mariner's JSON form of the shared event mapping (broker/core/events.py), both directions.

broker/core/events.py decides what a routed message is as a Hat event; this
module only moves between its :class:`broker.core.events.Event` and the Mariner
wire types:
- timestamps: router float seconds <-> ``{"s", "us"}``;
- payloads: json inline; binary base64 (Mariner 0.8 binary payloads have no
  type name, so the ``payload-type`` name is not carried, except that a name
  "sbs:MODULE.TYPE" goes out as Mariner's SBS payload and an incoming SBS
  payload comes in under that name).
"""

from __future__ import annotations

from broker.core import events as ev
from broker.core.router import Routed
from wire import mariner as mw


def mariner_timestamp(t: float) -> mw.Timestamp:
    return mw.Timestamp(*ev.timestamp_parts(t))


def mariner_payload(payload: ev.Payload) -> mw.Payload:
    if payload is None:
        return None
    if isinstance(payload, ev.JsonPayload):
        return mw.JsonPayload(payload.data)
    sbs = ev.parse_sbs_type_name(payload.type)
    if sbs is not None:
        return mw.SbsPayload(sbs[0], sbs[1], payload.data)
    return mw.BinaryPayload(payload.data)


def payload_from_mariner(payload: mw.Payload) -> ev.Payload:
    if payload is None:
        return None
    if isinstance(payload, mw.JsonPayload):
        return ev.JsonPayload(payload.data)
    if isinstance(payload, mw.SbsPayload):
        return ev.BinaryPayload(ev.sbs_type_name(payload.module, payload.type), payload.data)
    # No type name on the Mariner side: an empty payload-type tag still says "binary".
    return ev.BinaryPayload("", payload.data)


class EncodedEvents:
    """JSON text of routed messages as Mariner events, encoded once per message.

    The router hands the same :class:`Routed` to every recipient in turn, so
    remembering the last one makes a message reaching many Mariner clients
    cost one encoding.  Event types are few and repeat, so their JSON text is
    cached too (bounded).
    """

    __slots__ = ("_last", "_text", "_types", "server_id")

    # Distinct event types whose JSON text is kept; cleared when full.
    TYPE_CACHE = 4096

    def __init__(self, server_id: int) -> None:
        self.server_id = server_id
        self._last: Routed | None = None
        self._text = ""
        self._types: dict[tuple[str, ...], str] = {}

    def __call__(self, routed: Routed) -> str:
        if routed is not self._last:
            event = ev.event_from_routed(routed, self.server_id)
            type_json = self._types.get(event.type)
            if type_json is None:
                if len(self._types) >= self.TYPE_CACHE:
                    self._types.clear()
                type_json = self._types[event.type] = mw.encode_event_type(event.type)
            s, us = ev.timestamp_parts(event.timestamp)
            self._text = mw.encode_event_fields(
                event.id.server, event.id.session, event.id.instance, type_json, s, us,
                None if event.source_timestamp is None
                else mariner_timestamp(event.source_timestamp),
                mariner_payload(event.payload),
            )
            self._last = routed
        return self._text
