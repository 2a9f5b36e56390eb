"""The one model of a Hat event, shared by the Eventer and Mariner codecs.

Pure attrs classes, no I/O.  The Eventer SBS codec (:mod:`wire.eventer.messages`)
and the Mariner JSON codec (:mod:`wire.mariner.messages`) encode and decode
these classes; the broker's Routed <-> event mapping (``broker/core/events.py``)
builds them from routed Skan messages and turns them back into sends.

Payload kinds and where they travel:

- :class:`JsonPayload`: both protocols (Eventer as JSON text, Mariner inline).
- :class:`BinaryPayload`: both protocols.  Its ``type`` name travels on
  Eventer only; Mariner 0.8 binary payloads have no type name, so the Mariner
  codec drops it when encoding and decodes a binary payload with type ``""``.
- :class:`SbsPayload`: Mariner only.  Eventer 0.9 has no SBS payload kind, and
  the broker routes it as a binary payload named ``"sbs:MODULE.TYPE"``
  (:meth:`SbsPayload.to_binary`); :func:`sbs_payload` gives it back as SBS.
  The Eventer codec therefore encodes an SbsPayload as that binary payload.
"""

from __future__ import annotations

from typing import Any

import attrs

from wire.hattime import join_timestamp, split_timestamp

# An event type, and an event-type pattern ("*" as the last segment matches
# any rest, "?" any one segment), as tuples of segments.
EventType = tuple[str, ...]


@attrs.frozen(order=True)
class EventId:
    """(server, session, instance); ordered as the tuple (the order of a store)."""

    server: int
    session: int
    instance: int


@attrs.frozen(order=True)
class Timestamp:
    """Hat's timestamp: whole seconds ``s`` and microseconds ``us`` (0..999999)."""

    s: int
    us: int

    @classmethod
    def from_float(cls, t: float) -> Timestamp:
        """Float seconds (the router's clock), rounded to the microsecond."""
        return cls(*split_timestamp(t))

    def to_float(self) -> float:
        return join_timestamp(self.s, self.us)


@attrs.frozen
class BinaryPayload:
    """Bytes with a type name (``""`` when the sender gave none; not carried by Mariner)."""

    type: str
    data: bytes


@attrs.frozen
class JsonPayload:
    """A parsed JSON value."""

    data: Any


# Prefix of the binary type name under which an SBS payload is routed.
SBS_PREFIX = "sbs:"


@attrs.frozen
class SbsPayload:
    """Hat 0.8's SBS payload (Mariner only; routed as binary, see the module docstring)."""

    module: str | None
    type: str
    data: bytes

    def to_binary(self) -> BinaryPayload:
        """The binary payload named ``"sbs:MODULE.TYPE"`` (``"sbs:TYPE"`` without a module)."""
        name = f"{self.module}.{self.type}" if self.module else self.type
        return BinaryPayload(SBS_PREFIX + name, self.data)


def sbs_payload(payload: BinaryPayload) -> SbsPayload | None:
    """The SBS payload a binary payload made by :meth:`SbsPayload.to_binary` stands for.

    None for any other type name.
    """
    if not payload.type.startswith(SBS_PREFIX):
        return None
    module, _, type_name = payload.type[len(SBS_PREFIX) :].rpartition(".")
    return SbsPayload(module or None, type_name, payload.data)


Payload = BinaryPayload | JsonPayload | SbsPayload | None


@attrs.frozen
class Event:
    id: EventId
    type: EventType
    timestamp: Timestamp
    source_timestamp: Timestamp | None = None
    payload: Payload = None
