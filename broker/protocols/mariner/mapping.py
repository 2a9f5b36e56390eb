"""Mariner's own part of the event mapping: routed messages as Mariner event JSON text.

broker/core/events.py decides what a routed message is as a Hat event (the
shared model in wire/hat.py) and wire/mariner encodes that model; this
module is the delivery hot path between them, plus the one Mariner-only
rule: a binary payload named "sbs:MODULE.TYPE" goes out as Mariner's SBS
payload (:func:`wire.hat.sbs_payload`).  Mariner 0.8 binary payloads have
no type name, so any other name is not carried.
"""

from __future__ import annotations

from broker.core import events as ev
from broker.core.router import Routed
from wire import mariner as mw
from wire.hat import BinaryPayload, Payload, sbs_payload
from wire.hattime import split_timestamp


def mariner_payload(payload: Payload) -> Payload:
    """A payload as Mariner sends it (a binary SBS name becomes the SBS kind)."""
    if type(payload) is BinaryPayload:
        return sbs_payload(payload) or payload
    return payload


class EncodedEvents:
    """JSON text of routed messages as Mariner events, encoded once per message.

    The router hands the same :class:`Routed` to every recipient in turn, so
    remembering the last one makes a message reaching many Mariner clients
    cost one encoding.  Event types are few and repeat, so their JSON text is
    cached too (bounded), keyed by the routed (group, instance).  The text is
    built from the parts of :func:`broker.core.events.event_from_routed`
    without the intermediate event object.
    """

    __slots__ = ("_last", "_text", "_types", "server_id")

    # Distinct event types whose JSON text is kept; cleared when full.
    TYPE_CACHE = 4096

    def __init__(self, server_id: int) -> None:
        self.server_id = server_id
        self._last: Routed | None = None
        self._text = ""
        self._types: dict[tuple[bytes, bytes], str] = {}

    def __call__(self, routed: Routed) -> str:
        if routed is not self._last:
            header = routed.header
            key = (header[b"group"], header[b"instance"])
            type_json = self._types.get(key)
            if type_json is None:
                if len(self._types) >= self.TYPE_CACHE:
                    self._types.clear()
                type_json = self._types[key] = mw.encode_event_type(ev.event_type(*key))
            s, us = split_timestamp(routed.timestamp)
            self._text = mw.encode_event_fields(
                # A message from the cluster backplane keeps its origin's EventId.
                routed.server or self.server_id, routed.session, routed.instance, type_json,
                s, us,
                ev.source_timestamp_exact(header),
                mariner_payload(ev.payload_from_routed(routed)),
            )
            self._last = routed
        return self._text
