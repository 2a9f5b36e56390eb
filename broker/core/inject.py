"""Messages the broker builds itself and routes on an endpoint's behalf (pure).

An event registered over Eventer, an event a Mariner or Eventer bridge
receives, a payload an HSP bridge receives: each becomes a Skan ``send``
whose ``from`` is the lname of the endpoint it came in on (the router
checks ``from`` on client sends; for injected ones this is the one place
that sets it).  The frame is encoded once and its routing header is built
alongside it, so nobody re-parses the bytes they just produced.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from broker.core.eventtypes import STAR
from broker.core.reasons import ErrorKind
from broker.core.refusals import FrameTooLarge
from broker.core.router import Endpoint, Routed, Router
from wire.skan import MAGIC, Nested, encode_item

# Bytes of an item's length field per length code (the high nibble of its TyLen).
_LENGTH_BYTES = {0x20: 1, 0x10: 2, 0x00: 4}
_NULL = 0x04


@attrs.frozen
class Injected:
    """A Skan ``send`` frame (length prefix included) and its decoded routing header."""

    frame: bytes
    header: dict[bytes, Any]


def _header_value(item: bytes, offset: int) -> Any:
    """The header value for one encoded item starting at ``offset`` in the frame."""
    tylen = item[0]
    if tylen == _NULL:
        return None
    head = 1 + _LENGTH_BYTES[tylen & 0xF0]
    if tylen & 0x0F == 0x01:  # DATA
        return item[head:]
    return Nested(tylen & 0x0F, offset + head, offset + len(item))


def build_send(
    sender: bytes,
    group: bytes,
    instance: bytes,
    seq: int,
    msg: Any,
    tags: Mapping[bytes, Any] | None = None,
    *,
    to: bytes = STAR,
) -> Injected:
    """The ``send`` frame of an injected message, ``from`` = ``sender`` (the lname).

    ``msg`` and ``tags`` values are anything :func:`wire.skan.encode_item`
    accepts; extra ``tags`` (``payload-type``, ``hsp-type``, ...) follow
    the routing fields, then ``msg``.
    """
    fields: dict[bytes, Any] = {
        b"type": b"send",
        b"from": sender,
        b"to": to,
        b"group": group,
        b"instance": instance,
        b"seq": str(seq).encode(),
    }
    if tags:
        fields.update(tags)
    fields[b"msg"] = msg
    parts = [MAGIC]
    header: dict[bytes, Any] = {}
    # Offsets in the header are relative to the frame: 4-byte prefix, then magic.
    pos = 8
    for tag, value in fields.items():
        item = encode_item(value)
        parts += (bytes((len(tag),)), tag, item)
        pos += 1 + len(tag)
        header[tag] = _header_value(item, pos)
        pos += len(item)
    body = b"".join(parts)
    return Injected(len(body).to_bytes(4, "big") + body, header)


def check_injected(router: Router, endpoint: Endpoint, message: Injected) -> None:
    """Hold a message the broker built (from an HSP payload, a Hat event, a
    bridged event) to the same ``max_frame`` as received Skan frames, so no
    Skan client with that limit is ever sent a frame it must refuse.

    Raises :class:`FrameTooLarge`, counted here once (a protocol error of
    ``endpoint``'s protocol, kind ``too-large``); the caller refuses the
    input at its edge with its own protocol's error.
    """
    limit = router.max_frame
    size = len(message.frame) - 4
    if limit is not None and size > limit:
        router.counters.protocol_error(endpoint.protocol, ErrorKind.TOO_LARGE)
        raise FrameTooLarge(f"its Skan message of {size} bytes exceeds max_frame ({limit} bytes)")


def route_injected(router: Router, endpoint: Endpoint, message: Injected) -> Routed:
    """Route an injected message as ``endpoint``'s own send.

    Raises :class:`~broker.core.refusals.FrameTooLarge` (counted, nothing
    routed) when it passes ``max_frame``: every injected message enters
    routing here, so the rule is enforced in one place; and, from the router,
    :class:`~broker.core.refusals.NotPermitted` when ``endpoint`` may not send it.
    """
    check_injected(router, endpoint, message)
    return router.route(endpoint, message.frame, message.header)
