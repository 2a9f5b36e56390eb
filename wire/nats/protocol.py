"""The NATS client protocol, sans-IO: bytes in, events out; commands as bytes.

The subset a broker needs to use a NATS server as its backplane
(docs.nats.io, "Client Protocol"): from the server ``INFO``, ``MSG``,
``HMSG``, ``PING``, ``PONG``, ``+OK``, ``-ERR``; to the server ``CONNECT``,
``PUB``, ``HPUB``, ``SUB``, ``UNSUB``, ``PING``, ``PONG``.

Why not nats-py: it is asyncio-only, and driven from trio it managed 7.4k
publishes/s called per message (docs/cluster.md has the measurements); this
codec plus a trio stream reaches the server's own rate.

``NatsConnection.receive_data(data)`` buffers and returns the complete
events; a control line longer than :data:`MAX_CONTROL_LINE` or a payload
longer than the server's ``max_payload`` is a :class:`NatsError` (the
connection is then unusable, as in every sans-IO machine here).
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs

from wire.buffer import ReceiveBuffer
from wire.errors import MalformedError, ProtocolError
from wire.keepalive import Ping, Pong

CRLF = b"\r\n"
# nats-server's own limit for a protocol line (MAX_CONTROL_LINE_SIZE,
# 4096); a longer line from the server means we are not talking to NATS.
MAX_CONTROL_LINE = 4096
# Payload limit until INFO says otherwise (nats-server's default max_payload).
DEFAULT_MAX_PAYLOAD = 1024 * 1024
HEADER_VERSION = b"NATS/1.0"


class NatsError(ProtocolError):
    """The server broke the protocol (or is not a NATS server)."""


@attrs.frozen
class Info:
    fields: dict[str, Any]


@attrs.frozen
class Msg:
    subject: bytes
    sid: bytes
    reply: bytes | None
    payload: bytes
    # Raw header block ("NATS/1.0\r\nK: V\r\n\r\n") or None for MSG.
    headers: bytes | None = None


@attrs.frozen
class Ok:
    pass


@attrs.frozen
class Err:
    message: str


Event = Info | Msg | Ping | Pong | Ok | Err

PING_EVENT = Ping()
PONG_EVENT = Pong()
OK_EVENT = Ok()


class NatsConnection:
    """The client side of one NATS connection."""

    __slots__ = ("_args", "_buffer", "_dead", "max_payload")

    def __init__(self) -> None:
        self._buffer = ReceiveBuffer()
        self.max_payload = DEFAULT_MAX_PAYLOAD
        self._dead: NatsError | None = None
        # The MSG/HMSG line _measure parsed last, for _event: (start, args).
        self._args: tuple[int, tuple[bytes, bytes, bytes | None, int, int]] | None = None

    def receive_data(self, data: bytes) -> list[Event]:
        """The complete events ``data`` finishes, in order."""
        if self._dead is not None:
            raise self._dead
        events: list[Event] = []
        rx = self._buffer
        pos = 0
        base = rx.offset  # stream offset of data[0], for error hints
        try:
            if len(rx):
                first, data, pos = rx.resume(data)
                if first is not None:
                    self._args = None  # measured on an earlier buffer
                    try:
                        event = self._event(first, 0, len(first))
                    except NatsError as exc:
                        exc.offset = base
                        raise
                    if event is not None:
                        events.append(event)
                    base += len(first) - pos
            pos = self._scan(data, pos, events)
        except NatsError as exc:
            exc.events = events
            if exc.offset is None:
                exc.offset = base + pos
            rx.clear()
            self._dead = exc
            raise
        rx.offset = base + pos
        return events

    def _scan(self, data: bytes, pos: int, events: list[Event]) -> int:
        """Append the events complete in ``data[pos:]``; keep the unfinished tail.

        The fast path is a message line exactly as nats-server writes it (one
        regular-expression match, sizes in bounds); anything else, including
        every refusal, goes through :meth:`_measure` and :meth:`_event`.
        Returns where scanning stopped: the end of ``data``, or the start of
        the tail it keeps.
        """
        size = len(data)
        max_payload = self.max_payload
        append = events.append
        while pos < size:
            initial = data[pos]
            m = None
            if initial == 72:  # "H"
                m = _HMSG_LINE.match(data, pos)
                if m is not None:
                    subject, sid, reply, hlen_s, total_s = m.groups()
                    hlen = int(hlen_s)
            elif initial == 77:  # "M"
                m = _MSG_LINE.match(data, pos)
                if m is not None:
                    subject, sid, reply, total_s = m.groups()
                    hlen = -1
            if m is not None and m.end() - pos <= MAX_CONTROL_LINE + 2:
                total = int(total_s)
                body = m.end()
                stop = body + total
                if total <= max_payload and hlen <= total and (
                    hlen < 0 or data.startswith(HEADER_VERSION, body)
                ):
                    if stop + 2 > size:
                        self._buffer.keep(data, pos, stop + 2 - pos)
                        return pos
                    if data[stop:stop + 2] != CRLF:
                        raise NatsError("message payload not followed by CRLF")
                    if hlen < 0:
                        append(Msg(subject, sid, reply, data[body:stop]))
                    else:
                        split = body + hlen
                        append(Msg(subject, sid, reply, data[split:stop], data[body:split]))
                    pos = stop + 2
                    continue
            n = self._measure(data, pos, size)
            if n < 0 or pos + n > size:
                self._buffer.keep(data, pos, n)
                return pos
            event = self._event(data, pos, pos + n)
            if event is not None:
                append(event)
            pos += n
            max_payload = self.max_payload  # INFO may have changed it
        return pos

    def _measure(self, buf: bytes, pos: int, size: int) -> int:
        """Length of the command at ``pos``: its line, plus a MSG's payload and CRLF."""
        end = buf.find(CRLF, pos, min(size, pos + MAX_CONTROL_LINE + 2))
        if end < 0:
            if size - pos > MAX_CONTROL_LINE + 1:
                raise NatsError(f"protocol line longer than {MAX_CONTROL_LINE} bytes")
            return -1
        n = end + 2 - pos
        if buf[pos] in _MSG_INITIALS:
            args = self._msg_args(buf[pos:end])
            self._args = (pos, args)
            n += args[4] + 2
        return n

    def _msg_args(self, line: bytes) -> tuple[bytes, bytes, bytes | None, int, int]:
        """(subject, sid, reply, header length or -1, total length) of a MSG/HMSG line."""
        op, *args = line.split()
        op = op.upper()
        if op == b"MSG":
            need = 3
        elif op == b"HMSG":
            need = 4
        else:
            raise NatsError(f"unknown protocol operation {op[:16]!r}")
        if len(args) not in (need, need + 1):
            raise NatsError(f"bad {op.decode()} arguments")
        reply = args[2] if len(args) == need + 1 else None
        sizes = args[len(args) - (need - 2):]
        if not all(s.isdigit() and len(s) <= 10 for s in sizes):
            raise NatsError(f"bad {op.decode()} size")
        total = int(sizes[-1])
        hlen = int(sizes[0]) if need == 4 else -1
        if total > self.max_payload or hlen > total:
            raise NatsError(f"message of {total} bytes out of bounds")
        return args[0], args[1], reply, hlen, total

    def _event(self, buf: bytes, start: int, stop: int) -> Event | None:
        end = buf.find(CRLF, start, stop)
        line = buf[start:end]
        if buf[start] in _MSG_INITIALS:
            # _measure parsed this line (the span starts where it measured;
            # a message completed by the receive buffer is parsed again).
            cached = self._args
            subject, sid, reply, hlen, total = (
                cached[1] if cached is not None and cached[0] == start
                else self._msg_args(line)
            )
            self._args = None
            body = buf[end + 2:stop]
            if body[total:] != CRLF:
                raise NatsError("message payload not followed by CRLF")
            if hlen < 0:
                return Msg(subject, sid, reply, body[:total])
            # A header block that is not NATS/1.0 is the publisher's fault,
            # not the server's: the framing is intact, so it is delivered as
            # it came (parse_headers refuses it), never a reason to close.
            return Msg(subject, sid, reply, body[hlen:total], body[:hlen])
        op = line.split(b" ", 1)[0].upper()
        if op == b"PING":
            return PING_EVENT
        if op == b"PONG":
            return PONG_EVENT
        if op == b"+OK":
            return OK_EVENT
        rest = line[len(op) + 1:]
        if op == b"-ERR":
            return Err(rest.strip().strip(b"'").decode("utf-8", "replace"))
        if op == b"INFO":
            try:
                fields = json.loads(rest)
            except (ValueError, RecursionError) as exc:
                raise NatsError(f"INFO is not JSON: {exc}") from None
            if not isinstance(fields, dict):
                raise NatsError("INFO is not a JSON object")
            mp = fields.get("max_payload")
            if isinstance(mp, int) and mp > 0:
                self.max_payload = mp
            return Info(fields)
        raise NatsError(f"unknown protocol operation {op[:16]!r}")


