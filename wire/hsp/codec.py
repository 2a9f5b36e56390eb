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

import attrs

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


class ProtocolError(ValueError):
    """The peer broke HSP (unknown command, bad MessageID); the stream cannot continue.

    ``events`` holds the well-formed events that preceded the fault in the
    same input, so a caller can still act on them before closing.
    """

    def __init__(self, reason: str, events: list | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.events: list = events or []


class LocalProtocolError(ValueError):
    """We tried to send something HSP does not allow (bad field range, unowed answer)."""


def frame_payload(payload: bytes) -> bytes:
    """Prefix ``payload`` with its 4-byte big-endian length (the wire form of a ByteArray)."""
    if len(payload) > MAX_U32:
        raise LocalProtocolError(f"payload of {len(payload)} bytes exceeds HSP's 32-bit length")
    return len(payload).to_bytes(4, "big") + payload


# ---- events -----------------------------------------------------------------


@attrs.define(slots=True)
class Data:
    """DATA: fire-and-forget.  ``framed`` = 4-byte length + payload (see module doc)."""

    type: int
    framed: bytes = attrs.field(repr=lambda b: f"<{len(b) - 4} bytes>")

    @property
    def payload(self) -> bytes:
        return self.framed[4:]

    @classmethod
    def make(cls, type: int, payload: bytes) -> Data:
        return cls(type, frame_payload(payload))


@attrs.define(slots=True)
class DataAck:
    """DATA_ACK: must be answered with ACK, ERROR or ERROR_UNDEF carrying ``message_id``."""

    message_id: int
    type: int
    framed: bytes = attrs.field(repr=lambda b: f"<{len(b) - 4} bytes>")

    @property
    def payload(self) -> bytes:
        return self.framed[4:]

    @classmethod
    def make(cls, message_id: int, type: int, payload: bytes) -> DataAck:
        return cls(message_id, type, frame_payload(payload))


@attrs.define(slots=True)
class Ack:
    message_id: int


@attrs.define(slots=True)
class Ping:
    pass


@attrs.define(slots=True)
class Pong:
    pass


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

class Decoder:
    """Split an HSP byte stream into events.

    ``feed(data)`` returns the events completed by ``data``.  A partial
    message is kept until the rest arrives; chunks of a large payload are
    collected in a list and joined once, so a big message costs O(size).
    An unknown command byte raises :class:`ProtocolError` (carrying the
    events decoded before it), after which the decoder refuses further
    input: the stream position is lost.
    """

    __slots__ = ("_buf", "_chunks", "_dead", "_have", "_need", "_offset", "_skip", "max_payload")

    def __init__(self, max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        self.max_payload = max_payload
        self._buf = b""
        # While a message known to need ``_need`` bytes is incomplete, its
        # chunks wait in ``_chunks`` (``_have`` bytes) instead of being re-joined.
        self._chunks: list[bytes] = []
        self._have = 0
        self._need = 0
        # Bytes of an oversized payload still to discard.
        self._skip = 0
        # Stream offset of ``_buf[0]``, for error messages.
        self._offset = 0
        self._dead: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes held for a message that is not complete yet."""
        return len(self._buf) + self._have

    def feed(self, data: bytes) -> list[Event]:
        if self._dead is not None:
            raise self._dead
        if self._skip:
            n = min(self._skip, len(data))
            self._skip -= n
            self._offset += n
            data = data[n:]
            if not data:
                return []
        if self._need:
            self._chunks.append(data)
            self._have += len(data)
            if self._have < self._need:
                return []
            buf = b"".join(self._chunks)
            self._chunks = []
            self._have = 0
            self._need = 0
        else:
            buf = self._buf + data if self._buf else data
        events: list[Event] = []
        pos = 0
        size = len(buf)
        limit = self.max_payload
        while pos < size:
            cmd = buf[pos]
            if cmd == DATA:
                if size - pos < 7:
                    break
                length = int.from_bytes(buf[pos + 3 : pos + 7], "big")
                typ = (buf[pos + 1] << 8) | buf[pos + 2]
                end = pos + 7 + length
                if length > limit:
                    events.append(Oversized(DATA, None, typ, length))
                    pos = self._start_skip(pos + 7, length, size)
                    continue
                if end > size:
                    self._need = end - pos
                    break
                events.append(Data(typ, buf[pos + 3 : end]))
                pos = end
            elif cmd in (DATA_ACK, ERROR):
                if size - pos < 11:
                    break
                mid = int.from_bytes(buf[pos + 1 : pos + 5], "big")
                typ = (buf[pos + 5] << 8) | buf[pos + 6]
                length = int.from_bytes(buf[pos + 7 : pos + 11], "big")
                end = pos + 11 + length
                if length > limit:
                    events.append(Oversized(cmd, mid, typ, length))
                    pos = self._start_skip(pos + 11, length, size)
                    continue
                if end > size:
                    self._need = end - pos
                    break
                if cmd == DATA_ACK:
                    events.append(DataAck(mid, typ, buf[pos + 7 : end]))
                else:
                    events.append(Error(mid, typ, buf[pos + 11 : end]))
                pos = end
            elif cmd in (ACK, ERROR_UNDEF):
                if size - pos < 5:
                    break
                mid = int.from_bytes(buf[pos + 1 : pos + 5], "big")
                events.append(Ack(mid) if cmd == ACK else ErrorUndef(mid))
                pos += 5
            elif cmd == PING:
                events.append(Ping())
                pos += 1
            elif cmd == PONG:
                events.append(Pong())
                pos += 1
            else:
                reason = (
                    f"unknown HSP command byte 0x{cmd:02x} at stream offset {self._offset + pos}"
                )
                self._dead = ProtocolError(reason)
                self._buf = b""
                self._need = 0
                raise ProtocolError(reason, events)
        self._offset += pos
        rest = buf[pos:] if pos < size else b""
        if self._need:
            self._chunks = [rest]
            self._have = len(rest)
            self._buf = b""
        else:
            self._buf = rest
        return events

    def _start_skip(self, payload_start: int, length: int, size: int) -> int:
        """Discard an oversized payload: what is here now, the rest as it arrives."""
        available = size - payload_start
        if available >= length:
            return payload_start + length
        self._skip = length - available
        return size
