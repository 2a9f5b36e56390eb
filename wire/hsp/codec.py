"""HSP codec: the seven commands as attrs events, their encoder and an incremental decoder.

Sans-IO: bytes in, events out; no trio.  Fixed-width big-endian fields
(specs/hsp.txt)::

    DATA         00 | Type u16 | Length u32 | Payload
    DATA_ACK     01 | MessageID u32 | Type u16 | Length u32 | Payload
    ACK          02 | MessageID u32
    PING         03
    PONG         04
    ERROR        05 | MessageID u32 | Type u16 | Length u32 | Payload
    ERROR_UNDEF  06 | MessageID u32

DATA and DATA_ACK keep their payload *framed*: the 4-byte Length followed
by the payload, exactly as it was on the wire.  That is a slice of the
received bytes, and when the payload is a Skan message it is byte for byte
a Skan frame, so the broker routes it with no copy and no re-encoding.
"""

from __future__ import annotations

import struct
from typing import Any

import attrs

from wire.buffer import Reassembler
from wire.errors import FramingError, LocalProtocolError, ProtocolError, RemoteProtocolError
from wire.keepalive import Ping, Pong

DATA = 0
DATA_ACK = 1
ACK = 2
PING = 3
PONG = 4
ERROR = 5
ERROR_UNDEF = 6

COMMAND_NAMES = {
    DATA: "DATA",
    DATA_ACK: "DATA_ACK",
    ACK: "ACK",
    PING: "PING",
    PONG: "PONG",
    ERROR: "ERROR",
    ERROR_UNDEF: "ERROR_UNDEF",
}

MAX_U16 = 0xFFFF
MAX_U32 = 0xFFFF_FFFF

# Default bound on one payload (DATA, DATA_ACK, ERROR).  HSP's Length field
# allows 4 GiB and the spec lets an application restrict it "to avoid
# utilizing too much memory while receiving": a payload is buffered whole
# before it is handed on, so without a bound one peer announcing a huge
# payload could make us hold gigabytes.  8 MiB matches the broker's default
# Skan max_frame, since Type 1 payloads are Skan messages.  A larger payload
# is not buffered: its bytes are skipped as they arrive and an
# :class:`Oversized` event is reported instead (the stream stays in sync).
DEFAULT_MAX_PAYLOAD = 8 * 1024 * 1024


def frame_payload(payload: bytes) -> bytes:
    """Prefix ``payload`` with its 4-byte big-endian length (the wire form of a ByteArray)."""
    if len(payload) > MAX_U32:
        raise LocalProtocolError(f"payload of {len(payload)} bytes exceeds HSP's 32-bit length")
    return len(payload).to_bytes(4, "big") + payload


# ---- events -----------------------------------------------------------------


class _Framed:
    """What DATA and DATA_ACK share: ``framed`` = 4-byte length + payload (see module doc)."""

    __slots__ = ()
    framed: bytes

    @property
    def payload(self) -> bytes:
        return self.framed[4:]


def _framed_field() -> Any:
    """The ``framed`` attribute, shown in a repr by its payload's size only."""
    return attrs.field(repr=lambda b: f"<{len(b) - 4} bytes>")


@attrs.define(slots=True)
class Data(_Framed):
    """DATA: fire-and-forget."""

    type: int
    framed: bytes = _framed_field()

    @classmethod
    def make(cls, type: int, payload: bytes) -> Data:
        return cls(type, frame_payload(payload))


@attrs.define(slots=True)
class DataAck(_Framed):
    """DATA_ACK: must be answered with ACK, ERROR or ERROR_UNDEF carrying ``message_id``."""

    message_id: int
    type: int
    framed: bytes = _framed_field()

    @classmethod
    def make(cls, message_id: int, type: int, payload: bytes) -> DataAck:
        return cls(message_id, type, frame_payload(payload))


@attrs.define(slots=True)
class Ack:
    message_id: int


@attrs.define(slots=True)
class Error:
    """ERROR: the DATA_ACK ``message_id`` could not be processed; ``type`` is the error code."""

    message_id: int
    type: int
    payload: bytes = b""

    @property
    def reason(self) -> str:
        return self.payload.decode("utf-8", errors="replace")


@attrs.define(slots=True)
class ErrorUndef:
    message_id: int


@attrs.define(slots=True)
class Oversized:
    """A DATA, DATA_ACK or ERROR whose payload exceeded the limit; its bytes were skipped.

    ``message_id`` is None for DATA.  A DATA_ACK reported this way still
    needs an answer (the broker sends ERROR 3, too large).
    """

    command: int
    message_id: int | None
    type: int
    length: int


Event = Data | DataAck | Ack | Ping | Pong | Error | ErrorUndef | Oversized


# ---- encoding ---------------------------------------------------------------

_DATA_ACK_HEAD = struct.Struct(">BLH")
_ID_ONLY = struct.Struct(">BL")
_ERROR_HEAD = struct.Struct(">BLHL")
PING_BYTES = b"\x03"
PONG_BYTES = b"\x04"


def data_prefix(type: int) -> bytes:
    """The 3 bytes before a framed payload in a DATA message of ``type``."""
    if not 0 <= type <= MAX_U16:
        raise LocalProtocolError(f"Type {type} is outside 0..65535")
    return bytes((DATA, type >> 8, type & 0xFF))