# ---- commands (client -> server) ----------------------------------------


_MSG_INITIALS = frozenset(b"MmHh")
# The message lines nats-server writes (upper case, single spaces, at most
# 10-digit sizes as _msg_args requires): the fast path of _scan.  Tokens are
# runs of non-white-space bytes, as bytes.split() in _msg_args sees them.
_MSG_LINE = re.compile(rb"MSG (\S+) (\S+) (?:(\S+) )?(\d{1,10})\r\n")
_HMSG_LINE = re.compile(rb"HMSG (\S+) (\S+) (?:(\S+) )?(\d{1,10}) (\d{1,10})\r\n")


def connect(options: dict[str, Any]) -> bytes:
    return b"CONNECT " + json.dumps(options, separators=(",", ":")).encode() + CRLF


def pub(subject: bytes, payload: bytes, reply: bytes | None = None) -> bytes:
    head = b"PUB " + subject + (b" " + reply if reply else b"")
    return b"%s %d\r\n%s\r\n" % (head, len(payload), payload)


def hpub(subject: bytes, headers: bytes, payload: bytes, reply: bytes | None = None) -> bytes:
    """``headers`` is a complete header block (see :func:`header_block`)."""
    head = b"HPUB " + subject + (b" " + reply if reply else b"")
    hlen = len(headers)
    return b"%s %d %d\r\n%s%s\r\n" % (head, hlen, hlen + len(payload), headers, payload)


def header_block(fields: list[tuple[bytes, bytes]]) -> bytes:
    return HEADER_VERSION + CRLF + b"".join(k + b": " + v + CRLF for k, v in fields) + CRLF


def parse_headers(block: bytes) -> dict[bytes, bytes]:
    """Header block -> {name: value} (last one wins; names as sent).
    MalformedError for a block another client could have sent wrong (the
    message is refused, the connection stays)."""
    if not block.startswith(HEADER_VERSION):
        raise MalformedError("header block without NATS/1.0")
    out: dict[bytes, bytes] = {}
    for line in block.split(CRLF)[1:]:
        if not line:
            continue
        name, sep, value = line.partition(b":")
        if not sep:
            raise MalformedError("header line without ':'")
        out[name.strip()] = value.strip()
    return out


def sub(subject: bytes, sid: bytes, queue: bytes | None = None) -> bytes:
    return b"SUB " + subject + (b" " + queue if queue else b"") + b" " + sid + CRLF


def unsub(sid: bytes) -> bytes:
    return b"UNSUB " + sid + CRLF


PING = b"PING\r\n"
PONG = b"PONG\r\n"
