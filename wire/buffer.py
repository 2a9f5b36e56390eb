"""The one receive buffer every framing uses: linear-time reassembly of messages.

A framing supplies a *measure* function: given the bytes ``buf``, a position
``pos`` and the end ``size``, it returns the total length of the message that
starts at ``pos`` (header included) once its header is complete, ``-1`` while
the header is incomplete, or raises :class:`~wire.errors.FramingError` for a
header it refuses (e.g. a length over the limit, checked before a byte of
the body is buffered).

:meth:`ReceiveBuffer.messages` yields ``(buf, start, stop)`` spans of the
complete messages in the received bytes.  A framing on the hot path (Skan)
may instead scan with its own loop between :meth:`ReceiveBuffer.resume` and
:meth:`ReceiveBuffer.keep`, the two halves of the same bookkeeping.

Complete messages are sliced straight out of the chunk they arrived in; only
the unfinished tail is kept, in one ``bytearray`` that grows by appending.
Each received byte is therefore copied a bounded number of times (at most
twice into the buffer and once out), whatever the read size: an 8 MiB frame
arriving in 256 KiB reads costs about 16 MiB of copying, not the ~140 MiB of
re-joining the partial frame on every read (quadratic in the number of
reads).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from wire.errors import ProtocolError

# (buf, pos, size) -> total message length, or -1 while the header is incomplete.
Measure = Callable[[bytes, int, int], int]


class ReceiveBuffer:
    """Unconsumed bytes of one received stream (sans-IO)."""

    __slots__ = ("_need", "_skip", "copied", "held", "offset")

    def __init__(self) -> None:
        # The start of a message that is not complete yet.  Public so that a
        # splitter on the hot path asks ``len(rx.held)`` with no method call
        # (one per received chunk on every Skan connection).
        self.held = bytearray()
        # Its total length once its header is known, else 0.
        self._need = 0
        # Bytes still to discard (see :meth:`skip`).
        self._skip = 0
        # Stream offset of the next byte :meth:`messages` examines (for error hints).
        self.offset = 0
        # Bytes copied into and out of the pending area: the cost of
        # reassembly, kept so tests and benchmarks can show it is linear.
        self.copied = 0

    def __len__(self) -> int:
        """Bytes held for a message that is not complete yet."""
        return len(self.held)

    def skip(self, n: int) -> None:
        """Discard the next ``n`` bytes of the stream without buffering them.

        Called while iterating :meth:`messages` (e.g. by the HSP decoder after
        the header of an oversized payload); the bytes are dropped as they
        arrive, in this and later calls.
        """
        self._skip += n

    def clear(self) -> None:
        self.held = bytearray()
        self._need = 0
        self._skip = 0

    def resume(self, data: bytes) -> tuple[bytes | None, bytes, int]:
        """Complete the pending message with ``data``.

        Returns (that message or None, the bytes to scan next, where to start).
        When the pending bytes did not even hold a whole header, they are
        joined with ``data`` (a header is a few bytes) and scanned afresh.
        """
        pending = self.held
        need = self._need
        if need:
            missing = need - len(pending)
            if len(data) < missing:
                pending += data
                self.copied += len(data)
                return None, b"", 0
            pending += memoryview(data)[:missing]
            message = bytes(pending)
            self.copied += missing + need
            self.held = bytearray()
            self._need = 0
            return message, data, missing
        pending += data
        self.copied += len(pending)
        joined = bytes(pending)
        self.held = bytearray()
        return None, joined, 0

    def keep(self, data: bytes, pos: int, need: int) -> None:
        """Keep ``data[pos:]``, the start of a message of ``need`` bytes (0: header cut)."""
        self._need = max(need, 0)
        self.held += memoryview(data)[pos:]
        self.copied += len(data) - pos

    def _refused(self, exc: ProtocolError) -> None:
        if exc.offset is None:
            exc.offset = self.offset
        self.clear()

    def messages(self, data: bytes, measure: Measure) -> Iterator[tuple[bytes, int, int]]:
        """Spans ``(buf, start, stop)`` of the messages ``data`` completes, in order.

        A :class:`~wire.errors.ProtocolError` raised by ``measure`` empties the
        buffer and gets the stream offset of the refused header as its hint.
        """
        pos = 0
        if self.held:
            message, data, pos = self.resume(data)
            if message is not None:
                yield message, 0, len(message)
                self.offset += len(message)
        size = len(data)
        while True:
            if self._skip:
                n = min(self._skip, size - pos)
                self._skip -= n
                self.offset += n
                pos += n
            if pos >= size:
                return
            try:
                n = measure(data, pos, size)
            except ProtocolError as exc:
                self._refused(exc)
                raise
            if n < 0 or pos + n > size:
                self.keep(data, pos, n)
                return
            yield data, pos, pos + n
            self.offset += n
            pos += n


class Reassembler:
    """The base of every framing's splitter or decoder: the one :class:`ReceiveBuffer` it owns."""

    __slots__ = ("_rx",)

    def __init__(self) -> None:
        self._rx = ReceiveBuffer()

    @property
    def buffered(self) -> int:
        """Bytes held for a message that is not complete yet."""
        return len(self._rx.held)

    @property
    def copied(self) -> int:
        """Bytes copied to reassemble messages so far (linear in the bytes received)."""
        return self._rx.copied


__all__ = ["Measure", "Reassembler", "ReceiveBuffer"]
