"""HSP connection state machine: which DATA_ACKs are owed an answer, in both directions.

Sans-IO, in the manner of h11/wsproto: ``receive_data(bytes)`` returns events
and raises :class:`~wire.errors.RemoteProtocolError` when the peer breaks the protocol;
``send(event)`` returns the bytes to write and raises
:class:`LocalProtocolError` when *we* would break it.  Both peers are
symmetric in HSP, so the same class serves the broker's listener, its
bridges and the clients.

Tracked state:
- ``awaiting``: MessageIDs of DATA_ACKs we sent that have no ACK/ERROR yet.
  An ACK, ERROR or ERROR_UNDEF for any other id is a peer fault.
- ``owed``: MessageIDs of DATA_ACKs we received and have not answered.
  The peer may reuse an id only once answered, so a DATA_ACK with an owed
  id is a peer fault; we may only answer owed ids.
- ``pings``: PINGs we sent without a PONG yet.  An unsolicited PONG is
  tolerated and counted in ``unsolicited_pongs`` (harmless, and some
  implementations send one as a keep-alive).
"""

from __future__ import annotations

from wire.errors import LocalProtocolError, RemoteProtocolError
from wire.hsp.codec import (
    DATA_ACK,
    DEFAULT_MAX_PAYLOAD,
    ERROR,
    MAX_U32,
    Ack,
    Data,
    DataAck,
    Decoder,
    Error,
    ErrorUndef,
    Event,
    Oversized,
    Ping,
    Pong,
    encode,
)

_ANSWERS = (Ack, Error, ErrorUndef)
_NAMES = {Ack: "ACK", Error: "ERROR", ErrorUndef: "ERROR_UNDEF"}


class HSPConnection:
    """One side of an HSP connection."""

    __slots__ = ("_dead", "_decoder", "_next_id", "awaiting", "owed", "pings",
                 "unsolicited_pongs")

    def __init__(self, max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        self._decoder = Decoder(max_payload)
        self.awaiting: set[int] = set()
        self.owed: set[int] = set()
        self.pings = 0
        self.unsolicited_pongs = 0
        self._next_id = 0
        # The first peer fault; the connection is unusable after it.
        self._dead: RemoteProtocolError | None = None

    @property
    def max_payload(self) -> int:
        return self._decoder.max_payload

    @property
    def buffered(self) -> int:
        """Bytes received of a message that is not complete yet."""
        return self._decoder.buffered

    # ---- receiving --------------------------------------------------------

    def receive_data(self, data: bytes) -> list[Event]:
        """Events completed by ``data``; raises RemoteProtocolError on a peer fault.

        The error's ``events`` holds the valid events before the fault
        (already accounted for in the state).  After a fault every further
        call raises it again.
        """
        if self._dead is not None:
            raise RemoteProtocolError(self._dead.reason)
        try:
            try:
                events = self._decoder.receive_data(data)
            except RemoteProtocolError as exc:
                self._track(exc.events)
                raise
            self._track(events)
        except RemoteProtocolError as exc:
            self._dead = exc
            raise
        return events

    def _track(self, events: list[Event]) -> None:
        for i, ev in enumerate(events):
            t = type(ev)
            if t is Data:
                continue
            if t is DataAck:
                self._owe(ev.message_id, events, i)
            elif t is Ack or t is ErrorUndef or t is Error:
                self._answered(ev.message_id, _NAMES[t], events, i)
            elif t is Pong:
                if self.pings:
                    self.pings -= 1
                else:
                    self.unsolicited_pongs += 1
            elif t is Oversized:
                if ev.command == DATA_ACK:
                    self._owe(ev.message_id, events, i)
                elif ev.command == ERROR:
                    self._answered(ev.message_id, "ERROR", events, i)

    def _owe(self, mid: int, events: list[Event], i: int) -> None:
        if mid in self.owed:
            raise RemoteProtocolError(
                f"peer reused MessageID {mid} before its DATA_ACK was answered",
                events=events[:i],
            )
        self.owed.add(mid)

    def _answered(self, mid: int, what: str, events: list[Event], i: int) -> None:
        if mid not in self.awaiting:
            raise RemoteProtocolError(
                f"{what} for MessageID {mid}, which no DATA_ACK of ours is awaiting",
                events=events[:i],
            )
        self.awaiting.discard(mid)

    # ---- sending ----------------------------------------------------------

    def send(self, event: Event) -> bytes:
        """The bytes for ``event``, after checking that HSP allows sending it now."""
        t = type(event)
        if t is Oversized:
            raise LocalProtocolError("Oversized is a receive-side report, not a command")
        data = encode(event)
        if t is DataAck:
            if event.message_id in self.awaiting:
                raise LocalProtocolError(
                    f"MessageID {event.message_id} is still awaiting its answer"
                )
            self.awaiting.add(event.message_id)
        elif t in _ANSWERS:
            if event.message_id not in self.owed:
                raise LocalProtocolError(
                    f"no DATA_ACK with MessageID {event.message_id} is waiting for an answer"
                )
            self.owed.discard(event.message_id)
        elif t is Ping:
            self.pings += 1
        return data

    def next_message_id(self) -> int:
        """A MessageID not awaiting an answer (cycles through the 32-bit space)."""
        if len(self.awaiting) > MAX_U32:
            raise LocalProtocolError("every MessageID is awaiting an answer")
        mid = self._next_id
        while mid in self.awaiting:
            mid = (mid + 1) & MAX_U32
        self._next_id = (mid + 1) & MAX_U32
        return mid


__all__ = ["HSPConnection"]
