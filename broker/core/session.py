"""Skan message semantics for one connection: getlname first, the five types, errors.

Pure: it decodes a frame's routing header, applies it to the router, and
answers through ``endpoint.send_control``.  The Skan listener and the HSP
listener ("Skan over HSP") both drive it, so the semantics exist once.

``handle`` raises :class:`wire.skan.SkanError` for a malformed message (the
caller decides: the Skan listener closes, HSP answers ERROR 1) and returns
a :class:`Rejected` for a well-formed message with a semantic fault.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import attrs

from broker.core.router import SUBTYPES, Endpoint, Router
from wire.skan import Nested, decode_header, encode_frame

# Bounded work per scheduling slice.  A listener handles at most this many
# received messages (frames, HSP commands), or about this many of their
# bytes, before it lets the event loop run other connections; the rest of the
# chunk waits in its InputSlices until the next slice.  The numbers keep one
# slice near a millisecond of work (a subscribe or stats costs ~5-20 us, a
# routed send a few us per recipient), so one connection's burst -- thousands
# of subscribes or stats requests in one write, or a run of multi-MiB
# frames -- delays the others by about that much, not by the whole burst.
SLICE_ITEMS = 64
SLICE_BYTES = 1 << 20

T = TypeVar("T")


class InputSlices(Generic[T]):
    """Decoded input of one connection not yet handled, handed out in bounded slices."""

    __slots__ = ("items", "pos")

    def __init__(self) -> None:
        self.items: list[T] = []
        self.pos = 0

    def add(self, items: list[T]) -> None:
        if self.pos < len(self.items):
            self.items = self.items[self.pos :] + items
        else:
            self.items = items
        self.pos = 0

    def next_slice(self, size: Callable[[T], int] = len) -> list[T]:  # type: ignore[assignment]
        """The next items to handle: at most SLICE_ITEMS, and stopping after the
        item that reaches SLICE_BYTES (one oversized item is a slice of its own)."""
        items, start = self.items, self.pos
        end = min(len(items), start + SLICE_ITEMS)
        budget = SLICE_BYTES
        i = start
        while i < end:
            budget -= size(items[i])
            i += 1
            if budget <= 0:
                break
        self.pos = i
        if i == start == 0 and len(items) == i:
            return items
        return items[start:i]

    @property
    def pending(self) -> bool:
        """More items wait for a later slice."""
        return self.pos < len(self.items)

    def clear(self) -> None:
        self.items = []
        self.pos = 0


class ControlEndpoint(Protocol):
    lname: bytes

    def send_control(self, message: dict[str, Any]) -> None:
        """Queue a broker-originated message (reply or error) to this connection."""


@attrs.frozen
class Rejected:
    """A well-formed message the broker refused; ``close`` ends the connection."""

    reason: str
    seq: bytes | None = None
    close: bool = False
    # Metric label of the protocol error it is counted as.
    label: str = "rejected"

    def error_message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"type": "error", "error": self.reason}
        if self.seq is not None:
            msg["seq"] = self.seq
        return msg


def error_frame(reason: str, seq: bytes | None = None) -> bytes:
    return encode_frame(Rejected(reason, seq).error_message())


def _data(header: dict[bytes, Any], tag: bytes, what: str) -> bytes | Rejected:
    value = header.get(tag)
    if value is None:
        if tag in header:
            return Rejected(f"field '{tag.decode()}' of a {what} must be DATA, not NULL")
        return Rejected(f"a {what} message needs the field '{tag.decode()}'")
    if isinstance(value, Nested):
        return Rejected(f"field '{tag.decode()}' of a {what} must be DATA")
    return value


class SkanSession:
    """The Skan state of one connection (any transport carrying Skan messages)."""

    __slots__ = ("endpoint", "named", "router")

    def __init__(self, router: Router, endpoint: Endpoint) -> None:
        self.router = router
        self.endpoint = endpoint
        self.named = False

    def handle(self, frame: bytes) -> Rejected | None:
        """Apply one framed Skan message (4-byte prefix included)."""
        header = decode_header(frame, 4)
        mtype = header.get(b"type")
        if mtype == b"send" and self.named:
            # Hot path: everything below is validation of the routing fields.
            group = header.get(b"group")
            instance = header.get(b"instance")
            to = header.get(b"to")
            sender = header.get(b"from")
            if (
                type(group) is bytes
                and type(instance) is bytes
                and type(to) is bytes
                and sender == self.endpoint.lname
                and b"msg" in header
                and type(header.get(b"seq")) is bytes
            ):
                self.router.route(self.endpoint, frame, header)
                return None
            return self._bad_send(header)
        seq = header.get(b"seq")
        seq = seq if type(seq) is bytes else None
        if not self.named:
            if mtype != b"getlname":
                return Rejected("the first message must be getlname", seq, close=True)
            self.named = True
            self.endpoint.send_control({"lname": self.endpoint.lname})
            return None
        if mtype == b"subscribe":
            return self._subscribe(header, seq)
        if mtype == b"unsubscribe":
            group = _data(header, b"group", "unsubscribe")
            if isinstance(group, Rejected):
                return attrs.evolve(group, seq=seq)
            instance = _data(header, b"instance", "unsubscribe")
            if isinstance(instance, Rejected):
                return attrs.evolve(instance, seq=seq)
            self.router.unsubscribe(self.endpoint, group, instance)
            return None
        if mtype == b"stats":
            self.endpoint.send_control({"stats": self.router.stats()})
            return None
        if mtype == b"getlname":
            self.endpoint.send_control({"lname": self.endpoint.lname})
            return None
        if mtype is None:
            if b"type" in header:
                return Rejected("the field 'type' must be DATA, not NULL", seq)
            return Rejected("the message has no 'type' field", seq)
        if isinstance(mtype, Nested):
            return Rejected("the field 'type' must be DATA", seq)
        return Rejected(f"unknown message type {mtype.decode(errors='replace')!r}", seq)

    def _bad_send(self, header: dict[bytes, Any]) -> Rejected:
        seq = header.get(b"seq")
        seq = seq if type(seq) is bytes else None
        for tag in (b"group", b"instance", b"to", b"from", b"seq"):
            value = _data(header, tag, "send")
            if isinstance(value, Rejected):
                return attrs.evolve(value, seq=seq)
        if b"msg" not in header:
            return Rejected("a send message needs the field 'msg' (NULL is allowed)", seq)
        sender = header[b"from"]
        return Rejected(
            f"'from' is {sender.decode(errors='replace')!r} but this connection's lname is "
            f"{self.endpoint.lname.decode()!r}",
            seq,
        )

    def _subscribe(self, header: dict[bytes, Any], seq: bytes | None) -> Rejected | None:
        group = _data(header, b"group", "subscribe")
        if isinstance(group, Rejected):
            return attrs.evolve(group, seq=seq)
        instance = _data(header, b"instance", "subscribe")
        if isinstance(instance, Rejected):
            return attrs.evolve(instance, seq=seq)
        raw = header.get(b"subtype", b"normal")
        subtype = SUBTYPES.get(raw) if type(raw) is bytes else None
        if subtype is None:
            shown = raw.decode(errors="replace") if type(raw) is bytes else "not DATA"
            return Rejected(
                f"bad subtype {shown!r} (expected normal, meonly or promisc)", seq
            )
        if not self.router.subscribe(self.endpoint, group, instance, subtype):
            return Rejected(
                f"too many subscriptions: this connection already holds "
                f"{self.router.max_subscriptions} (max_subscriptions)",
                seq,
                label="max-subscriptions",
            )
        return None