def _check_id(message_id: int) -> None:
    if not 0 <= message_id <= MAX_U32:
        raise LocalProtocolError(f"MessageID {message_id} is outside 0..2**32-1")


def encode(event: Event) -> bytes:
    """The wire bytes of one command."""
    t = type(event)
    if t is Data:
        return data_prefix(event.type) + event.framed
    if t is DataAck:
        _check_id(event.message_id)
        if not 0 <= event.type <= MAX_U16:
            raise LocalProtocolError(f"Type {event.type} is outside 0..65535")
        return _DATA_ACK_HEAD.pack(DATA_ACK, event.message_id, event.type) + event.framed
    if t is Ack:
        _check_id(event.message_id)
        return _ID_ONLY.pack(ACK, event.message_id)
    if t is Ping:
        return PING_BYTES
    if t is Pong:
        return PONG_BYTES
    if t is Error:
        _check_id(event.message_id)
        if not 0 <= event.type <= MAX_U16:
            raise LocalProtocolError(f"error Type {event.type} is outside 0..65535")
        return _ERROR_HEAD.pack(ERROR, event.message_id, event.type, len(event.payload)) + bytes(
            event.payload
        )
    if t is ErrorUndef:
        _check_id(event.message_id)
        return _ID_ONLY.pack(ERROR_UNDEF, event.message_id)
    raise LocalProtocolError(f"cannot encode {event!r}")


# ---- decoding ---------------------------------------------------------------

class Decoder(Reassembler):
    """Split an HSP byte stream into events.

    ``receive_data(data)`` returns the events completed by ``data``.  A
    partial message waits in the shared :class:`~wire.buffer.ReceiveBuffer`
    (linear reassembly).  An unknown command byte raises
    :class:`~wire.errors.FramingError` (carrying the events decoded before it
    in ``events``), after which the decoder refuses further input: the stream
    position is lost.
    """

    __slots__ = ("_dead", "max_payload")

    def __init__(self, max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        super().__init__()
        self.max_payload = max_payload
        self._dead: RemoteProtocolError | None = None

    def _measure(self, buf: bytes, pos: int, size: int) -> int:
        """Total length of the command at ``pos`` (only the header for an oversized payload)."""
        cmd = buf[pos]
        if cmd == DATA:
            if size - pos < 7:
                return -1
            length = int.from_bytes(buf[pos + 3 : pos + 7], "big")
            return 7 if length > self.max_payload else 7 + length
        if cmd in (DATA_ACK, ERROR):
            if size - pos < 11:
                return -1
            length = int.from_bytes(buf[pos + 7 : pos + 11], "big")
            return 11 if length > self.max_payload else 11 + length
        if cmd in (ACK, ERROR_UNDEF):
            return 5
        if cmd in (PING, PONG):
            return 1
        raise FramingError(
            f"unknown HSP command byte 0x{cmd:02x} at stream offset {self._rx.offset}"
        )

    def receive_data(self, data: bytes) -> list[Event]:
        if self._dead is not None:
            raise FramingError(self._dead.reason)
        events: list[Event] = []
        limit = self.max_payload
        try:
            for buf, pos, end in self._rx.messages(data, self._measure):
                cmd = buf[pos]
                if cmd == DATA:
                    typ = (buf[pos + 1] << 8) | buf[pos + 2]
                    length = int.from_bytes(buf[pos + 3 : pos + 7], "big")
                    if length > limit:
                        events.append(Oversized(DATA, None, typ, length))
                        self._rx.skip(length)
                    else:
                        events.append(Data(typ, buf[pos + 3 : end]))
                elif cmd in (DATA_ACK, ERROR):
                    mid = int.from_bytes(buf[pos + 1 : pos + 5], "big")
                    typ = (buf[pos + 5] << 8) | buf[pos + 6]
                    length = int.from_bytes(buf[pos + 7 : pos + 11], "big")
                    if length > limit:
                        events.append(Oversized(cmd, mid, typ, length))
                        self._rx.skip(length)
                    elif cmd == DATA_ACK:
                        events.append(DataAck(mid, typ, buf[pos + 7 : end]))
                    else:
                        events.append(Error(mid, typ, buf[pos + 11 : end]))
                elif cmd == ACK:
                    events.append(Ack(int.from_bytes(buf[pos + 1 : pos + 5], "big")))
                elif cmd == ERROR_UNDEF:
                    events.append(ErrorUndef(int.from_bytes(buf[pos + 1 : pos + 5], "big")))
                elif cmd == PING:
                    events.append(Ping())
                else:
                    events.append(Pong())
        except RemoteProtocolError as exc:
            self._dead = exc
            exc.events = events
            raise
        return events


__all__ = [
    "ACK",
    "COMMAND_NAMES",
    "DATA",
    "DATA_ACK",
    "DEFAULT_MAX_PAYLOAD",
    "ERROR",
    "ERROR_UNDEF",
    "PING",
    "PING_BYTES",
    "PONG",
    "PONG_BYTES",
    "Ack",
    "Data",
    "DataAck",
    "Decoder",
    "Error",
    "ErrorUndef",
    "Event",
    "FramingError",
    "LocalProtocolError",
    "Oversized",
    "Ping",
    "Pong",
    "ProtocolError",
    "RemoteProtocolError",
    "data_prefix",
    "encode",
    "frame_payload",
]
