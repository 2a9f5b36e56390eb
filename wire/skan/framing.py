"""Incremental splitter for the Skan TCP stream: 4-byte big-endian length, then the message.

Sans-IO: ``receive_data(bytes)`` returns the complete frames.  The length is
checked against ``max_frame`` as soon as the 4-byte prefix is seen, so a
header announcing 2 GiB is refused before a single byte of it is buffered.
Reassembly is linear in the bytes received (:mod:`wire.buffer`).
"""

from __future__ import annotations

from wire.buffer import ReceiveBuffer
from wire.errors import FramingError

MAGIC_LEN = 4


class FrameSplitter:
    """Split a byte stream into frames.

    ``receive_data(data)`` returns a list of complete frames, each a ``bytes``
    object holding the 4-byte prefix and the message, ready to forward
    byte-for-byte.  Raises :class:`~wire.errors.FramingError` for a length
    over ``max_frame`` or shorter than the magic.
    """

    __slots__ = ("_rx", "max_frame")

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._rx = ReceiveBuffer()

    @property
    def buffered(self) -> int:
        """Bytes held for a frame that is not complete yet."""
        return len(self._rx)

    @property
    def copied(self) -> int:
        """Bytes copied to reassemble frames so far (linear in the bytes received)."""
        return self._rx.copied

    def receive_data(self, data: bytes) -> list[bytes]:
        rx = self._rx
        frames: list[bytes] = []
        pos = 0
        if len(rx):
            first, data, pos = rx.resume(data)
            if first is not None:
                frames.append(first)
        size = len(data)
        max_frame = self.max_frame
        # The scan is written out here rather than through a measure callback
        # (wire.buffer.ReceiveBuffer.messages): this is every Skan
        # connection's receive path, and the call per frame costs ~40 %.
        while size - pos >= 4:
            n = int.from_bytes(data[pos : pos + 4], "big")
            if n > max_frame or n < MAGIC_LEN:
                rx.clear()
                if n < MAGIC_LEN:
                    raise FramingError(
                        f"frame of {n} bytes is shorter than the 4-byte magic"
                    )
                raise FramingError(
                    f"frame of {n} bytes exceeds the limit of {max_frame} bytes"
                )
            stop = pos + 4 + n
            if stop > size:
                rx.keep(data, pos, 4 + n)
                return frames
            frames.append(data[pos:stop])
            pos = stop
        if pos < size:
            rx.keep(data, pos, 0)
        return frames
