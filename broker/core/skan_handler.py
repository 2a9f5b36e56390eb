"""Skan message semantics for one connection: getlname first, the five types, errors.

Pure: it decodes a frame's routing header, applies it to the router, and
answers through ``endpoint.send_control``.  The Skan listener and the HSP
listener ("Skan over HSP") both drive it, so the semantics exist once.

``handle`` raises :class:`wire.skan.SkanError` for a malformed message (the
caller decides: the Skan listener closes, HSP answers ERROR 1) and a
:class:`~broker.core.refusals.Refused` carrying the message's ``seq`` for a
well-formed message it refuses (a semantic fault, permissions, the
subscription limit).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from time import perf_counter
from typing import Any, Generic, NoReturn, TypeVar

from broker.core.refusals import Refused
from broker.core.router import SUBTYPES, Endpoint, RouteKey, Router
from wire.errors import ProtocolError
from wire.skan import Nested, codec, decode_header, encode_frame
from wire.skan.eventjson import PAYLOAD_JSON_TAG, loads_exact

# Bounded work per scheduling slice.  A listener handles received messages
# (frames, HSP commands) for at most SLICE_SECONDS of wall time, or about
# SLICE_BYTES of their bytes, before it lets the event loop run the other
# connections; the rest of the chunk waits in its InputSlices for the next
# slice.  One connection's burst -- thousands of subscribes or stats requests
# in one write, or a run of multi-MiB frames -- then delays every other
# connection by about one slice, not by the whole burst.  Half a millisecond
# keeps a bystander's median latency under 2 ms during subscription churn
# (measured 1.2-1.7 ms on a busy machine) while a saturating publisher's
# deliveries per CPU-second stay those of unsliced reading (0.2 ms slices
# cost about 10 % there: one scheduler round trip per slice); the clock is
# read only every SLICE_CHECK messages so the hot path does not pay for it.
SLICE_SECONDS = 0.0005
SLICE_CHECK = 16
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

    def take(self, size: Callable[[T], int] = len) -> Iterator[list[T]]:  # type: ignore[assignment]
        """Yield the items of one slice, SLICE_CHECK at a time (the caller loops
        over each list): until SLICE_SECONDS have passed or the items handed
        out reach SLICE_BYTES, both checked between the lists.  What is left
        stays pending.  (One generator step per SLICE_CHECK items keeps the
        per-message cost of slicing to a few nanoseconds.)"""
        items = self.items
        n = len(items)
        i = self.pos
        if i == 0 and n <= SLICE_CHECK:
            # The common case: a chunk of a few messages is one slice.
            self.pos = n
            yield items
            return
        stop_at = perf_counter() + SLICE_SECONDS
        budget = SLICE_BYTES
        while i < n:
            chunk = items[i : i + SLICE_CHECK]
            i += len(chunk)
            self.pos = i
            yield chunk
            budget -= sum(map(size, chunk))
            if budget <= 0 or perf_counter() >= stop_at:
                return

    @property
    def pending(self) -> bool:
        """More items wait for a later slice."""
        return self.pos < len(self.items)

    def clear(self) -> None:
        self.items = []
        self.pos = 0


def error_frame(reason: str, seq: bytes | None = None) -> bytes:
    """The Skan error frame answering a message numbered ``seq`` (None: none)."""
    return encode_frame(Refused(reason, seq).error_message())


def _data(header: dict[bytes, Any], tag: bytes, what: str, seq: bytes | None) -> bytes:
    """The DATA value of field ``tag``; raises :class:`Refused` answering ``seq``."""
    value = header.get(tag)
    if value is None:
        if tag in header:
            raise Refused(f"field '{tag.decode()}' of a {what} must be DATA, not NULL", seq)
        raise Refused(f"a {what} message needs the field '{tag.decode()}'", seq)
    if isinstance(value, Nested):
        raise Refused(f"field '{tag.decode()}' of a {what} must be DATA", seq)
    return value


def _group_instance(header: dict[bytes, Any], what: str,
                    seq: bytes | None) -> tuple[bytes, bytes]:
    """The DATA group and instance of a subscribe or unsubscribe (``what``);
    raises :class:`Refused` answering ``seq``."""
    return _data(header, b"group", what, seq), _data(header, b"instance", what, seq)


def check_payload_json(header: dict[bytes, Any]) -> str | None:
    """Why a send's ``payload-json`` tag (the exact Hat JSON payload, see
    :mod:`wire.skan.eventjson`) is refused, or None when it is sound.

    It must be DATA holding UTF-8 JSON within the decoder limits, and a send
    is a JSON or a binary payload, not both (``payload-type``).  Called only
    for sends that carry the tag (the send decoder gives them no routing key).
    """
    raw = header[PAYLOAD_JSON_TAG]
    if type(raw) is not bytes:
        return "the tag 'payload-json' must be DATA holding JSON text"
    if b"payload-type" in header:
        return ("the tags 'payload-json' (a JSON payload) and 'payload-type' (a binary "
                "payload) exclude each other")
    try:
        loads_exact(raw)
    except ProtocolError as exc:
        return f"the tag 'payload-json' is not a JSON payload: {exc}"
    return None


def send_key(header: dict[bytes, Any], lname: bytes) -> RouteKey | None:
    """The routing key ``(group, instance, to, is_reply)`` of a well-formed send from
    ``lname`` without a ``payload-json`` tag; None for any other message (which
    :meth:`SkanHandler.handle` then examines field by field: a send with the
    tag is checked there, so sends without it pay nothing for the check).
    ``_speedups.decode_send`` compiles exactly this rule (differential tests)."""
    if PAYLOAD_JSON_TAG in header:
        return None
    return route_key(header, lname)


def route_key(header: dict[bytes, Any], lname: bytes) -> RouteKey | None:
    """The routing key of a well-formed send from ``lname``, whatever its tags."""
    if header.get(b"type") != b"send":
        return None
    group = header.get(b"group")
    instance = header.get(b"instance")
    to = header.get(b"to")
    if (
        type(group) is bytes
        and type(instance) is bytes
        and type(to) is bytes
        and header.get(b"from") == lname
        and b"msg" in header
        and type(header.get(b"seq")) is bytes
    ):
        return (group, instance, to, b"repl" in header or b"reply" in header)
    return None


def decode_send_py(
    frame: bytes, start: int, lname: bytes | None
) -> tuple[dict[bytes, Any], RouteKey | None]:
    """Decode a message's routing header and, for a named connection (``lname``
    not None), its send routing key.  Raises SkanError for a malformed message."""
    header = decode_header(frame, start)
    return header, (send_key(header, lname) if lname is not None else None)


# The hot path: one C call decodes the header and checks the send (see
# wire/skan/_codec_speedups.c); SKAN_PURE_PYTHON=1 or an unbuilt extension keeps this
# reference.
decode_send = decode_send_py
if codec.IMPLEMENTATION == "c":
    decode_send = codec._speedups.decode_send


class SkanHandler:
    """The Skan state of one connection (any transport carrying Skan messages)."""

    __slots__ = ("endpoint", "lname", "named", "router")

    def __init__(self, router: Router, endpoint: Endpoint) -> None:
        self.router = router
        self.endpoint = endpoint
        self.named = False
        # The connection's lname once getlname is done: what 'from' must say.
        self.lname: bytes | None = None

    def handle(self, frame: bytes) -> None:
        """Apply one framed Skan message (4-byte prefix included).

        Raises :class:`Refused` (answering the message's ``seq``) when it is
        refused; the caller answers with it and closes if ``close`` is set.
        """
        header, key = decode_send(frame, 4, self.lname)
        if key is not None:
            # Hot path: a well-formed send from this connection (no payload-json).
            try:
                self.router.route(self.endpoint, frame, header, key=key)
            except Refused as exc:
                raise exc.answering(header[b"seq"]) from None
            return
        mtype = header.get(b"type")
        if mtype == b"send" and self.named:
            if PAYLOAD_JSON_TAG in header:
                self._tagged_send(frame, header)
                return
            self._bad_send(header)
        seq = header.get(b"seq")
        seq = seq if type(seq) is bytes else None
        if not self.named:
            if mtype != b"getlname":
                raise Refused("the first message must be getlname", seq, close=True)
            # Section 7: getlname may carry the credential, a DATA field 'token'.
            token = header.get(b"token")
            if token is not None and type(token) is not bytes:
                raise Refused("field 'token' of a getlname must be DATA", seq, close=True)
            try:
                self.router.enforcer.login(self.endpoint, token)
            except Refused as exc:
                raise exc.answering(seq) from None
            self.named = True
            self.lname = self.endpoint.lname
            self.endpoint.send_control({"lname": self.endpoint.lname})
            return
        if mtype == b"subscribe":
            self._subscribe(header, seq)
        elif mtype == b"unsubscribe":
            self.router.unsubscribe(self.endpoint, *_group_instance(header, "unsubscribe", seq))
        elif mtype == b"stats":
            self.endpoint.send_control({"stats": self.router.stats()})
        elif mtype == b"getlname":
            self.endpoint.send_control({"lname": self.endpoint.lname})
        elif mtype is None:
            if b"type" in header:
                raise Refused("the field 'type' must be DATA, not NULL", seq)
            raise Refused("the message has no 'type' field", seq)
        elif isinstance(mtype, Nested):
            raise Refused("the field 'type' must be DATA", seq)
        else:
            raise Refused(f"unknown message type {mtype.decode(errors='replace')!r}", seq)

    def _tagged_send(self, frame: bytes, header: dict[bytes, Any]) -> None:
        """A send carrying the ``payload-json`` tag: routed once the tag is sound."""
        key = route_key(header, self.endpoint.lname)
        if key is None:
            self._bad_send(header)
        seq = header[b"seq"]
        refused = check_payload_json(header)
        if refused is not None:
            raise Refused(refused, seq)
        try:
            self.router.route(self.endpoint, frame, header, key=key)
        except Refused as exc:
            raise exc.answering(seq) from None

    def _bad_send(self, header: dict[bytes, Any]) -> NoReturn:
        seq = header.get(b"seq")
        seq = seq if type(seq) is bytes else None
        for tag in (b"group", b"instance", b"to", b"from", b"seq"):
            _data(header, tag, "send", seq)
        if b"msg" not in header:
            raise Refused("a send message needs the field 'msg' (NULL is allowed)", seq)
        sender = header[b"from"]
        raise Refused(
            f"'from' is {sender.decode(errors='replace')!r} but this connection's lname is "
            f"{self.endpoint.lname.decode()!r}",
            seq,
        )

    def _subscribe(self, header: dict[bytes, Any], seq: bytes | None) -> None:
        group, instance = _group_instance(header, "subscribe", seq)
        raw = header.get(b"subtype", b"normal")
        subtype = SUBTYPES.get(raw) if type(raw) is bytes else None
        if subtype is None:
            shown = raw.decode(errors="replace") if type(raw) is bytes else "not DATA"
            raise Refused(f"bad subtype {shown!r} (expected normal, meonly or promisc)", seq)
        try:
            self.router.subscribe(self.endpoint, group, instance, subtype)
        except Refused as exc:
            raise exc.answering(seq) from None
